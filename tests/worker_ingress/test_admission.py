"""The admission gate: the sans-IO state step by step, then the Trio shell (autojump clock)."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from shim_common.wire import RejectReason
from worker_ingress._admission import (
    AdmissionGate,
    AdmissionState,
    GateRefusal,
    Rejection,
    Ticket,
    TicketStatus,
)
from worker_ingress._config import WorkerSettings

# -- AdmissionState (no Trio) -------------------------------------------------------------------


def _admit(state: AdmissionState) -> Ticket:
    decision = state.arrive(now=0.0)
    assert isinstance(decision, Ticket), decision
    return decision


@pytest.mark.parametrize(("slots", "queue"), [(0, 2), (-1, 16), (1, 1), (4, 0)])
def test_state_rejects_invalid_sizes(slots: int, queue: int) -> None:
    with pytest.raises(ValueError, match="must be >="):
        AdmissionState(engine_slots=slots, queue_limit=queue)


def test_state_cap_is_exactly_n_plus_q_with_the_hand_counted_as_queued() -> None:
    state = AdmissionState(engine_slots=2, queue_limit=3)
    running = [_admit(state) for _ in range(2)]
    assert [t.status for t in running] == [TicketStatus.RUNNING] * 2
    queued = [_admit(state) for _ in range(3)]
    # The first queued ticket is in the dispatcher's hand, the other Q - 1 in the channel.
    assert [t.status for t in queued] == [
        TicketStatus.HAND,
        TicketStatus.CHANNEL,
        TicketStatus.CHANNEL,
    ]
    assert (state.running, state.queued, state.in_flight) == (2, 3, 5)
    rejected = state.arrive(now=0.0)
    assert isinstance(rejected, GateRefusal)
    assert rejected.reason == RejectReason.OVERLOADED
    assert state.rejected_total == 1
    assert state.in_flight == 5


def test_state_a_freed_slot_goes_to_the_hand_and_the_channel_head_moves_up() -> None:
    state = AdmissionState(engine_slots=1, queue_limit=3)
    first = _admit(state)
    a, b, c = (_admit(state) for _ in range(3))
    assert state.queued_tickets() == [a, b, c]
    assert state.finish(first, now=0.0) is a
    assert a.status is TicketStatus.RUNNING
    assert state.hand is b
    assert b.status is TicketStatus.HAND
    assert state.queued_tickets() == [b, c]
    assert state.finish(a, now=0.0) is b
    assert state.finish(b, now=0.0) is c
    assert state.hand is None
    assert state.finish(c, now=0.0) is None
    assert (state.running, state.queued) == (0, 0)
    assert (state.started_total, state.finished_total) == (4, 4)


def test_state_newcomer_never_overtakes_a_queued_ticket() -> None:
    state = AdmissionState(engine_slots=1, queue_limit=2)
    first = _admit(state)
    waiting = _admit(state)
    # The slot is busy, so the next arrival queues behind ``waiting`` ...
    behind = _admit(state)
    assert behind.status is TicketStatus.CHANNEL
    # ... and when the slot frees, ``waiting`` starts, not a newcomer.
    assert state.finish(first, now=0.0) is waiting
    newcomer = _admit(state)
    assert newcomer.status is TicketStatus.CHANNEL
    assert state.queued_tickets() == [behind, newcomer]


def test_state_cancel_of_the_hand_moves_the_next_up_and_gives_the_place_back() -> None:
    state = AdmissionState(engine_slots=1, queue_limit=2)
    running = _admit(state)
    hand, channel = _admit(state), _admit(state)
    assert isinstance(state.arrive(now=0.0), GateRefusal)
    assert state.cancel(hand, now=0.0) is None
    assert hand.status is TicketStatus.CANCELLED
    assert state.hand is channel
    assert state.queued == 1
    # The place is free again.
    again = _admit(state)
    assert state.queued_tickets() == [channel, again]
    assert state.finish(running, now=0.0) is channel


def test_state_cancel_from_the_middle_of_the_channel_keeps_the_order() -> None:
    state = AdmissionState(engine_slots=1, queue_limit=4)
    running = _admit(state)
    a, b, c, d = (_admit(state) for _ in range(4))
    state.cancel(c, now=0.0)
    assert state.queued_tickets() == [a, b, d]
    assert [state.finish(t, now=0.0) for t in (running, a, b)] == [a, b, d]


def test_state_cancel_of_a_running_ticket_frees_its_slot_and_is_idempotent() -> None:
    state = AdmissionState(engine_slots=1, queue_limit=2)
    running = _admit(state)
    waiting = _admit(state)
    assert state.cancel(running, now=0.0) is waiting
    assert running.status is TicketStatus.FINISHED
    assert state.cancel(running, now=0.0) is None
    assert (state.running, state.queued) == (1, 0)


def test_state_finish_needs_a_running_ticket() -> None:
    state = AdmissionState(engine_slots=1, queue_limit=2)
    _admit(state)
    waiting = _admit(state)
    with pytest.raises(ValueError, match="running ticket"):
        state.finish(waiting, now=0.0)


def test_state_expire_counts_a_rejection_only_for_a_queued_ticket() -> None:
    state = AdmissionState(engine_slots=1, queue_limit=2)
    running = _admit(state)
    waiting = _admit(state)
    assert state.expire(running) is False
    assert state.expire(waiting) is True
    assert waiting.status is TicketStatus.TIMED_OUT
    assert state.expire(waiting) is False
    assert (state.rejected_total, state.timed_out_total, state.queued) == (1, 1, 0)


def test_state_drain_rejects_arrivals_apart_and_lets_the_rest_go_on() -> None:
    state = AdmissionState(engine_slots=1, queue_limit=2)
    running = _admit(state)
    waiting = _admit(state)
    state.drain()
    rejected = state.arrive(now=0.0)
    assert isinstance(rejected, GateRefusal)
    assert rejected.reason == RejectReason.DRAINING
    assert (state.rejected_total, state.draining_rejected_total) == (0, 1)
    assert state.finish(running, now=0.0) is waiting
    assert state.finish(waiting, now=0.0) is None
    assert state.in_flight == 0


# -- AdmissionGate (Trio) -----------------------------------------------------------------------


class EngineFailure(Exception):
    """What a failing engine raises inside the slot block."""


class Client:
    """One request through the gate: records what happened to it; the test ends it at will."""

    def __init__(self, gate: AdmissionGate, log: list[str], name: str) -> None:
        self.gate = gate
        self.log = log
        self.name = name
        self.scope = trio.CancelScope()
        self.release = trio.Event()
        self.fail = False
        self.outcome: str | None = None

    async def run(self) -> None:
        with self.scope:
            try:
                async with self.gate.slot():
                    self.log.append(self.name)
                    await self.release.wait()
                    if self.fail:
                        raise EngineFailure(self.name)
                self.outcome = "done"
            except Rejection as rejection:
                self.outcome = rejection.reason
            except EngineFailure:
                self.outcome = "failed"
        if self.outcome is None:
            self.outcome = "cancelled"


async def _start(nursery: trio.Nursery, gate: AdmissionGate, log: list[str], name: str) -> Client:
    client = Client(gate, log, name)
    nursery.start_soon(client.run)
    await trio.testing.wait_all_tasks_blocked()
    return client


async def test_gate_runs_queues_and_rejects_in_arrival_order() -> None:
    changes: list[tuple[int, int]] = []
    gate = AdmissionGate(
        engine_slots=2, queue_limit=2, on_change=lambda: changes.append((gate.running, gate.queued))
    )
    log: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            clients = [await _start(nursery, gate, log, f"r{i}") for i in range(5)]
            assert log == ["r0", "r1"]
            assert (gate.running, gate.queued, gate.in_flight) == (2, 2, 4)
            assert clients[4].outcome == RejectReason.OVERLOADED
            assert gate.rejected_total == 1
            clients[1].release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["r0", "r1", "r2"]
            for client in clients[:4]:
                client.release.set()
    assert log == ["r0", "r1", "r2", "r3"]
    assert [c.outcome for c in clients] == ["done"] * 4 + [RejectReason.OVERLOADED]
    assert gate.in_flight == 0
    assert changes[:4] == [(1, 0), (2, 0), (2, 1), (2, 2)]
    assert changes[-1] == (0, 0)


async def test_gate_cancelled_running_request_frees_its_slot_for_the_next() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    log: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            running = await _start(nursery, gate, log, "running")
            waiting = await _start(nursery, gate, log, "waiting")
            running.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert running.outcome == "cancelled"
            assert log == ["running", "waiting"]
            assert (gate.running, gate.queued) == (1, 0)
            waiting.release.set()
    assert gate.in_flight == 0


async def test_gate_cancelled_queued_request_gives_its_place_back() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    log: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            running = await _start(nursery, gate, log, "running")
            in_hand = await _start(nursery, gate, log, "in_hand")
            in_channel = await _start(nursery, gate, log, "in_channel")
            assert (await _start(nursery, gate, log, "full")).outcome == RejectReason.OVERLOADED
            in_hand.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert in_hand.outcome == "cancelled"
            assert (gate.running, gate.queued) == (1, 1)
            late = await _start(nursery, gate, log, "late")
            assert late.outcome is None
            assert gate.queued == 2
            for client in (running, in_channel, late):
                client.release.set()
    assert log == ["running", "in_channel", "late"]
    assert gate.in_flight == 0


async def test_gate_cancelled_just_after_being_woken_passes_the_slot_on() -> None:
    cancel_on_change: list[trio.CancelScope] = []

    def on_change() -> None:
        # Runs inside the finishing request's exit, right after it handed its slot over.
        while cancel_on_change:
            cancel_on_change.pop().cancel()

    gate = AdmissionGate(engine_slots=1, queue_limit=3, on_change=on_change)
    log: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            running = await _start(nursery, gate, log, "running")
            woken = await _start(nursery, gate, log, "woken")
            after = await _start(nursery, gate, log, "after")
            # In one scheduling round the slot passes to ``woken``, which is cancelled before it
            # runs: it must still give the slot on to ``after``.
            cancel_on_change.append(woken.scope)
            running.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert woken.outcome == "cancelled"
            assert log[-1] == "after"
            assert (gate.running, gate.queued) == (1, 0)
            after.release.set()
    assert gate.in_flight == 0


async def test_gate_slot_held_by_a_failing_engine_comes_back() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    log: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            failing = await _start(nursery, gate, log, "failing")
            waiting = await _start(nursery, gate, log, "waiting")
            failing.fail = True
            failing.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert failing.outcome == "failed"
            assert log == ["failing", "waiting"]
            waiting.release.set()
    assert gate.in_flight == 0


async def test_gate_error_propagates_out_of_the_block() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    with trio.fail_after(5), pytest.raises(EngineFailure):
        async with gate.slot():
            raise EngineFailure("engine")
    assert gate.in_flight == 0


async def test_gate_queue_timeout_rejects_with_the_reason_and_counts_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2, queue_timeout=5.0)
    log: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            running = await _start(nursery, gate, log, "running")
            first = await _start(nursery, gate, log, "first")
            await trio.sleep(3)
            second = await _start(nursery, gate, log, "second")
            await trio.sleep(2.5)  # first has waited 5.5 s, second 2.5 s
            assert first.outcome == RejectReason.QUEUE_TIMEOUT
            assert second.outcome is None
            assert (gate.queued, gate.rejected_total, gate.state.timed_out_total) == (1, 1, 1)
            running.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["running", "second"]
            await trio.sleep(10)  # started before its deadline: the timeout no longer applies
            assert second.outcome is None
            second.release.set()
    assert gate.in_flight == 0


async def test_gate_drain_rejects_newcomers_and_wait_idle_waits_for_the_rest() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    log: list[str] = []
    idle = False

    async def wait_idle() -> None:
        nonlocal idle
        await gate.wait_idle()
        idle = True

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            running = await _start(nursery, gate, log, "running")
            waiting = await _start(nursery, gate, log, "waiting")
            gate.drain()
            assert gate.draining
            newcomer = await _start(nursery, gate, log, "newcomer")
            assert newcomer.outcome == RejectReason.DRAINING
            assert gate.rejected_total == 0
            nursery.start_soon(wait_idle)
            running.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["running", "waiting"]
            assert not idle
            waiting.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert idle
    assert gate.in_flight == 0


async def test_gate_wait_idle_returns_at_once_when_idle() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    with trio.fail_after(5):
        await gate.wait_idle()


async def test_gate_already_cancelled_caller_takes_no_slot() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    with trio.fail_after(5), trio.CancelScope() as scope:
        scope.cancel()
        async with gate.slot():
            pytest.fail("a cancelled caller entered the block")
    assert gate.in_flight == 0


async def test_gate_rejection_text_is_the_reason() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    gate.drain()
    with trio.fail_after(5), pytest.raises(Rejection) as info:
        async with gate.slot():
            pass
    assert str(info.value) == info.value.reason == RejectReason.DRAINING


async def test_gate_reject_now_answers_only_when_slot_would_reject_and_counts_the_same() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    log: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            clients = [await _start(nursery, gate, log, f"r{i}") for i in range(2)]
            # One running, one queued: room for one more, so the gate must decide in slot().
            assert gate.reject_now() is None
            assert gate.state.received_total == 2
            clients.append(await _start(nursery, gate, log, "r2"))
            assert gate.reject_now() == RejectReason.OVERLOADED
            assert (gate.state.received_total, gate.rejected_total) == (4, 1)
            gate.drain()
            assert gate.reject_now() == RejectReason.DRAINING
            assert gate.state.draining_rejected_total == 1
            for client in clients:
                client.release.set()
    assert gate.reject_now() == RejectReason.DRAINING
    assert gate.in_flight == 0


async def test_gate_lease_is_single_use() -> None:
    gate = AdmissionGate(engine_slots=2, queue_limit=2)
    lease = gate.slot()
    with trio.fail_after(5):
        async with lease:
            pass
        with pytest.raises(RuntimeError, match="only once"):
            async with lease:
                pass
    assert gate.in_flight == 0


async def test_gate_lease_that_arrived_holds_its_slot_and_enters_without_waiting() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    first, second = gate.slot(), gate.slot()
    with trio.fail_after(5):
        first.arrive()
        second.arrive()  # queued behind the first, before any task has entered
        assert (gate.running, gate.queued) == (1, 1)
        with pytest.raises(RuntimeError, match="only once"):
            first.arrive()
        async with first:
            pass
        # The first's exit started the second, which had no task waiting yet.
        assert (gate.running, gate.queued) == (1, 0)
        async with second:  # nothing else runs here: a wait would never end
            assert gate.running == 1
    assert gate.in_flight == 0


async def test_gate_arrival_refused_raises_and_holds_nothing() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    leases = [gate.slot() for _ in range(3)]
    for lease in leases:
        lease.arrive()
    refused = gate.slot()
    with pytest.raises(Rejection) as rejection:
        refused.arrive()
    assert rejection.value.reason == RejectReason.OVERLOADED
    assert (gate.running, gate.queued, gate.rejected_total) == (1, 2, 1)


async def test_gate_lease_that_arrived_and_is_cancelled_before_entering_gives_back() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    running, queued = gate.slot(), gate.slot()
    running.arrive()
    queued.arrive()
    with trio.fail_after(5):
        for lease in (queued, running):
            with trio.CancelScope() as scope:
                scope.cancel()
                async with lease:
                    pytest.fail("a cancelled task entered its block")
    assert gate.in_flight == 0


async def test_gate_lease_displaced_before_entering_is_rejected_on_entering() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    running, hand, channel = (gate.slot(priority=5) for _ in range(3))
    for lease in (running, hand, channel):
        lease.arrive()
    better = gate.slot(priority=0)
    better.arrive()  # the full queue's newest worse ticket makes room for it
    assert (gate.running, gate.queued) == (1, 2)
    with trio.fail_after(5), pytest.raises(Rejection) as rejection:
        async with channel:
            pytest.fail("a displaced request entered its block")
    assert rejection.value.reason == RejectReason.DISPLACED_PRIORITY
    assert (gate.running, gate.queued) == (1, 2)


async def test_gate_on_start_runs_as_the_slot_is_taken_even_before_the_task_waits() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    started: list[str] = []
    first = gate.slot(on_start=lambda: started.append("first"))
    second = gate.slot(on_start=lambda: started.append(f"second, {gate.running} running"))
    first.arrive()
    assert started == ["first"]  # the direct path: at the arrival
    second.arrive()
    with trio.fail_after(5):
        async with first:
            assert started == ["first"]
        # Inside the first's exit, though the second's task has not entered its lease yet.
        assert started == ["first", "second, 1 running"]
        async with second:
            pass
    assert started == ["first", "second, 1 running"]
    assert gate.in_flight == 0


async def test_gate_cancel_gives_back_at_once_only_what_has_not_begun_to_run() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    running, queued = gate.slot(), gate.slot()
    running.arrive()
    queued.arrive()
    queued.cancel()  # its place, at once
    queued.cancel()  # idempotent
    assert (gate.running, gate.queued) == (1, 0)
    running.cancel()  # arrived with a slot, its block not begun: the slot, at once
    assert gate.in_flight == 0
    entered = gate.slot()
    with trio.fail_after(5):
        async with entered:
            entered.cancel()  # a running block keeps its slot until it leaves
            assert gate.running == 1
    assert gate.in_flight == 0


def test_gate_from_settings_uses_the_limits_in_force() -> None:
    unlimited = AdmissionGate.from_settings(WorkerSettings(worker_id="w"))
    assert (unlimited.engine_slots, unlimited.queue_limit) == (10_000, 40_000)
    assert unlimited.queue_timeout is None
    limited = AdmissionGate.from_settings(
        WorkerSettings(
            worker_id="w", engine_request_limit=3, request_queue_limit=5, queue_timeout=2.5
        )
    )
    assert (limited.engine_slots, limited.queue_limit, limited.queue_timeout) == (3, 5, 2.5)


@pytest.mark.parametrize("timeout", [-1.0, math.nan])
def test_gate_rejects_an_invalid_queue_timeout(timeout: float) -> None:
    with pytest.raises(ValueError, match="queue_timeout"):
        AdmissionGate(engine_slots=1, queue_limit=2, queue_timeout=timeout)
