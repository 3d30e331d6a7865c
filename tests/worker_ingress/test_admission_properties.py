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

import pytest
import trio
import trio.testing
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shim_common.wire import RejectReason
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
        decision = self.state.arrive(now=0.0)
        if isinstance(decision, GateRefusal):
            assert expected in ("rejected", "draining")
            if expected == "rejected":
                # Refused only when there was truly no room.
                assert in_flight_before == self.model.slots + self.model.queue_limit
                assert decision.reason == RejectReason.OVERLOADED
            else:
                assert decision.reason == RejectReason.DRAINING
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
        started = (
            self.state.finish(ticket, now=0.0)
            if running_only
            else self.state.cancel(ticket, now=0.0)
        )
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
            self.state.cancel(self.tickets[rid], now=0.0)
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
                        assert request.outcome == RejectReason.OVERLOADED
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
            assert request.outcome in (
                "cancelled",
                RejectReason.OVERLOADED,
                RejectReason.QUEUE_TIMEOUT,
            )


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


# -- priorities, tenants, displacement, the waiting limit -----------------------------------------


class ClassesStateMachine(RuleBasedStateMachine):
    """Random priorities, tenants, weights, cancels, expiries, displacements and first outputs.

    Checked on every step, against the rules of worker_ingress/_admission.py and
    worker_ingress/_fair_queue.py written the obvious way (scans of plain lists):

    - the cap: in flight <= N + Q; a plain rejection only at a full queue with nobody to
      displace; queued > 0 only while every slot or every waiting place is taken;
    - who starts next: the hand first; then a ticket of the best priority queued, of a tenant
      with the least service among that band's backlogged tenants, the oldest of that tenant;
    - whom an arrival displaces: the newest of the worst priority (a better arrival) or the
      newest of the tenant holding the most places in that band (a fairer share);
    - the counters add up, and the per-kind rejections sum to the total.
    """

    def __init__(self) -> None:
        super().__init__()
        self.setup(1, 2, None, 1, {})

    def setup(
        self,
        slots: int,
        queue_limit: int,
        waiting: int | None,
        limit: int,
        weights: dict[str, float],
    ) -> None:
        self.state = AdmissionState(
            engine_slots=slots,
            queue_limit=queue_limit,
            waiting_limit=waiting,
            tenant_weights=weights,
            tenant_metrics_limit=2,
        )
        self.slots, self.queue_limit, self.waiting_limit = slots, queue_limit, waiting
        self.state.set_slot_limit(min(limit, slots), now=0.0)
        self.running: list[Ticket] = []
        self.queued: list[Ticket] = []  # channel and hand, in no particular order
        self.started_order: list[Ticket] = []

    @initialize(
        slots=st.integers(1, 3),
        queue_limit=st.integers(2, 6),
        waiting=st.one_of(st.none(), st.integers(1, 3)),
        limit=st.integers(1, 3),
        weights=st.dictionaries(st.sampled_from("abc"), st.sampled_from([0.5, 1.0, 2.0, 4.0])),
    )
    def sizes(
        self,
        slots: int,
        queue_limit: int,
        waiting: int | None,
        limit: int,
        weights: dict[str, float],
    ) -> None:
        self.setup(slots, queue_limit, waiting, limit, weights)

    def _expect_next(self) -> None:
        # Before an event that may start the hand: what the policy must pick into the hand next.
        self.hand_before = self.state.hand
        channel = [t for t in self.queued if t is not self.state.hand]
        self.channel_before = channel
        self.service_before = {t.tenant.name: t.tenant.service for t in channel}

    def _check_pick(self) -> None:
        # The new hand (if the old one started) obeys rule 2 of the policy.
        hand = self.state.hand
        if hand is None or hand is self.hand_before:
            return
        channel = self.channel_before
        assert hand in channel
        best = min(t.priority for t in channel)
        assert hand.priority == best
        band = [t for t in channel if t.priority == best]
        least = min(self.service_before[t.tenant.name] for t in band)
        # The pick's tenant was least served, or tied within float rounding.
        assert self.service_before[hand.tenant.name] <= least + 1e-9
        assert hand.number == min(t.number for t in band if t.tenant is hand.tenant)

    def _record_started(self, started: Ticket | None) -> None:
        if started is not None:
            assert started is self.hand_before
            self.queued.remove(started)
            self.running.append(started)
            self.started_order.append(started)
        self._check_pick()

    @rule(
        priority=st.sampled_from([-1, 0, 0, 3]),
        tenant=st.sampled_from(["", "a", "b", "c"]),
        prompt=st.integers(0, 50),
    )
    def arrive(self, priority: int, tenant: str, prompt: int) -> None:
        state = self.state
        full = state.queued == self.queue_limit
        channel = [t for t in self.queued if t is not state.hand]
        predicted = state.would_reject(priority, tenant, now=0.0)
        # A tenant new to the gate counts one place more when it may displace by share (the
        # policy's rule 5: it never takes another tenant's only place).
        new = state.policy.is_new(tenant)
        # The policy's memory of tenants served and gone aside, "new" means nothing in the gate.
        assert not (new and any(t.tenant.name == tenant for t in self.running + self.queued))
        decision = state.arrive(priority, tenant, prompt, now=0.0)
        if isinstance(decision, GateRefusal):
            assert predicted
            assert full
            assert decision.reason == RejectReason.OVERLOADED
            # Nobody could be displaced: not by priority, not by share.
            if channel:
                worst = max(t.priority for t in channel)
                assert priority >= worst
                if priority == worst:
                    band = [t for t in channel if t.priority == worst]
                    places = {t.tenant.name: sum(u.tenant is t.tenant for u in band) for t in band}
                    assert places.get(tenant, 0) + new >= max(places.values())
            return
        assert not predicted
        victim = decision.displaced
        if victim is not None:
            assert full
            assert victim in channel
            worst = max(t.priority for t in channel)
            band = [t for t in channel if t.priority == worst]
            assert victim.priority == worst
            if priority < worst:
                assert victim.reason == RejectReason.DISPLACED_PRIORITY
                assert victim.number == max(t.number for t in band)
            else:
                assert priority == worst
                assert victim.reason == RejectReason.DISPLACED_SHARE
                mine = sum(t.tenant.name == tenant for t in band)
                theirs = sum(t.tenant is victim.tenant for t in band)
                most = max(sum(t.tenant is u.tenant for t in band) for u in band)
                assert mine + new < theirs == most
                assert victim.number == max(t.number for t in band if t.tenant is victim.tenant)
            assert victim.status is TicketStatus.DISPLACED
            event(f"displaced: {victim.reason}")
            self.queued.remove(victim)
            decision.displaced = None
        else:
            assert not full
        if decision.status is TicketStatus.RUNNING:
            assert not self.queued
            self.running.append(decision)
            self.started_order.append(decision)
        else:
            self.queued.append(decision)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 20))
    def first_output(self, index: int) -> None:
        ticket = self.running[index % len(self.running)]
        self._expect_next()
        self._record_started(self.state.first_output(ticket, now=0.0))

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 20), tokens=st.integers(0, 20))
    def generate(self, index: int, tokens: int) -> None:
        ticket = self.running[index % len(self.running)]
        before = ticket.tenant.service
        self.state.charge(ticket, tokens)
        assert ticket.tenant.service == pytest.approx(before + 2 * tokens / ticket.tenant.weight)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 20))
    def finish(self, index: int) -> None:
        ticket = self.running.pop(index % len(self.running))
        self._expect_next()
        self._record_started(self.state.finish(ticket, now=0.0))

    @precondition(lambda self: self.queued)
    @rule(index=st.integers(0, 20), how=st.sampled_from(["cancel", "expire", "refuse"]))
    def leave_queue(self, index: int, how: str) -> None:
        ticket = self.queued.pop(index % len(self.queued))
        self._expect_next()
        was_hand = ticket is self.state.hand
        if how == "cancel":
            assert self.state.cancel(ticket, now=0.0) is None
        elif how == "expire":
            assert self.state.expire(ticket)
        else:
            assert self.state.refuse(ticket)
        if was_hand:
            self.hand_before = None
            self.channel_before = [t for t in self.channel_before if t is not ticket]
            self._check_pick()

    @rule(limit=st.integers(1, 3))
    def set_slot_limit(self, limit: int) -> None:
        limit = min(limit, self.slots)
        for ticket in self.state.set_slot_limit(limit, now=0.0):
            self.queued.remove(ticket)
            self.running.append(ticket)

    @invariant()
    def rules_hold(self) -> None:
        state = self.state
        assert state.running == len(self.running) <= self.slots
        assert state.queued == len(self.queued) <= self.queue_limit
        assert state.in_flight <= self.slots + self.queue_limit
        assert state.waiting == sum(t.waiting for t in self.running)
        if self.waiting_limit is not None:
            assert state.waiting <= self.waiting_limit
        if self.queued:
            assert state.running >= state.slot_limit or (
                self.waiting_limit is not None and state.waiting == self.waiting_limit
            )
            assert state.hand in self.queued
        assert sorted(t.number for t in state.queued_tickets()) == sorted(
            t.number for t in self.queued
        )
        assert sum(count for _, count in state.queued_by_priority()) == state.queued
        assert sum(state.rejected_by_kind().values()) == state.rejected_total
        assert state.received_total == (
            state.admitted_direct_total
            + state.admitted_queue_total
            + state.rejected_total
            + state.draining_rejected_total
            + state.cancelled_queued_total
            + state.queued
        )
        # The per-tenant ledger sums to the gate's counters.
        accounts = [account for _, account in state.ledger.items()]
        assert sum(a.admitted for a in accounts) == state.started_total
        assert sum(a.rejected for a in accounts) == (
            state.rejected_total + state.draining_rejected_total
        )
        assert sum(a.cancelled for a in accounts) == state.cancelled_queued_total
        # Tenant records: exactly those with a request in the gate (idle tenants forgotten).
        live = {t.tenant.name for t in (*self.running, *self.queued)}
        assert set(state.policy.tenants) == live

    def teardown(self) -> None:
        for ticket in [*self.queued, *self.running]:
            self.state.cancel(ticket, now=0.0)
        assert self.state.in_flight == 0
        assert not self.state.policy.tenants


