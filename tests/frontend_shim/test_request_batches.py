"""A frontend link packs what queued up during a write into :class:`~shim_common.wire.RequestBatch`
messages only for a worker whose hello lists :data:`~shim_common.wire.FEATURE_REQUEST_BATCH`; an
older worker gets one message per request, as before. Both serve every request.
"""

from __future__ import annotations

import msgspec
import pytest
import trio
from test_workers import PROMPT, start_link, start_worker

from shim_common import wire
from worker_ingress import _planes


@pytest.mark.parametrize("listed", [True, False], ids=["listed", "older-worker"])
async def test_requests_queued_together_share_a_message_only_when_the_worker_reads_batches(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, listed: bool
) -> None:
    received: list[str] = []

    def recording(data: bytes) -> wire.ClientMessage:
        message = wire.decode_client_message(data)
        received.append(type(message).__name__)
        return message

    monkeypatch.setattr(_planes, "decode_client_message", recording)
    ends: list[wire.End] = []

    async def one(index: int) -> None:
        async with link.request("completions", PROMPT) as stream:
            assert isinstance(await stream.first(), wire.Started)
            replies = [reply async for reply in stream]
        assert isinstance(replies[-1], wire.End)
        ends.append(replies[-1])

    with trio.fail_after(10):
        worker, address, _ = await start_worker(nursery, engine_request_limit=32)
        if not listed:
            features = [f for f in worker.hello.features if f != wire.FEATURE_REQUEST_BATCH]
            worker._hello = msgspec.structs.replace(worker.hello, features=features)
        link, _ = await start_link(nursery, address.ws_url)
        await link.wait_connected()
        async with trio.open_nursery() as clients:
            for index in range(20):  # all queue before the link's sender runs
                clients.start_soon(one, index)
    assert len(ends) == 20
    generates = received.count("Generate")
    if listed:
        assert "RequestBatch" in received
        assert generates < 20
    else:
        assert "RequestBatch" not in received
        assert generates == 20
