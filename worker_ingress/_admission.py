"""The admission gate: N engine slots, one dispatcher, an overflow channel of Q - 1 places.

A sans-IO core (:class:`AdmissionState`: events in, decisions out, no clock, no tasks) and a thin
Trio shell (:class:`AdmissionGate`: one ``async with gate.slot():`` per request).

Rules of the state machine
==========================

1. Everything that decides whether a request runs, waits or is turned away lives in
   :class:`AdmissionState`. The Trio shell only parks waiting tasks and wakes them.
2. The state does not know about time. The shell measures the queue timeout and reports it with
   :meth:`AdmissionState.expire`.

Theory of operation
-------------------

The worker has N engine slots and a queue of Q places. The queue is the one request held by the
single dispatcher (its "hand", in transit between the channel and the engine) plus an overflow
channel of Q - 1 places; the dispatcher is modelled as state, not as a task. Hence::

    0 <= running <= N          0 <= queued = hand + channel <= Q          in_flight <= N + Q

A ticket goes through these states::

    arrive() --(slot free and nobody queued)--------------------------------> RUNNING
        |                                                                      |  finish()
        +--(room in hand/channel)--> CHANNEL --> HAND --(a slot frees)------> RUNNING --> FINISHED
        |                               |          |                            cancel() ^
        |                               +----------+--cancel()--> CANCELLED
        |                               +----------+--expire()--> TIMED_OUT   (a rejection)
        +--(hand and channel full)----> GateRefusal(REASON_OVERLOADED)  (counted)
        +--(after drain())------------> GateRefusal(REASON_DRAINING)    (not counted)

- Direct path: a new request starts at once only when a slot is free AND nobody is queued, so a
  newcomer never overtakes a queued request. Invariant: ``queued > 0`` implies ``running == N``.
- When a slot frees, the ticket in the dispatcher's hand starts, and the head of the channel moves
  into the hand: queued requests start in arrival order (FIFO).
- A queued ticket that is cancelled gives its place back; if it was in the hand, the head of the
  channel moves up. A running ticket that is cancelled frees its slot exactly like ``finish``.
- A queued ticket that waited too long is expired: it leaves the queue and counts as a rejection
  (``dynamo_rejection_request_total`` counts "engine and queue full, and queue timeouts").
- After :meth:`AdmissionState.drain`, every arrival is rejected with ``REASON_DRAINING``; queued and
  running tickets go on. Draining rejections are counted apart (``draining_rejected_total``) and
  NOT in ``rejected_total``: they say the worker is shutting down, not that it is overloaded, and
  an operator alerting on overload should not be paged by a rolling restart.

Counters add up: every arrival is exactly one of started, rejected (overload or queue timeout),
rejected while draining, cancelled while queued, or still queued, so at any moment
``received_total == started_total + rejected_total + draining_rejected_total +
cancelled_queued_total + queued``.

Every transition is O(1): the channel is an insertion-ordered mapping, so a cancelled ticket leaves
from the middle without a scan.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Final

import trio

from shim_common.wire import REASON_DRAINING, REASON_OVERLOADED, REASON_QUEUE_TIMEOUT

if TYPE_CHECKING:
    from worker_ingress._config import WorkerSettings

__all__ = [
    "AdmissionGate",
    "AdmissionState",
    "GateRefusal",
    "Rejection",
    "Ticket",
    "TicketStatus",
]


class TicketStatus(enum.Enum):
    """Where a ticket is in its life (see the diagram at the top of the module)."""

    CHANNEL = "channel"
    HAND = "hand"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


# Module-level aliases: a global lookup is cheaper than an attribute lookup on the enum class.
_CHANNEL: Final = TicketStatus.CHANNEL
_HAND: Final = TicketStatus.HAND
_RUNNING: Final = TicketStatus.RUNNING
_FINISHED: Final = TicketStatus.FINISHED
_CANCELLED: Final = TicketStatus.CANCELLED
_TIMED_OUT: Final = TicketStatus.TIMED_OUT


class Ticket:
    """One admitted request (running or queued), as the state tracks it.

    Attributes:
        number: Arrival order among admitted tickets, from 0.
        status: Where the ticket is now.
        wake: Set by the shell for a queued ticket: how to wake the task waiting on it when the
            state reports that it started. The state never calls it.
    """

    __slots__ = ("number", "status", "wake")

    def __init__(self, number: int, status: TicketStatus) -> None:
        self.number = number
        self.status = status
        self.wake: Callable[[], object] | None = None

    def __repr__(self) -> str:
        return f"<Ticket #{self.number} {self.status.value}>"


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
    """Sans-IO admission: N slots, a dispatcher hand and a Q - 1 channel; exact cap N + Q.

    Args:
        engine_slots: N, how many requests may run in the engine at once (>= 1).
        queue_limit: Q, how many may wait: the dispatcher's hand plus Q - 1 channel places (>= 2).

    Raises:
        ValueError: N < 1 or Q < 2.
    """

    __slots__ = (
        "_admitted_total",
        "_channel",
        "_draining",
        "_hand",
        "_queued",
        "_running",
        "cancelled_queued_total",
        "draining_rejected_total",
        "engine_slots",
        "finished_total",
        "queue_limit",
        "received_total",
        "rejected_total",
        "started_total",
        "timed_out_total",
    )

    def __init__(self, *, engine_slots: int, queue_limit: int) -> None:
        if engine_slots < 1:
            raise ValueError(f"engine_slots must be >= 1, got {engine_slots}")
        if queue_limit < 2:
            raise ValueError(f"queue_limit must be >= 2, got {queue_limit}")
        #: N in force.
        self.engine_slots: Final = engine_slots
        #: Q in force (hand + channel).
        self.queue_limit: Final = queue_limit
        self._running = 0
        self._queued = 0
        self._hand: Ticket | None = None
        # Q - 1 places at most; insertion-ordered, O(1) removal from the middle on cancel.
        self._channel: OrderedDict[Ticket, None] = OrderedDict()
        self._draining = False
        self._admitted_total = 0
        #: Every arrival, whatever became of it.
        self.received_total = 0
        #: Queued tickets withdrawn before they started (the caller went away).
        self.cancelled_queued_total = 0
        #: Overload rejections plus queue timeouts (``dynamo_rejection_request_total``).
        self.rejected_total = 0
        #: Of ``rejected_total``, the queue timeouts.
        self.timed_out_total = 0
        #: Arrivals turned away because the worker is draining (not in ``rejected_total``).
        self.draining_rejected_total = 0
        #: Tickets that entered the engine, directly or from the queue.
        self.started_total = 0
        #: Running tickets that left the engine (finished, failed or cancelled).
        self.finished_total = 0

    # -- read-only views ------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Tickets holding an engine slot."""
        return self._running

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

    def queued_tickets(self) -> list[Ticket]:
        """The waiting tickets in the order they will start (hand first)."""
        if self._hand is None:
            return []
        return [self._hand, *self._channel]

    # -- events ---------------------------------------------------------------------------------

    def arrive(self) -> Ticket | GateRefusal:
        """A request arrives.

        Returns:
            A :class:`Ticket` that is ``RUNNING`` (it holds a slot now) or queued (``HAND`` or
            ``CHANNEL``: wait until a later event reports it started), or a :class:`GateRefusal`.
        """
        self.received_total += 1
        if self._draining:
            self.draining_rejected_total += 1
            return _REJECTED_DRAINING
        # "Nobody queued" follows from "a slot is free" (invariant: queued > 0 implies
        # running == N); it is spelled out because it is the rule that keeps arrivals FIFO.
        if self._queued == 0 and self._running < self.engine_slots:
            self._running += 1
            self.started_total += 1
            number = self._admitted_total
            self._admitted_total = number + 1
            return Ticket(number, _RUNNING)
        if self._queued < self.queue_limit:
            number = self._admitted_total
            self._admitted_total = number + 1
            ticket = Ticket(number, _CHANNEL)
            self._queued += 1
            if self._hand is None:
                ticket.status = _HAND
                self._hand = ticket
            else:
                self._channel[ticket] = None
            return ticket
        self.rejected_total += 1
        return _REJECTED_OVERLOADED

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
        self.finished_total += 1
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
        status = ticket.status
        if status is not _HAND and status is not _CHANNEL:
            return False
        self._unqueue(ticket)
        ticket.status = _TIMED_OUT
        self.rejected_total += 1
        self.timed_out_total += 1
        return True

    def drain(self) -> None:
        """Stop admitting: later arrivals are rejected with ``REASON_DRAINING``."""
        self._draining = True

    # -- internals ------------------------------------------------------------------------------

    def _dispatch(self) -> Ticket | None:
        # A slot just freed. The dispatcher puts the ticket in its hand into the engine and takes
        # the head of the channel into its hand. Called only when running < N.
        ticket = self._hand
        if ticket is None:
            return None
        self._queued -= 1
        self._running += 1
        self.started_total += 1
        ticket.status = _RUNNING
        self._take_head_into_hand()
        return ticket

    def _unqueue(self, ticket: Ticket) -> None:
        self._queued -= 1
        if ticket is self._hand:
            self._take_head_into_hand()
        else:
            del self._channel[ticket]

    def _take_head_into_hand(self) -> None:
        if self._channel:
            head, _ = self._channel.popitem(last=False)
            head.status = _HAND
            self._hand = head
        else:
            self._hand = None


