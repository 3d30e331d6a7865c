"""KV events: numbered per worker, a snapshot first and after a gap, never coalesced, bounded;
the sans-IO log first, then a real worker on loopback with a real client, old and new peers."""

from __future__ import annotations

import itertools
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
from worker_ingress._kv_events import (
    EVENT_COST,
    KV_SNAPSHOT_GAP,
    MIN_BACKLOG_LIMIT,
    KvEventLog,
    snapshot_parts,
)
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


# ----------------------------------------------------------------------------- parts (rules 6, 7)


class PartsIndex(Index):
    """An index that also takes a snapshot in parts: nothing but its parts until the last."""

    def __init__(self) -> None:
        super().__init__()
        self.building: dict[int, set[int]] | None = None
        self.building_seq = -1

    def apply(self, event: wire.KvEvent) -> None:
        if isinstance(event, KvSnapshot):
            if self.building is None:
                self.building, self.building_seq = {}, event.seq
            assert event.seq == self.building_seq, "a part of another snapshot"
            for rank, names in enumerate(event.ranks):
                self.building.setdefault(rank, set()).update(names)
            if not event.more:
                self.ranks, self.seq, self.building = self.building, event.seq, None
            return
        assert self.building is None, "an event inside a snapshot's parts"
        super().apply(event)


def units(events: list[wire.KvEvent]) -> int:
    """What a message costs a part (rule 6)."""
    total = 0
    for event in events:
        if isinstance(event, KvSnapshot):
            total += sum(len(names) for names in event.ranks)
        else:
            total += len(getattr(event, "blocks", ())) + EVENT_COST
    return total


def test_a_snapshot_in_parts_is_the_whole_cache_and_no_part_is_over_the_bound() -> None:
    ranks = [list(range(r * 10_000, r * 10_000 + n)) for r, n in enumerate((5000, 0, 2048, 1))]
    snapshot = KvSnapshot(seq=9, ranks=ranks)
    parts = snapshot_parts(snapshot)
    assert all(units([part]) <= wire.KV_PART_NAMES for part in parts)
    assert [part.more for part in parts] == [True] * (len(parts) - 1) + [False]
    assert {part.seq for part in parts} == {9}
    index = PartsIndex()
    for part in parts:
        index.apply(part)
    assert index.ranks == {r: set(names) for r, names in enumerate(ranks) if names or r < 4}
    # A small snapshot is one part, the same bytes a whole one is.
    (whole,) = snapshot_parts(KvSnapshot(seq=1, ranks=[[1, 2]]))
    assert wire.encode(whole) == wire.encode(KvSnapshot(seq=1, ranks=[[1, 2]]))


def test_a_long_chain_is_recorded_as_events_that_each_fit_a_part() -> None:
    log = KvEventLog(lambda: [[]], backlog_limit=10**6)
    names = list(range(1, 5001))
    with log.subscribe(parts=True, clock=lambda: 0.0) as subscription:
        index = PartsIndex()
        for event in subscription.take():
            index.apply(event)
        log.record(0, [(STORED, None, names), (REMOVED, None, names[4000:])])
        assert log.seq == 4  # three events for the chain of 5,000, one for the removal
        while subscription.pending:
            message = subscription.take()
            assert units(message) <= wire.KV_PART_NAMES
            for event in message:
                index.apply(event)
    assert index.ranks == {0: set(names[:4000])}


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=12),
    ask_at=st.integers(0, 12),
)
def test_a_subscriber_of_parts_rebuilds_the_cache_through_parts_and_events(
    sizes: list[int], ask_at: int
) -> None:
    cached: list[int] = list(range(10**6, 10**6 + 3000))
    log = KvEventLog(lambda: [list(cached)], backlog_limit=10**6)
    fresh = iter(range(1, 10**6))
    with log.subscribe(parts=True, clock=lambda: 0.0) as subscription:
        index = PartsIndex()
        for round_, size in enumerate(sizes):
            chain = [next(fresh) for _ in range(size)]
            cached.extend(chain)
            log.record(0, [(STORED, None, chain)])
            if round_ == ask_at:
                subscription.ask_snapshot()
            for _ in range(size % 3):  # read a little, or nothing, between the changes
                if subscription.pending:
                    message = subscription.take()
                    assert units(message) <= wire.KV_PART_NAMES
                    for event in message:
                        index.apply(event)
        while subscription.pending:
            for event in subscription.take():
                index.apply(event)
    assert index.ranks == {0: set(cached)}


async def test_parts_go_at_the_byte_rate_and_snapshots_at_most_one_a_gap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cached = list(range(1, 20_001))  # ten parts
    log = KvEventLog(lambda: [list(cached)], backlog_limit=0)
    sent: list[tuple[float, int, bool]] = []  # (when, bytes, a snapshot's first part)
    with log.subscribe(parts=True) as subscription, trio.fail_after(60):
        building = False
        while len([s for s in sent if s[2]]) < 4:
            if not subscription.pending:
                subscription.ask_snapshot()  # a subscriber asking in a loop
            events = await subscription.next_batch(0.0)
            data = wire.encode(KvBatch(events=events))
            (part,) = events
            assert isinstance(part, KvSnapshot)
            sent.append((trio.current_time(), len(data), not building))
            building = part.more
            subscription.sent(len(data))
    for (when, size, _), (after, _, _) in itertools.pairwise(sent):
        assert after - when >= size / wire.KV_BYTES_PER_SECOND
    firsts = [when for when, _, first in sent if first]
    assert all(b - a >= KV_SNAPSHOT_GAP for a, b in itertools.pairwise(firsts))
    assert len(sent) == 3 * 10 + 1  # three snapshots of ten parts, and the first of a fourth


async def test_a_worker_sends_a_subscriber_of_parts_its_cache_in_parts() -> None:
    settings = mocker_settings(num_gpu_blocks=4096, block_size=1, max_num_batched_tokens=8192)
    engine = MockerEngine(settings.mocker)
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT * 6):
        async with running(worker) as address:
            async with request_plane(address) as requests:
                prompt = " ".join(f"w{i}" for i in range(3000))
                await send(requests, completion(1, prompt, max_tokens=1))
                await collect_until_final(requests, {1})
            async with open_websocket_url(address.ws_url + wire.EVENTS_PATH) as events:
                hello = wire.decode_event_message(await get_message_bytes(events))
                assert isinstance(hello, Hello)
                assert wire.FEATURE_KV_PARTS in hello.features
                await send(
                    events, Subscribe(thresholds=BusyThresholds(), kv_events=True, kv_parts=True)
                )
                index = PartsIndex()
                messages: list[bytes] = []
                while index.seq is None:
                    data = await get_message_bytes(events)
                    message = wire.decode_event_message(data)
                    if isinstance(message, KvBatch):
                        messages.append(data)
                        for event in message.events:
                            index.apply(event)
    assert index.ranks == {0: set(engine.ranks[0].pool.names())}
    assert len(messages) >= 2
    assert max(map(len, messages)) <= 20 * 1024