TestClassesStateMachine = ClassesStateMachine.TestCase
TestClassesStateMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=2, max_size=4),
    costs=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(0, 20)), max_size=300
    ),
)
def test_backlogged_tenants_start_within_a_bound_and_their_service_stays_close(
    weights: list[float], costs: list[tuple[int, int, int]]
) -> None:
    """Fair queuing's two guarantees, with one slot and every tenant kept backlogged.

    - No starvation within a priority: between two starts of a backlogged tenant, at most
      ``(k - 1) * (max_cost * w_max / (min_cost * w_min) + 2)`` other requests start.
    - The service difference bound: the counters of two backlogged tenants never differ by
      more than twice the largest request's whole cost (prompt plus two per generated token,
      over the smallest weight): the fair-queuing bound of Virtual Token Counter, with one
      request's cost charged in one piece when, as here, output is charged at the end.
    """
    names = [f"t{i}" for i in range(len(weights))]
    state = AdmissionState(
        engine_slots=1, queue_limit=64, tenant_weights=dict(zip(names, weights, strict=True))
    )
    # Prompt and generated tokens of each arrival, by tenant (a cost of at least 1).
    plan = [(names[i % len(names)], prompt, generated) for i, prompt, generated in costs]
    max_cost = 40 + 2 * 20
    bound_starts = (len(names) - 1) * (max_cost * max(weights) / (1 * min(weights)) + 2)
    max_request = (40 + 2 * 20) / min(weights)
    running = state.arrive(0, names[0], 1, now=0.0)
    assert isinstance(running, Ticket)
    pending = {name: 0 for name in names}
    generated_of: dict[int, int] = {}
    since_start = {name: 0 for name in names}
    step = 0

    def top_up() -> None:
        # Keep every tenant backlogged with two queued requests from the plan (or defaults).
        nonlocal step
        for name in names:
            while pending[name] < 2:
                _, prompt, generated = plan[step % len(plan)] if plan else (name, 1, 0)
                step += 1
                ticket = state.arrive(0, name, max(prompt, 1), now=0.0)
                assert isinstance(ticket, Ticket)
                assert ticket.displaced is None
                generated_of[ticket.number] = generated
                pending[name] += 1

    top_up()
    for _ in range(min(len(plan), 200) + 5):
        state.charge(running, generated_of.get(running.number, 0))
        started = state.finish(running, now=0.0)
        assert started is not None
        name = started.tenant.name
        pending[name] -= 1
        for other in names:
            since_start[other] = 0 if other == name else since_start[other] + 1
            assert since_start[other] <= bound_starts
        running = started
        top_up()
        services = [state.policy.tenants[n].service for n in names]
        assert max(services) - min(services) <= 2 * max_request + 1e-9


