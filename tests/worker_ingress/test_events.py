"""The event publisher: change detection, heartbeats, coalescing, latest-wins per subscriber."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from shim_common.wire import BusyThresholds, Heartbeat, LoadEvent, Mailbox, RankLoad, WorkerEvent
from worker_ingress._events import EventPublisher, LoadTracker, Subscription
from worker_ingress._watch import ChangeSignal


def rank(dp_rank: int, blocks: int = 0, prefill: int = 0) -> RankLoad:
    return RankLoad(
        dp_rank=dp_rank,
        active_decode_blocks=blocks,
        active_prefill_tokens=prefill,
        kv_used_blocks=blocks,
    )


def fixed_clock() -> float:
    return 1000.0


@asynccontextmanager
async def open_event_publisher(publisher: EventPublisher) -> AsyncIterator[EventPublisher]:
    """Run ``publisher`` in a nursery for the duration of the block; yield it, started."""
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        yield publisher
        nursery.cancel_scope.cancel()


# ----------------------------------------------------------------------------- LoadTracker


def test_tracker_emits_once_per_changed_rank() -> None:
    tracker = LoadTracker(wall_clock=fixed_clock)
    first = tracker.observe([rank(0), rank(1)], 0, 0)
    assert [(event.seq, event.load.dp_rank) for event in first] == [(1, 0), (2, 1)]
    assert tracker.observe([rank(0), rank(1)], 0, 0) == []
    changed = tracker.observe([rank(0), rank(1, blocks=3)], 0, 0)
    assert [(event.seq, event.load) for event in changed] == [(3, rank(1, blocks=3))]
    assert changed[0].ts == 1000.0


def test_tracker_gauge_change_emits_for_every_rank() -> None:
    tracker = LoadTracker(wall_clock=fixed_clock)
    tracker.observe([rank(0), rank(1)], 0, 0)
    events = tracker.observe([rank(0), rank(1)], 2, 1)
    assert [(e.load.dp_rank, e.engine_requests, e.queued_requests) for e in events] == [
        (0, 2, 1),
        (1, 2, 1),
    ]


def test_tracker_carries_the_effective_limit_and_a_change_of_it_is_an_event() -> None:
    tracker = LoadTracker(wall_clock=fixed_clock)
    assert [e.effective_limit for e in tracker.observe([rank(0)], 1, 0)] == [None]
    assert [e.effective_limit for e in tracker.observe([rank(0)], 1, 0, 8)] == [8]
    assert tracker.observe([rank(0)], 1, 0, 8) == []
    assert tracker.heartbeat("ready").effective_limit == 8


def test_tracker_carries_the_queue_by_priority_and_a_change_of_it_is_an_event() -> None:
    tracker = LoadTracker(wall_clock=lambda: 0.0)
    assert [e.queue_ahead for e in tracker.observe([rank(0)], 1, 2, 1, [(0, 2)])] == [[(0, 2)]]
    assert tracker.observe([rank(0)], 1, 2, 1, [(0, 2)]) == []
    # Same total, other classes (a better arrival displaced a worse one): an event.
    assert [e.queue_ahead for e in tracker.observe([rank(0)], 1, 2, 1, [(-1, 2)])] == [[(-1, 2)]]
    assert tracker.heartbeat("ready").queue_ahead == [(-1, 2)]


def test_heartbeat_repeats_latest_state_and_takes_a_sequence_number() -> None:
    tracker = LoadTracker(wall_clock=fixed_clock)
    tracker.observe([rank(0, blocks=4)], 1, 0)
    heartbeat = tracker.heartbeat("draining")
    assert heartbeat == Heartbeat(
        seq=2,
        ts=1000.0,
        loads=[rank(0, blocks=4)],
        engine_requests=1,
        queued_requests=0,
        status="draining",
    )
    assert tracker.seq == 2


# ----------------------------------------------------------------------------- Mailbox


def load_event(seq: int, dp_rank: int, blocks: int = 0) -> LoadEvent:
    return LoadEvent(
        seq=seq, ts=0.0, load=rank(dp_rank, blocks), engine_requests=0, queued_requests=0
    )


def heartbeat(seq: int) -> Heartbeat:
    return Heartbeat(seq=seq, ts=0.0, loads=[], engine_requests=0, queued_requests=0)


def test_mailbox_keeps_latest_per_rank_in_seq_order() -> None:
    mailbox = Mailbox()
    mailbox.put(load_event(1, dp_rank=0, blocks=1))
    mailbox.put(load_event(2, dp_rank=1, blocks=1))
    mailbox.put(load_event(3, dp_rank=0, blocks=2))
    assert len(mailbox) == 2
    assert [event.seq for event in mailbox.take()] == [2, 3]
    assert mailbox.take() == []


def test_heartbeat_supersedes_older_load_events() -> None:
    mailbox = Mailbox()
    mailbox.put(load_event(1, dp_rank=0))
    mailbox.put(heartbeat(2))
    mailbox.put(load_event(3, dp_rank=0))
    assert [event.seq for event in mailbox.take()] == [2, 3]


events_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("load"), st.integers(0, 3)),
        st.tuples(st.just("heartbeat"), st.just(0)),
        st.tuples(st.just("take"), st.just(0)),
    ),
    max_size=60,
)


@given(operations=events_strategy)
def test_mailbox_is_bounded_and_never_loses_the_latest_state(
    operations: list[tuple[str, int]],
) -> None:
    """Model: what a subscriber took, replayed in order, ends in the latest state."""
    mailbox = Mailbox()
    seq = itertools.count(1)
    latest: dict[int, int] = {}  # rank -> seq of the latest event for it (heartbeat: all ranks)
    seen: dict[int, int] = {}
    last_taken = 0
    for kind, dp_rank in [*operations, ("take", 0)]:
        if kind == "load":
            event: WorkerEvent = load_event(next(seq), dp_rank)
            latest[dp_rank] = event.seq
            mailbox.put(event)
        elif kind == "heartbeat":
            event = heartbeat(next(seq))
            for known in latest:
                latest[known] = event.seq
            mailbox.put(event)
        else:
            taken = mailbox.take()
            assert [e.seq for e in taken] == sorted(e.seq for e in taken)
            assert all(e.seq > last_taken for e in taken)
            for e in taken:
                last_taken = e.seq
                if isinstance(e, Heartbeat):
                    for known in latest:
                        seen[known] = e.seq
                else:
                    seen[e.load.dp_rank] = e.seq
        assert len(mailbox) <= 4 + 1
    assert seen == latest


async def test_a_forwarded_bump_wakes_the_waiter_of_the_other_signal() -> None:
    engine, publisher = ChangeSignal(), ChangeSignal()
    engine.forward_to(publisher)
    with pytest.raises(ValueError, match="itself"):
        engine.forward_to(engine)
    woke: list[int] = []

    async def wait() -> None:
        woke.append(await publisher.wait_past(0))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            engine.bump()
    assert woke == [1]
    assert engine.version == 1
    publisher.bump()  # forwarding goes one way
    assert engine.version == 1


# ----------------------------------------------------------------------------- EventPublisher


class FakeLoad:
    """An engine's load: two ranks and a change signal, plus the ingress gauges."""

    def __init__(self) -> None:
        self.loads = [rank(0), rank(1)]
        self.changed = ChangeSignal()
        self.running = 0
        self.queued = 0

    def load(self) -> list[RankLoad]:
        return list(self.loads)

    def gauges(self) -> tuple[int, int]:
        return self.running, self.queued

    def publisher(
        self, heartbeat_interval: float = 1.0, publish_interval: float = 0.1
    ) -> EventPublisher:
        return EventPublisher(
            load=self.load,
            load_changed=self.changed,
            gauges=self.gauges,
            heartbeat_interval=heartbeat_interval,
            publish_interval=publish_interval,
            limits=lambda: (100, 1000),
        )


