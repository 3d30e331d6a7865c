"""The admission gate's sans-IO core: N engine slots, W waiting places, a hand, a Q - 1 channel.

:class:`AdmissionState` is one state machine, as h11's connection is: events in (an arrival, a
first output, a finish, a cancellation, a deadline that passed, the time), decisions and the
tickets they moved out; no clock, no tasks, no callbacks. The Trio shell that drives it is
:mod:`worker_ingress._admission`. Which queued request starts next, and whom a full queue turns
away, is the pure policy of :mod:`worker_ingress._fair_queue` (strict priority, then least
attained service per tenant).

Rules of the state machine
==========================

1. Everything that decides whether a request runs, waits or is turned away, and when a queued
   request's wait runs out, lives here. :meth:`AdmissionState.decide` is that decision, pure
   (nothing changes); :meth:`AdmissionState.arrive` is ``decide`` plus its application, and
   :meth:`AdmissionState.would_reject` is ``decide`` alone. The shell parks, wakes, arms the
   deadline a decision names and reads the clock; it decides nothing.
2. Time comes in as ``now`` (seconds on any monotonic clock) with every event that needs it,
   never with a default: the state never reads a clock, and never makes a time up (a 0 would be a
   start long ago on a clock that began long ago, as Trio's does). The objective's controller is
   given the time it starts by whoever makes it. Every time the state stamps (a ticket's arrival and
   start, what the objective learns) is the ``now`` of the event that caused it. A request that
   spent time before the gate says so with ``already_waited`` (seconds): the objective judges it on
   what is left (bound and deadline).
3. The order of the channel is :class:`~worker_ingress._fair_queue.FairQueue`'s; this module
   never reorders or scans it.
4. With a time-to-first-token objective the state owns the sans-IO
   :class:`~worker_ingress._slo.SloController` it is given (its rules are at the top of its module)
   and is the only one that feeds it: starts, first outputs and finishes with their times, the limit
   in use, and :meth:`AdmissionState.tick` to close its windows. Its two outputs act here: L through
   :meth:`AdmissionState.set_slot_limit`, and the queue bound B, by refusing an arrival that would
   queue behind B (``SLO``) and by the deadline of a queued request (``SLO`` when it passes).
5. Service is charged by one rule, :func:`~worker_ingress._fair_queue.service_tokens` (prompt
   tokens, plus :data:`~worker_ingress._fair_queue.GENERATED_TOKEN_COST` per generated token).
   A request's start cost is computed by it once, on arrival, and kept on its ticket; that one
   amount goes to the fair queue's counter when the request is chosen to start (it enters the
   hand, or starts at once) and to the tenant ledger when it starts; generated tokens to both.
6. Reasons are :class:`~shim_common.wire.RejectReason` values; the state never spells a text.

Theory of operation
-------------------

The worker has N engine slots, of which at most W may hold requests that have not produced their
first output yet (the *waiting places*; W unset: no separate bound), and a queue of Q places. The
queue is the one request held by the single dispatcher (its "hand", in transit between the
channel and the engine) plus an overflow channel of Q - 1 places; the dispatcher is modelled as
state, not as a task. An effective limit L <= N (:meth:`AdmissionState.set_slot_limit`; L = N
unless an adaptive controller lowers it) bounds the slots used. Hence::

    0 <= running <= L <= N     0 <= waiting <= W     0 <= queued = hand + channel <= Q
    in_flight = running + queued <= N + Q

A ticket goes through these states::

    arrive() --(slot and waiting place free, nobody queued)------------------> RUNNING
        |                                                                        |  finish()
        +--(room in hand/channel)--> CHANNEL --> HAND --(slot + place free)---> RUNNING --> FINISHED
        |                               |          |                           cancel() ^
        |                               +----------+--cancel()--> CANCELLED
        |                               +----------+--deadline passed: QUEUE_TIMEOUT--> TIMED_OUT
        |                               +----------+--deadline passed: SLO-----------> REFUSED
        |                               +--an arrival displaces it--> DISPLACED (a rejection)
        +--(queue full, nobody to displace)--> GateRefusal(OVERLOADED)        (counted)
        +--(objective: no room to wait)------> GateRefusal(SLO)               (counted)
        +--(after drain())-----------------> GateRefusal(DRAINING)          (not counted)

- Direct path: a new request starts at once only when a slot and a waiting place are free AND
  nobody is queued, so a newcomer never overtakes a queued request. Invariant: ``queued > 0``
  implies ``running == L`` or ``waiting == W``.
- A running ticket holds a waiting place until :meth:`AdmissionState.first_output` (or its end),
  and its slot until :meth:`AdmissionState.finish`. Whenever a slot or a waiting place frees and
  both are then available, the ticket in the dispatcher's hand starts, and the queue's policy
  picks the next one into the hand. The hand is committed: it starts next, whatever arrives.
- At a full queue an arrival may displace a channel ticket (better priority, or a fairer share
  of the worst priority: the policy's rule 5); the victim is rejected with its reason and the
  arrival takes its place, so ``queued`` and the cap do not move. Running tickets are never
  preempted.
- A queued ticket that is cancelled gives its place back; if it was in the hand, the policy's
  next one moves up. A running ticket that is cancelled frees its slot exactly like ``finish``.
- A queued ticket carries the deadline its decision named (the queue timeout, or the
  objective's deadline when that comes first) and how its wait ends then
  (:meth:`AdmissionState.deadline_passed`: ``QUEUE_TIMEOUT`` or ``SLO``): it leaves the queue
  and counts as a rejection.
- After :meth:`AdmissionState.drain`, every arrival is rejected with ``DRAINING``; queued and
  running tickets go on. Draining rejections are counted apart (``draining_rejected_total``) and
  NOT in ``rejected_total``: they say the worker is shutting down, not that it is overloaded, and
  an operator alerting on overload should not be paged by a rolling restart.

Counters add up: every arrival is exactly one of started (directly or from the queue), rejected
(queue full, displaced, queue timeout, SLO), rejected while draining, cancelled while queued, or
still queued, so at any moment ``received_total == started_total + rejected_total +
draining_rejected_total + cancelled_queued_total + queued``.

Every transition is O(log n) or better in the number queued (the policy's heaps; the direct path
and a plain rejection are O(1)).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final, cast

from shim_common.wire import RejectReason
from worker_ingress._fair_queue import DISPLACED_BY_PRIORITY, FairQueue, service_tokens
from worker_ingress._slo import SloController
from worker_ingress._tenant_ledger import TenantAccount, TenantLedger
from worker_ingress._tickets import (
    START,
    Decision,
    GateRefusal,
    QueueDecision,
    StartDecision,
    Ticket,
    TicketStatus,
)

__all__ = ["REJECTION_KINDS", "AdmissionState"]

# Module-level aliases: a global lookup is cheaper than an attribute lookup on the enum class.
_CHANNEL: Final = TicketStatus.CHANNEL
_HAND: Final = TicketStatus.HAND
_RUNNING: Final = TicketStatus.RUNNING
_FINISHED: Final = TicketStatus.FINISHED
_CANCELLED: Final = TicketStatus.CANCELLED
_TIMED_OUT: Final = TicketStatus.TIMED_OUT
_DISPLACED: Final = TicketStatus.DISPLACED
_REFUSED: Final = TicketStatus.REFUSED

_OVERLOADED: Final = RejectReason.OVERLOADED
_DRAINING: Final = RejectReason.DRAINING
_SLO: Final = RejectReason.SLO
_QUEUE_TIMEOUT: Final = RejectReason.QUEUE_TIMEOUT

#: The kinds of rejection the gate counts apart (the ``reason`` label of the metrics): the keys
#: of its reasons (both displacements are ``displaced``), spelled by the wire alone.
REJECTION_KINDS: Final = tuple(
    reason.key for reason in (_OVERLOADED, RejectReason.DISPLACED_PRIORITY, _QUEUE_TIMEOUT, _SLO)
)

# Refusals carry no per-request data, so they are shared: a rejection allocates nothing here.
_REFUSED_OVERLOADED: Final = GateRefusal(_OVERLOADED)
_REFUSED_DRAINING: Final = GateRefusal(_DRAINING)
_REFUSED_SLO: Final = GateRefusal(_SLO)

_NO_ACCOUNT: Final = TenantAccount()


class AdmissionState:
    """Sans-IO admission: N slots, W waiting places, a hand and a Q - 1 channel; exact cap N + Q.

    Args:
        engine_slots: N, how many requests may run in the engine at once (>= 1).
        queue_limit: Q, how many may wait: the dispatcher's hand plus Q - 1 channel places (>= 2).
        waiting_limit: W, how many running requests may not have produced their first output
            yet (>= 1); ``None``: no bound beyond N.
        tenant_weights: Tenant name to weight (see :class:`~worker_ingress._fair_queue.FairQueue`
            for the range); others weigh 1.
        max_tenants: Tenant records kept at most (see the policy's rule 6).
        tenant_metrics_limit: Tenants counted by name in :attr:`ledger`.
        queue_timeout: Seconds a request may wait queued before it is rejected with
            ``QUEUE_TIMEOUT``; ``None``: no limit.
        slo: The controller of a time-to-first-token objective S (rule 4), made by the caller
            with N as its ``max_limit`` and the time it starts (its first window opens then);
            from here on the state owns it and alone drives it: it moves L and refuses early
            (``SLO``) a request that would miss S. ``None``: no objective; L stays N unless
            :meth:`set_slot_limit` moves it.

    The state itself starts at no particular time: every event that needs the time brings it.

    Raises:
        ValueError: N < 1, Q < 2, W < 1, a weight out of range, a negative or NaN queue
            timeout, or a controller whose ``max_limit`` is not N.
    """

    __slots__ = (
        "_admitted_total",
        "_draining",
        "_hand",
        "_queue",
        "_queued",
        "_refused_account",
        "_refused_priority",
        "_refused_tenant",
        "_refused_version",
        "_running",
        "_wait_cap",
        "_waiting",
        "admitted_queue_total",
        "cancelled_queued_total",
        "displaced_total",
        "draining_rejected_total",
        "engine_slots",
        "finished_total",
        "ledger",
        "queue_limit",
        "queue_timeout",
        "received_total",
        "rejected_total",
        "slo",
        "slo_rejected_total",
        "slot_limit",
        "started_total",
        "timed_out_total",
        "waiting_limit",
    )

    def __init__(
        self,
        *,
        engine_slots: int,
        queue_limit: int,
        waiting_limit: int | None = None,
        tenant_weights: Mapping[str, float] | None = None,
        max_tenants: int = 4096,
        tenant_metrics_limit: int = 50,
        queue_timeout: float | None = None,
        slo: SloController | None = None,
    ) -> None:
        if engine_slots < 1:
            raise ValueError(f"engine_slots must be >= 1, got {engine_slots}")
        if queue_limit < 2:
            raise ValueError(f"queue_limit must be >= 2, got {queue_limit}")
        if waiting_limit is not None and waiting_limit < 1:
            raise ValueError(f"waiting_limit must be >= 1, got {waiting_limit}")
        if queue_timeout is not None and not queue_timeout >= 0:
            raise ValueError(f"queue_timeout must be >= 0 seconds, got {queue_timeout}")
        if slo is not None and slo.max_limit != engine_slots:
            raise ValueError(
                f"the controller's max_limit must be N = {engine_slots}, got {slo.max_limit}"
            )
        #: N in force.
        self.engine_slots: Final = engine_slots
        #: L, the slots usable now (N unless lowered by :meth:`set_slot_limit`).
        self.slot_limit = engine_slots
        #: Q in force (hand + channel).
        self.queue_limit: Final = queue_limit
        #: W as configured; ``None``: unset.
        self.waiting_limit: Final = waiting_limit
        #: Seconds a request may wait queued; ``None``: no limit.
        self.queue_timeout: Final = queue_timeout
        #: The objective's controller (rule 4), or ``None`` without an objective. Read it; the
        #: state alone drives it.
        self.slo: Final = slo
        self._wait_cap = waiting_limit if waiting_limit is not None else engine_slots
        self._running = 0
        self._waiting = 0
        self._queued = 0
        self._hand: Ticket | None = None
        # The Q - 1 channel places, in the policy's order.
        self._queue = FairQueue(weights=tenant_weights, max_tenants=max_tenants)
        self._draining = False
        self._admitted_total = 0
        # The last arrival refused at a full queue, and the queue's version then: while the
        # queue is unchanged, the same class is refused again without asking the policy (the
        # overload fast path costs what the FIFO gate's did).
        self._refused_priority = 0
        self._refused_tenant = ""
        self._refused_version = -1
        self._refused_account = _NO_ACCOUNT
        #: Per-tenant outcomes and service (bounded; for metrics).
        self.ledger = TenantLedger(tenant_metrics_limit)
        #: Every arrival, whatever became of it.
        self.received_total = 0
        #: Queued tickets withdrawn before they started (the caller went away).
        self.cancelled_queued_total = 0
        #: Every rejection but draining ones: queue full, displaced, queue timeout, SLO
        #: (``dynamo_rejection_request_total``).
        self.rejected_total = 0
        #: Of ``rejected_total``, the queue timeouts.
        self.timed_out_total = 0
        #: Of ``rejected_total``, queued tickets displaced by a better arrival.
        self.displaced_total = 0
        #: Of ``rejected_total``, refusals for the TTFT objective.
        self.slo_rejected_total = 0
        #: Arrivals turned away because the worker is draining (not in ``rejected_total``).
        self.draining_rejected_total = 0
        #: Tickets that entered the engine, directly or from the queue.
        self.started_total = 0
        #: Of ``started_total``, those that waited in the queue first.
        self.admitted_queue_total = 0
        #: Running tickets that left the engine (finished, failed or cancelled).
        self.finished_total = 0

    # -- read-only views ------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Tickets holding an engine slot."""
        return self._running

    @property
    def waiting(self) -> int:
        """Running tickets holding a waiting place (no first output yet)."""
        return self._waiting

    @property
    def queued(self) -> int:
        """Tickets waiting: the dispatcher's hand included, so this peaks at Q."""
        return self._queued

    @property
    def in_flight(self) -> int:
        """Running plus queued; never more than N + Q."""
        return self._running + self._queued

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called."""
        return self._draining

    @property
    def hand(self) -> Ticket | None:
        """The ticket the dispatcher holds in transit, if any (the next to start)."""
        return self._hand

    @property
    def admitted_direct_total(self) -> int:
        """Tickets that started at once, without waiting in the queue."""
        return self.started_total - self.admitted_queue_total

    @property
    def queue_full_total(self) -> int:
        """Arrivals rejected because the queue was full and nobody could be displaced."""
        return (
            self.rejected_total
            - self.timed_out_total
            - self.displaced_total
            - self.slo_rejected_total
        )

    @property
    def policy(self) -> FairQueue:
        """The queue's policy (tenant records and weights), for metrics and tests."""
        return self._queue

    def rejected_by_kind(self) -> dict[str, int]:
        """``rejected_total`` split by :data:`REJECTION_KINDS`, in their order."""
        counts = (self.queue_full_total, self.displaced_total, self.timed_out_total)
        return dict(zip(REJECTION_KINDS, (*counts, self.slo_rejected_total), strict=True))

    def queued_tickets(self) -> list[Ticket]:
        """The waiting tickets, hand first, then by priority and arrival (see the policy)."""
        if self._hand is None:
            return []
        return [self._hand, *cast("list[Ticket]", self._queue.entries())]

    def queued_by_priority(self) -> Iterator[tuple[int, int]]:
        """``(priority, tickets queued)``, best first, the hand included (for metrics)."""
        counts = dict(self._queue.sizes_by_priority())
        if self._hand is not None:
            counts[self._hand.priority] = counts.get(self._hand.priority, 0) + 1
        for priority in sorted(counts):
            yield priority, counts[priority]

    def queued_ahead(self, priority: int) -> int:
        """Queued tickets an arrival of this priority would start behind: the hand, and those of
        its priority or a better one. O(priorities queued), never a scan of the queue."""
        return 0 if self._hand is None else 1 + self._queue.ahead(priority)

    def queue_ahead(self, limit: int) -> list[tuple[int, int]]:
        """``(priority, queued_ahead(priority))`` for each priority queued, best first, at most
        ``limit`` of them (what the load events carry)."""
        hand = self._hand
        return self._queue.ahead_by_priority(None if hand is None else hand.priority, limit)

    # -- the decision ---------------------------------------------------------------------------

    def decide(
        self, priority: int = 0, tenant: str = "", *, now: float, already_waited: float = 0.0
    ) -> Decision:
        """What :meth:`arrive` would do with this arrival now; nothing changes (rule 1).

        In this order: draining refuses (``DRAINING``); a slot and a waiting place free with
        nobody queued start it (:data:`~worker_ingress._tickets.START`); a full queue that
        refused this class last and is unchanged refuses it (``OVERLOADED``); with an objective,
        an arrival with no room left for its wait, or that would queue behind the B of what is
        left of S or more, is refused (``SLO``), before anyone is displaced for it; a full queue
        with nobody to displace refuses it (``OVERLOADED``); else it queues, displacing the
        policy's victim when the queue is full.

        Args:
            priority: Lower starts first.
            tenant: Whose request it is (``""``: the shared tenant).
            now: The time of the arrival (the queued ticket's deadline counts from it).
            already_waited: Seconds the request spent before it reached the gate; it shortens
                the objective's room for its wait (never below zero).

        Returns:
            :data:`~worker_ingress._tickets.START`, a
            :class:`~worker_ingress._tickets.QueueDecision` or a :class:`GateRefusal`.
        """
        if self._draining:
            return _REFUSED_DRAINING
        # "Nobody queued" follows from "a slot and a waiting place are free" (invariant: queued
        # > 0 implies running == L or waiting == W); it is spelled out because it is the rule
        # that keeps arrivals from overtaking the queue.
        if self._queued == 0 and self._running < self.slot_limit and self._waiting < self._wait_cap:
            return START
        victim: Ticket | None = None
        victim_reason: RejectReason | None = None
        full = self._queued >= self.queue_limit
        queue = self._queue
        if (
            full
            and queue.version == self._refused_version
            and priority == self._refused_priority
            and tenant == self._refused_tenant
        ):
            return _REFUSED_OVERLOADED
        slo = self.slo
        timeout = self.queue_timeout
        ends = _QUEUE_TIMEOUT
        if slo is not None:
            # worker_ingress/_slo.py, rule 6: an arrival that would queue behind B has no room
            # for its first token within what is left of S. Rule 7: a queued request is refused
            # once its wait leaves no room (at once: no room now), unless the queue timeout
            # comes first. Judged before a victim: a hopeless arrival displaces nobody.
            room = slo.queue_deadline - already_waited
            if room <= 0 or self.queued_ahead(priority) >= slo.queue_bound_after(already_waited):
                return _REFUSED_SLO
            if timeout is None or room < timeout:
                timeout = room
                ends = _SLO
        if full:
            record = queue.tenants.get(tenant)
            new = record is None and queue.is_new(tenant)
            found = queue.victim(priority, record, new=new) if queue.size else None
            if found is None:
                return _REFUSED_OVERLOADED
            entry, why = found
            victim = cast("Ticket", entry)
            victim_reason = (
                RejectReason.DISPLACED_PRIORITY
                if why == DISPLACED_BY_PRIORITY
                else RejectReason.DISPLACED_SHARE
            )
        deadline = None if timeout is None else now + timeout
        return QueueDecision(deadline, ends, victim, victim_reason)

    def would_reject(
        self, priority: int = 0, tenant: str = "", *, now: float, already_waited: float = 0.0
    ) -> bool:
        """Whether :meth:`arrive` with these values would be a :class:`GateRefusal` (that is,
        :meth:`decide` is one); no change."""
        decision = self.decide(priority, tenant, now=now, already_waited=already_waited)
        return isinstance(decision, GateRefusal)

    # -- events ---------------------------------------------------------------------------------

    def arrive(
        self,
        priority: int = 0,
        tenant: str = "",
        prompt_tokens: int = 0,
        *,
        now: float,
        already_waited: float = 0.0,
    ) -> Ticket | GateRefusal:
        """A request arrives: :meth:`decide`, then apply the decision.

        Args:
            priority: Lower starts first.
            tenant: Whose request it is (``""``: the shared tenant).
            prompt_tokens: Its prompt's size, of which rule 5 makes its start cost.
            now: The time of the arrival.
            already_waited: As for :meth:`decide`.

        Returns:
            A :class:`Ticket` that is ``RUNNING`` (it holds a slot now) or queued (``HAND`` or
            ``CHANNEL``: wait until a later event reports it started or rejected, or until its
            :attr:`~Ticket.deadline`), or the :class:`GateRefusal`. A queued ticket may have
            displaced another one: see :attr:`Ticket.displaced`.
        """
        decision = self.decide(priority, tenant, now=now, already_waited=already_waited)
        self.received_total += 1
        if isinstance(decision, GateRefusal):
            return self._refuse_arrival(decision, priority, tenant)
        start_cost = service_tokens(prompt_tokens=prompt_tokens)  # rule 5: once, here
        if isinstance(decision, StartDecision):
            ticket = self._start_now(priority, tenant, start_cost, now)
        else:
            ticket = self._enqueue(decision, priority, tenant, start_cost, now)
        ticket.waited = already_waited
        return ticket

    def tick(self, now: float) -> list[Ticket]:
        """Time passed: with an objective, the controller closes its window if one is due and a
        new L is put in force at once (lowering it evicts nobody; what a raise starts, starts at
        ``now``).

        Cheap when no window is due (two comparisons); call it on any event.

        Returns:
            The queued tickets that started because L rose (their waiters must be woken).
        """
        slo = self.slo
        if slo is None or not slo.update(now) or slo.limit == self.slot_limit:
            return []
        return self.set_slot_limit(slo.limit, now=now)

    def first_output(self, ticket: Ticket, *, now: float) -> Ticket | None:
        """A running ticket produced its first output: it gives its waiting place back (and,
        with an objective, is the controller's sample).

        Args:
            ticket: Any ticket; only a running one that still holds a waiting place changes.
            now: When the output came.

        Returns:
            The queued ticket that started with the place this freed, if any.
        """
        if not ticket.waiting:
            return None
        slo = self.slo
        if slo is not None and ticket.status is _RUNNING:
            # The client's time to first token: from its arrival at the frontend, when known.
            arrived = ticket.arrived - ticket.waited
            slo.observe_first_output(
                ticket, arrived=arrived, started=ticket.started, first_output=now
            )
        ticket.waiting = False
        self._waiting -= 1
        return self._dispatch(now)

    def charge(self, ticket: Ticket, generated_tokens: int) -> None:
        """Count generated tokens of a running ticket as its tenant's service (rule 5); a
        ticket that left charges nothing (its tenant may be forgotten already)."""
        if ticket.status is not _RUNNING:
            return
        tokens = service_tokens(generated_tokens=generated_tokens)
        FairQueue.charge(ticket.tenant, tokens)
        ticket.account.service_tokens += tokens

    def finish(self, ticket: Ticket, *, now: float) -> Ticket | None:
        """A running ticket leaves the engine (done, failed or cancelled): its slot frees.

        Args:
            ticket: A ``RUNNING`` ticket.
            now: When it left (with an objective, the controller learns how long it held
                its slot).

        Returns:
            The queued ticket that started in the freed slot, if any; its waiter must be woken.

        Raises:
            ValueError: The ticket is not running.
        """
        if ticket.status is not _RUNNING:
            raise ValueError(f"finish() needs a running ticket, got {ticket!r}")
        ticket.status = _FINISHED
        self._running -= 1
        if ticket.waiting:
            ticket.waiting = False
            self._waiting -= 1
        self.finished_total += 1
        self._queue.release(ticket.tenant)
        slo = self.slo
        if slo is not None:
            slo.observe_finish(ticket, started=ticket.started, finished=now)
        if self._hand is None:
            return None
        return self._dispatch(now)

    def cancel(self, ticket: Ticket, *, now: float) -> Ticket | None:
        """Withdraw a ticket, whatever its state: the caller has gone away.

        A queued ticket gives its place back; a running one frees its slot (as :meth:`finish`);
        a ticket that already left does nothing, so calling this twice is harmless.

        Args:
            ticket: Any ticket from :meth:`arrive`.
            now: When the caller went away.

        Returns:
            The queued ticket that started in a slot this freed, if any.
        """
        status = ticket.status
        if status is _RUNNING:
            return self.finish(ticket, now=now)
        if status is _HAND or status is _CHANNEL:
            self._unqueue(ticket)
            ticket.status = _CANCELLED
            ticket.account.cancelled += 1
            self.cancelled_queued_total += 1
        return None

    def deadline_passed(self, ticket: Ticket, now: float) -> bool:
        """The time is ``now``: a queued ticket whose :attr:`~Ticket.deadline` has come is
        rejected as its decision said (:attr:`~Ticket.ends`: ``QUEUE_TIMEOUT`` or ``SLO``).

        Returns:
            True if the ticket was still queued, its deadline has come, and it is now rejected
            (counted); False otherwise, in which case nothing changes.
        """
        deadline = ticket.deadline
        if deadline is None or now < deadline:
            return False
        if ticket.ends is _SLO:
            return self.refuse(ticket)
        return self.expire(ticket)

    def expire(self, ticket: Ticket) -> bool:
        """A queued ticket waited longer than the queue timeout: reject it (``QUEUE_TIMEOUT``).

        Args:
            ticket: Any ticket from :meth:`arrive`.

        Returns:
            True if the ticket was still queued and is now rejected (counted); False if it had
            already started or left, in which case nothing changes.
        """
        if not self._take_out(ticket, _TIMED_OUT, _QUEUE_TIMEOUT):
            return False
        self.timed_out_total += 1
        return True

    def refuse(self, ticket: Ticket) -> bool:
        """A queued ticket can no longer meet the TTFT objective: reject it with ``SLO``.

        Args:
            ticket: Any ticket from :meth:`arrive`.

        Returns:
            True if it was queued and is now rejected (counted under ``slo``); False otherwise.
        """
        if not self._take_out(ticket, _REFUSED, _SLO):
            return False
        self.slo_rejected_total += 1
        return True

    def set_slot_limit(self, limit: int, *, now: float) -> list[Ticket]:
        """Set L, the slots usable now (the controller's output, or an operator's).

        Lowering it never evicts a running ticket: fewer start until running falls below it.

        Args:
            limit: 1 <= L <= N.
            now: The time (the start time of what starts).

        Returns:
            The queued tickets that started because L rose (their waiters must be woken).

        Raises:
            ValueError: L out of range.
        """
        if not 1 <= limit <= self.engine_slots:
            raise ValueError(f"slot limit must be in [1, {self.engine_slots}], got {limit}")
        self.slot_limit = limit
        started: list[Ticket] = []
        while (ticket := self._dispatch(now)) is not None:
            started.append(ticket)
        return started

    def drain(self) -> None:
        """Stop admitting: later arrivals are rejected with ``DRAINING``."""
        self._draining = True

    # -- internals ------------------------------------------------------------------------------

    def _start_now(self, priority: int, tenant: str, start_cost: int, now: float) -> Ticket:
        record = self._queue.tenant(tenant)
        FairQueue.charge(record, start_cost)
        self._running += 1
        self._waiting += 1
        self.started_total += 1
        number = self._admitted_total
        self._admitted_total = number + 1
        ticket = Ticket(number, _RUNNING, priority, record, start_cost)
        ticket.waiting = True
        ticket.arrived = ticket.started = now
        account = ticket.account = self.ledger.account(tenant)
        account.admitted += 1
        account.service_tokens += start_cost
        slo = self.slo
        if slo is not None:
            slo.observe_start(ticket, started=now, running=self._running)
        return ticket

    def _refuse_arrival(self, refusal: GateRefusal, priority: int, tenant: str) -> GateRefusal:
        reason = refusal.reason
        if reason is _DRAINING:
            self.draining_rejected_total += 1
            self.ledger.account(tenant).rejected += 1
            return refusal
        self.rejected_total += 1
        slo = self.slo
        if slo is not None:
            slo.observe_backlog()
        if reason is _SLO:
            self.slo_rejected_total += 1
            self.ledger.account(tenant).rejected += 1
            return refusal
        queue = self._queue
        if (
            queue.version == self._refused_version
            and priority == self._refused_priority
            and tenant == self._refused_tenant
        ):
            self._refused_account.rejected += 1
            return refusal
        account = self._refused_account = self.ledger.account(tenant)
        account.rejected += 1
        self._refused_priority = priority
        self._refused_tenant = tenant
        self._refused_version = queue.version
        return refusal

    def _enqueue(
        self,
        decision: QueueDecision,
        priority: int,
        tenant: str,
        start_cost: int,
        now: float,
    ) -> Ticket:
        if self.slo is not None:
            self.slo.observe_backlog()
        queue = self._queue
        victim = decision.victim
        if victim is None:
            record = queue.tenant(tenant)
            number = self._admitted_total
            self._admitted_total = number + 1
            self._queued += 1
            if self._hand is None:
                # Chosen to start next the moment it arrives: charged now, as the policy
                # charges whatever it picks for the hand.
                FairQueue.charge(record, start_cost)
                ticket = Ticket(number, _HAND, priority, record, start_cost)
                self._hand = ticket
            else:
                ticket = Ticket(number, _CHANNEL, priority, record, start_cost)
                queue.push(ticket)
        else:
            queue.remove(victim)
            queue.release(victim.tenant)
            victim.status = _DISPLACED
            victim.reason = decision.victim_reason
            victim.account.rejected += 1
            self.rejected_total += 1
            self.displaced_total += 1
            number = self._admitted_total
            self._admitted_total = number + 1
            ticket = Ticket(number, _CHANNEL, priority, queue.tenant(tenant), start_cost)
            queue.push(ticket)
            ticket.displaced = victim
        ticket.account = self.ledger.account(tenant)
        ticket.arrived = now
        ticket.deadline = decision.deadline
        ticket.ends = decision.ends
        return ticket

    def _dispatch(self, now: float) -> Ticket | None:
        # A slot or a waiting place just freed. If both are available, the dispatcher puts the
        # ticket in its hand into the engine and the policy picks the next one into the hand.
        ticket = self._hand
        if ticket is None or self._running >= self.slot_limit or self._waiting >= self._wait_cap:
            return None
        self._queued -= 1
        self._running += 1
        self._waiting += 1
        self.started_total += 1
        self.admitted_queue_total += 1
        ticket.status = _RUNNING
        ticket.waiting = True
        ticket.started = now
        ticket.deadline = None
        account = ticket.account
        account.admitted += 1
        account.service_tokens += ticket.start_cost
        self._take_next_into_hand()
        slo = self.slo
        if slo is not None:
            slo.observe_start(ticket, started=now, running=self._running)
        return ticket

    def _take_out(self, ticket: Ticket, status: TicketStatus, reason: RejectReason) -> bool:
        if ticket.status is not _HAND and ticket.status is not _CHANNEL:
            return False
        self._unqueue(ticket)
        ticket.status = status
        ticket.reason = reason
        ticket.account.rejected += 1
        self.rejected_total += 1
        return True

    def _unqueue(self, ticket: Ticket) -> None:
        self._queued -= 1
        if ticket is self._hand:
            self._take_next_into_hand()
        else:
            self._queue.remove(ticket)
        self._queue.release(ticket.tenant)

    def _take_next_into_hand(self) -> None:
        head = cast("Ticket | None", self._queue.pop())
        if head is not None:
            head.status = _HAND
        self._hand = head
