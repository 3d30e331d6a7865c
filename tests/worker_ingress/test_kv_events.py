"""KV events: numbered per worker, a snapshot first and after a gap, never coalesced, bounded;
the sans-IO log first, then a real worker on loopback with a real client, old and new peers."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from trio_websocket import WebSocketConnection, open_websocket_url
from worker_harness import (
    TIMEOUT,
    collect_until_final,
    completion,
    get_message_bytes,
    make_settings,
    new_worker,
    request_plane,
    running,
    send,
    wait_for,
)

from shim_common import wire
from shim_common.prefix import WordTokenizer, block_names
from shim_common.wire import (
    FEATURE_KV_EVENTS,
    BusyThresholds,
    EventBatch,
    Hello,
    KvBatch,
    KvCleared,
    KvRemoved,
    KvSnapshot,
    KvStored,
    Subscribe,
)
from worker_ingress._config import MockerSettings
from worker_ingress._kv_events import MIN_BACKLOG_LIMIT, KvEventLog
from worker_ingress.engines._kv_pool import REMOVED, STORED
from worker_ingress.engines._mock_scheduler import MockSequence, RankScheduler
from worker_ingress.engines._mocker import MockerEngine


class Index:
    """What a frontend believes each rank caches, from the events alone; fails on a gap."""

    def __init__(self) -> None:
        self.ranks: dict[int, set[int]] = {}
        self.seq: int | None = None

    def apply(self, event: wire.KvEvent) -> None:
        if isinstance(event, KvSnapshot):
            self.ranks = {rank: set(names) for rank, names in enumerate(event.ranks)}
            self.seq = event.seq
            return
        assert self.seq is not None, "an event before the first snapshot"
        assert event.seq == self.seq + 1, f"a gap: {self.seq} then {event.seq}"
        self.seq = event.seq
        cached = self.ranks.setdefault(event.dp_rank, set())
        if isinstance(event, KvStored):
            assert event.parent is None or event.parent in cached
            assert not cached & set(event.blocks)
            cached.update(event.blocks)
        elif isinstance(event, KvRemoved):
            assert set(event.blocks) <= cached
            cached.difference_update(event.blocks)
        else:
            assert isinstance(event, KvCleared)
            cached.clear()


# ----------------------------------------------------------------------------- sans-IO


def log_over(ranks: list[RankScheduler], backlog_limit: int = 0) -> KvEventLog:
    return KvEventLog(lambda: [r.pool.names() for r in ranks], backlog_limit=backlog_limit)


def record_all(log: KvEventLog, ranks: list[RankScheduler]) -> None:
    for index, rank in enumerate(ranks):
        log.record(index, rank.take_kv_events())


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.lists(st.integers(0, 2), max_size=12), st.integers(0, 1)), max_size=30
    ),
    reads=st.lists(st.integers(0, 6), min_size=1, max_size=30),
)
def test_a_subscriber_rebuilds_every_rank_exactly_from_snapshot_and_events(
    prompts: list[tuple[list[int], int]], reads: list[int]
) -> None:
    ranks = [
        RankScheduler(num_blocks=8, block_size=2, max_num_seqs=2, max_num_batched_tokens=6)
        for _ in range(2)
    ]
    log = log_over(ranks)
    index = Index()
    with log.subscribe(clock=lambda: 0.0) as subscription:
        for number, (prompt, rank) in enumerate(prompts):
            if ranks[rank].fits(len(prompt), 1):
                names = block_names(prompt, 2)
                ranks[rank].add(
                    MockSequence(prompt_tokens=len(prompt), max_tokens=1, block_names=names)
                )
            for scheduler in ranks:
                step = scheduler.schedule()
                if step is not None:
                    scheduler.complete(step)
            record_all(log, ranks)
            if reads[number % len(reads)] == 0:
                for event in subscription.take():
                    index.apply(event)
        for event in subscription.take():
            index.apply(event)
    assert index.seq == log.seq
    assert index.ranks == {r: set(s.pool.names()) for r, s in enumerate(ranks)}


def test_events_are_numbered_per_worker_across_ranks_and_never_coalesced() -> None:
    log = KvEventLog(lambda: [[], []], backlog_limit=0)
    with log.subscribe(clock=lambda: 0.0) as subscription:
        assert subscription.take() == [KvSnapshot(seq=0, ranks=[[], []])]
        log.record(0, [(STORED, None, [1, 2])])
        log.record(1, [(STORED, None, [1])])
        log.record(0, [(REMOVED, None, [2]), (STORED, 1, [2])])
        log.cleared(1)
        assert subscription.take() == [
            KvStored(seq=1, dp_rank=0, parent=None, blocks=[1, 2]),
            KvStored(seq=2, dp_rank=1, parent=None, blocks=[1]),
            KvRemoved(seq=3, dp_rank=0, blocks=[2]),
            KvStored(seq=4, dp_rank=0, parent=1, blocks=[2]),
            KvCleared(seq=5, dp_rank=1),
        ]
        assert subscription.take() == []


def test_a_subscriber_that_cannot_keep_up_gets_a_snapshot_instead_of_a_backlog() -> None:
    cached: list[int] = []
    log = KvEventLog(lambda: [list(cached)], backlog_limit=0)
    with log.subscribe(clock=lambda: 0.0) as subscription:
        subscription.take()
        for name in range(MIN_BACKLOG_LIMIT):
            cached.append(name)
            log.record(0, [(STORED, None, [name])])
            # Never more than the bound waits, however long the subscriber does not read.
            assert subscription.pending <= MIN_BACKLOG_LIMIT
        assert subscription.overflows == 1
        assert subscription.take() == [KvSnapshot(seq=log.seq, ranks=[cached])]
        log.record(0, [(REMOVED, None, [0])])
        assert subscription.take() == [KvRemoved(seq=log.seq, dp_rank=0, blocks=[0])]


def test_asking_for_a_snapshot_replaces_what_is_pending() -> None:
    log = KvEventLog(lambda: [[7]], backlog_limit=0)
    with log.subscribe(clock=lambda: 0.0) as subscription:
        subscription.take()
        log.record(0, [(STORED, None, [7])])
        subscription.ask_snapshot()
        assert subscription.take() == [KvSnapshot(seq=1, ranks=[[7]])]
    assert log.subscriber_count == 0


async def test_batches_are_paced_by_the_interval(autojump_clock: trio.testing.MockClock) -> None:
    log = KvEventLog(lambda: [[]], backlog_limit=0)
    with log.subscribe() as subscription:
        with trio.fail_after(10):
            assert isinstance((await subscription.next_batch(1.0))[0], KvSnapshot)
            sent = trio.current_time()
            log.record(0, [(STORED, None, [1])])
            log.record(0, [(STORED, 1, [2])])
            batch = await subscription.next_batch(1.0)
        assert [event.seq for event in batch] == [1, 2]
        assert trio.current_time() - sent >= 1.0


# ----------------------------------------------------------------------------- a real worker


def mocker_settings(**mocker: Any) -> Any:
    values: dict[str, Any] = {
        "num_gpu_blocks": 32,
        "block_size": 2,
        "max_num_batched_tokens": 64,
        "speedup_ratio": 100.0,
    }
    values.update(mocker)
    return make_settings(load_publish_interval=0.01, mocker=MockerSettings(**values))


async def read_kv(ws: WebSocketConnection, index: Index, until: Any) -> None:
    """Read event-plane messages into ``index`` until ``until()`` holds (bounded)."""
    for _ in range(2000):
        if until():
            return
        message = wire.decode_event_message(await get_message_bytes(ws))
        if isinstance(message, KvBatch):
            for event in message.events:
                index.apply(event)
    raise AssertionError("the index never got there")


def subscribe(*, kv_events: bool = True, kv_snapshot: bool = False) -> Subscribe:
    return Subscribe(thresholds=BusyThresholds(), kv_events=kv_events, kv_snapshot=kv_snapshot)


async def test_a_worker_sends_a_snapshot_then_every_event_and_a_fresh_snapshot_on_request() -> None:
    settings = mocker_settings(data_parallel_size=2)
    engine = MockerEngine(settings.mocker)
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT * 4):
        async with (
            running(worker) as address,
            open_websocket_url(address.ws_url + wire.EVENTS_PATH) as events,
        ):
            hello = wire.decode_event_message(await get_message_bytes(events))
            assert isinstance(hello, Hello)
            assert FEATURE_KV_EVENTS in hello.features
            await send(events, subscribe())
            index = Index()
            await read_kv(events, index, lambda: index.seq is not None)
            async with request_plane(address) as requests:
                prompts = [" ".join(f"t{i % 7}" for i in range(n)) for n in (9, 13, 9, 30)]
                for number, prompt in enumerate(prompts):
                    generate = completion(number, prompt, max_tokens=2)
                    if number % 2:
                        generate = msgspec.structs.replace(generate, dp_rank=1)
                    await send(requests, generate)
                    await collect_until_final(requests, {number})

            log = worker.kv_events
            assert log is not None
            await read_kv(events, index, lambda: index.seq == log.seq)
            truth = {r: set(rank.pool.names()) for r, rank in enumerate(engine.ranks)}
            assert index.ranks == truth
            assert truth[0]
            assert truth[1]
            # The first prompt's blocks, as the frontend would name them, are on rank 0.
            first = block_names(WordTokenizer().encode(prompts[0]), 2)
            assert set(first) <= truth[0]
            # A fresh snapshot on request, whatever the subscriber believed.
            index.ranks = {}
            await send(events, subscribe(kv_snapshot=True))
            await read_kv(events, index, lambda: index.ranks == truth)


@pytest.mark.parametrize("caching", [True, False])
async def test_older_peers_neither_get_nor_are_sent_kv_events(caching: bool) -> None:
    # A subscriber that does not ask (an older frontend) gets load events only; a worker
    # without a prefix cache does not list the feature and ignores the ask.
    settings = mocker_settings(enable_prefix_caching=caching)
    worker = new_worker(settings, MockerEngine(settings.mocker))
    with trio.fail_after(TIMEOUT * 4):
        async with (
            running(worker) as address,
            open_websocket_url(address.ws_url + wire.EVENTS_PATH) as events,
        ):
            hello = wire.decode_event_message(await get_message_bytes(events))
            assert isinstance(hello, Hello)
            assert (FEATURE_KV_EVENTS in hello.features) == caching
            await send(events, subscribe(kv_events=not caching))
            async with request_plane(address) as requests:
                await send(requests, completion(1, "a b c d e f g", max_tokens=2))
                await collect_until_final(requests, {1})
            if caching:
                log = worker.kv_events
                assert log is not None
                await wait_for(lambda: log.seq > 0, "a stored event")
            for _ in range(5):  # heartbeats every 50 ms: several messages, none KV
                message = wire.decode_event_message(await get_message_bytes(events))
                assert isinstance(message, EventBatch)