async def test_new_subscriber_starts_with_a_heartbeat(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(source.publisher()) as publisher:
        with publisher.subscribe() as subscription:
            (first,) = await subscription.next_batch()
    assert isinstance(first, Heartbeat)
    assert first.loads == [rank(0), rank(1)]


async def test_engine_change_is_published_and_heartbeats_tick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(source.publisher(heartbeat_interval=2.0)) as publisher:
        with publisher.subscribe() as subscription:
            await subscription.next_batch()
            start = trio.current_time()
            source.loads = [rank(0), rank(1, blocks=5)]
            source.changed.bump()
            (event,) = await subscription.next_batch()
            assert isinstance(event, LoadEvent)
            assert event.load == rank(1, blocks=5)
            assert trio.current_time() - start < 0.5
            beats: list[float] = []
            for _ in range(3):
                (beat,) = await subscription.next_batch()
                assert isinstance(beat, Heartbeat)
                assert beat.seq > event.seq
                beats.append(trio.current_time())
    gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]
    assert all(1.5 < gap < 2.5 for gap in gaps), gaps


async def test_gauge_change_through_notify(autojump_clock: trio.testing.MockClock) -> None:
    source = FakeLoad()
    async with open_event_publisher(source.publisher()) as publisher:
        with publisher.subscribe() as subscription:
            await subscription.next_batch()
            source.running, source.queued = 3, 2
            publisher.notify()
            events = await subscription.next_batch()
    assert {(e.engine_requests, e.queued_requests) for e in events} == {(3, 2)}
    assert sorted(e.load.dp_rank for e in events if isinstance(e, LoadEvent)) == [0, 1]


