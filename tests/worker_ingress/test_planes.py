"""Both websocket planes, one connection at a time: frames, subscribers, coalescing, the objective,
admission classes. What bad, absurd or out-of-range messages do to a plane is in
``test_planes_bad_messages.py``.
"""

from __future__ import annotations

import socket as stdlib_socket
from collections.abc import AsyncGenerator

import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from trio_websocket import WebSocketConnection
from worker_harness import (
    TIMEOUT,
    HeldEngine,
    collect_until_final,
    completion,
    event_plane,
    make_settings,
    new_worker,
    port_of,
    read_events,
    receive,
    request_plane,
    running,
    send,
    upgrade_request,
    wait_for,
)

from shim_common import wire
from shim_common.wire import (
    EVENTS_PATH,
    Cancel,
    Chunk,
    End,
    Failed,
    Generate,
    Heartbeat,
    LoadEvent,
    Rejected,
    Started,
)
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress._planes import coalesce_chunks
from worker_ingress.engines._base import FIRST_OUTPUT, EngineOutput, PreparedRequest

# ----------------------------------------------------------------------------- request plane


async def test_completion_streams_started_chunks_end() -> None:
    with trio.fail_after(TIMEOUT):
        async with running(new_worker(make_settings())) as address, request_plane(address) as ws:
            await send(ws, completion(7, prompt="a b c d e", max_tokens=3))
            frames = (await collect_until_final(ws, {7}))[7]
    assert frames[0] == Started(request_id=7, prompt_tokens=5)
    chunks = frames[1:-1]
    # One chunk per token, unless tokens queued up and were merged (they arrive at once here).
    assert 1 <= len(chunks) <= 3
    assert all(isinstance(chunk, Chunk) for chunk in chunks)
    assert sum(chunk.tokens for chunk in chunks if isinstance(chunk, Chunk)) == 3
    assert isinstance(chunks[-1], Chunk)
    assert chunks[-1].finish_reason == "length"
    end = frames[-1]
    assert isinstance(end, End)
    assert (end.request_id, end.prompt_tokens, end.completion_tokens) == (7, 5, 3)
    assert end.started_seq is not None
    assert end.first_output_seq is not None
    assert end.ended_seq is not None
    assert end.started_seq <= end.first_output_seq <= end.ended_seq


async def test_bad_request_fails_without_taking_a_slot() -> None:
    worker = new_worker(make_settings(engine_request_limit=1, request_queue_limit=2))
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await send(ws, Generate(request_id=1, endpoint="completions", body={}))
            (failed,) = (await collect_until_final(ws, {1}))[1]
            assert isinstance(failed, Failed)
            assert failed.kind == "bad_request"
            assert worker.gate.state.started_total == 0
            # The connection is still usable.
            await send(ws, completion(2))
            assert isinstance((await collect_until_final(ws, {2}))[2][-1], End)


async def test_many_requests_multiplexed_on_one_connection() -> None:
    request_ids = set(range(100, 160))
    with trio.fail_after(TIMEOUT):
        async with (
            running(new_worker(make_settings())) as address,
            request_plane(address) as ws,
        ):
            for request_id in sorted(request_ids):
                await send(ws, completion(request_id, max_tokens=request_id % 5))
            frames = await collect_until_final(ws, request_ids)
    for request_id, messages in frames.items():
        assert isinstance(messages[0], Started)
        assert isinstance(messages[-1], End)
        assert messages[-1].completion_tokens == request_id % 5
        assert all(isinstance(message, Chunk) for message in messages[1:-1])


async def test_rejection_at_cap_plus_one_and_the_others_are_served() -> None:
    settings = make_settings(engine_request_limit=2, request_queue_limit=3)
    engine = HeldEngine(settings)
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            for request_id in range(1, 6):  # N + Q = 5 fit
                await send(ws, completion(request_id))
            await wait_for(lambda: worker.gate.in_flight == 5, "5 requests in flight")
            await send(ws, completion(6))
            (rejected,) = (await collect_until_final(ws, {6}))[6]
            assert rejected == Rejected(request_id=6, reason=wire.RejectReason.OVERLOADED)
            assert worker.gate.rejected_total == 1
            engine.release.set()
            frames = await collect_until_final(ws, set(range(1, 6)))
            assert all(isinstance(messages[-1], End) for messages in frames.values())
            # Still usable after a rejection.
            await send(ws, completion(7))
            assert isinstance((await collect_until_final(ws, {7}))[7][-1], End)


