"""The admission gate: N engine slots, W waiting places, one dispatcher, a channel of Q - 1 places.

A sans-IO core (:class:`AdmissionState`: events in, decisions out, no clock, no tasks) and a thin
Trio shell (:class:`AdmissionGate`: one ``async with gate.slot(...):`` per request). Which queued
request starts next, and whom a full queue turns away, is the pure policy of
:mod:`worker_ingress._fair_queue` (strict priority, then least attained service per tenant).

Rules of the state machine
==========================

1. Everything that decides whether a request runs, waits or is turned away lives in
   :class:`AdmissionState`. The Trio shell only parks waiting tasks and wakes them.
2. The state does not know about time. The shell measures the queue timeout and reports it with
   :meth:`AdmissionState.expire`.
3. The order of the channel is :class:`~worker_ingress._fair_queue.FairQueue`'s; this module
   never reorders or scans it.
4. With a time-to-first-token objective, when to refuse and how many may run is the sans-IO
   :class:`~worker_ingress._slo.SloController`'s (its rules are at the top of its module). The
   shell only hands it the times it measures (arrival, start, first output, end) and applies
   its two outputs: L through :meth:`AdmissionState.set_slot_limit`, and the queue bound, by
   refusing an arrival that would queue behind it (:meth:`AdmissionState.count_slo_refusal`)
   and a queued request whose wait has run out (:meth:`AdmissionState.refuse`).

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
        |                               +----------+--expire()--> TIMED_OUT   (a rejection)
        |                               +----------+--refuse()--> REFUSED     (a rejection)
        |                               +--an arrival displaces it--> DISPLACED (a rejection)
        +--(queue full, nobody to displace)--> GateRefusal(REASON_OVERLOADED)  (counted)
        +--(after drain())-----------------> GateRefusal(REASON_DRAINING)    (not counted)

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
- A queued ticket that waited too long is expired (:meth:`AdmissionState.refuse` with another
  reason is the same for an SLO controller): it leaves the queue and counts as a rejection.
- After :meth:`AdmissionState.drain`, every arrival is rejected with ``REASON_DRAINING``; queued and
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

import enum
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Final, cast

import trio

from shim_common.wire import (
    REASON_DISPLACED_PRIORITY,
    REASON_DISPLACED_SHARE,
    REASON_DRAINING,
    REASON_OVERLOADED,
    REASON_QUEUE_TIMEOUT,
    REASON_SLO,
)
from worker_ingress._fair_queue import DISPLACED_BY_PRIORITY, FairQueue, QueueEntry, Tenant
from worker_ingress._slo import SloController
from worker_ingress._tenant_ledger import TenantAccount, TenantLedger

if TYPE_CHECKING:
    from worker_ingress._config import WorkerSettings

__all__ = [
    "REJECTION_KINDS",
    "AdmissionGate",
    "AdmissionState",
    "GateRefusal",
    "Rejection",
    "SlotLease",
    "Ticket",
    "TicketStatus",
]

#: The kinds of rejection the gate counts apart (the ``reason`` label of the metrics).
REJECTION_KINDS: Final = ("queue_full", "displaced", "queue_timeout", "slo")


class TicketStatus(enum.Enum):
    """Where a ticket is in its life (see the diagram at the top of the module)."""

    CHANNEL = "channel"
    HAND = "hand"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    DISPLACED = "displaced"
    REFUSED = "refused"


# Module-level aliases: a global lookup is cheaper than an attribute lookup on the enum class.
_CHANNEL: Final = TicketStatus.CHANNEL
_HAND: Final = TicketStatus.HAND
_RUNNING: Final = TicketStatus.RUNNING
_FINISHED: Final = TicketStatus.FINISHED
_CANCELLED: Final = TicketStatus.CANCELLED
_TIMED_OUT: Final = TicketStatus.TIMED_OUT
_DISPLACED: Final = TicketStatus.DISPLACED
_REFUSED: Final = TicketStatus.REFUSED


class Ticket(QueueEntry):
    """One admitted request (running or queued), as the state tracks it.

    Attributes:
        number: Arrival order among admitted tickets, from 0.
        status: Where the ticket is now.
        priority: Lower starts first.
        tenant: The tenant's record in the queue's policy.
        prompt_tokens: The prompt's size, charged to the tenant when the ticket starts.
        waiting: Whether it holds a waiting place (running, no first output yet).
        reason: Why it was rejected once queued (``DISPLACED``, ``TIMED_OUT``, ``REFUSED``).
        displaced: On an arrival that displaced a queued ticket: that ticket, whose waiter the
            shell must wake (it then sees its ``reason``). The state never calls anything.
        wake: Set by the shell for a queued ticket: how to wake the task waiting on it when the
            state reports that it started or was rejected. The state never calls it.
    """

    __slots__ = ("account", "displaced", "reason", "status", "waiting", "wake")

    def __init__(
        self,
        number: int,
        status: TicketStatus,
        priority: int = 0,
        tenant: Tenant | None = None,
        prompt_tokens: int = 0,
    ) -> None:
        # The entry's fields set here rather than through super().__init__: an arrival is the
        # hot path, and the call costs a fifth of it.
        self.number = number
        self.priority = priority
        self.tenant = tenant if tenant is not None else _NOBODY
        self.prompt_tokens = prompt_tokens
        self._flow = None
        self.status = status
        #: The tenant's account in the state's ledger (for per-tenant metrics).
        self.account = _NO_ACCOUNT
        self.waiting = False
        self.reason = ""
        self.displaced: Ticket | None = None
        self.wake: Callable[[], object] | None = None

    def __repr__(self) -> str:
        return f"<Ticket #{self.number} {self.status.value} p={self.priority}>"


# The tenant of a ticket built by hand in a test (the state always passes a real record).
_NOBODY: Final = Tenant("", 1.0)
_NO_ACCOUNT: Final = TenantAccount()


class GateRefusal:
    """The decision to turn a request away; ``reason`` is one of the ``wire.REASON_*`` texts."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"GateRefusal({self.reason!r})"