# -- one charge rule ------------------------------------------------------------------------------


def _odd_rule(prompt_tokens: int = 0, generated_tokens: int = 0) -> int:
    # Never the prompt itself: a site that charged raw prompt tokens would show.
    return 3 * prompt_tokens + 5 * generated_tokens + 7


@settings(max_examples=150, deadline=None)
@given(
    slots=st.integers(1, 2),
    queue_limit=st.integers(2, 4),
    waiting=st.one_of(st.none(), st.just(1)),
    weights=st.dictionaries(st.sampled_from("ab"), st.sampled_from([0.5, 2.0])),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["arrive", "first", "generate", "finish", "cancel", "expire"]),
            st.sampled_from(["", "a", "b"]),
            st.integers(0, 40),
            st.integers(0, 20),
        ),
        max_size=40,
    ),
)
def test_every_charge_of_the_queue_and_the_ledger_is_the_one_rule(
    slots: int,
    queue_limit: int,
    waiting: int | None,
    weights: dict[str, float],
    steps: list[tuple[str, str, int, int]],
) -> None:
    """With the rule swapped for one that is never the identity, each tenant's counter in the
    fair queue and its account in the ledger hold exactly what the rule gives: start costs of
    the requests chosen to start (queue) or started (ledger), plus generated tokens charged."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("worker_ingress._admission_state.service_tokens", _odd_rule)
        patch.setattr("worker_ingress._fair_queue.service_tokens", _odd_rule)
        state = AdmissionState(
            engine_slots=slots,
            queue_limit=queue_limit,
            waiting_limit=waiting,
            tenant_weights=weights,
        )
        prompts: dict[Ticket, int] = {}
        chosen: set[Ticket] = set()
        started: set[Ticket] = set()
        queue_charged = {name: 0 for name in ("", "a", "b")}
        ledger_charged = dict(queue_charged)
        for what, tenant, prompt, tokens in steps:
            live = [t for t in prompts if t.status in (TicketStatus.HAND, TicketStatus.CHANNEL)]
            running = [t for t in prompts if t.status is TicketStatus.RUNNING]
            if what == "arrive":
                ticket = state.arrive(0, tenant, prompt, now=0.0)
                if isinstance(ticket, Ticket):
                    prompts[ticket] = prompt
            elif what in ("first", "generate", "finish") and running:
                ticket = running[tokens % len(running)]
                if what == "first":
                    state.first_output(ticket, now=0.0)
                elif what == "generate":
                    state.charge(ticket, tokens)
                    name = ticket.tenant.name
                    queue_charged[name] += _odd_rule(generated_tokens=tokens)
                    ledger_charged[name] += _odd_rule(generated_tokens=tokens)
                else:
                    state.finish(ticket, now=0.0)
            elif what in ("cancel", "expire") and live:
                ticket = live[tokens % len(live)]
                if what == "cancel":
                    state.cancel(ticket, now=0.0)
                else:
                    state.expire(ticket)
            for ticket, prompt in prompts.items():
                name = ticket.tenant.name
                if ticket not in chosen and (
                    ticket is state.hand or ticket.status is TicketStatus.RUNNING
                ):
                    chosen.add(ticket)
                    queue_charged[name] += _odd_rule(prompt_tokens=prompt)
                if ticket not in started and ticket.status is TicketStatus.RUNNING:
                    started.add(ticket)
                    ledger_charged[name] += _odd_rule(prompt_tokens=prompt)
            # A tenant with nothing left in the gate is forgotten by the queue (its rule 6).
            for name in queue_charged:
                record = state.policy.tenants.get(name)
                if record is None:
                    queue_charged[name] = 0
                else:
                    assert record.attained == pytest.approx(queue_charged[name] / record.weight)
            accounts = dict(state.ledger.items())
            for name, charged in ledger_charged.items():
                assert (accounts[name].service_tokens if name in accounts else 0) == charged