async def test_cancel_frees_the_slot_and_the_queue_place() -> None:
    settings = make_settings(engine_request_limit=1, request_queue_limit=2)
    engine = HeldEngine(settings)
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await send(ws, completion(1))
            await send(ws, completion(2))
            await wait_for(lambda: worker.gate.in_flight == 2, "one running, one queued")
            await send(ws, Cancel(request_id=2))  # the queued one
            await send(ws, Cancel(request_id=1))  # the running one
            frames = await collect_until_final(ws, {1, 2})
            assert frames[1][0] == Started(request_id=1, prompt_tokens=3)
            assert [type(message) for message in frames[2]] == [Failed]
            for request_id in (1, 2):
                final = frames[request_id][-1]
                assert isinstance(final, Failed)
                assert final.kind == "cancelled"
            assert (worker.gate.running, worker.gate.queued) == (0, 0)
            await send(ws, Cancel(request_id=99))  # unknown ids are ignored
            engine.release.set()
            await send(ws, completion(3))
            assert isinstance((await collect_until_final(ws, {3}))[3][-1], End)


async def test_engine_failure_answers_failed_and_frees_the_slot() -> None:
    settings = make_settings(engine_request_limit=1, request_queue_limit=2)
    engine = HeldEngine(settings)
    engine.fail = True
    engine.release.set()
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await send(ws, completion(1))
            frames = (await collect_until_final(ws, {1}))[1]
            assert isinstance(frames[0], Started)
            assert isinstance(frames[-1], Failed)
            assert frames[-1].kind == "engine"
            assert worker.gate.in_flight == 0


async def test_dropped_connection_frees_every_slot_and_queue_place() -> None:
    settings = make_settings(engine_request_limit=2, request_queue_limit=2)
    worker = new_worker(settings, HeldEngine(settings))
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address:
            async with request_plane(address) as ws:
                for request_id in range(4):
                    await send(ws, completion(request_id))
                await wait_for(lambda: worker.gate.in_flight == 4, "2 running and 2 queued")
                assert (worker.gate.running, worker.gate.queued) == (2, 2)
            await wait_for(lambda: worker.gate.in_flight == 0, "gauges back to 0")
            assert (worker.gate.running, worker.gate.queued) == (0, 0)
            # The worker still serves a new connection.
            async with request_plane(address) as ws:
                await send(ws, completion(9))
                assert await receive(ws) == Started(request_id=9, prompt_tokens=3)


# ----------------------------------------------------------------------------- event plane


async def test_two_subscribers_get_heartbeats_with_increasing_seq() -> None:
    with trio.fail_after(TIMEOUT):
        async with (
            running(new_worker(make_settings())) as address,
            event_plane(address) as first,
            event_plane(address) as second,
        ):
            for ws in (first, second):
                seqs: list[int] = []
                heartbeats = 0
                for _ in range(50):
                    for event in await read_events(ws):
                        seqs.append(event.seq)
                        assert event.ts > 1.6e9
                        heartbeats += isinstance(event, Heartbeat)
                    if heartbeats >= 3:
                        break
                assert heartbeats >= 3
                assert seqs == sorted(set(seqs))


async def test_events_follow_the_mockers_load() -> None:
    from worker_ingress.engines._mocker import create as create_mocker

    # Slow enough that the request runs across several publish intervals (it is cancelled
    # once seen busy): a request over within one interval may never be seen at all.
    settings = make_settings(
        heartbeat_interval=0.5, mocker=MockerSettings(speedup_ratio=50.0, block_size=4)
    )
    worker = new_worker(settings, create_mocker(settings))
    with trio.fail_after(TIMEOUT):
        async with (
            running(worker) as address,
            event_plane(address) as events,
            request_plane(address) as ws,
        ):
            await send(ws, completion(1, prompt="w " * 64, max_tokens=2000))
            busy: LoadEvent | None = None
            for _ in range(200):
                for event in await read_events(events):
                    if isinstance(event, LoadEvent) and event.load.active_decode_blocks > 0:
                        busy = event
                if busy is not None:
                    break
            assert busy is not None
            assert busy.engine_requests == 1
            await send(ws, Cancel(request_id=1))
            await collect_until_final(ws, {1})
            idle = False
            for _ in range(200):
                batch = await read_events(events)
                last = batch[-1]
                loads = last.loads if isinstance(last, Heartbeat) else [last.load]
                if last.engine_requests == 0 and all(
                    load.active_decode_blocks == 0 for load in loads
                ):
                    idle = True
                    break
            assert idle


