"""The gate's one decision, pure: ``decide`` changes nothing, ``arrive`` is ``decide`` applied and
``would_reject`` is ``decide`` alone (worker_ingress/_admission_state.py, rule 1). No Trio, no
sockets: time is a number passed in.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shim_common.wire import RejectReason
from worker_ingress._admission_state import AdmissionState
from worker_ingress._slo import SloController
from worker_ingress._tickets import START, GateRefusal, QueueDecision, Ticket, TicketStatus


def _counters(state: AdmissionState) -> tuple[object, ...]:
    slo = state.slo
    return (
        state.received_total,
        state.rejected_total,
        state.started_total,
        state.running,
        state.queued,
        state.waiting,
        state.slot_limit,
        state.policy.version,
        [(name, _fields(account)) for name, account in state.ledger.items()],
        None if slo is None else (slo.limit, slo.queue_bound, slo.windows),
    )


def _fields(account: object) -> tuple[int, ...]:
    return tuple(
        getattr(account, f) for f in ("admitted", "rejected", "cancelled", "service_tokens")
    )


def _ticket(result: Ticket | GateRefusal) -> Ticket:
    assert isinstance(result, Ticket), result
    return result


def test_decide_starts_queues_and_refuses_in_the_order_of_its_rules() -> None:
    state = AdmissionState(engine_slots=1, queue_limit=2, queue_timeout=5.0)
    assert state.decide(now=0.0) is START
    _ticket(state.arrive(now=0.0))
    queued = state.decide(now=1.0)
    assert isinstance(queued, QueueDecision)
    assert (queued.deadline, queued.ends, queued.victim) == (6.0, RejectReason.QUEUE_TIMEOUT, None)
    _ticket(state.arrive(now=1.0))
    _ticket(state.arrive(now=1.0))
    full = state.decide(now=2.0)
    assert isinstance(full, GateRefusal)
    assert full.reason is RejectReason.OVERLOADED
    # A better priority displaces the newest entry of the worst priority waiting.
    better = state.decide(-1, now=2.0)
    assert isinstance(better, QueueDecision)
    assert better.victim is not None
    assert better.victim_reason is RejectReason.DISPLACED_PRIORITY
    state.drain()
    draining = state.decide(-1, now=3.0)
    assert isinstance(draining, GateRefusal)
    assert draining.reason is RejectReason.DRAINING


def test_decide_changes_nothing() -> None:
    state = AdmissionState(engine_slots=1, queue_limit=2, tenant_weights={"gold": 2.0})
    for tenant in ("a", "b", "gold", "b"):
        before = _counters(state)
        for priority in (-1, 0, 1):
            state.decide(priority, tenant, now=1.0)
            state.would_reject(priority, tenant, now=1.0)
        assert _counters(state) == before
        state.arrive(0, tenant, 10, now=1.0)


def _state_after_a_window(objective: float, queue_limit: int) -> tuple[AdmissionState, float]:
    """A gate of one slot whose controller has seen a window's requests (not yet closed): each
    held the slot 0.5 s, its first token 0.1 s after its start."""
    state = AdmissionState(
        engine_slots=1,
        queue_limit=queue_limit,
        slo=SloController(objective=objective, max_limit=1, now=0.0),
    )
    now = 0.0
    for _ in range(16):
        ticket = _ticket(state.arrive(now=now))
        state.first_output(ticket, now=now + 0.1)
        state.finish(ticket, now=now + 0.5)
        now += 0.5
    return state, now


def _state_with_evidence() -> tuple[AdmissionState, float]:
    """A gate with a 1 s objective whose controller has closed that window. Then B = 1."""
    state, now = _state_after_a_window(1.0, queue_limit=4)
    assert state.tick(now) == []
    assert state.slo is not None
    assert state.slo.windows == 1
    assert state.slo.queue_bound == 1
    return state, now


def test_with_an_objective_an_arrival_behind_the_bound_is_refused_and_counted() -> None:
    state, now = _state_with_evidence()
    _ticket(state.arrive(now=now))
    hand = state.decide(now=now)
    assert isinstance(hand, QueueDecision)
    # No queue timeout: the objective's deadline (S minus the engine's median TTFT) ends it.
    assert hand.ends is RejectReason.SLO
    assert hand.deadline is not None
    assert abs(hand.deadline - (now + 0.9)) < 1e-9
    _ticket(state.arrive(now=now))
    behind = state.decide(now=now)
    assert isinstance(behind, GateRefusal)
    assert behind.reason is RejectReason.SLO
    assert state.would_reject(now=now)
    assert state.arrive(now=now) is behind
    assert (state.rejected_total, state.slo_rejected_total) == (1, 1)


def test_time_already_spent_upstream_shortens_the_objectives_deadline() -> None:
    state, now = _state_with_evidence()
    _ticket(state.arrive(now=now))
    fresh = state.decide(now=now)
    late = state.decide(now=now, already_waited=0.5)
    assert isinstance(fresh, QueueDecision)
    assert isinstance(late, QueueDecision)
    assert fresh.deadline is not None
    assert late.deadline is not None
    assert abs((fresh.deadline - late.deadline) - 0.5) < 1e-9
    # No room left for its wait (0.9 s, S less the engine's median): refused, not queued.
    for waited in (0.9, 5.0):
        hopeless = state.decide(now=now, already_waited=waited)
        assert isinstance(hopeless, GateRefusal)
        assert hopeless.reason is RejectReason.SLO


def _state_with_room(objective: float) -> tuple[AdmissionState, float]:
    """As _state_with_evidence, with an objective of ``objective`` seconds and room to queue."""
    state, now = _state_after_a_window(objective, queue_limit=40)
    state.tick(now)
    return state, now


def test_the_bound_of_an_arrival_is_that_of_what_is_left_of_the_objective() -> None:
    # S = 10 s, starts at 2 a second: B = 14 for a fresh arrival, 1 for one that spent 8 s of
    # S in a frontend. Two queued: the fresh one queues, the late one is refused.
    state, now = _state_with_room(10.0)
    slo = state.slo
    assert slo is not None
    assert slo.queue_bound == 14
    assert slo.queue_bound_after(0.0) == 14
    assert slo.queue_bound_after(8.0) == 1
    for _ in range(3):
        _ticket(state.arrive(now=now))
    assert state.queued_ahead(0) == 2
    assert isinstance(state.decide(now=now, already_waited=1.0), QueueDecision)
    late = state.decide(now=now, already_waited=8.0)
    assert isinstance(late, GateRefusal)
    assert late.reason is RejectReason.SLO


def test_a_hopeless_arrival_displaces_nobody() -> None:
    # A full queue of worse requests: a better one may displace one of them, but not when it
    # has no room left for its own wait; it would be refused right after, for nothing.
    # Before any evidence the room is the whole objective, 10 s.
    now = 0.0
    state = AdmissionState(
        engine_slots=1, queue_limit=2, slo=SloController(objective=10.0, max_limit=1, now=now)
    )
    for _ in range(3):
        _ticket(state.arrive(5, now=now))
    viable = state.decide(-1, now=now, already_waited=1.0)
    assert isinstance(viable, QueueDecision)
    assert viable.victim is not None
    refused = state.arrive(-1, now=now, already_waited=10.0)
    assert isinstance(refused, GateRefusal)
    assert refused.reason is RejectReason.SLO
    assert state.displaced_total == 0
    assert state.queued == 2


def test_the_time_to_first_token_counts_from_the_arrival_at_the_frontend() -> None:
    # Each request spent 0.3 s in a frontend and got its first token 0.1 s after its start:
    # the client's time is 0.4 s; the law's in-engine figure is still 0.1 s, so L is as before.
    state = AdmissionState(
        engine_slots=1, queue_limit=4, slo=SloController(objective=1.0, max_limit=1, now=0.0)
    )
    now = 0.0
    for _ in range(16):
        ticket = _ticket(state.arrive(now=now, already_waited=0.3))
        state.first_output(ticket, now=now + 0.1)
        state.finish(ticket, now=now + 0.5)
        now += 0.5
    state.tick(now)
    slo = state.slo
    assert slo is not None
    assert abs(slo.ttft_p90 - 0.4) < 1e-9
    assert abs(slo.engine_ttft_p90 - 0.1) < 1e-9
    assert slo.limit == 1


def _from_figures(figures: list[tuple[int, int]], priority: int) -> int:
    """What an arrival of ``priority`` would start behind, read back from the event's figures
    as a frontend reads them (frontend_shim/_queue_hold.py, rule 2)."""
    ahead = 1 if figures else 0
    for band, figure in figures:
        if band > priority:
            break
        ahead = figure
    return ahead


@settings(max_examples=200, deadline=None)
@given(priorities=st.lists(st.integers(-3, 3), max_size=12))
def test_the_queue_by_priority_gives_back_what_each_priority_would_start_behind(
    priorities: list[int],
) -> None:
    state = AdmissionState(engine_slots=1, queue_limit=40)
    assert state.queue_ahead(8) == []
    _ticket(state.arrive(now=0.0))
    for priority in priorities:
        _ticket(state.arrive(priority, now=0.0))
    figures = state.queue_ahead(8)
    assert [band for band, _ in figures] == sorted({band for band, _ in figures})
    for priority in range(-4, 5):
        assert _from_figures(figures, priority) == state.queued_ahead(priority)
    # Cut to the best bands: past them the figure read back is no more than the truth.
    for priority in range(-4, 5):
        assert _from_figures(state.queue_ahead(2), priority) <= state.queued_ahead(priority)


def test_a_queue_timeout_shorter_than_the_objectives_deadline_wins() -> None:
    state = AdmissionState(
        engine_slots=1,
        queue_limit=4,
        slo=SloController(objective=1.0, max_limit=1, now=0.0),
        queue_timeout=0.25,
    )
    _ticket(state.arrive(now=0.0))
    decision = state.decide(now=0.0)
    assert isinstance(decision, QueueDecision)
    assert (decision.deadline, decision.ends) == (0.25, RejectReason.QUEUE_TIMEOUT)
    queued = _ticket(state.arrive(now=0.0))
    assert not state.deadline_passed(queued, 0.2)
    assert state.deadline_passed(queued, 0.25)
    assert queued.status is TicketStatus.TIMED_OUT
    assert queued.reason is RejectReason.QUEUE_TIMEOUT


# -- the property: arrive == decide + apply, would_reject == decide is a refusal -----------------

_OPERATION = st.one_of(
    st.tuples(
        st.just("arrive"),
        st.sampled_from([-1, 0, 0, 2]),
        st.sampled_from(["", "a", "b", "gold"]),
        st.integers(0, 40),
        st.sampled_from([0.0, 0.0, 0.3, 2.0]),
    ),
    st.tuples(
        st.sampled_from(["first_output", "finish", "cancel", "deadline"]), st.integers(0, 30)
    ),
    st.tuples(st.just("advance"), st.floats(0.0, 0.7)),
    st.tuples(st.just("drain")),
)


@settings(max_examples=150, deadline=None)
@given(
    slots=st.integers(1, 3),
    queue_limit=st.integers(2, 5),
    objective=st.sampled_from([None, 0.5, 2.0]),
    timeout=st.sampled_from([None, 0.4, 3.0]),
    operations=st.lists(_OPERATION, max_size=80),
)
def test_arrive_is_decide_applied_and_would_reject_agrees(
    slots: int,
    queue_limit: int,
    objective: float | None,
    timeout: float | None,
    operations: list[tuple[object, ...]],
) -> None:
    state = AdmissionState(
        engine_slots=slots,
        queue_limit=queue_limit,
        queue_timeout=timeout,
        slo=None
        if objective is None
        else SloController(objective=objective, max_limit=slots, now=0.0),
        tenant_weights={"gold": 3.0},
    )
    now = 0.0
    tickets: list[Ticket] = []
    for operation in operations:
        name = operation[0]
        if name == "arrive":
            _, priority, tenant, prompt, waited = operation
            assert isinstance(priority, int)
            assert isinstance(tenant, str)
            assert isinstance(prompt, int)
            assert isinstance(waited, float)
            before = _counters(state)
            decision = state.decide(priority, tenant, now=now, already_waited=waited)
            predicted = state.would_reject(priority, tenant, now=now, already_waited=waited)
            assert _counters(state) == before
            assert predicted == isinstance(decision, GateRefusal)
            result = state.arrive(priority, tenant, prompt, now=now, already_waited=waited)
            assert state.received_total == before[0] + 1  # type: ignore[operator]
            if isinstance(decision, GateRefusal):
                assert isinstance(result, GateRefusal)
                assert result.reason is decision.reason
                continue
            assert isinstance(result, Ticket)
            tickets.append(result)
            if decision is START:
                assert result.status is TicketStatus.RUNNING
                continue
            assert isinstance(decision, QueueDecision)
            assert result.status in (TicketStatus.HAND, TicketStatus.CHANNEL)
            assert (result.deadline, result.ends) == (decision.deadline, decision.ends)
            assert result.displaced is decision.victim
            if decision.victim is not None:
                assert decision.victim.status is TicketStatus.DISPLACED
                assert decision.victim.reason is decision.victim_reason
        elif name == "advance":
            step = operation[1]
            assert isinstance(step, float)
            now += step
            state.tick(now)
        elif name == "drain":
            state.drain()
        elif tickets:
            index = operation[1]
            assert isinstance(index, int)
            ticket = tickets[index % len(tickets)]
            if name == "first_output":
                state.first_output(ticket, now=now)
            elif name == "finish" and ticket.status is TicketStatus.RUNNING:
                state.finish(ticket, now=now)
            elif name == "cancel":
                state.cancel(ticket, now=now)
            elif name == "deadline":
                state.deadline_passed(ticket, now)
        # The counters add up after every step (the module's theory of operation).
        assert state.received_total == (
            state.started_total
            + state.rejected_total
            + state.draining_rejected_total
            + state.cancelled_queued_total
            + state.queued
        )
        assert state.in_flight <= slots + queue_limit
