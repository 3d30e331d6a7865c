"""KV events on a worker link (frontend_shim._links rule 7), with a worker played by the test.

The hand-made worker lists the feature (or not), records what the link writes on each plane,
and sends what the test tells it: a snapshot, events, a gap. Loopback only, under fail_after.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import trio
from test_peers import LINK, accept_upgrade, frame, poll

from frontend_shim._fleet_bridge import FleetBridge
from frontend_shim._kv_index import KvIndex
from frontend_shim._links import LinkSettings, WorkerLink
from frontend_shim._load import Fleet
from shim_common import wire

TIMEOUT = 20.0
KV_LINK = LinkSettings(
    connect_timeout=LINK.connect_timeout,
    disconnect_timeout=LINK.disconnect_timeout,
    keepalive_interval=30.0,
    keepalive_timeout=30.0,
    kv_events=True,
)


def hello(features: Sequence[str]) -> bytes:
    config = wire.RuntimeConfig(
        worker_id="w-kv",
        model="m",
        kv_total_blocks=100,
        block_size=4,
        max_num_batched_tokens=1000,
        max_num_seqs=16,
        data_parallel_size=2,
        engine_request_limit=None,
        request_queue_limit=40000,
        heartbeat_interval=0.05,
    )
    message = wire.Hello(
        protocol_version=wire.PROTOCOL_VERSION, config=config, features=[*features]
    )
    return frame(wire.encode(message))


def client_messages(data: bytes | bytearray) -> list[bytes]:
    """The binary messages a websocket client wrote (masked frames of any length, unfragmented),
    in order; a trailing partial frame is left out."""
    messages = []
    position = 0
    while position + 2 <= len(data):
        opcode, length, offset = data[position] & 0x0F, data[position + 1] & 0x7F, 2
        if length == 126:
            length, offset = int.from_bytes(data[position + 2 : position + 4], "big"), 4
        elif length == 127:
            length, offset = int.from_bytes(data[position + 2 : position + 10], "big"), 10
        start = position + offset + 4
        if start + length > len(data):
            break
        mask = data[start - 4 : start]
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(data[start : start + length]))
        if opcode == 2:
            messages.append(payload)
        position = start + length
    return messages


class HandMadeWorker:
    """Both planes of a worker, recording what the frontend writes on them."""

    def __init__(self, features: Sequence[str]) -> None:
        self.features = features
        self.written = {wire.EVENTS_PATH: bytearray(), wire.REQUESTS_PATH: bytearray()}
        self._send, self._to_send = trio.open_memory_channel[bytes](16)

    async def serve(self, nursery: trio.Nursery) -> str:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(trio.serve_listeners, self._handle, listeners)
        return f"ws://127.0.0.1:{listeners[0].socket.getsockname()[1]}"

    async def send(self, *events: wire.KvEvent) -> None:
        await self._send.send(frame(wire.encode(wire.KvBatch(events=list(events)))))

    def messages(self, path: str) -> list[bytes]:
        return client_messages(self.written[path])

    def subscribes(self) -> list[wire.Subscribe]:
        return [wire.decode_subscriber_message(m) for m in self.messages(wire.EVENTS_PATH)]

    async def _handle(self, stream: trio.SocketStream) -> None:
        with trio.move_on_after(60):
            path = await accept_upgrade(stream)
            if path is None:
                return
            await stream.send_all(hello(self.features))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._record, stream, path)
                if path == wire.EVENTS_PATH:
                    sending = trio.Lock()  # one writer at a time on the stream
                    nursery.start_soon(self._heartbeats, stream, sending)
                    async for data in self._to_send:
                        async with sending:
                            await stream.send_all(data)
                else:
                    await trio.sleep_forever()

    async def _record(self, stream: trio.SocketStream, path: str) -> None:
        while data := await stream.receive_some(4096):
            self.written[path].extend(data)

    async def _heartbeats(self, stream: trio.SocketStream, sending: trio.Lock) -> None:
        seq = 0
        while True:
            seq += 1
            beat = wire.Heartbeat(
                seq=seq, ts=time.time(), loads=[], engine_requests=0, queued_requests=0
            )
            async with sending:
                await stream.send_all(
                    frame(wire.encode(wire.EventBatch(events=[beat], sent=time.time())))
                )
            await trio.sleep(0.05)


async def test_the_link_subscribes_feeds_the_index_and_asks_for_a_snapshot_after_a_gap() -> None:
    index = KvIndex()
    fleet = Fleet()
    links: dict[str, WorkerLink] = {}
    bridge = FleetBridge(fleet, on_change=lambda: None, links=links, kv_index=index)
    worker = HandMadeWorker([wire.FEATURE_KV_EVENTS])
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await worker.serve(nursery)
            link = WorkerLink(url, bridge, KV_LINK)
            links[url] = link
            await nursery.start(link.run)
            await poll(lambda: link.connected, "the link to come up")
            assert link.kv_events
            await poll(lambda: bool(worker.subscribes()), "the subscription")
            assert worker.subscribes()[0].kv_events
            assert not worker.subscribes()[0].kv_snapshot
            await worker.send(
                wire.KvSnapshot(seq=2, ranks=[[1, 2], [7]]),
                wire.KvStored(seq=3, dp_rank=0, parent=2, blocks=[3]),
                wire.KvRemoved(seq=4, dp_rank=1, blocks=[7]),
            )
            await poll(lambda: index.depth("w-kv", 0, [1, 2, 3], 0.0) == 3, "the events")
            assert index.depth("w-kv", 1, [7], 0.0) == 0
            # Event 5 never comes: 6 shows the gap, and the link asks for a fresh snapshot.
            await worker.send(wire.KvStored(seq=6, dp_rank=1, parent=None, blocks=[9]))
            await poll(lambda: len(worker.subscribes()) == 2, "the snapshot request")
            again = worker.subscribes()[1]
            assert again.kv_events
            assert again.kv_snapshot
            assert link.stats.kv_snapshots_asked == 1
            await worker.send(wire.KvSnapshot(seq=6, ranks=[[1, 2, 3, 4], [9]]))
            await poll(lambda: index.depth("w-kv", 0, [1, 2, 3, 4], 0.0) == 4, "the snapshot")
            assert index.stats.gaps == 1
            nursery.cancel_scope.cancel()
    # The worker went away with the link: the index forgot it.
    assert index.worker("w-kv") is None


async def test_an_old_worker_is_sent_no_kv_subscription_and_no_rank() -> None:
    index = KvIndex()
    fleet = Fleet()
    links: dict[str, WorkerLink] = {}
    bridge = FleetBridge(fleet, on_change=lambda: None, links=links, kv_index=index)
    worker = HandMadeWorker([])
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await worker.serve(nursery)
            link = WorkerLink(url, bridge, KV_LINK)
            links[url] = link
            await nursery.start(link.run)
            await poll(lambda: link.connected, "the link to come up")
            assert not link.kv_events
            kept = index.worker("w-kv")
            assert kept is not None
            assert not kept.events  # predicted from the router's own decisions
            async with link.request("completions", {"prompt": "a"}, dp_rank=1):
                await poll(lambda: bool(worker.messages(wire.REQUESTS_PATH)), "the request")
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
    # No Subscribe at all (the worker lists no feature that takes one) and a Generate without a
    # rank: the bytes an older frontend sends.
    assert worker.subscribes() == []
    generate = msgspec.msgpack.decode(worker.messages(wire.REQUESTS_PATH)[0])
    assert generate["type"] == "generate"
    assert "dp_rank" not in generate


async def test_a_new_worker_is_sent_the_rank_and_without_kv_mode_no_subscription() -> None:
    worker = HandMadeWorker([wire.FEATURE_KV_EVENTS])
    fleet = Fleet()
    bridge = FleetBridge(fleet, on_change=lambda: None)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await worker.serve(nursery)
            link = WorkerLink(url, bridge, LINK)  # kv_events off: another router mode
            await nursery.start(link.run)
            await poll(lambda: link.connected, "the link to come up")
            assert not link.kv_events
            async with link.request("completions", {"prompt": "a"}, dp_rank=1):
                await poll(lambda: bool(worker.messages(wire.REQUESTS_PATH)), "the request")
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
    assert worker.subscribes() == []
    generate = msgspec.msgpack.decode(worker.messages(wire.REQUESTS_PATH)[0])
    assert generate["dp_rank"] == 1