@pytest.mark.parametrize("cancelled", [False, True])
async def test_the_final_frame_names_the_last_event_that_counts_the_request(
    cancelled: bool,
) -> None:
    from worker_ingress.engines._mocker import create as create_mocker

    settings = make_settings(
        heartbeat_interval=0.5, mocker=MockerSettings(speedup_ratio=50.0, block_size=4)
    )
    worker = new_worker(settings, create_mocker(settings))
    with trio.fail_after(TIMEOUT):
        async with (
            running(worker) as address,
            event_plane(address, queue_size=64) as events,
            request_plane(address) as ws,
        ):
            for request_id in range(1, 4):  # repeated: the publisher races the end each time
                await send(ws, completion(request_id, prompt="w " * 16, max_tokens=6))
                if cancelled:
                    await send(ws, Cancel(request_id=request_id))
                final = (await collect_until_final(ws, {request_id}))[request_id][-1]
                assert isinstance(final, End | Failed)
                ended = final.ended_seq
                assert ended is not None
                # Every event produced after the end sees the request gone.
                after: list[LoadEvent | Heartbeat] = []
                for _ in range(200):
                    after += [e for e in await read_events(events) if e.seq > ended]
                    if after:
                        break
                assert after
                for event in after:
                    loads = event.loads if isinstance(event, Heartbeat) else [event.load]
                    assert event.engine_requests == 0
                    assert all(load.active_decode_blocks == 0 for load in loads)


async def test_the_final_frame_names_an_event_before_any_that_counts_the_request() -> None:
    settings = make_settings(heartbeat_interval=0.5, load_publish_interval=0.0)
    engine = HeldEngine(settings)
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT):
        async with (
            running(worker) as address,
            event_plane(address, queue_size=64) as events,
            request_plane(address) as ws,
        ):
            # Repeated: the publisher and the request's task race for the turn after the
            # request takes its slot (each wins about half the time).
            for request_id in range(1, 17):
                engine.release = trio.Event()
                await send(ws, completion(request_id))
                await wait_for(lambda: worker.gate.running == 1, "the request running")
                engine.release.set()
                final = (await collect_until_final(ws, {request_id}))[request_id][-1]
                assert isinstance(final, End)
                started, ended = final.started_seq, final.ended_seq
                assert started is not None
                assert ended is not None
                seen: list[LoadEvent | Heartbeat] = []
                for _ in range(200):
                    seen += await read_events(events)
                    if seen[-1].seq >= ended:
                        break
                # Up to its started_seq, no event counts the request: the frontend takes
                # every report after it as counting the request, and none before.
                assert all(e.engine_requests == 0 for e in seen if e.seq <= started), (
                    started,
                    [(e.seq, e.engine_requests) for e in seen],
                )


async def read_until_idle(ws: WebSocketConnection) -> int:
    """Read event batches until one ends with the idle state; return how many were read."""
    for count in range(1, 20_001):
        last = (await read_events(ws))[-1]
        if isinstance(last, LoadEvent) and last.engine_requests == 0:
            return count
    raise AssertionError("never saw the idle state")


async def test_a_subscriber_that_never_reads_costs_nothing_once_its_socket_is_full() -> None:
    from worker_ingress.engines._mocker import create as create_mocker

    # Fat heartbeats (64 ranks) every 5 ms, each sent at once: the socket of a subscriber that
    # never reads (with a small receive buffer) fills within a second.
    settings = make_settings(
        heartbeat_interval=0.005,
        load_publish_interval=0.0,
        mocker=MockerSettings(data_parallel_size=64),
    )
    worker = new_worker(settings, create_mocker(settings))
    publisher = worker.publisher
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address:
            raw = stdlib_socket.socket()
            raw.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_RCVBUF, 4096)
            sock = trio.socket.from_stdlib_socket(raw)
            with sock:
                await sock.connect(("127.0.0.1", port_of(address)))
                await sock.send(upgrade_request(EVENTS_PATH))
                await wait_for(lambda: publisher.subscriber_count == 1, "the subscriber")
                # Once the socket is full, the sender waits on it for good and the
                # subscription stays out of the publisher's delivery: heartbeats go on, and
                # none of them is even put in its mailbox.
                out_for = 0
                for _ in range(1000):
                    out = not publisher._subscribers and publisher.subscriber_count == 1
                    out_for = out_for + 1 if out else 0
                    if out_for == 50:  # 0.5 s, a hundred heartbeats
                        break
                    await trio.sleep(0.01)
                assert out_for == 50, "the subscriber is still delivered to"


