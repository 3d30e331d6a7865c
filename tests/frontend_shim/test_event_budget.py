"""The event budget: the interval a fleet's links get, latest-wins over one read, event slices."""

from __future__ import annotations

import functools
import math
import time
from typing import Literal

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_shim._event_budget import MAX_BUDGET_INTERVAL, EventBudget, latest_wins
from frontend_shim._pacer import EventSlices, ReadPacer
from shim_common import wire

# ----------------------------------------------------------------------------- EventBudget


def test_the_budget_is_shared_evenly_by_the_links() -> None:
    budget = EventBudget(6000)
    assert budget.resize(2048)
    assert budget.interval == pytest.approx(2048 / 6000)
    assert budget.links == 2048
    # Every link at that interval: the fleet sends the budget.
    assert budget.expected_messages_per_second([0.1] * 2048) == pytest.approx(6000)


def test_a_small_fleet_gets_no_more_than_the_workers_own_rate() -> None:
    budget = EventBudget(6000)
    budget.resize(64)
    assert budget.interval == pytest.approx(64 / 6000)
    # Their own 0.1 s interval is longer than the budget's: they send at their own pace.
    assert budget.expected_messages_per_second([0.1] * 64) == pytest.approx(640)


def test_the_interval_is_capped_and_then_the_budget_is_exceeded() -> None:
    budget = EventBudget(1000)
    budget.resize(100_000)
    assert budget.interval == MAX_BUDGET_INTERVAL
    assert budget.expected_messages_per_second([0.1] * 100_000) == pytest.approx(100_000)


def test_small_changes_in_the_fleet_do_not_re_ask_every_worker() -> None:
    budget = EventBudget(1000, resend_share=0.2)
    assert budget.resize(500)
    first = budget.interval
    assert not budget.resize(550)  # 10 % more: the interval stays
    assert budget.interval == first
    assert budget.resize(700)  # 40 % more: asked again
    assert budget.interval == pytest.approx(0.7)
    assert budget.resize(0)
    assert budget.interval == 0.0
    assert not budget.resize(0)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_a_budget_that_is_not_a_positive_number_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="event budget"):
        EventBudget(bad)


@given(
    budget=st.floats(min_value=1.0, max_value=1e6),
    links=st.integers(min_value=1, max_value=100_000),
    own=st.floats(min_value=0.0, max_value=2.0),
)
def test_under_the_cap_the_fleet_never_sends_more_than_the_budget(
    budget: float, links: int, own: float
) -> None:
    shared = EventBudget(budget)
    shared.resize(links)
    expected = shared.expected_messages_per_second([own] * links)
    if shared.interval < MAX_BUDGET_INTERVAL:
        assert expected <= budget * (1 + 1e-9)
    else:
        assert expected <= links / MAX_BUDGET_INTERVAL * (1 + 1e-9)


# ----------------------------------------------------------------------------- latest_wins


def load(seq: int, rank: int, blocks: int) -> wire.LoadEvent:
    return wire.LoadEvent(
        seq=seq,
        ts=float(seq),
        load=wire.RankLoad(
            dp_rank=rank, active_decode_blocks=blocks, active_prefill_tokens=0, kv_used_blocks=0
        ),
        engine_requests=seq,
        queued_requests=0,
    )


def heartbeat(
    seq: int, blocks: list[int], status: Literal["ready", "draining"] = "ready"
) -> wire.Heartbeat:
    return wire.Heartbeat(
        seq=seq,
        ts=float(seq),
        loads=[
            wire.RankLoad(
                dp_rank=rank, active_decode_blocks=b, active_prefill_tokens=0, kv_used_blocks=0
            )
            for rank, b in enumerate(blocks)
        ],
        engine_requests=seq,
        queued_requests=0,
        status=status,
    )


def applied(events: list[wire.WorkerEvent]) -> tuple[dict[int, int], str, int]:
    """What a subscriber knows after applying events in order: blocks per rank, status, gauge."""
    blocks: dict[int, int] = {}
    status = "ready"
    gauge = -1
    for event in events:
        if isinstance(event, wire.Heartbeat):
            blocks = {rank.dp_rank: rank.active_decode_blocks for rank in event.loads}
            status = event.status
        else:
            blocks[event.load.dp_rank] = event.load.active_decode_blocks
        gauge = event.engine_requests
    return blocks, status, gauge


def test_one_batch_is_applied_as_it_is() -> None:
    batch: list[wire.WorkerEvent] = [load(1, 0, 5), load(2, 1, 6)]
    assert latest_wins([batch]) == batch


def test_several_batches_keep_the_latest_per_rank_and_the_latest_heartbeat() -> None:
    batches: list[list[wire.WorkerEvent]] = [
        [load(1, 0, 5), load(2, 1, 6)],
        [heartbeat(3, [7, 8], "draining")],
        [load(4, 0, 9)],
        [load(5, 0, 10)],
    ]
    assert latest_wins(batches) == [heartbeat(3, [7, 8], "draining"), load(5, 0, 10)]