# -- the Trio shell -----------------------------------------------------------------------------


class Rejection(Exception):
    """The gate turned the request away before it started; ``str(exc) == exc.reason``.

    Raised as ``Rejection(reason)``. The reason is kept in ``args`` only (no ``__init__`` of our
    own): a rejection is the hot path under overload, and this halves the cost of raising it.
    """

    @property
    def reason(self) -> str:
        """One of ``wire.REASON_OVERLOADED``, ``REASON_QUEUE_TIMEOUT`` or ``REASON_DRAINING``."""
        reason: str = self.args[0]
        return reason


class AdmissionGate:
    """Admission for one worker: ``async with gate.slot():`` around each request's engine work.

    Args:
        engine_slots: N (>= 1).
        queue_limit: Q (>= 2): the dispatcher's hand plus Q - 1 channel places.
        queue_timeout: Seconds (Trio time) a request may wait in the queue before it is rejected
            with ``REASON_QUEUE_TIMEOUT``; ``None``: no limit.
        on_change: Called synchronously whenever ``running`` or ``queued`` changes (the event
            plane publishes from it). It must be cheap and must not raise.

    Raises:
        ValueError: N < 1, Q < 2, or a negative or NaN queue timeout.
    """

    __slots__ = ("_idle", "_on_change", "_queue_timeout", "_state")

    def __init__(
        self,
        *,
        engine_slots: int,
        queue_limit: int,
        queue_timeout: float | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        if queue_timeout is not None and not queue_timeout >= 0:
            raise ValueError(f"queue_timeout must be >= 0 seconds, got {queue_timeout}")
        self._state = AdmissionState(engine_slots=engine_slots, queue_limit=queue_limit)
        self._queue_timeout = queue_timeout
        self._on_change = on_change
        # Created only while someone sits in wait_idle(); set when in_flight reaches 0.
        self._idle: trio.Event | None = None

    @classmethod
    def from_settings(
        cls, settings: WorkerSettings, on_change: Callable[[], None] | None = None
    ) -> AdmissionGate:
        """Build the gate a worker's settings ask for (N and Q in force, queue timeout).

        Args:
            settings: The validated worker settings.
            on_change: As for the constructor.

        Returns:
            A new gate.
        """
        return cls(
            engine_slots=settings.engine_slots,
            queue_limit=settings.queue_limit,
            queue_timeout=settings.queue_timeout,
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
    def rejected_total(self) -> int:
        """Requests rejected for overload, queue timeouts included (draining excluded)."""
        return self._state.rejected_total

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called."""
        return self._state.draining

    @property
    def state(self) -> AdmissionState:
        """The sans-IO state, for metrics and tests (read it, do not drive it)."""
        return self._state

    # -- operations -----------------------------------------------------------------------------

    def slot(self) -> AbstractAsyncContextManager[None]:
        """Wait for an engine slot, or raise :class:`Rejection` at once; hold it for the block.

        Cancellation while queued gives the place back; leaving the block (normally, by an error
        or by cancellation) frees the slot at once and starts the next queued request. On the
        direct path (a slot free, nobody queued) entering does not yield to the scheduler; it
        does raise ``trio.Cancelled`` if the caller is already cancelled.

        Returns:
            An async context manager, to be used once.
        """
        return _SlotLease(self)

    def reject_now(self) -> str | None:
        """Turn an arrival away here and now if the gate is certain to (draining, or Q waiting).

        For a caller that sheds load without a task per request: on a certain rejection the
        arrival is counted as ``slot()`` would count it and its reason returned; otherwise
        nothing is counted and the caller goes on to ``slot()``, which decides.

        Returns:
            The ``wire.REASON_*`` text of the rejection, or ``None``.
        """
        state = self._state
        if not state.draining and state.queued < state.queue_limit:
            return None
        decision = state.arrive()
        if not isinstance(decision, GateRefusal):
            raise RuntimeError(f"the gate admitted a request at its cap: {decision!r}")
        return decision.reason

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
        # running or queued moved: tell the event plane, and release wait_idle() at zero.
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

    async def _wait_until_started(self, ticket: Ticket) -> None:
        # Park until _withdraw()/__aexit__ of another request starts this ticket and wakes it.
        started = trio.Event()
        ticket.wake = started.set
        timeout = self._queue_timeout
        try:
            if timeout is None:
                await started.wait()
                return
            with trio.move_on_after(timeout):
                await started.wait()
        except BaseException:
            # Cancelled while queued (place given back) or just after being started (slot freed).
            self._withdraw(ticket)
            raise
        # The deadline and the wake-up may land in the same scheduling round: started wins.
        if ticket.status is not _RUNNING and self._state.expire(ticket):
            self._changed()
            raise Rejection(REASON_QUEUE_TIMEOUT)


class _SlotLease:
    """The context manager :meth:`AdmissionGate.slot` returns: one request's hold on a slot."""

    __slots__ = ("_gate", "_ticket")

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate = gate
        self._ticket: Ticket | None = None

    async def __aenter__(self) -> None:
        if self._ticket is not None:
            raise RuntimeError("a slot lease can be entered only once")
        # A caller that is already cancelled must not take a slot; this does not yield.
        await trio.lowlevel.checkpoint_if_cancelled()
        gate = self._gate
        decision = gate._state.arrive()
        if isinstance(decision, GateRefusal):
            raise Rejection(decision.reason)
        ticket = decision
        self._ticket = ticket
        try:
            gate._changed()
        except BaseException:
            gate._withdraw(ticket)
            raise
        if ticket.status is not _RUNNING:
            await gate._wait_until_started(ticket)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        ticket = self._ticket
        if ticket is not None:
            self._gate._withdraw(ticket)