async def test_slow_subscriber_catches_up_with_the_latest_state() -> None:
    from worker_ingress.engines._mocker import create as create_mocker

    settings = make_settings(heartbeat_interval=10.0, mocker=MockerSettings(speedup_ratio=1000.0))
    worker = new_worker(settings, create_mocker(settings))
    most_pending = 0

    async def watch_pending() -> None:
        nonlocal most_pending
        for _ in range(100_000):
            for subscription in worker.publisher._subscribers:
                most_pending = max(most_pending, subscription.pending)
            await trio.sleep(0.001)

    with trio.fail_after(TIMEOUT):
        async with (
            running(worker) as address,
            event_plane(address) as slow,
            event_plane(address) as fast,
            trio.open_nursery() as watcher,
        ):
            watcher.start_soon(watch_pending)
            async with request_plane(address) as ws:
                for request_id in range(20):
                    await send(ws, completion(request_id, prompt="w " * 32, max_tokens=50))
                # The slow subscriber reads nothing while the fast one follows the load.
                frames = await collect_until_final(ws, set(range(20)))
                assert all(isinstance(m[-1], End) for m in frames.values())
                fast_messages = await read_until_idle(fast)
            assert fast_messages > 1
            # Then the slow one reads: it reaches the same latest state, and it never got
            # more messages than the fast one (its backlog is coalesced, never grown).
            slow_messages = await read_until_idle(slow)
            assert slow_messages <= fast_messages + 1
            watcher.cancel_scope.cancel()
    # Per subscriber the worker held at most one event per rank (1 here) plus a heartbeat.
    assert most_pending <= 2


# -- merging queued chunks ------------------------------------------------------------------


def test_coalesce_merges_each_requests_queued_text_and_keeps_order() -> None:
    frames = [
        Started(request_id=1, prompt_tokens=2),
        Chunk(request_id=1, text="a", tokens=1),
        Chunk(request_id=2, text="x", tokens=1),
        Chunk(request_id=1, text=" b", tokens=1),
        Chunk(request_id=2, text=" y", tokens=1, finish_reason="length"),
        End(request_id=2, prompt_tokens=1, completion_tokens=2),
        Chunk(request_id=1, text=" c", tokens=1, finish_reason="length"),
        End(request_id=1, prompt_tokens=2, completion_tokens=3),
    ]
    assert coalesce_chunks(frames) == [
        Started(request_id=1, prompt_tokens=2),
        Chunk(request_id=1, text="a b c", tokens=3, finish_reason="length"),
        Chunk(request_id=2, text="x y", tokens=2, finish_reason="length"),
        End(request_id=2, prompt_tokens=1, completion_tokens=2),
        End(request_id=1, prompt_tokens=2, completion_tokens=3),
    ]


def test_coalesce_never_merges_embeddings_or_across_a_requests_other_frames() -> None:
    vector = Chunk(request_id=1, embedding=[0.5], index=0)
    frames = [
        vector,
        Chunk(request_id=1, embedding=[0.25], index=1),
        Chunk(request_id=3, text="a", tokens=1),
        Failed(request_id=3, kind="engine", message="boom"),
        Chunk(request_id=3, text="late", tokens=1),
    ]
    assert coalesce_chunks(frames) == frames


@given(
    st.lists(
        st.tuples(st.integers(min_value=1, max_value=3), st.text(max_size=3), st.booleans()),
        max_size=30,
    )
)
def test_coalesce_keeps_every_requests_text_and_token_count(
    pieces: list[tuple[int, str, bool]],
) -> None:
    frames: list[msgspec.Struct] = [
        Chunk(request_id=rid, text=text, tokens=1)
        if is_chunk
        else Started(request_id=rid, prompt_tokens=0)
        for rid, text, is_chunk in pieces
    ]
    merged = coalesce_chunks(frames)

    def per_request(items: list[msgspec.Struct]) -> dict[int, list[str | int]]:
        # Each request's frames as a list: the text between two other frames joined, and the
        # token count of that text, so only chunk boundaries may differ, never order or content.
        seen: dict[int, list[str | int]] = {}
        for item in items:
            assert isinstance(item, Chunk | Started)
            parts = seen.setdefault(item.request_id, [])
            if isinstance(item, Chunk):
                if len(parts) >= 2 and isinstance(parts[-2], str):
                    text, tokens = parts[-2], parts[-1]
                    assert isinstance(tokens, int)
                    parts[-2:] = [text + item.text, tokens + item.tokens]
                else:
                    parts += [item.text, item.tokens]
            else:
                parts.append(-1)  # a Started frame
        return seen

    assert per_request(merged) == per_request(frames)
    assert len(merged) <= len(frames)


