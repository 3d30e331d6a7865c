"""The gate on a clock that does not start at 0 (worker_ingress/_admission_state.py, rule 2).

Trio's real clock starts far from 0 (tens of thousands of seconds in), the autojump clock of the
other tests at 0: a time the gate made up as 0 reads as right on the one and as a start decades
ago on the other. So the pure core is played here over the same scenario shifted in time, and
must decide exactly the same; and the Trio shell is driven on a mock clock jumped far ahead.

Every time and duration of the scenario is a multiple of :data:`GRID` (a power of two), and the
offsets are whole seconds below 2**40: every sum and difference of times is then exact in
floating point, so "the same" means equal, not approximately equal.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import trio
import trio.testing
from hypothesis import example, given, settings
from hypothesis import strategies as st

from worker_ingress._admission import AdmissionGate, Rejection, SlotLease
from worker_ingress._admission_state import AdmissionState
from worker_ingress._slo import SloController
from worker_ingress._tickets import Ticket, TicketStatus

#: One step of the scenario (seconds).
GRID = 1 / 64
#: The objective: its engine share (S / 2 = 16 steps) is on the grid too.
S = 0.5
#: Where Trio's real clock may start (it picks a random offset of this order).
REAL_CLOCK = 50_000.0


def _engine_steps(step: int, running: int) -> int:
    """Steps from start to first output: past a knee of 4 a slow engine in the first 6 s (the
    objective lowers L), a fast flat one after (the objective raises L while requests wait)."""
    if step < 6 * 64:
        return 4 + 3 * max(0, running - 4)
    return 2


class Step(NamedTuple):
    """What the gate showed at the end of one step of :func:`play`."""

    step: int
    limit: int
    queue_bound: int
    windows: int
    hold: float | None
    running: int
    queued: int
    started: int
    rejected: int
    refused_for_the_objective: int


class Start(NamedTuple):
    """One start in :func:`play`, as the ticket holds it (times from the scenario's offset)."""

    step: int
    number: int
    started: float
    queue_wait: float
    by_objective: bool


def play(offset: float, seed: int) -> tuple[list[Step], list[Start]]:
    """Twenty seconds of a loaded gate with an objective, every time shifted by ``offset``.

    Returns:
        What the gate did, one record per step and one per start, with every time measured from
        ``offset``.
    """
    rng = random.Random(seed)
    state = AdmissionState(
        engine_slots=12, queue_limit=24, slo=SloController(objective=S, max_limit=12, now=offset)
    )
    slo = state.slo
    assert slo is not None
    # Running ticket -> (step of its first output, step of its end).
    engine: dict[Ticket, tuple[int, int]] = {}
    queued: list[Ticket] = []
    steps: list[Step] = []
    starts: list[Start] = []

    def started(ticket: Ticket | None, step: int, by_objective: bool = False) -> None:
        if ticket is None:
            return
        first = step + _engine_steps(step, state.running)
        engine[ticket] = (first, first + rng.randint(8, 40))
        wait = ticket.started - ticket.arrived
        starts.append(Start(step, ticket.number, ticket.started - offset, wait, by_objective))

    def tick(step: int, now: float) -> None:
        for ticket in state.tick(now):
            started(ticket, step, by_objective=True)

    for step in range(20 * 64):
        now = offset + step * GRID
        tick(step, now)
        for ticket in sorted(engine, key=lambda t: t.number):
            first, end = engine[ticket]
            if first == step:
                started(state.first_output(ticket, now=now), step)
                tick(step, now)
            if end == step:
                del engine[ticket]
                started(state.finish(ticket, now=now), step)
                tick(step, now)
        for ticket in queued:
            state.deadline_passed(ticket, now)
        for _ in range(2 if rng.random() < 0.15 else 1 if rng.random() < 0.2 else 0):
            tick(step, now)
            outcome = state.arrive(prompt_tokens=rng.randint(1, 100), now=now)
            if isinstance(outcome, Ticket):
                if outcome.status is TicketStatus.RUNNING:
                    started(outcome, step)
                else:
                    queued.append(outcome)
        queued = [t for t in queued if t.status in (TicketStatus.HAND, TicketStatus.CHANNEL)]
        steps.append(
            Step(
                step,
                state.slot_limit,
                slo.queue_bound,
                slo.windows,
                slo.hold_seconds,
                state.running,
                state.queued,
                state.started_total,
                state.rejected_total,
                state.slo_rejected_total,
            )
        )
    return steps, starts


def test_a_ticket_the_objective_starts_is_stamped_with_the_time_it_started() -> None:
    steps, starts = play(REAL_CLOCK, seed=7)
    # The scenario does what it is for: the objective lowered L, then raised it while requests
    # waited, and so started some of them itself.
    assert min(record.limit for record in steps) < 12
    assert any(start.by_objective for start in starts)
    for start in starts:
        assert start.started == start.step * GRID, f"#{start.number} started at {start.started}"
        assert start.queue_wait >= 0


@settings(max_examples=12, deadline=None)
@given(offset=st.integers(1, 2**36).map(float), seed=st.integers(0, 2**16))
@example(offset=REAL_CLOCK, seed=7)
def test_the_objective_decides_the_same_on_a_clock_shifted_in_time(
    offset: float, seed: int
) -> None:
    assert play(offset, seed) == play(0.0, seed)


# -- the Trio shell ------------------------------------------------------------------------------


class Request:
    """One request driven by hand (its first output and its end released by the test)."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.lease: SlotLease | None = None
        self.first = trio.Event()
        self.done = trio.Event()
        self.rejected: Rejection | None = None

    async def run(self) -> None:
        try:
            async with self.gate.slot() as lease:
                self.lease = lease
                await self.first.wait()
                lease.first_output()
                await self.done.wait()
        except Rejection as rejection:
            self.rejected = rejection

    def end(self) -> None:
        self.first.set()
        self.done.set()


async def _start(nursery: trio.Nursery, gate: AdmissionGate) -> Request:
    request = Request(gate)
    nursery.start_soon(request.run)
    await trio.testing.wait_all_tasks_blocked()
    return request


async def test_the_objectives_first_window_opens_when_the_gate_is_made(
    autojump_clock: trio.testing.MockClock,
) -> None:
    autojump_clock.jump(REAL_CLOCK)
    gate = AdmissionGate(engine_slots=20, queue_limit=2, ttft_objective=S)
    slo = gate.slo
    assert slo is not None
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            requests = [await _start(nursery, gate) for _ in range(20)]
            await trio.sleep(0.5)
            for request in requests:
                request.end()
            await trio.testing.wait_all_tasks_blocked()
            # Samples enough, but the window has lasted half a second of its one: still open,
            # as on a clock from 0.
            assert slo.windows == 0
            await trio.sleep(0.5)
            await _start(nursery, gate)  # an arrival: the window is due, and closes
            assert slo.windows == 1
            nursery.cancel_scope.cancel()


async def test_a_request_the_objective_starts_reports_its_queue_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    autojump_clock.jump(REAL_CLOCK)
    gate = AdmissionGate(engine_slots=2, queue_limit=4, ttft_objective=S)
    slo = gate.slo
    assert slo is not None
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            first = await _start(nursery, gate)
            await trio.sleep(0.125)
            first.end()  # a hold time: the objective can compute its queue bound
            await trio.testing.wait_all_tasks_blocked()
            gate.set_slot_limit(1)  # an operator's L, below the controller's
            running = await _start(nursery, gate)
            running.first.set()
            await trio.sleep(3.0)  # the controller's window has lasted long enough to starve
            waiting = await _start(nursery, gate)
            assert gate.queued == 1
            await trio.sleep(0.125)
            # The next arrival ticks the controller: a starved window (the limit in use, nobody
            # late for a first output) closes, and its L (N) is put in force, starting the one
            # waiting.
            late = await _start(nursery, gate)
            assert slo.windows == 1
            assert gate.effective_limit == 2
            assert waiting.lease is not None
            assert waiting.lease.queue_wait == pytest.approx(0.125)
            for request in (running, waiting, late):
                request.end()
    hold = slo.hold_seconds
    assert hold is not None
    assert hold < 4.0  # each request held its slot for seconds, not for the clock's age