# Decisions carry no per-request data, so they are shared: a rejection allocates nothing here.
_REJECTED_OVERLOADED: Final = GateRefusal(REASON_OVERLOADED)
_REJECTED_DRAINING: Final = GateRefusal(REASON_DRAINING)


class AdmissionState:
    """Sans-IO admission: N slots, W waiting places, a hand and a Q - 1 channel; exact cap N + Q.

    Args:
        engine_slots: N, how many requests may run in the engine at once (>= 1).
        queue_limit: Q, how many may wait: the dispatcher's hand plus Q - 1 channel places (>= 2).
        waiting_limit: W, how many running requests may not have produced their first output
            yet (>= 1); ``None``: no bound beyond N.
        tenant_weights: Tenant name to weight (> 0); others weigh 1.
        max_tenants: Tenant records kept at most (see the policy's rule 6).
        tenant_metrics_limit: Tenants counted by name in :attr:`ledger`.

    Raises:
        ValueError: N < 1, Q < 2, W < 1, or a weight that is not positive.
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
        "received_total",
        "rejected_total",
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
    ) -> None:
        if engine_slots < 1:
            raise ValueError(f"engine_slots must be >= 1, got {engine_slots}")
        if queue_limit < 2:
            raise ValueError(f"queue_limit must be >= 2, got {queue_limit}")
        if waiting_limit is not None and waiting_limit < 1:
            raise ValueError(f"waiting_limit must be >= 1, got {waiting_limit}")
        #: N in force.
        self.engine_slots: Final = engine_slots
        #: L, the slots usable now (N unless lowered by :meth:`set_slot_limit`).
        self.slot_limit = engine_slots
        #: Q in force (hand + channel).
        self.queue_limit: Final = queue_limit
        #: W as configured; ``None``: unset.
        self.waiting_limit: Final = waiting_limit
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
        #: Of ``rejected_total``, refusals for the TTFT objective (:meth:`refuse`).
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
        """``rejected_total`` split by :data:`REJECTION_KINDS`."""
        return {
            "queue_full": self.queue_full_total,
            "displaced": self.displaced_total,
            "queue_timeout": self.timed_out_total,
            "slo": self.slo_rejected_total,
        }

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

    # -- events ---------------------------------------------------------------------------------

    def arrive(
        self, priority: int = 0, tenant: str = "", prompt_tokens: int = 0
    ) -> Ticket | GateRefusal:
        """A request arrives.

        Args:
            priority: Lower starts first.
            tenant: Whose request it is (``""``: the shared tenant).
            prompt_tokens: Its prompt's size, the service it costs its tenant to start.

        Returns:
            A :class:`Ticket` that is ``RUNNING`` (it holds a slot now) or queued (``HAND`` or
            ``CHANNEL``: wait until a later event reports it started or rejected), or a
            :class:`GateRefusal`. A queued ticket may have displaced another one: see
            :attr:`Ticket.displaced`.
        """
        self.received_total += 1
        if self._draining:
            self.draining_rejected_total += 1
            self.ledger.account(tenant).rejected += 1
            return _REJECTED_DRAINING
        # "Nobody queued" follows from "a slot and a waiting place are free" (invariant: queued
        # > 0 implies running == L or waiting == W); it is spelled out because it is the rule
        # that keeps arrivals from overtaking the queue.
        if self._queued == 0 and self._running < self.slot_limit and self._waiting < self._wait_cap:
            record = self._queue.tenant(tenant)
            cost = prompt_tokens * record.inverse_weight
            record.service += cost
            record.attained += cost
            self._running += 1
            self._waiting += 1
            self.started_total += 1
            number = self._admitted_total
            self._admitted_total = number + 1
            ticket = Ticket(number, _RUNNING, priority, record, prompt_tokens)
            ticket.waiting = True
            account = ticket.account = self.ledger.account(tenant)
            account.admitted += 1
            account.service_tokens += prompt_tokens
            return ticket
        if self._queued < self.queue_limit:
            record = self._queue.tenant(tenant)
            number = self._admitted_total
            self._admitted_total = number + 1
            self._queued += 1
            if self._hand is None:
                # Chosen to start next the moment it arrives: charged now, as the policy
                # charges whatever it picks for the hand.
                cost = prompt_tokens * record.inverse_weight
                record.service += cost
                record.attained += cost
                ticket = Ticket(number, _HAND, priority, record, prompt_tokens)
                self._hand = ticket
            else:
                ticket = Ticket(number, _CHANNEL, priority, record, prompt_tokens)
                self._queue.push(ticket)
            ticket.account = self.ledger.account(tenant)
            return ticket
        queue = self._queue
        if (
            queue.version == self._refused_version
            and priority == self._refused_priority
            and tenant == self._refused_tenant
        ):
            self.rejected_total += 1
            self._refused_account.rejected += 1
            return _REJECTED_OVERLOADED
        found = queue.victim(priority, queue.tenants.get(tenant)) if queue.size else None
        if found is None:
            self.rejected_total += 1
            account = self._refused_account = self.ledger.account(tenant)
            account.rejected += 1
            self._refused_priority = priority
            self._refused_tenant = tenant
            self._refused_version = queue.version
            return _REJECTED_OVERLOADED
        entry, why = found
        victim = cast("Ticket", entry)
        queue.remove(victim)
        queue.release(victim.tenant)
        victim.status = _DISPLACED
        victim.reason = (
            REASON_DISPLACED_PRIORITY if why == DISPLACED_BY_PRIORITY else REASON_DISPLACED_SHARE
        )
        victim.account.rejected += 1
        self.rejected_total += 1
        self.displaced_total += 1
        number = self._admitted_total
        self._admitted_total = number + 1
        ticket = Ticket(number, _CHANNEL, priority, queue.tenant(tenant), prompt_tokens)
        queue.push(ticket)
        ticket.account = self.ledger.account(tenant)
        ticket.displaced = victim
        return ticket

    def would_reject(self, priority: int = 0, tenant: str = "") -> bool:
        """Whether :meth:`arrive` with these values would be a :class:`GateRefusal`; no change."""
        if self._draining:
            return True
        if self._queued < self.queue_limit:
            return False
        queue = self._queue
        if (
            queue.version == self._refused_version
            and priority == self._refused_priority
            and tenant == self._refused_tenant
        ):
            return True
        return not queue.size or queue.victim(priority, queue.tenants.get(tenant)) is None

    def can_start_now(self) -> bool:
        """Whether an arrival would start at once (a slot under L and a waiting place free,
        nobody queued); no change."""
        return (
            self._queued == 0 and self._running < self.slot_limit and self._waiting < self._wait_cap
        )

    def queued_ahead(self, priority: int) -> int:
        """Queued tickets an arrival of this priority would start behind: the hand, and those of
        its priority or a better one. O(priorities queued), never a scan of the queue."""
        if self._hand is None:
            return 0
        ahead = 1
        for band, size in self._queue.sizes_by_priority():
            if band > priority:
                break
            ahead += size
        return ahead

    def first_output(self, ticket: Ticket) -> Ticket | None:
        """A running ticket produced its first output: it gives its waiting place back.

        Args:
            ticket: Any ticket; only a running one that still holds a waiting place changes.

        Returns:
            The queued ticket that started with the place this freed, if any.
        """
        if not ticket.waiting:
            return None
        ticket.waiting = False
        self._waiting -= 1
        return self._dispatch()

    def charge(self, ticket: Ticket, generated_tokens: int) -> None:
        """Count generated tokens of a running ticket as its tenant's service (two per token);
        a ticket that left charges nothing (its tenant may be forgotten already)."""
        if ticket.status is not _RUNNING:
            return
        tenant = ticket.tenant
        cost = 2 * generated_tokens * tenant.inverse_weight
        tenant.service += cost
        tenant.attained += cost
        ticket.account.service_tokens += 2 * generated_tokens

    def finish(self, ticket: Ticket) -> Ticket | None:
        """A running ticket leaves the engine (done, failed or cancelled): its slot frees.

        Args:
            ticket: A ``RUNNING`` ticket.

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
        if self._hand is None:
            return None
        return self._dispatch()

    def cancel(self, ticket: Ticket) -> Ticket | None:
        """Withdraw a ticket, whatever its state: the caller has gone away.

        A queued ticket gives its place back; a running one frees its slot (as :meth:`finish`);
        a ticket that already left does nothing, so calling this twice is harmless.

        Args:
            ticket: Any ticket from :meth:`arrive`.

        Returns:
            The queued ticket that started in a slot this freed, if any.
        """
        status = ticket.status
        if status is _RUNNING:
            return self.finish(ticket)
        if status is _HAND or status is _CHANNEL:
            self._unqueue(ticket)
            ticket.status = _CANCELLED
            ticket.account.cancelled += 1
            self.cancelled_queued_total += 1
        return None

    def expire(self, ticket: Ticket) -> bool:
        """A queued ticket waited longer than the queue timeout: reject it.

        Args:
            ticket: Any ticket from :meth:`arrive`.

        Returns:
            True if the ticket was still queued and is now rejected (counted); False if it had
            already started or left, in which case nothing changes.
        """
        if not self._take_out(ticket, _TIMED_OUT, REASON_QUEUE_TIMEOUT):
            return False
        self.timed_out_total += 1
        return True

    def refuse(self, ticket: Ticket) -> bool:
        """A queued ticket can no longer meet the TTFT objective: reject it with ``REASON_SLO``.

        Args:
            ticket: Any ticket from :meth:`arrive`.

        Returns:
            True if it was queued and is now rejected (counted under ``slo``); False otherwise.
        """
        if not self._take_out(ticket, _REFUSED, REASON_SLO):
            return False
        self.slo_rejected_total += 1
        return True

    def count_slo_refusal(self, tenant: str = "") -> None:
        """Count an arrival that an SLO controller refused before it reached :meth:`arrive`."""
        self.ledger.account(tenant).rejected += 1
        self.received_total += 1
        self.rejected_total += 1
        self.slo_rejected_total += 1

    def set_slot_limit(self, limit: int) -> list[Ticket]:
        """Set L, the slots usable now (an adaptive controller's output).

        Lowering it never evicts a running ticket: fewer start until running falls below it.

        Args:
            limit: 1 <= L <= N.

        Returns:
            The queued tickets that started because L rose (their waiters must be woken).

        Raises:
            ValueError: L out of range.
        """
        if not 1 <= limit <= self.engine_slots:
            raise ValueError(f"slot limit must be in [1, {self.engine_slots}], got {limit}")
        self.slot_limit = limit
        started: list[Ticket] = []
        while (ticket := self._dispatch()) is not None:
            started.append(ticket)
        return started

    def drain(self) -> None:
        """Stop admitting: later arrivals are rejected with ``REASON_DRAINING``."""
        self._draining = True

    # -- internals ------------------------------------------------------------------------------

    def _dispatch(self) -> Ticket | None:
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
        account = ticket.account
        account.admitted += 1
        account.service_tokens += ticket.prompt_tokens
        self._take_next_into_hand()
        return ticket

    def _take_out(self, ticket: Ticket, status: TicketStatus, reason: str) -> bool:
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


