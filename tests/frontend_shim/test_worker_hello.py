"""A worker's hello: sizes out of bounds are refused with the reason, and cost nothing."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import httpx
import pytest
import trio
import trio_websocket
from worker_configs import runtime_config

from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from frontend_shim._worker_hello import (
    KV_PART_BYTES,
    MAX_DATA_PARALLEL_SIZE,
    MAX_HELLO_BYTES,
    MAX_KV_BLOCKS,
    event_message_bound,
    kv_message_bytes,
    refusal,
)
from shim_common import wire
from worker_ingress._kv_events import EVENT_COST


def test_a_plausible_hello_is_accepted_to_its_bounds() -> None:
    assert refusal(runtime_config()) is None
    assert refusal(runtime_config(data_parallel_size=MAX_DATA_PARALLEL_SIZE)) is None
    assert refusal(runtime_config(kv_total_blocks=MAX_KV_BLOCKS, engine_request_limit=0)) is None
    assert refusal(runtime_config(heartbeat_interval=60.0, load_publish_interval=3600.0)) is None
    assert refusal(runtime_config(heartbeat_interval=0.001, load_publish_interval=0.0)) is None


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"data_parallel_size": 2_000_000}, "data_parallel_size 2000000"),
        ({"data_parallel_size": 0}, "data_parallel_size 0"),
        ({"kv_total_blocks": 2**64 - 1}, "kv_total_blocks"),
        ({"kv_total_blocks": MAX_KV_BLOCKS + 1}, f"kv_total_blocks {MAX_KV_BLOCKS + 1} (0 to"),
        ({"block_size": -1}, "block_size"),
        ({"max_num_batched_tokens": 2**63}, "max_num_batched_tokens"),
        ({"max_num_seqs": -5}, "max_num_seqs"),
        ({"request_queue_limit": 2**53 + 1}, "request_queue_limit"),
        ({"engine_request_limit": -1}, "engine_request_limit"),
        ({"heartbeat_interval": float("nan")}, "heartbeat_interval nan"),
        ({"heartbeat_interval": float("inf")}, "heartbeat_interval inf"),
        ({"heartbeat_interval": 3600.0}, "heartbeat_interval 3600.0 (more than 0, at most 60"),
        ({"heartbeat_interval": 60.5}, "heartbeat_interval 60.5"),
        ({"heartbeat_interval": 0.0}, "heartbeat_interval 0.0"),
        ({"load_publish_interval": -1.0}, "load_publish_interval"),
        ({"worker_id": ""}, "worker_id of 0 characters"),
        ({"model": "m" * (1 << 20)}, "model of 1048576 characters"),
    ],
)
def test_an_absurd_hello_is_refused_naming_the_field(changes: dict[str, Any], named: str) -> None:
    reason = refusal(runtime_config(**changes))
    assert reason is not None
    assert named in reason
    assert len(reason) < 200


@pytest.mark.parametrize(
    ("claim", "logged"),
    [
        ({"data_parallel_size": 2_000_000}, "hello refused: data_parallel_size 2000000"),
        # The worker's own --heartbeat-interval stops at 60 s: a silent peer claiming an hour
        # would never be judged gone, and requests routed to it would hang.
        ({"heartbeat_interval": 3600.0}, "hello refused: heartbeat_interval 3600.0"),
    ],
    ids=["two-million-ranks", "hour-heartbeat"],
)
async def test_a_worker_claiming_too_much_is_refused_and_metrics_stay_small(
    caplog: pytest.LogCaptureFixture, claim: dict[str, Any], logged: str
) -> None:
    hello = wire.encode(
        wire.Hello(protocol_version=wire.PROTOCOL_VERSION, config=runtime_config(**claim))
    )
    hellos = 0

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        nonlocal hellos
        ws = await request.accept()
        await ws.send_message(hello)
        hellos += 1
        with contextlib.suppress(trio_websocket.ConnectionClosed):
            await ws.get_message()

    caplog.set_level(logging.WARNING, logger="frontend_shim")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                trio_websocket.serve_websocket, handler, "127.0.0.1", 0, None
            )
            settings = FrontendSettings(http_port=0, workers=(f"ws://127.0.0.1:{server.port}",))
            url: str = await nursery.start(run_frontend, settings)
            for _ in range(500):
                if "hello refused" in caplog.text:
                    break
                await trio.sleep(0.01)
            assert logged in caplog.text
            async with httpx.AsyncClient(base_url=url) as client:
                health = (await client.get("/health")).json()
                assert health["workers_connected"] == 0
                metrics = await client.get("/metrics")
                assert metrics.status_code == 200
                assert len(metrics.content) < 64 * 1024
                assert b'worker_id="w-1"' not in metrics.content
                reply = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
                assert reply.status_code == 503
            nursery.cancel_scope.cancel()
    assert hellos >= 2


def test_the_event_message_bound_follows_what_the_hello_announces() -> None:
    one_rank = event_message_bound(runtime_config())
    assert 64 * 1024 < one_rank < 128 * 1024  # far under the protocol's 16 MiB
    wide = event_message_bound(runtime_config(data_parallel_size=MAX_DATA_PARALLEL_SIZE))
    assert wide > one_rank
    # The widest batch a 1,024-rank worker can send (a load event per rank and a heartbeat,
    # every integer at its widest) fits.
    big = 2**63 - 1
    loads = [
        wire.RankLoad(
            dp_rank=rank, active_decode_blocks=big, active_prefill_tokens=big, kv_used_blocks=big
        )
        for rank in range(MAX_DATA_PARALLEL_SIZE)
    ]
    events: list[wire.WorkerEvent] = [
        wire.LoadEvent(
            seq=big,
            ts=1e9,
            load=load,
            engine_requests=big,
            queued_requests=big,
            effective_limit=big,
        )
        for load in loads
    ]
    events.append(
        wire.Heartbeat(seq=big, ts=1e9, loads=loads, engine_requests=big, queued_requests=big)
    )
    assert len(wire.encode(wire.EventBatch(events=events, sent=1e9))) < wide



def test_room_for_kv_events_does_not_grow_with_the_cache_a_worker_claims() -> None:
    # With parts: room for one part, whatever the claim (before, 64 bytes a block of every rank:
    # a claim of 262,144 blocks earned 16 MiB).
    big = 2**63 - 1
    for blocks in (1024, 1 << 18, MAX_KV_BLOCKS):
        config = runtime_config(kv_total_blocks=blocks, data_parallel_size=2)
        room = kv_message_bytes(config, parts=True)
        assert room == KV_PART_BYTES
        bound = event_message_bound(config, kv_bytes=room)
        assert bound == event_message_bound(config) + KV_PART_BYTES < 128 * 1024
    # The largest part a worker sends fits: a snapshot part of the widest names, or events
    # of one block each up to the part's names.
    part = wire.KvSnapshot(seq=big, ranks=[[], [big] * wire.KV_PART_NAMES], more=True)
    assert len(wire.encode(wire.KvBatch(events=[part]))) < KV_PART_BYTES
    per_event = wire.KV_PART_NAMES // (1 + EVENT_COST)
    events: list[wire.KvEvent] = [
        wire.KvStored(seq=big - n, dp_rank=1, parent=big, blocks=[big]) for n in range(per_event)
    ]
    assert len(wire.encode(wire.KvBatch(events=events))) < KV_PART_BYTES
    # An older worker (no parts) sends its whole cache in one message: its KV events are asked
    # for only when that fits, and then its snapshot and backlog fit the bound.
    small = runtime_config(kv_total_blocks=1024, data_parallel_size=2)
    room = kv_message_bytes(small, parts=False)
    assert room is not None
    with_kv = event_message_bound(small, kv_bytes=room)
    snapshot = wire.KvSnapshot(seq=big, ranks=[[big] * 1024, [big] * 1024])
    assert len(wire.encode(wire.KvBatch(events=[snapshot]))) < with_kv
    backlog: list[wire.KvEvent] = [
        wire.KvStored(seq=big - n, dp_rank=1, parent=big, blocks=[big]) for n in range(2048)
    ]
    assert len(wire.encode(wire.KvBatch(events=backlog))) < with_kv
    assert kv_message_bytes(runtime_config(kv_total_blocks=4096), parts=False) == 256 * 1024
    assert kv_message_bytes(runtime_config(kv_total_blocks=4097), parts=False) is None
    assert kv_message_bytes(runtime_config(kv_total_blocks=1 << 18), parts=False) is None


@pytest.mark.parametrize("features", [[], [wire.FEATURE_KV_EVENTS, *[f"f{n}" for n in range(30)]]])
def test_the_largest_hello_these_bounds_accept_fits_the_hello_cap_with_room(
    features: list[str],
) -> None:
    # Every name at its longest, in four-byte characters, every count at its widest.
    widest = runtime_config(
        worker_id="\U0001f600" * 256,
        model="\U0001f600" * 512,
        kv_total_blocks=MAX_KV_BLOCKS,
        block_size=2**53,
        max_num_batched_tokens=2**53,
        max_num_seqs=2**53,
        data_parallel_size=MAX_DATA_PARALLEL_SIZE,
        engine_request_limit=2**53,
        request_queue_limit=2**53,
        heartbeat_interval=0.123456789,
        load_publish_interval=3600.0,
    )
    assert refusal(widest) is None
    hello = wire.Hello(protocol_version=wire.PROTOCOL_VERSION, config=widest, features=features)
    assert len(wire.encode(hello)) * 3 < MAX_HELLO_BYTES