@st.composite
def event_batches(draw: st.DrawFn) -> list[list[wire.WorkerEvent]]:
    count = draw(st.integers(min_value=1, max_value=30))
    events: list[wire.WorkerEvent] = []
    for seq in range(1, count + 1):
        if draw(st.booleans()):
            events.append(load(seq, draw(st.integers(0, 3)), draw(st.integers(0, 100))))
        else:
            blocks = draw(st.lists(st.integers(0, 100), min_size=4, max_size=4))
            events.append(heartbeat(seq, blocks, draw(st.sampled_from(["ready", "draining"]))))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, count - 1)), max_size=count)))
    batches: list[list[wire.WorkerEvent]] = []
    start = 0
    for cut in [*cuts, count]:
        if cut > start:
            batches.append(events[start:cut])
            start = cut
    return batches


@settings(max_examples=50, deadline=None)
@given(event_batches())
def test_applying_the_latest_leaves_what_applying_everything_leaves(
    batches: list[list[wire.WorkerEvent]],
) -> None:
    everything = [event for batch in batches for event in batch]
    kept = latest_wins(batches)
    assert applied(kept) == applied(everything)
    assert [event.seq for event in kept] == sorted(event.seq for event in kept)
    if len(batches) > 1:  # one batch is the worker's mailbox already: applied as it is
        assert len(kept) <= 4 + 1


# ----------------------------------------------------------------------------- EventSlices


async def test_event_work_yields_to_other_tasks_after_each_slice() -> None:
    per_slice = 3
    slices = EventSlices(per_slice)
    turns = 0
    most_between = 0
    done = trio.Event()

    async def reader() -> None:
        nonlocal turns
        for _ in range(10):
            await slices.turn()
            turns += 1  # no checkpoint between turns: only the slices make it yield

    async def other_task() -> None:
        # Stands for an HTTP request: how many turns pass between two of its steps?
        nonlocal most_between
        while not done.is_set():
            before = turns
            await trio.lowlevel.checkpoint()
            most_between = max(most_between, turns - before)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(slices.run)
            nursery.start_soon(other_task)
            async with trio.open_nursery() as readers:
                for _ in range(20):
                    readers.start_soon(reader)
            done.set()
            nursery.cancel_scope.cancel()
    assert turns == 200
    assert slices.yields >= 200 // per_slice - 1
    # Turns left of one slice and the next slice's may meet in one pass, no more.
    assert most_between <= 2 * per_slice


def test_a_slice_takes_at_least_one_turn() -> None:
    with pytest.raises(ValueError, match="per_slice"):
        EventSlices(0)


# ----------------------------------------------------------------------------- ReadPacer


async def test_the_pacer_wakes_each_reader_at_its_time_within_a_tick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacer = ReadPacer(tick=0.01)
    woken: dict[int, float] = {}

    async def reader(index: int, when: float) -> None:
        await pacer.wait_until(when)
        woken[index] = trio.current_time()

    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        start = trio.current_time()
        wanted = {index: start + 0.013 * index for index in range(1, 40)}
        async with trio.open_nursery() as readers:
            for index, when in wanted.items():
                readers.start_soon(reader, index, when)
        # A time already past: back at once, no waiting.
        before = trio.current_time()
        await pacer.wait_until(start)
        await pacer.wait_until(-math.inf)
        assert trio.current_time() == before
        nursery.cancel_scope.cancel()
    for index, when in wanted.items():
        assert when <= woken[index] <= when + 0.01 + 1e-9


async def test_the_pacer_makes_each_call_at_its_time_within_a_tick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacer = ReadPacer(tick=0.01)
    called: dict[int, float] = {}

    def note(index: int) -> None:
        called[index] = trio.current_time()

    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        start = trio.current_time()
        wanted = {index: start + 0.013 * index for index in range(1, 40)}
        for index, when in wanted.items():
            pacer.call_at(when, functools.partial(note, index))
        # A time already past is called at the next tick, never inline.
        pacer.call_at(-math.inf, functools.partial(note, 0))
        assert 0 not in called
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert start <= called[0] <= start + 0.01 + 1e-9
    for index, when in wanted.items():
        assert when <= called[index] <= when + 0.01 + 1e-9