async def test_status_change_sends_a_heartbeat_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(source.publisher(heartbeat_interval=30.0)) as publisher:
        with publisher.subscribe() as subscription:
            await subscription.next_batch()
            start = trio.current_time()
            publisher.set_status("draining")
            (beat,) = await subscription.next_batch()
    assert isinstance(beat, Heartbeat)
    assert beat.status == "draining"
    assert trio.current_time() - start < 1.0


async def test_slow_subscriber_gets_latest_state_not_a_backlog(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(source.publisher(heartbeat_interval=100.0)) as publisher:
        with publisher.subscribe() as slow, publisher.subscribe() as fast:
            await slow.next_batch()
            await fast.next_batch()
            fast_events: list[WorkerEvent] = []
            for blocks in range(1, 201):
                source.loads = [rank(0, blocks=blocks), rank(1, blocks=blocks)]
                source.changed.bump()
                fast_events.extend(await fast.next_batch())
                assert slow.pending <= 3
            batch = await slow.next_batch()
    # The fast subscriber saw every step; the slow one only the last state of each rank.
    assert fast_events[-1].seq == batch[-1].seq
    assert len(fast_events) >= 200
    assert [e.load for e in batch if isinstance(e, LoadEvent)] == [
        rank(0, blocks=200),
        rank(1, blocks=200),
    ]


async def test_unsubscribed_subscriber_receives_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(source.publisher()) as publisher:
        with publisher.subscribe() as subscription:
            assert publisher.subscriber_count == 1
        assert publisher.subscriber_count == 0
        await trio.sleep(5)
        assert subscription.pending == 1  # only the initial heartbeat, never taken


# ----------------------------------------------------------------------------- rate and edges


async def _step_load(source: FakeLoad, steps: int, every: float, blocks: int = 10) -> None:
    """An engine stepping fast: the load of rank 0 changes ``steps`` times, ``every`` apart."""
    for step in range(steps):
        source.loads = [rank(0, blocks=blocks + step % 2), rank(1)]
        source.changed.bump()
        await trio.sleep(every)


async def test_publishing_rate_is_bounded_however_fast_the_engine_steps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    batches = 0
    async with open_event_publisher(
        source.publisher(heartbeat_interval=100.0, publish_interval=0.1)
    ) as publisher:
        with publisher.subscribe() as subscription:
            await subscription.next_batch()
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_step_load, source, 2000, 0.001)
                with trio.move_on_after(2.0):
                    while True:
                        await subscription.next_batch()
                        batches += 1
                nursery.cancel_scope.cancel()
            elapsed = trio.current_time() - start
    # 2,000 changes in 2 s; at most one batch per 0.1 s (+1 for the first one).
    assert 10 <= batches <= elapsed / 0.1 + 1


async def test_a_busy_edge_under_the_subscribers_thresholds_skips_the_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(
        source.publisher(heartbeat_interval=100.0, publish_interval=5.0)
    ) as publisher:
        with publisher.subscribe() as subscription:
            subscription.set_thresholds(BusyThresholds(active_decode_blocks=0.5))
            await subscription.next_batch()  # the first heartbeat: rank 0 free (0 of 100)
            # A change that keeps rank 0 free waits out the 5 s interval ...
            source.loads = [rank(0, blocks=20), rank(1)]
            source.changed.bump()
            start = trio.current_time()
            await subscription.next_batch()
            assert trio.current_time() - start >= 4.9
            # ... one that turns it busy (60 of 100 > 0.5) goes at once.
            source.loads = [rank(0, blocks=60), rank(1)]
            source.changed.bump()
            start = trio.current_time()
            (event,) = await subscription.next_batch()
            assert isinstance(event, LoadEvent)
            assert event.load.active_decode_blocks == 60
            assert trio.current_time() - start <= 5.0 / 20 + 0.01
            # And turning free again is an edge too.
            source.loads = [rank(0, blocks=10), rank(1)]
            source.changed.bump()
            start = trio.current_time()
            await subscription.next_batch()
            assert trio.current_time() - start <= 5.0 / 20 + 0.01


async def test_without_thresholds_a_busy_change_waits_for_the_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(
        source.publisher(heartbeat_interval=100.0, publish_interval=5.0)
    ) as publisher:
        with publisher.subscribe() as subscription:
            await subscription.next_batch()
            source.loads = [rank(0, blocks=90), rank(1)]
            source.changed.bump()
            start = trio.current_time()
            await subscription.next_batch()
    assert trio.current_time() - start >= 4.9