async def test_with_an_objective_events_carry_l_and_a_late_request_is_refused_for_it() -> None:
    settings = make_settings(engine_request_limit=1, request_queue_limit=4, ttft_slo=0.05)
    engine = HeldEngine(settings)
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            async with event_plane(address) as events:
                limits = [event.effective_limit for event in await read_events(events)]
                assert limits
                assert set(limits) == {1}
            await send(ws, completion(1))
            await send(ws, completion(2))
            # Request 2 waits behind 1 (held by the engine) until its wait leaves no room.
            (refused,) = (await collect_until_final(ws, {2}))[2]
            slo = worker.gate.slo
            assert slo is not None
            # The refusal says at which queue depth the worker refuses (none yet: unbounded).
            assert refused == Rejected(
                request_id=2, reason=wire.RejectReason.SLO, queue_bound=slo.queue_bound
            )
            assert worker.gate.state.slo_rejected_total == 1
            engine.release.set()
            assert isinstance((await collect_until_final(ws, {1}))[1][-1], End)


async def test_the_time_a_request_spent_in_the_frontend_counts_against_the_objective() -> None:
    settings = make_settings(engine_request_limit=1, request_queue_limit=4, ttft_slo=30.0)
    engine = HeldEngine(settings)
    worker = new_worker(settings, engine)
    assert wire.FEATURE_FRONTEND_TIME in worker.hello.features
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await send(ws, completion(1))  # holds the only slot
            # 30 s already spent in the frontend: no room left to wait, refused at once.
            late = msgspec.structs.replace(completion(2), frontend_ms=30_000)
            await send(ws, late)
            # 0 s spent: it waits in the queue for its turn.
            await send(ws, completion(3))
            (refused,) = (await collect_until_final(ws, {2}))[2]
            assert isinstance(refused, Rejected)
            assert refused.reason == wire.RejectReason.SLO
            await wait_for(lambda: worker.gate.queued == 1, "request 3 to wait in the queue")
            engine.release.set()
            finals = await collect_until_final(ws, {1, 3})
            assert isinstance(finals[1][-1], End)
            assert isinstance(finals[3][-1], End)


# ----------------------------------------------------------------------------- admission classes


class FirstOutputThenHeld(HeldEngine):
    """Says "first output" at once with the marker, then holds the rest until released."""

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        yield FIRST_OUTPUT
        async for output in super().generate(request):
            yield output


def classed(request_id: int, priority: int = 0, tenant: str = "") -> Generate:
    return Generate(
        request_id=request_id,
        endpoint="completions",
        body={"prompt": "one two three", "max_tokens": 1},
        priority=priority,
        tenant=tenant,
    )


async def test_the_first_output_marker_frees_the_waiting_place_and_is_not_forwarded() -> None:
    settings = make_settings(engine_request_limit=2, engine_request_waiting_limit=1)
    engine = FirstOutputThenHeld(settings)
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await send(ws, completion(1))
            await send(ws, completion(2))
            # The first one's marker gave its waiting place back: the second started too.
            await wait_for(lambda: worker.gate.running == 2, "both running")
            await wait_for(lambda: worker.gate.waiting == 0, "both past their first output")
            engine.release.set()
            frames = await collect_until_final(ws, {1, 2})
            for messages in frames.values():
                assert isinstance(messages[0], Started)
                assert isinstance(messages[-1], End)
                chunks = [m for m in messages if isinstance(m, Chunk)]
                # The marker is not a chunk: every chunk forwarded carries text.
                assert chunks
                assert all(chunk.text and chunk.tokens for chunk in chunks)
                assert sum(chunk.tokens for chunk in chunks) == messages[-1].completion_tokens


async def test_priority_and_tenant_of_generate_order_the_queue_and_displace() -> None:
    # N = 1, Q = 3: the hand and two channel places.
    settings = make_settings(engine_request_limit=1, request_queue_limit=3)
    engine = HeldEngine(settings)
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            for request_id, priority in [(1, 0), (2, 5), (3, 5), (4, 5)]:
                await send(ws, classed(request_id, priority))
                await wait_for(lambda n=request_id: worker.gate.in_flight == n, f"{request_id}")
            await send(ws, classed(5, 0, "interactive"))  # displaces 4, the newest of priority 5
            (displaced,) = (await collect_until_final(ws, {4}))[4]
            assert displaced == Rejected(request_id=4, reason=wire.RejectReason.DISPLACED_PRIORITY)
            assert worker.gate.state.displaced_total == 1
            engine.release.set()
            frames = await collect_until_final(ws, {1, 2, 3, 5})
            starts = [m for messages in frames.values() for m in messages if isinstance(m, Started)]
            assert len(starts) == 4
            # Queued ones report a wait; the first one started at once.
            assert frames[1][0] == Started(request_id=1, prompt_tokens=3, queue_wait_ms=0)
            assert worker.gate.state.admitted_queue_total == 3
