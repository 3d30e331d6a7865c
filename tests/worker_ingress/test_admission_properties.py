"""Property tests of the admission gate: the exact cap under bursts, FIFO starts, no leak.

Two levels, both checked against the same plain model (a list of running ids, a FIFO of queued
ids):

- the sans-IO :class:`AdmissionState`, driven by a Hypothesis ``RuleBasedStateMachine``;
- the Trio :class:`AdmissionGate`, driven by a generated list of operations run inside
  ``trio.run(..., clock=MockClock(autojump_threshold=0))`` (one task per request; queue timeouts
  in virtual time).
"""

from __future__ import annotations

import dataclasses

import trio
import trio.testing
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shim_common.wire import REASON_DRAINING, REASON_OVERLOADED, REASON_QUEUE_TIMEOUT
from worker_ingress._admission import (
    AdmissionGate,
    AdmissionState,
    GateRefusal,
    Rejection,
    Ticket,
    TicketStatus,
)


@dataclasses.dataclass
class Model:
    """The reference: what the gate must do, written the obvious way."""

    slots: int
    queue_limit: int
    running: list[int] = dataclasses.field(default_factory=list)
    queued: list[int] = dataclasses.field(default_factory=list)
    started: list[int] = dataclasses.field(default_factory=list)
    rejected: int = 0
    draining: bool = False

    def arrive(self, rid: int) -> str:
        if self.draining:
            return "draining"
        if not self.queued and len(self.running) < self.slots:
            self.running.append(rid)
            self.started.append(rid)
            return "running"
        if len(self.queued) < self.queue_limit:
            self.queued.append(rid)
            return "queued"
        self.rejected += 1
        return "rejected"

    def leave(self, rid: int) -> None:
        if rid in self.running:
            self.running.remove(rid)
            if self.queued:
                head = self.queued.pop(0)
                self.running.append(head)
                self.started.append(head)
        elif rid in self.queued:
            self.queued.remove(rid)


# -- the sans-IO state ----------------------------------------------------------------------------


class AdmissionStateMachine(RuleBasedStateMachine):
    """Random arrivals, finishes, cancellations, expiries and a drain against the model."""

    def __init__(self) -> None:
        super().__init__()
        self.state = AdmissionState(engine_slots=1, queue_limit=2)
        self.model = Model(1, 2)
        self.tickets: dict[int, Ticket] = {}
        self.next_id = 0
        self.started: list[int] = []

    @initialize(slots=st.integers(1, 5), queue_limit=st.integers(2, 6))
    def sizes(self, slots: int, queue_limit: int) -> None:
        self.state = AdmissionState(engine_slots=slots, queue_limit=queue_limit)
        self.model = Model(slots, queue_limit)

    def _id_of(self, ticket: Ticket) -> int:
        return next(rid for rid, t in self.tickets.items() if t is ticket)

    @rule()
    def arrive(self) -> None:
        rid = self.next_id
        self.next_id += 1
        in_flight_before = self.state.in_flight
        expected = self.model.arrive(rid)
        decision = self.state.arrive()
        if isinstance(decision, GateRefusal):
            assert expected in ("rejected", "draining")
            if expected == "rejected":
                # Refused only when there was truly no room.
                assert in_flight_before == self.model.slots + self.model.queue_limit
                assert decision.reason == REASON_OVERLOADED
            else:
                assert decision.reason == REASON_DRAINING
            return
        self.tickets[rid] = decision
        if decision.status is TicketStatus.RUNNING:
            assert expected == "running"
            self.started.append(rid)
        else:
            assert expected == "queued"

    def _leave(self, index: int, *, running_only: bool) -> None:
        live = self.model.running if running_only else self.model.running + self.model.queued
        rid = live[index % len(live)]
        ticket = self.tickets[rid]
        self.model.leave(rid)
        started = self.state.finish(ticket) if running_only else self.state.cancel(ticket)
        if started is not None:
            self.started.append(self._id_of(started))

    @precondition(lambda self: self.model.running)
    @rule(index=st.integers(0, 20))
    def finish(self, index: int) -> None:
        self._leave(index, running_only=True)

    @precondition(lambda self: self.model.running or self.model.queued)
    @rule(index=st.integers(0, 20))
    def cancel(self, index: int) -> None:
        self._leave(index, running_only=False)

    @precondition(lambda self: self.model.queued)
    @rule(index=st.integers(0, 20))
    def expire(self, index: int) -> None:
        rid = self.model.queued[index % len(self.model.queued)]
        self.model.leave(rid)
        self.model.rejected += 1
        assert self.state.expire(self.tickets[rid])

    # Late in a run only: once drained, nothing more is admitted, so an early drain wastes it.
    @precondition(lambda self: self.next_id >= 12)
    @rule()
    def drain(self) -> None:
        self.model.draining = True
        self.state.drain()

    @invariant()
    def matches_the_model(self) -> None:
        state, model = self.state, self.model
        assert state.running == len(model.running) <= model.slots
        assert state.queued == len(model.queued) <= model.queue_limit
        assert state.in_flight <= model.slots + model.queue_limit
        assert [self._id_of(t) for t in state.queued_tickets()] == model.queued
        assert self.started == model.started
        assert state.rejected_total == model.rejected
        # A queued ticket exists only while every slot is busy (nobody waits next to a free slot).
        assert not model.queued or len(model.running) == model.slots
        # Every arrival is accounted for exactly once.
        assert state.received_total == (
            state.started_total
            + state.rejected_total
            + state.draining_rejected_total
            + state.cancelled_queued_total
            + state.queued
        )

    def teardown(self) -> None:
        # Everything that is still in flight leaves: every slot and place comes back.
        for rid in [*self.model.running, *self.model.queued]:
            self.model.leave(rid)
            self.state.cancel(self.tickets[rid])
        assert self.state.in_flight == 0


