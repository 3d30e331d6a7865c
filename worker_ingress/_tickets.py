"""What the admission state hands out: tickets (one per admitted request) and decisions.

Plain data, no behaviour: :mod:`worker_ingress._admission_state` creates and moves them, the
Trio shell (:mod:`worker_ingress._admission`) reads them. A :class:`Decision` is what
:meth:`~worker_ingress._admission_state.AdmissionState.decide` says of an arrival before
anything changes: :data:`START`, a :class:`QueueDecision` (with its deadline and how the wait
ends if it runs out) or a :class:`GateRefusal` (with its :class:`~shim_common.wire.RejectReason`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final, TypeAlias

from shim_common.wire import RejectReason
from worker_ingress._fair_queue import QueueEntry, Tenant
from worker_ingress._tenant_ledger import TenantAccount

__all__ = [
    "START",
    "Decision",
    "GateRefusal",
    "QueueDecision",
    "StartDecision",
    "Ticket",
    "TicketStatus",
]


class TicketStatus(enum.Enum):
    """Where a ticket is in its life (see the diagram of :mod:`worker_ingress._admission_state`)."""

    CHANNEL = "channel"
    HAND = "hand"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    DISPLACED = "displaced"
    REFUSED = "refused"


class Ticket(QueueEntry):
    """One admitted request (running or queued), as the state tracks it.

    Attributes:
        number: Arrival order among admitted tickets, from 0.
        status: Where the ticket is now.
        priority: Lower starts first.
        tenant: The tenant's record in the queue's policy.
        start_cost: What starting it costs its tenant (the one rule's value of its prompt,
            computed once on arrival), charged to the queue's counter when it is chosen to
            start and to the ledger when it starts.
        account: The tenant's account in the state's ledger (for per-tenant metrics).
        waiting: Whether it holds a waiting place (running, no first output yet).
        arrived: When it reached the gate (the ``now`` of its arrival).
        waited: Seconds it spent before the gate (in a frontend), as its arrival said.
        started: When it entered the engine (``now`` of the event that started it); 0.0, which
            means nothing, until then: read it only once the ticket has started.
        deadline: While queued: when its wait runs out (on the clock of ``now``); ``None``:
            never.
        ends: How a wait that runs out ends (``QUEUE_TIMEOUT`` or ``SLO``).
        reason: Why it was rejected once queued (displaced, timed out, refused); else ``None``.
        displaced: On an arrival that displaced a queued ticket: that ticket, whose waiter the
            shell must wake (it then sees its ``reason``). The state never calls anything.
        wake: Set by the shell for a queued ticket: how to wake the task waiting on it when the
            state reports that it started or was rejected. The state never calls it.
    """

    __slots__ = (
        "account",
        "arrived",
        "deadline",
        "displaced",
        "ends",
        "reason",
        "started",
        "status",
        "waited",
        "waiting",
        "wake",
    )

    def __init__(
        self,
        number: int,
        status: TicketStatus,
        priority: int = 0,
        tenant: Tenant | None = None,
        start_cost: int = 0,
    ) -> None:
        # The entry's fields set here rather than through super().__init__: an arrival is the
        # hot path, and the call costs a fifth of it.
        self.number = number
        self.priority = priority
        self.tenant = tenant if tenant is not None else _NOBODY
        self.start_cost = start_cost
        self._flow = None
        self.status = status
        self.account = _NO_ACCOUNT
        self.waiting = False
        self.arrived = 0.0
        self.waited = 0.0
        self.started = 0.0
        self.deadline: float | None = None
        self.ends = RejectReason.QUEUE_TIMEOUT
        self.reason: RejectReason | None = None
        self.displaced: Ticket | None = None
        self.wake: Callable[[], object] | None = None

    def __repr__(self) -> str:
        return f"<Ticket #{self.number} {self.status.value} p={self.priority}>"


# The tenant of a ticket built by hand in a test (the state always passes a real record).
_NOBODY: Final = Tenant("", 1.0)
_NO_ACCOUNT: Final = TenantAccount()


class StartDecision:
    """The decision to start an arrival at once (a slot and a waiting place free, nobody queued)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "START"


#: The one start decision (it carries nothing).
START: Final = StartDecision()


class QueueDecision:
    """The decision to queue an arrival.

    Attributes:
        deadline: When its wait runs out, on the clock of the ``now`` it was decided at;
            ``None``: never.
        ends: The reason it is rejected with if the deadline passes first (``QUEUE_TIMEOUT``,
            or ``SLO`` when the objective's deadline is the earlier one).
        victim: The queued ticket it displaces (the queue is full), or ``None``.
        victim_reason: Why that ticket is displaced (``DISPLACED_PRIORITY`` or
            ``DISPLACED_SHARE``); ``None`` without a victim.
    """

    __slots__ = ("deadline", "ends", "victim", "victim_reason")

    def __init__(
        self,
        deadline: float | None,
        ends: RejectReason,
        victim: Ticket | None = None,
        victim_reason: RejectReason | None = None,
    ) -> None:
        self.deadline = deadline
        self.ends = ends
        self.victim = victim
        self.victim_reason = victim_reason

    def __repr__(self) -> str:
        victim = self.victim
        return f"QueueDecision(deadline={self.deadline}, ends={self.ends.name}, victim={victim})"


class GateRefusal:
    """The decision to turn a request away, with its :class:`~shim_common.wire.RejectReason`."""

    __slots__ = ("reason",)

    def __init__(self, reason: RejectReason) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"GateRefusal({self.reason.name})"


Decision: TypeAlias = StartDecision | QueueDecision | GateRefusal
