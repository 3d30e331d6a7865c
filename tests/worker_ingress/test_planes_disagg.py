"""Disaggregated serving through a worker's planes, in-process on loopback with a raw
request-plane client: the role in the hello, a prefill hop's end with its hand-off, a decode hop
from it, the hops a worker refuses, and each role's gate capping its own hops exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import msgspec
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url
from worker_harness import (
    TIMEOUT,
    closed_code,
    collect_until_final,
    completion,
    event_plane,
    get_message_bytes,
    make_settings,
    new_worker,
    read_events,
    request_plane,
    running,
    send,
    wait_for,
)

from shim_common import wire
from shim_common._busy import BusyThresholds
from shim_common.prefix import WordTokenizer, block_names
from shim_common.wire import (
    FEATURE_DISAGG,
    FEATURE_KV_EVENTS,
    Cancel,
    Chunk,
    End,
    Failed,
    Generate,
    Handoff,
    Hello,
    Rejected,
    Started,
    Subscribe,
)
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress.engines._loader import EngineLoadError, load_engine
from worker_ingress.engines._mocker import MockerEngine

BLOCK = 4
PROMPT = " ".join(f"p{i}" for i in range(10))  # 10 tokens: two full blocks and a partial one


def mocker_worker_settings(role: str = "agg", **mocker: Any) -> WorkerSettings:
    shape: dict[str, Any] = {
        "num_gpu_blocks": 64,
        "block_size": BLOCK,
        "speedup_ratio": 100.0,
        "kv_bytes_per_token": 1000,
    }
    shape.update(mocker)
    return make_settings(
        disaggregation_mode=role, worker_id=f"w-{role}", mocker=MockerSettings(**shape)
    )


def mocker_worker(settings: WorkerSettings) -> Any:
    return new_worker(settings, MockerEngine(settings.mocker, worker_id=settings.worker_id))


def prefill_only(request_id: int, prompt: str = PROMPT) -> Generate:
    return msgspec.structs.replace(completion(request_id, prompt), prefill_only=True)


def decode(
    request_id: int, handoff: Handoff, prompt: str = PROMPT, max_tokens: int = 3
) -> Generate:
    return msgspec.structs.replace(completion(request_id, prompt, max_tokens), handoff=handoff)


def a_handoff(**changes: Any) -> Handoff:
    fields: dict[str, Any] = {
        "handle": "h-1",
        "worker_id": "w-prefill",
        "dp_rank": 0,
        "block_size": BLOCK,
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "block_names": [],
        "kv_bytes": 10_000,
    }
    fields.update(changes)
    return Handoff(**fields)


async def hello_of(address: Any) -> Hello:
    async with open_websocket_url(address.ws_url + wire.REQUESTS_PATH) as ws:
        hello = wire.decode_worker_message(await get_message_bytes(ws))
    assert isinstance(hello, Hello)
    return hello


@pytest.mark.parametrize("role", ["agg", "prefill", "decode"])
async def test_the_hello_states_the_role_and_every_mocker_lists_disagg(role: str) -> None:
    worker = mocker_worker(mocker_worker_settings(role))
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address:
            hello = await hello_of(address)
    assert hello.config.worker_type == role
    assert FEATURE_DISAGG in hello.features
    # A decode worker publishes no KV events (as Dynamo's); the other roles do.
    assert (FEATURE_KV_EVENTS in hello.features) == (role != "decode")
    assert (worker.kv_events is None) == (role == "decode")


async def test_an_engine_that_cannot_hand_off_lists_no_disagg_and_cannot_take_a_role() -> None:
    worker = new_worker(make_settings())  # the instant engine
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address:
            hello = await hello_of(address)
    assert hello.config.worker_type == "agg"
    assert FEATURE_DISAGG not in hello.features
    for role in ("prefill", "decode"):
        settings = make_settings(engine="instant", disaggregation_mode=role)
        with pytest.raises(EngineLoadError, match="cannot hand KV off"):
            load_engine(settings)
    assert load_engine(make_settings(engine="instant")) is not None


async def test_a_prefill_hop_then_a_decode_hop_serve_one_request_on_two_workers() -> None:
    prefill_settings = mocker_worker_settings("prefill")
    decode_settings = mocker_worker_settings("decode", kv_transfer_bandwidth=1.0)
    prefill_worker = mocker_worker(prefill_settings)
    decode_worker = mocker_worker(decode_settings)
    with trio.fail_after(TIMEOUT):
        async with (
            running(prefill_worker) as p_address,
            running(decode_worker) as d_address,
            request_plane(p_address) as p,
            request_plane(d_address) as d,
        ):
            await send(p, prefill_only(1))
            first = (await collect_until_final(p, {1}))[1]
            await send(p, prefill_only(2))
            second = (await collect_until_final(p, {2}))[2]
            # Started, then the end: no chunk, nothing generated, the hand-off.
            assert [type(message) for message in first] == [Started, End]
            started, end = first
            assert isinstance(started, Started)
            assert isinstance(end, End)
            assert (started.prompt_tokens, end.prompt_tokens, end.completion_tokens) == (10, 10, 0)
            assert None not in (end.started_seq, end.first_output_seq, end.ended_seq)
            handoff = end.handoff
            assert handoff is not None
            assert (handoff.worker_id, handoff.block_size, handoff.prompt_tokens) == (
                "w-prefill",
                BLOCK,
                10,
            )
            assert handoff.block_names == block_names(WordTokenizer().encode(PROMPT), BLOCK)
            assert handoff.kv_bytes == 10 * 1000
            # The second prefill of the prompt finds its full blocks cached.
            last = second[-1]
            assert isinstance(last, End)
            assert last.handoff is not None
            assert (last.cached_tokens, last.handoff.cached_tokens) == (8, 8)
            assert last.handoff.handle != handoff.handle
            prefill_rank = prefill_worker.engine.ranks[0]
            assert (prefill_rank.used_blocks, prefill_rank.pool.evictable) == (0, 2)

            await send(d, decode(3, last.handoff, max_tokens=4))
            frames = (await collect_until_final(d, {3}))[3]
    assert isinstance(frames[0], Started)
    assert all(isinstance(message, Chunk) for message in frames[1:-1])
    end = frames[-1]
    assert isinstance(end, End)
    assert (end.prompt_tokens, end.completion_tokens, end.cached_tokens) == (10, 4, 8)
    assert end.handoff is None
    assert None not in (end.started_seq, end.first_output_seq, end.ended_seq)
    decode_rank = decode_worker.engine.ranks[0]
    assert (decode_rank.used_blocks, decode_rank.live_sequences) == (0, 0)
    assert decode_worker.gate.in_flight == prefill_worker.gate.in_flight == 0


@pytest.mark.parametrize("role", ["agg", "prefill", "decode"])
async def test_a_plain_request_runs_whole_in_every_role(role: str) -> None:
    # An older frontend sees an aggregated worker; a decode worker prefills for itself.
    worker = mocker_worker(mocker_worker_settings(role))
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await send(ws, completion(1, PROMPT, max_tokens=3))
            frames = (await collect_until_final(ws, {1}))[1]
    end = frames[-1]
    assert isinstance(end, End)
    assert (end.completion_tokens, end.handoff) == (3, None)


REFUSED: list[tuple[str, Any, str]] = [
    (
        "both",
        lambda: msgspec.structs.replace(prefill_only(1), handoff=a_handoff()),
        "not both",
    ),
    (
        "embeddings to prefill",
        lambda: Generate(
            request_id=1, endpoint="embeddings", body={"input": "a b"}, prefill_only=True
        ),
        "embeddings",
    ),
    (
        "embeddings to decode",
        lambda: Generate(
            request_id=1, endpoint="embeddings", body={"input": PROMPT}, handoff=a_handoff()
        ),
        "embeddings",
    ),
    ("an empty prompt", lambda: prefill_only(1, prompt=""), "no tokens"),
    (
        "another block size",
        lambda: decode(1, a_handoff(block_size=16)),
        "hold 16 tokens and this worker's 4",
    ),
    (
        "another prompt",
        lambda: decode(1, a_handoff(prompt_tokens=12)),
        "12-token prompt and this request's has 10",
    ),
]


@pytest.mark.parametrize(("case", "request_of", "says"), REFUSED, ids=[c[0] for c in REFUSED])
async def test_a_hop_this_worker_cannot_run_is_a_bad_request_that_takes_no_slot(
    case: str, request_of: Any, says: str
) -> None:
    settings = dataclasses.replace(mocker_worker_settings("decode"), engine_request_limit=1)
    worker = mocker_worker(settings)
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await send(ws, request_of())
            (failed,) = (await collect_until_final(ws, {1}))[1]
            assert worker.gate.in_flight == 0
            # The connection goes on.
            await send(ws, completion(2, PROMPT))
            assert isinstance((await collect_until_final(ws, {2}))[2][-1], End)
    assert isinstance(failed, Failed)
    assert failed.kind == "bad_request"
    assert says in failed.message


@pytest.mark.parametrize("hop", ["prefill_only", "handoff"])
async def test_an_engine_without_the_feature_refuses_hops_and_serves_the_rest(hop: str) -> None:
    worker = new_worker(make_settings())  # the instant engine
    request = prefill_only(1) if hop == "prefill_only" else decode(1, a_handoff(prompt_tokens=3))
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await send(ws, request)
            (failed,) = (await collect_until_final(ws, {1}))[1]
            await send(ws, completion(2))
            served = (await collect_until_final(ws, {2}))[2]
    assert isinstance(failed, Failed)
    assert failed.kind == "bad_request"
    assert "disagg" in failed.message
    assert isinstance(served[-1], End)


async def test_a_handoff_out_of_range_closes_the_connection_as_any_malformed_message() -> None:
    worker = mocker_worker(mocker_worker_settings("decode"))
    handoff = {**msgspec.to_builtins(a_handoff()), "kv_bytes": -1}
    data = msgpack.packb(
        {
            "type": "generate",
            "request_id": 1,
            "endpoint": "completions",
            "body": {"prompt": PROMPT},
            "handoff": handoff,
        }
    )
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await ws.send_message(data)
            assert await closed_code(ws) == wire.CLOSE_UNDECODABLE


async def hold_hops(ws: WebSocketConnection, requests: list[Generate]) -> None:
    for request in requests:
        await send(ws, request)


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_each_roles_gate_caps_its_own_hops_exactly(role: str) -> None:
    # N = 2, Q = 2: a prefill worker's cap counts its prefills, a decode worker's its decodes.
    # Each hop is held (a prefill slowed to a crawl, a transfer at a crawl) while the gate is
    # full: two start, two queue, the fifth is refused, and cancels give everything back.
    slow = {"speedup_ratio": 0.0001} if role == "prefill" else {"kv_transfer_bandwidth": 1e-9}
    settings = dataclasses.replace(
        mocker_worker_settings(role, **slow), engine_request_limit=2, request_queue_limit=2
    )
    worker = mocker_worker(settings)
    if role == "prefill":
        hops = [prefill_only(i) for i in range(1, 6)]
    else:
        hops = [decode(i, a_handoff()) for i in range(1, 6)]
    rank = worker.engine.ranks[0]
    with trio.fail_after(TIMEOUT):
        async with (
            running(worker) as address,
            request_plane(address) as ws,
            event_plane(address, queue_size=64) as events,
        ):
            await send(events, Subscribe(thresholds=BusyThresholds()))
            await hold_hops(ws, hops[:4])
            await wait_for(lambda: worker.gate.in_flight == 4, "two running, two queued")
            await send(ws, hops[4])
            (rejected,) = (await collect_until_final(ws, {5}))[5]
            assert rejected == Rejected(request_id=5, reason=wire.RejectReason.OVERLOADED)
            assert (worker.gate.running, worker.gate.queued) == (2, 2)
            if role == "prefill":
                # What a frontend's prefill thresholds judge: the two prompts waiting for prefill
                # (the one whose chunk the crawling step computes holds that chunk's blocks).
                await wait_for(lambda: rank.prefill_tokens == 20, "two prompts prefilling")
                assert rank.used_blocks in (3, 6)
                expected = (rank.used_blocks, 20)
            else:
                # What its decode threshold judges: the two transfers' blocks, nothing to prefill.
                await wait_for(lambda: len(rank.transferring) == 2, "two transfers")
                expected = (2 * 3, 0)
            assert (rank.used_blocks, rank.prefill_tokens) == (expected[0], expected[1])
            await wait_for_load(events, expected)
            for request_id in range(1, 5):
                await send(ws, Cancel(request_id=request_id))
            frames = await collect_until_final(ws, set(range(1, 5)))
            assert all(isinstance(messages[-1], Failed) for messages in frames.values())
            await wait_for(lambda: worker.gate.in_flight == 0, "everything given back")
            assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)
            await wait_for_load(events, (0, 0))


async def wait_for_load(events: WebSocketConnection, expected: tuple[int, int]) -> None:
    """Read load events until rank 0's (kv_used_blocks, active_prefill_tokens) is ``expected``;
    its active_decode_blocks must be its kv_used_blocks throughout."""
    for _ in range(200):
        for event in await read_events(events):
            loads = event.loads if isinstance(event, wire.Heartbeat) else [event.load]
            for load in loads:
                assert load.active_decode_blocks == load.kv_used_blocks
                if (load.kv_used_blocks, load.active_prefill_tokens) == expected:
                    return
    raise AssertionError(f"no load event showed {expected}")