TestAdmissionStateMachine = AdmissionStateMachine.TestCase
TestAdmissionStateMachine.settings = settings(max_examples=150, stateful_step_count=40)


# -- the Trio gate --------------------------------------------------------------------------------

# Operations: ("arrive", 0), ("finish", i), ("error", i), ("cancel", i), ("sleep", seconds).
# ``i`` picks among running requests (finish, error) or all live requests (cancel).
Op = tuple[str, int]

_OTHER_OPS = st.one_of(
    st.tuples(st.sampled_from(["finish", "error", "cancel"]), st.integers(0, 20)),
    st.tuples(st.just("sleep"), st.integers(1, 4)),
)
# Arrivals come in bursts, so that programs do fill the engine and the queue.
_PROGRAMS = st.lists(
    st.one_of(
        st.integers(1, 8).map(lambda burst: [("arrive", 0)] * burst),
        _OTHER_OPS.map(lambda op: [op]),
    ),
    max_size=25,
).map(lambda groups: [op for group in groups for op in group])


class EngineFailure(Exception):
    """Raised by a request's body to play a failing engine."""


@dataclasses.dataclass
class Request:
    rid: int
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    release: trio.Event = dataclasses.field(default_factory=trio.Event)
    fail: bool = False
    outcome: str | None = None