async def test_a_subscriber_may_ask_for_a_longer_interval_never_a_shorter_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(
        source.publisher(heartbeat_interval=100.0, publish_interval=0.1)
    ) as publisher:
        with publisher.subscribe() as slow, publisher.subscribe() as fast:
            slow.set_publish_interval(0.5)
            fast.set_publish_interval(0.01)  # below the worker's own: the worker's own holds
            assert (slow.publish_interval, fast.publish_interval) == (0.5, 0.1)
            counts = {"slow": 0, "fast": 0}

            async def count(name: str, subscription: Subscription) -> None:
                await subscription.next_batch()
                while True:
                    await subscription.next_batch()
                    counts[name] += 1

            async with trio.open_nursery() as nursery:
                nursery.start_soon(count, "slow", slow)
                nursery.start_soon(count, "fast", fast)
                nursery.start_soon(_step_load, source, 2000, 0.001)
                await trio.sleep(2.0)
                nursery.cancel_scope.cancel()
    # 2 s of changes every millisecond: about 4 batches at 0.5 s, about 20 at 0.1 s.
    assert 3 <= counts["slow"] <= 5
    assert 15 <= counts["fast"] <= 21


async def test_edges_skip_a_subscribers_longer_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(
        source.publisher(heartbeat_interval=100.0, publish_interval=0.1)
    ) as publisher:
        with publisher.subscribe() as subscription:
            subscription.set_thresholds(BusyThresholds(active_decode_blocks=0.5))
            subscription.set_publish_interval(10.0)
            await subscription.next_batch()
            source.loads = [rank(0, blocks=60), rank(1)]
            source.changed.bump()
            start = trio.current_time()
            (event,) = await subscription.next_batch()
            assert isinstance(event, LoadEvent)
            # The edge gap is the worker's own (0.1 / 20), not a share of the asked 10 s.
            assert trio.current_time() - start <= 0.1 / 20 + 0.01
            subscription.set_publish_interval(0.0)
            assert subscription.publish_interval == 0.1


# ----------------------------------------------------------------------------- senders that write


async def test_a_subscription_whose_sender_writes_is_delivered_nothing_and_then_catches_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(
        source.publisher(heartbeat_interval=100.0, publish_interval=0.1)
    ) as publisher:
        with publisher.subscribe() as writing, publisher.subscribe() as reading:
            taken = await writing.next_batch()
            await reading.next_batch()
            # `writing` took a batch and has not asked for the next one: its sender is still
            # writing (a socket that is full never returns). It costs nothing meanwhile.
            for blocks in range(1, 101):
                source.loads = [rank(0, blocks=blocks), rank(1)]
                source.changed.bump()
                await reading.next_batch()
                assert writing.pending == 0
            assert publisher.subscriber_count == 2
            publisher.set_status("draining")
            await trio.testing.wait_all_tasks_blocked()
            assert writing.pending == 0
            # Back for its next batch: at once (the status heartbeat is urgent), the latest
            # state only, every seq newer than what it was sent.
            start = trio.current_time()
            caught_up = await writing.next_batch()
            assert trio.current_time() - start <= 0.1 / 20 + 0.001
    assert [type(event) for event in caught_up] == [Heartbeat]
    (heartbeat,) = caught_up
    assert isinstance(heartbeat, Heartbeat)
    assert heartbeat.status == "draining"
    assert heartbeat.loads == [rank(0, blocks=100), rank(1)]
    assert heartbeat.seq > taken[-1].seq


async def test_a_rejoining_subscription_gets_the_latest_load_of_each_rank_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    async with open_event_publisher(
        source.publisher(heartbeat_interval=100.0, publish_interval=0.1)
    ) as publisher:
        with publisher.subscribe() as subscription:
            seqs = [event.seq for event in await subscription.next_batch()]
            for blocks in range(1, 50):
                source.loads = [rank(0, blocks=blocks), rank(1, blocks=blocks % 3)]
                source.changed.bump()
                await trio.sleep(0.01)
            batch = await subscription.next_batch()
            seqs += [event.seq for event in batch]
            source.loads = [rank(0, blocks=7), rank(1, blocks=1)]
            source.changed.bump()
            later = await subscription.next_batch()
            seqs += [event.seq for event in later]
    assert [e.load for e in batch if isinstance(e, LoadEvent)] == [
        rank(0, blocks=49),
        rank(1, blocks=1),
    ]
    assert [e.load for e in later if isinstance(e, LoadEvent)] == [rank(0, blocks=7)]
    assert seqs == sorted(set(seqs))


async def test_a_waiting_sender_is_woken_once_per_batch_not_once_per_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = FakeLoad()
    wakeups = 0
    async with open_event_publisher(
        source.publisher(heartbeat_interval=100.0, publish_interval=1.0)
    ) as publisher:
        with publisher.subscribe() as subscription:
            await subscription.next_batch()
            signal = subscription._signal
            before = signal.version
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_step_load, source, 500, 0.001)
                await subscription.next_batch()
                wakeups = signal.version - before
                nursery.cancel_scope.cancel()
    # 500 changes within the interval: one wake for the first pending event, none after.
    assert wakeups == 1
