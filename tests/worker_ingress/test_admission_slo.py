"""The gate with a time-to-first-token objective: L in force, early refusal, the deadline, and the
cap N + Q exact while L moves (worker_ingress/_admission.py with worker_ingress/_slo.py).

Everything runs on Trio's autojump clock, so the times below are exact, not measured.
"""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from shim_common.wire import RejectReason
from worker_ingress._admission import AdmissionGate, Rejection, SlotLease
from worker_ingress._config import WorkerSettings
from worker_ingress._metrics import WorkerMetrics
from worker_ingress._slo import UNBOUNDED_QUEUE

S = 0.3


class Request:
    """One request driven by hand: it enters the gate, and its first output and end are
    released by the test."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.outcome: str | None = None
        self.lease: SlotLease | None = None
        self.first = trio.Event()
        self.done = trio.Event()
        self.ended = trio.Event()

    async def run(self) -> None:
        try:
            async with self.gate.slot() as lease:
                self.lease = lease
                self.outcome = "running"
                await self.first.wait()
                lease.first_output()
                await self.done.wait()
            self.outcome = "finished"
        except Rejection as rejection:
            self.outcome = rejection.reason
        finally:
            self.ended.set()


async def _start(nursery: trio.Nursery, gate: AdmissionGate, count: int) -> list[Request]:
    requests = [Request(gate) for _ in range(count)]
    for request in requests:
        nursery.start_soon(request.run)
        await trio.testing.wait_all_tasks_blocked()
    return requests


async def test_without_an_objective_l_is_n_and_nothing_is_refused_early() -> None:
    gate = AdmissionGate(engine_slots=3, queue_limit=2)
    assert gate.slo is None
    assert gate.effective_limit == 3
    assert gate.reject_now() is None


async def test_from_settings_takes_the_objective_and_the_floor() -> None:
    settings = WorkerSettings(
        worker_id="w", engine_request_limit=8, ttft_slo=0.25, adaptive_min_limit=2
    )
    gate = AdmissionGate.from_settings(settings)
    assert gate.slo is not None
    assert (gate.slo.objective, gate.slo.min_limit, gate.slo.max_limit) == (0.25, 2, 8)
    assert gate.effective_limit == 8


async def test_a_queued_request_is_refused_once_its_wait_leaves_no_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=4, ttft_objective=S)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            running, queued = await _start(nursery, gate, 2)
            assert (running.outcome, queued.outcome) == ("running", None)
            started = trio.current_time()
            await queued.ended.wait()
            # No window closed yet: the deadline is S itself.
            assert trio.current_time() - started == pytest.approx(S)
            assert queued.outcome == RejectReason.SLO
            running.first.set()
            running.done.set()
    state = gate.state
    assert state.slo_rejected_total == 1
    assert state.rejected_by_kind()["slo"] == 1
    assert state.received_total == state.started_total + state.rejected_total


async def test_the_queue_timeout_wins_when_it_is_shorter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=4, queue_timeout=0.1, ttft_objective=S)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            running, queued = await _start(nursery, gate, 2)
            await queued.ended.wait()
            assert queued.outcome is not None
            assert queued.outcome != RejectReason.SLO
            running.first.set()
            running.done.set()
    assert gate.state.timed_out_total == 1


async def test_an_arrival_behind_the_bound_is_refused_at_once_and_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=8, ttft_objective=S)
    slo = gate.slo
    assert slo is not None
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            running, first_queued = await _start(nursery, gate, 2)
            assert slo.queue_bound == UNBOUNDED_QUEUE
            slo.queue_bound = 1  # as a window would set it: one queued ahead leaves no room
            # The fast path (the request plane's receive loop) and slot() agree.
            assert gate.reject_now() == RejectReason.SLO
            # Counted against the arrival's tenant, like any other refusal.
            assert gate.reject_now(0, "acme") == RejectReason.SLO
            assert gate.state.ledger.account("acme").rejected == 1
            (late,) = await _start(nursery, gate, 1)
            assert late.outcome == RejectReason.SLO
            assert gate.queued == 1
            running.first.set()
            running.done.set()
            # Now the queued one runs and nobody is queued: an arrival that would queue behind
            # nobody (0 < 1) is admitted.
            await trio.testing.wait_all_tasks_blocked()
            assert first_queued.outcome == "running"
            (next_one,) = await _start(nursery, gate, 1)
            assert next_one.outcome is None
            assert gate.queued == 1
            for request in (first_queued, next_one):
                request.first.set()
                request.done.set()
    state = gate.state
    assert state.slo_rejected_total == 3
    assert state.received_total == (
        state.started_total + state.rejected_total + state.cancelled_queued_total + state.queued
    )


async def test_a_full_queue_still_answers_queue_full() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2, ttft_objective=S)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            requests = await _start(nursery, gate, 3)
            assert gate.reject_now() == RejectReason.OVERLOADED
            for request in requests:
                request.first.set()
                request.done.set()


async def test_lowering_l_evicts_nobody_and_raising_it_starts_the_queue() -> None:
    gate = AdmissionGate(engine_slots=4, queue_limit=4, ttft_objective=S)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            running = await _start(nursery, gate, 4)
            gate.set_slot_limit(2)
            assert gate.running == 4  # nobody evicted
            queued = await _start(nursery, gate, 2)
            assert gate.queued == 2
            running[0].first.set()
            running[0].done.set()
            await trio.testing.wait_all_tasks_blocked()
            assert (gate.running, gate.queued) == (3, 2)  # 3 > L: nobody starts
            gate.set_slot_limit(4)
            await trio.testing.wait_all_tasks_blocked()
            assert (gate.running, gate.queued) == (4, 1)
            for request in running[1:] + queued:
                request.first.set()
                request.done.set()


async def test_samples_reach_the_controller_and_a_slow_engine_lowers_l(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate(engine_slots=16, queue_limit=4, ttft_objective=S)
    slo = gate.slo
    assert slo is not None
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            requests = await _start(nursery, gate, 16)
            await trio.sleep(1.0)  # 1 s without a first output: every one is overdue
            for request in requests:
                request.first.set()
            await trio.testing.wait_all_tasks_blocked()
            assert slo.windows == 1
            # 1 s overdue against the engine's share of S: the first cut from N, by eight.
            assert gate.effective_limit == 2
            for request in requests:
                request.done.set()
    assert slo.hold_seconds is not None


async def test_metrics_export_l_and_the_controllers_figures() -> None:
    plain = WorkerMetrics(AdmissionGate(engine_slots=5, queue_limit=2)).render(None)[0].decode()
    assert "dynamo_engine_request_limit_effective 5.0" in plain
    assert "dynamo_worker_slo_queue_bound" not in plain
    gate = AdmissionGate(engine_slots=5, queue_limit=2, ttft_objective=S)
    gate.set_slot_limit(3)
    text = WorkerMetrics(gate).render(None)[0].decode()
    assert "dynamo_engine_request_limit_effective 3.0" in text
    assert "dynamo_engine_request_limit 5.0" in text
    assert "dynamo_worker_slo_ttft_objective_seconds 0.3" in text
    assert "dynamo_worker_slo_ttft_p90_seconds NaN" in text


# -- the cap while L moves, under Hypothesis -----------------------------------------------------

operations = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(1, 3)),
        st.tuples(st.just("first"), st.integers(0, 30)),
        st.tuples(st.just("finish"), st.integers(0, 30)),
        st.tuples(st.just("limit"), st.integers(1, 6)),
        st.tuples(st.just("sleep"), st.integers(1, 400)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(slots=st.integers(1, 6), queue_limit=st.integers(2, 5), program=operations)
def test_cap_exact_and_no_eviction_while_l_moves(
    slots: int, queue_limit: int, program: list[tuple[str, int]]
) -> None:
    async def main() -> None:
        gate = AdmissionGate(engine_slots=slots, queue_limit=queue_limit, ttft_objective=S)
        state = gate.state
        requests: list[Request] = []
        with trio.fail_after(3600):
            async with trio.open_nursery() as nursery:
                for action, value in program:
                    running_before = state.running
                    limit_before = state.slot_limit
                    started_before = state.started_total
                    if action == "arrive":
                        requests += await _start(nursery, gate, value)
                    elif action in ("first", "finish") and requests:
                        request = requests[value % len(requests)]
                        request.first.set()
                        if action == "finish":
                            request.done.set()
                    elif action == "limit":
                        gate.set_slot_limit(min(value, slots))
                    else:
                        await trio.sleep(value / 1000)
                    await trio.testing.wait_all_tasks_blocked()
                    assert state.in_flight <= slots + queue_limit
                    assert state.running <= slots
                    assert 1 <= state.slot_limit <= slots
                    # Lowering L never takes a slot back: running falls only as requests end.
                    if action == "limit":
                        assert state.running >= min(running_before, state.running)
                        assert state.running >= running_before
                    # Nobody starts while running is at or over L.
                    if state.started_total > started_before and action != "limit":
                        assert running_before - 1 < max(limit_before, state.slot_limit)
                    assert state.received_total == (
                        state.started_total
                        + state.rejected_total
                        + state.draining_rejected_total
                        + state.cancelled_queued_total
                        + state.queued
                    )
                for request in requests:
                    request.first.set()
                    request.done.set()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_nan_is_what_a_first_window_reports() -> None:
    gate = AdmissionGate(engine_slots=2, queue_limit=2, ttft_objective=S)
    assert gate.slo is not None
    assert math.isnan(gate.slo.ttft_p90)