# -- the Trio shell -----------------------------------------------------------------------------


class Rejection(Exception):
    """The gate turned the request away before it started; ``str(exc) == exc.reason``.

    Raised as ``Rejection(reason)``. The reason is kept in ``args`` only (no ``__init__`` of our
    own): a rejection is the hot path under overload, and this halves the cost of raising it.
    """

    @property
    def reason(self) -> str:
        """One of the ``wire.REASON_*`` texts (overloaded, displaced, timeout, SLO, draining)."""
        reason: str = self.args[0]
        return reason


class AdmissionGate:
    """Admission for one worker: ``async with gate.slot(...):`` around each request's engine work.

    Args:
        engine_slots: N (>= 1).
        queue_limit: Q (>= 2): the dispatcher's hand plus Q - 1 channel places.
        waiting_limit: W (>= 1), or ``None``: see :class:`AdmissionState`.
        tenant_weights: Tenant name to weight; others weigh 1.
        max_tenants: Tenant records kept at most.
        tenant_metrics_limit: Tenants counted by name for the per-tenant metrics.
        queue_timeout: Seconds (Trio time) a request may wait in the queue before it is rejected
            with ``REASON_QUEUE_TIMEOUT``; ``None``: no limit.
        ttft_objective: S, seconds: with it, an SLO controller (worker_ingress/_slo.py) moves
            the effective limit L in [``adaptive_min_limit``, N] and the gate refuses early
            (``REASON_SLO``) a request that would miss S; ``None``: L stays N.
        adaptive_min_limit: The floor of L (1 <= it <= N).
        on_change: Called synchronously whenever ``running``, ``queued`` or L changes (the
            event plane publishes from it). It must be cheap and must not raise.

    Raises:
        ValueError: N < 1, Q < 2, W < 1, a weight that is not positive, a negative or NaN
            queue timeout, or an objective or minimum limit out of range.
    """

    __slots__ = ("_idle", "_on_change", "_queue_timeout", "_slo", "_state")

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
        ttft_objective: float | None = None,
        adaptive_min_limit: int = 1,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        if queue_timeout is not None and not queue_timeout >= 0:
            raise ValueError(f"queue_timeout must be >= 0 seconds, got {queue_timeout}")
        self._state = AdmissionState(
            engine_slots=engine_slots,
            queue_limit=queue_limit,
            waiting_limit=waiting_limit,
            tenant_weights=tenant_weights,
            max_tenants=max_tenants,
            tenant_metrics_limit=tenant_metrics_limit,
        )
        self._queue_timeout = queue_timeout
        self._on_change = on_change
        # Created only while someone sits in wait_idle(); set when in_flight reaches 0.
        self._idle: trio.Event | None = None
        self._slo = (
            None
            if ttft_objective is None
            else SloController(
                objective=ttft_objective, max_limit=engine_slots, min_limit=adaptive_min_limit
            )
        )

    @classmethod
    def from_settings(
        cls, settings: WorkerSettings, on_change: Callable[[], None] | None = None
    ) -> AdmissionGate:
        """Build the gate a worker's settings ask for (N, Q, W, weights, queue timeout).

        Args:
            settings: The validated worker settings.
            on_change: As for the constructor.

        Returns:
            A new gate.
        """
        return cls(
            engine_slots=settings.engine_slots,
            queue_limit=settings.queue_limit,
            waiting_limit=settings.engine_request_waiting_limit,
            tenant_weights=settings.tenant_weights,
            max_tenants=settings.max_tracked_tenants,
            tenant_metrics_limit=settings.tenant_metrics_limit,
            queue_timeout=settings.queue_timeout,
            ttft_objective=settings.ttft_slo,
            adaptive_min_limit=settings.adaptive_min_limit,
            on_change=on_change,
        )

    # -- read-only views ------------------------------------------------------------------------

    @property
    def engine_slots(self) -> int:
        """N in force."""
        return self._state.engine_slots

    @property
    def queue_limit(self) -> int:
        """Q in force."""
        return self._state.queue_limit

    @property
    def queue_timeout(self) -> float | None:
        """Seconds a request may wait queued; ``None``: no limit."""
        return self._queue_timeout

    @property
    def running(self) -> int:
        """Requests holding an engine slot now."""
        return self._state.running

    @property
    def queued(self) -> int:
        """Requests waiting now, the dispatcher's hand included (peaks at Q)."""
        return self._state.queued

    @property
    def in_flight(self) -> int:
        """Running plus queued (at most N + Q)."""
        return self._state.in_flight

    @property
    def waiting(self) -> int:
        """Running requests that have not produced their first output yet."""
        return self._state.waiting

    @property
    def rejected_total(self) -> int:
        """Requests rejected for overload, queue timeouts included (draining excluded)."""
        return self._state.rejected_total

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called."""
        return self._state.draining

    @property
    def effective_limit(self) -> int:
        """L, the engine slots usable now: N unless the SLO controller has lowered it."""
        return self._state.slot_limit

    @property
    def slo(self) -> SloController | None:
        """The SLO controller, when an objective is set (read it, do not drive it)."""
        return self._slo

    @property
    def state(self) -> AdmissionState:
        """The sans-IO state, for metrics and tests (read it, do not drive it)."""
        return self._state

    # -- operations -----------------------------------------------------------------------------

    def slot(self, priority: int = 0, tenant: str = "", prompt_tokens: int = 0) -> SlotLease:
        """Wait for an engine slot, or raise :class:`Rejection` at once; hold it for the block.

        Cancellation while queued gives the place back; leaving the block (normally, by an error
        or by cancellation) frees the slot at once and starts the next queued request. A queued
        request that a better arrival displaces raises :class:`Rejection` with the displacement
        reason. On the direct path (a slot free, nobody queued) entering does not yield to the
        scheduler; it does raise ``trio.Cancelled`` if the caller is already cancelled.

        Args:
            priority: Lower starts first.
            tenant: Whose request it is, for fair sharing (``""``: the shared tenant).
            prompt_tokens: The prompt's size (the service it costs the tenant).

        Returns:
            An async context manager, to be used once; inside the block, tell it of the first
            output (:meth:`SlotLease.first_output`) and of generated tokens
            (:meth:`SlotLease.charge`).
        """
        return SlotLease(self, priority, tenant, prompt_tokens)

    def reject_now(self, priority: int = 0, tenant: str = "") -> str | None:
        """Turn an arrival away here and now if the gate is certain to (draining, or Q waiting
        and nobody this arrival could displace, or, with an objective, no room for its first
        token within it).

        For a caller that sheds load without a task per request: on a certain rejection the
        arrival is counted as ``slot()`` would count it and its reason returned; otherwise
        nothing is counted and the caller goes on to ``slot()``, which decides.

        Args:
            priority: The arrival's priority.
            tenant: The arrival's tenant.

        Returns:
            The ``wire.REASON_*`` text of the rejection, or ``None``.
        """
        state = self._state
        at_cap = state.would_reject(priority, tenant)
        if self._slo is not None and self._objective_refuses(priority, tenant, at_cap=at_cap):
            return REASON_SLO
        if not at_cap:
            return None
        decision = state.arrive(priority, tenant)
        if not isinstance(decision, GateRefusal):
            raise RuntimeError(f"the gate admitted a request at its cap: {decision!r}")
        return decision.reason

    def set_slot_limit(self, limit: int) -> None:
        """Set the effective limit L (1 <= L <= N); raising it starts queued requests."""
        for ticket in self._state.set_slot_limit(limit):
            if ticket.wake is not None:
                ticket.wake()
        self._changed()

    def _objective_refuses(self, priority: int, tenant: str, *, at_cap: bool) -> bool:
        # worker_ingress/_slo.py, rule 6: an arrival that would queue behind the controller's
        # bound B has no room for its first token within S; it is refused (and counted) here.
        # ``at_cap``: the queue refuses it anyway, which says only that the limit is in use.
        # Only called with an objective.
        slo = self._slo
        assert slo is not None
        state = self._state
        if at_cap:
            if not state.draining:
                slo.observe_backlog()
            return False
        self._slo_tick(trio.current_time())
        if state.can_start_now():
            return False
        slo.observe_backlog()
        if state.queued_ahead(priority) < slo.queue_bound:
            return False
        state.count_slo_refusal(tenant)
        return True

    def _slo_tick(self, now: float) -> None:
        # The controller closes its window when one is due; a new L is put in force at once
        # (lowering it evicts nobody: fewer start until running falls under it).
        slo = self._slo
        assert slo is not None
        if slo.update(now) and slo.limit != self._state.slot_limit:
            self.set_slot_limit(slo.limit)

    def drain(self) -> None:
        """Stop admitting: new requests get ``Rejection(REASON_DRAINING)``; the rest go on."""
        self._state.drain()

    async def wait_idle(self) -> None:
        """Return once nothing runs or waits (immediately if that is already so)."""
        if self._state.in_flight == 0:
            await trio.lowlevel.checkpoint()
            return
        while self._state.in_flight:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    # -- internals ------------------------------------------------------------------------------

    def _changed(self) -> None:
        # running, waiting or queued moved: tell the event plane, and release wait_idle() at 0.
        if self._on_change is not None:
            self._on_change()
        if self._idle is not None and self._state.in_flight == 0:
            self._idle.set()
            self._idle = None

    def _withdraw(self, ticket: Ticket) -> None:
        # The ticket's task is leaving (block done, error, cancellation): give back what it holds.
        started = self._state.cancel(ticket)
        if started is not None and started.wake is not None:
            started.wake()
        self._changed()

    def _first_output(self, ticket: Ticket) -> None:
        started = self._state.first_output(ticket)
        if started is not None and started.wake is not None:
            started.wake()
        self._changed()

    async def _wait_until_started(self, ticket: Ticket) -> None:
        # Park until another request's exit starts this ticket (or an arrival displaces it).
        woken = trio.Event()
        ticket.wake = woken.set
        timeout = self._queue_timeout
        # With an objective, a request whose wait leaves no room for its first token within it
        # is refused (worker_ingress/_slo.py, rule 7), unless the queue timeout comes first.
        slo = self._slo
        slo_deadline = slo is not None and (timeout is None or slo.queue_deadline < timeout)
        if slo is not None and slo_deadline:
            timeout = slo.queue_deadline
        try:
            if timeout is None:
                await woken.wait()
            else:
                with trio.move_on_after(timeout):
                    await woken.wait()
        except BaseException:
            # Cancelled while queued (place given back) or just after being started (slot freed).
            self._withdraw(ticket)
            raise
        status = ticket.status
        if status is _RUNNING:
            return
        if status is _HAND or status is _CHANNEL:
            # The deadline passed (a wake-up in the same round would have made it RUNNING).
            if slo_deadline:
                self._state.refuse(ticket)
            else:
                self._state.expire(ticket)
            self._changed()
        raise Rejection(ticket.reason)


class SlotLease:
    """What :meth:`AdmissionGate.slot` returns: one request's hold on a slot, used once."""

    __slots__ = (
        "_arrived",
        "_gate",
        "_priority",
        "_prompt_tokens",
        "_started",
        "_tenant",
        "_ticket",
        "queue_wait",
    )

    def __init__(self, gate: AdmissionGate, priority: int, tenant: str, prompt_tokens: int) -> None:
        self._gate = gate
        self._priority = priority
        self._tenant = tenant
        self._prompt_tokens = prompt_tokens
        self._ticket: Ticket | None = None
        #: Seconds (Trio time) the request waited in the queue before it started; 0.0 on the
        #: direct path.
        self.queue_wait = 0.0
        # Trio times of arrival and start, kept only for the SLO controller's samples.
        self._arrived = 0.0
        self._started = 0.0

    def first_output(self) -> None:
        """The request produced its first output: give the waiting place back and, with an
        objective, report the sample (idempotent)."""
        ticket = self._ticket
        if ticket is not None and ticket.waiting:
            gate = self._gate
            slo = gate._slo
            if slo is not None and ticket.status is _RUNNING:
                now = trio.current_time()
                slo.observe_first_output(
                    self, arrived=self._arrived, started=self._started, first_output=now
                )
                gate._slo_tick(now)
            gate._first_output(ticket)

    def charge(self, generated_tokens: int) -> None:
        """Count generated tokens as the tenant's service."""
        ticket = self._ticket
        if ticket is not None:
            self._gate._state.charge(ticket, generated_tokens)

    async def __aenter__(self) -> SlotLease:
        if self._ticket is not None:
            raise RuntimeError("a slot lease can be entered only once")
        # A caller that is already cancelled must not take a slot; this does not yield.
        await trio.lowlevel.checkpoint_if_cancelled()
        gate = self._gate
        state = gate._state
        slo = gate._slo
        if slo is not None:
            self._arrived = self._started = trio.current_time()
            at_cap = state.would_reject(self._priority, self._tenant)
            if gate._objective_refuses(self._priority, self._tenant, at_cap=at_cap):
                raise Rejection(REASON_SLO)
        decision = state.arrive(self._priority, self._tenant, self._prompt_tokens)
        if isinstance(decision, GateRefusal):
            raise Rejection(decision.reason)
        ticket = decision
        self._ticket = ticket
        victim = ticket.displaced
        if victim is not None:
            ticket.displaced = None
            if victim.wake is not None:
                victim.wake()
        try:
            gate._changed()
        except BaseException:
            gate._withdraw(ticket)
            raise
        if ticket.status is not _RUNNING:
            queued_at = trio.current_time()
            await gate._wait_until_started(ticket)
            self.queue_wait = trio.current_time() - queued_at
            self._started = queued_at + self.queue_wait
        if slo is not None:
            slo.observe_start(self, started=self._started, running=state.running)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        ticket = self._ticket
        if ticket is not None:
            gate = self._gate
            ran = ticket.status is _RUNNING
            gate._withdraw(ticket)
            slo = gate._slo
            if slo is not None and ran:
                now = trio.current_time()
                slo.observe_finish(self, started=self._started, finished=now)
                gate._slo_tick(now)