async def test_the_pacer_lets_the_scheduler_run_between_slices_of_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 100 calls due at one tick, 24 a slice: another task gets a turn between slices.
    pacer = ReadPacer(tick=0.01, per_slice=24)
    order: list[str] = []
    first_call = trio.Event()

    def call(index: int) -> None:
        first_call.set()
        order.append("call")

    async def other_task() -> None:
        await first_call.wait()
        for _ in range(1000):
            if order.count("call") == 100:
                return
            order.append("other")
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        nursery.start_soon(other_task)
        when = trio.current_time() + 0.05
        for index in range(100):
            pacer.call_at(when, functools.partial(call, index))
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert order.count("call") == 100
    assert pacer.yields == 4
    # Five slices in five passes of the scheduler, and the other task ran once in each of the
    # three between the first and the last (Trio may run it before or after the slice).
    first, last = order.index("call"), len(order) - 1 - order[::-1].index("call")
    assert order[first:last].count("other") >= 3


async def test_a_slice_of_reads_ends_once_it_applied_a_slices_worth_of_kv_names(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Eight reads a slice, each applying a part of 2,048 names: before, all eight (16,384 names,
    # several milliseconds) ran in one pass of the scheduler; now two.
    pacer = ReadPacer(tick=0.01, per_slice=8, names_per_slice=4096)
    passes: list[int] = [0]
    called = 0
    first_call = trio.Event()

    def read() -> None:
        nonlocal called
        called += 1
        first_call.set()
        passes[-1] += 2048
        pacer.spend(2048)

    async def count_passes() -> None:
        await first_call.wait()
        while called < 16:
            if passes[-1]:
                passes.append(0)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        nursery.start_soon(count_passes)
        when = trio.current_time() + 0.05
        for _ in range(16):
            pacer.call_at(when, read)
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert called == 16
    assert pacer.yields == 7  # a slice every two reads (by reads alone: one, after eight)
    # Trio may run the other task before or after a slice: two slices may meet, no more.
    assert max(passes) <= 2 * 4096


async def test_task_read_slices_end_once_a_slices_worth_of_kv_names_is_spent() -> None:
    slices = EventSlices(per_slice=8, names_per_slice=4096)
    most = 0
    applied = 0

    async def reader() -> None:
        nonlocal applied
        for _ in range(4):
            await slices.turn()
            applied += 2048
            slices.spend(2048)

    async def other_task() -> None:
        nonlocal most
        while applied < 16 * 2048:
            before = applied
            await trio.lowlevel.checkpoint()
            most = max(most, applied - before)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(slices.run)
            nursery.start_soon(other_task)
            async with trio.open_nursery() as readers:
                for _ in range(4):
                    readers.start_soon(reader)
            nursery.cancel_scope.cancel()
    # Turns left of one slice and the next slice's may meet in one pass, no more.
    assert most <= 2 * 4096


def test_a_pacer_makes_at_least_one_call_per_slice() -> None:
    with pytest.raises(ValueError, match="per_slice"):
        ReadPacer(per_slice=0)


async def test_the_pacer_calls_a_watched_descriptor_on_the_ticks_it_is_readable() -> None:
    # Real time: epoll sees real sockets. A quiet socket is never called; bytes are noticed
    # within about a tick, and on every tick while they stay unread; unwatch stops the calls.
    pacer = ReadPacer(tick=0.01)
    if not pacer.can_watch:
        pytest.skip("watching needs epoll")
    calls: list[float] = []
    ours, theirs = trio.socket.socketpair()
    with ours, theirs, trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(pacer.run)
            pacer.watch(ours.fileno(), lambda: calls.append(trio.current_time()))
            await trio.sleep(0.1)
            assert calls == []
            sent_at = trio.current_time()
            await theirs.send(b"x")
            await trio.sleep(0.1)
            # Noticed within the 0.1 s (ten ticks), and called again on later ticks while unread.
            assert len(calls) >= 2
            assert calls[0] > sent_at
            assert await ours.recv(1) == b"x"
            await trio.sleep(0.05)
            count = len(calls)
            await trio.sleep(0.1)
            assert len(calls) == count  # read: no more calls
            pacer.unwatch(ours.fileno())
            await theirs.send(b"y")
            await trio.sleep(0.1)
            assert len(calls) == count
            nursery.cancel_scope.cancel()


async def test_the_pacer_times_its_calls_and_nothing_between_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The CPU the reads in place take is what the event budget is measured by: each call's
    # own, and not that of the tasks that run between two slices (HTTP work, say).
    pacer = ReadPacer(tick=0.01, per_slice=2)
    call_cpu, other_cpu = 0.001, 0.01

    def busy(seconds: float) -> None:
        began = time.thread_time()
        while time.thread_time() - began < seconds:
            pass

    async def other_task() -> None:
        for _ in range(20):
            busy(other_cpu)  # between the slices: must not be charged to the reads
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        for _ in range(6):
            pacer.call_at(trio.current_time(), lambda: busy(call_cpu))
        nursery.start_soon(other_task)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert pacer.event_reads == 6
    # Six calls of 1 ms each; the other task's 200 ms, spent between them, is not counted.
    assert 6 * call_cpu <= pacer.event_cpu < 10 * 6 * call_cpu