async def _run_program(
    slots: int, queue_limit: int, queue_timeout: float | None, ops: list[Op]
) -> None:
    gate = AdmissionGate(engine_slots=slots, queue_limit=queue_limit, queue_timeout=queue_timeout)
    model = Model(slots, queue_limit)
    started: list[int] = []
    requests: list[Request] = []
    queued_at: dict[int, float] = {}
    peak_in_flight = 0

    async def client(request: Request) -> None:
        with request.scope:
            try:
                async with gate.slot():
                    started.append(request.rid)
                    await request.release.wait()
                    if request.fail:
                        raise EngineFailure
                request.outcome = "done"
            except Rejection as rejection:
                request.outcome = rejection.reason
            except EngineFailure:
                request.outcome = "failed"
        if request.outcome is None:
            request.outcome = "cancelled"

    def expire_model(now: float) -> None:
        # Queued requests whose deadline passed; deadlines are at x.5 s, ops at whole seconds.
        if queue_timeout is None:
            return
        for rid in list(model.queued):
            if queued_at[rid] + queue_timeout < now:
                model.leave(rid)
                model.rejected += 1

    with trio.fail_after(10_000):  # virtual seconds: far more than any program sleeps
        async with trio.open_nursery() as nursery:
            for op in ops:
                if op[0] == "arrive":
                    request = Request(len(requests))
                    requests.append(request)
                    in_flight_before = gate.in_flight
                    expected = model.arrive(request.rid)
                    if expected == "queued":
                        queued_at[request.rid] = trio.current_time()
                    nursery.start_soon(client, request)
                    await trio.testing.wait_all_tasks_blocked()
                    if expected == "rejected":
                        assert request.outcome == REASON_OVERLOADED
                        assert in_flight_before == slots + queue_limit
                    else:
                        assert request.outcome is None
                elif op[0] in ("finish", "error") and model.running:
                    rid = model.running[op[1] % len(model.running)]
                    requests[rid].fail = op[0] == "error"
                    requests[rid].release.set()
                    model.leave(rid)
                elif op[0] == "cancel" and (model.running or model.queued):
                    live = model.running + model.queued
                    rid = live[op[1] % len(live)]
                    requests[rid].scope.cancel()
                    model.leave(rid)
                elif op[0] == "sleep":
                    await trio.sleep(op[1])
                    expire_model(trio.current_time())
                await trio.testing.wait_all_tasks_blocked()
                peak_in_flight = max(peak_in_flight, gate.in_flight)
                assert gate.running == len(model.running)
                assert gate.queued == len(model.queued)
                assert gate.rejected_total == model.rejected
                assert started == model.started
            # The end: let every running request finish and every queued one time out or run.
            for _ in range(len(requests) + 1):
                if not model.running:
                    break
                rid = model.running[0]
                requests[rid].release.set()
                model.leave(rid)
                await trio.testing.wait_all_tasks_blocked()
                expire_model(trio.current_time())
            assert not model.running
            assert not model.queued
    assert peak_in_flight <= slots + queue_limit
    assert gate.in_flight == 0
    # Shown by ``pytest --hypothesis-show-statistics``: the programs reach the interesting states.
    event(f"reached the cap: {peak_in_flight == slots + queue_limit}")
    event(f"queue timeouts: {gate.state.timed_out_total > 0}")
    assert started == model.started
    for request in requests:
        if request.rid in model.started:
            assert request.outcome in ("done", "failed", "cancelled")
        else:
            assert request.outcome in ("cancelled", REASON_OVERLOADED, REASON_QUEUE_TIMEOUT)


@settings(max_examples=200, deadline=None)
@given(
    slots=st.integers(1, 4),
    queue_limit=st.integers(2, 5),
    timeout=st.sampled_from([None, 0.5, 1.5, 3.5]),
    ops=_PROGRAMS,
)
def test_gate_program_matches_the_model(
    slots: int, queue_limit: int, timeout: float | None, ops: list[Op]
) -> None:
    trio.run(
        _run_program,
        slots,
        queue_limit,
        timeout,
        ops,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )


@settings(max_examples=40, deadline=None)
@given(slots=st.integers(1, 6), queue_limit=st.integers(2, 8), burst=st.integers(1, 40))
def test_gate_burst_admits_exactly_n_plus_q(slots: int, queue_limit: int, burst: int) -> None:
    """A burst of simultaneous arrivals: min(burst, N + Q) admitted, the rest rejected at once."""

    async def main() -> None:
        gate = AdmissionGate(engine_slots=slots, queue_limit=queue_limit)
        release = trio.Event()
        outcomes: list[str] = []

        async def client() -> None:
            try:
                async with gate.slot():
                    await release.wait()
                outcomes.append("done")
            except Rejection as rejection:
                outcomes.append(rejection.reason)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for _ in range(burst):
                    nursery.start_soon(client)
                await trio.testing.wait_all_tasks_blocked()
                admitted = min(burst, slots + queue_limit)
                assert gate.in_flight == admitted
                assert gate.running == min(burst, slots)
                assert gate.rejected_total == burst - admitted
                release.set()
        assert outcomes.count("done") == min(burst, slots + queue_limit)
        assert gate.in_flight == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
