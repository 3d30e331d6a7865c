"""The admission gate's Trio shell: one ``async with gate.slot(...):`` per request.

:class:`AdmissionGate` drives the sans-IO :class:`~worker_ingress._admission_state.AdmissionState`
(which decides everything, objective included) and does the I/O side of it: it reads the clock,
parks a queued request's task until the state reports it started or rejected, arms the deadline
the state's decision named, and wakes the tasks the state's events moved.

Rules of the shell
==================

1. The shell decides nothing: whether a request starts, waits or is turned away, when a wait runs
   out and with which reason, what the objective's controller learns, are the state's. The shell
   passes ``trio.current_time()`` to the objective's controller it makes and to every event that
   takes a time (the core has no default for it: a made-up 0 would read as a start long ago on
   Trio's real clock, which begins tens of thousands of seconds in). With an objective (the only
   part of the state that time moves) it calls
   :meth:`~worker_ingress._admission_state.AdmissionState.tick` before each arrival and after each
   first output and each end (the events on which the objective's window may close); without one it
   never calls it.
2. Every ticket an event reports as started (or displaced) is woken by the shell at once; the
   state never calls anything.
3. A task leaving its block for any reason (done, error, cancellation, while queued or while
   running) withdraws its ticket (:meth:`~worker_ingress._admission_state.AdmissionState.cancel`
   is idempotent), so no slot or queue place outlives its task.
4. :class:`SlotLease` holds no time of its own: the ticket carries its arrival and start times.
5. A request may meet the gate before its task exists (:meth:`SlotLease.arrive`, for a caller
   that reads several requests at once and must keep their order); entering the lease then only
   waits. A queued ticket's wake is armed at its arrival, so the shell wakes it (and calls the
   lease's ``on_start`` as it takes its slot) whether or not its task waits yet; a lease
   cancelled before its block began to run gives its ticket back at once
   (:meth:`SlotLease.cancel`), and on entering, when its task was cancelled before it got there.

The names of the sans-IO core are re-exported here (``AdmissionState``, ``GateRefusal``,
``Ticket``, ``TicketStatus``, ``REJECTION_KINDS``), so the gate is one import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Final

import trio

from shim_common.wire import RejectReason
from worker_ingress._admission_state import REJECTION_KINDS, AdmissionState
from worker_ingress._slo import SloController
from worker_ingress._tickets import GateRefusal, Ticket, TicketStatus

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

_RUNNING: Final = TicketStatus.RUNNING
_HAND: Final = TicketStatus.HAND
_CHANNEL: Final = TicketStatus.CHANNEL
_FINISHED: Final = TicketStatus.FINISHED


class Rejection(Exception):
    """The gate turned the request away before it started; ``str(exc) == exc.reason``.

    Raised as ``Rejection(reason)``. The reason is kept in ``args`` only (no ``__init__`` of our
    own): a rejection is the hot path under overload, and this halves the cost of raising it.
    """

    @property
    def reason(self) -> RejectReason:
        """Why: a :class:`~shim_common.wire.RejectReason` (overloaded, displaced, timeout, SLO,
        draining)."""
        reason: RejectReason = self.args[0]
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
            with ``QUEUE_TIMEOUT``; ``None``: no limit.
        ttft_objective: S, seconds: with it, the state's SLO controller (worker_ingress/_slo.py)
            moves the effective limit L in [``adaptive_min_limit``, N] and the gate refuses early
            (``SLO``) a request that would miss S; ``None``: L stays N.
        adaptive_min_limit: The floor of L (1 <= it <= N).
        on_change: Called synchronously whenever ``running``, ``queued`` or L changes (the
            event plane publishes from it). It must be cheap and must not raise.

    A gate with an objective is made inside a Trio run: it reads the clock then (the
    controller's first window opens when the gate is made). Without one it reads no clock
    until its first request.

    Raises:
        ValueError: N < 1, Q < 2, W < 1, a weight out of range, a negative or NaN queue
            timeout, or an objective or minimum limit out of range.
    """

    __slots__ = ("_idle", "_on_change", "_state")

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
        slo = None
        if ttft_objective is not None:
            # Its first window opens now: a gate with an objective is made inside a Trio run.
            slo = SloController(
                objective=ttft_objective,
                max_limit=engine_slots,
                min_limit=adaptive_min_limit,
                now=trio.current_time(),
            )
        self._state = AdmissionState(
            engine_slots=engine_slots,
            queue_limit=queue_limit,
            waiting_limit=waiting_limit,
            tenant_weights=tenant_weights,
            max_tenants=max_tenants,
            tenant_metrics_limit=tenant_metrics_limit,
            queue_timeout=queue_timeout,
            slo=slo,
        )
        self._on_change = on_change
        # Created only while someone sits in wait_idle(); set when in_flight reaches 0.
        self._idle: trio.Event | None = None

    @classmethod
    def from_settings(
        cls, settings: WorkerSettings, on_change: Callable[[], None] | None = None
    ) -> AdmissionGate:
        """Build the gate a worker's settings ask for (N, Q, W, the tenants' weights and
        bounds, the queue timeout and the objective with its floor).

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
        return self._state.queue_timeout

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
        """Rejections: queue full, displaced, queue timeout, objective (draining excluded)."""
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
        """The state's SLO controller, when an objective is set (read it, do not drive it)."""
        return self._state.slo

    @property
    def state(self) -> AdmissionState:
        """The sans-IO state, for metrics and tests (read it, do not drive it)."""
        return self._state

    # -- operations -----------------------------------------------------------------------------

    def slot(
        self,
        priority: int = 0,
        tenant: str = "",
        prompt_tokens: int = 0,
        *,
        already_waited: float = 0.0,
        on_start: Callable[[], None] | None = None,
    ) -> SlotLease:
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
            already_waited: Seconds the request spent before the gate (in a frontend), which
                an objective counts against its room to wait and its queue bound.
            on_start: Called at the moment the request takes its slot (at its arrival on the
                direct path, else inside the exit that starts it), before any other task runs:
                for what must be stamped exactly then.

        Returns:
            An async context manager, to be used once; inside the block, tell it of the first
            output (:meth:`SlotLease.first_output`) and of generated tokens
            (:meth:`SlotLease.charge`).
        """
        return SlotLease(self, priority, tenant, prompt_tokens, already_waited, on_start)

    def reject_now(
        self, priority: int = 0, tenant: str = "", *, already_waited: float = 0.0
    ) -> RejectReason | None:
        """Turn an arrival away here and now if the state's decision is a refusal (draining, Q
        waiting and nobody this arrival could displace, or, with an objective, no room for its
        first token within it).

        For a caller that sheds load without a task per request: on a refusal the arrival is
        counted as ``slot()`` would count it and its reason returned; otherwise nothing is
        counted and the caller goes on to ``slot()``, which decides again.

        Args:
            priority: The arrival's priority.
            tenant: The arrival's tenant.
            already_waited: As for :meth:`slot`.

        Returns:
            The reason of the refusal, or ``None``.
        """
        state = self._state
        now = trio.current_time()
        if state.slo is not None:  # the only part of the state that time moves
            self._wake_all(state.tick(now))
        if not state.would_reject(priority, tenant, now=now, already_waited=already_waited):
            return None
        decision = state.arrive(priority, tenant, now=now, already_waited=already_waited)
        if not isinstance(decision, GateRefusal):
            raise RuntimeError(f"the gate admitted a request it had refused: {decision!r}")
        return decision.reason

    def set_slot_limit(self, limit: int) -> None:
        """Set the effective limit L (1 <= L <= N); raising it starts queued requests."""
        self._wake_all(self._state.set_slot_limit(limit, now=trio.current_time()))
        self._changed()

    def drain(self) -> None:
        """Stop admitting: new requests get ``Rejection(DRAINING)``; the rest go on."""
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

    @staticmethod
    def _wake(ticket: Ticket | None) -> None:
        if ticket is not None and ticket.wake is not None:
            ticket.wake()

    @staticmethod
    def _wake_all(tickets: Iterable[Ticket]) -> None:
        for ticket in tickets:
            if ticket.wake is not None:
                ticket.wake()

    def _after(self, started: Ticket | None, now: float) -> None:
        # An event freed a slot or a waiting place (``started`` took it), and time passed.
        self._wake(started)
        state = self._state
        if state.slo is not None:
            self._wake_all(state.tick(now))
        self._changed()

    def _withdraw(self, ticket: Ticket) -> None:
        # The ticket's task is leaving (block done, error, cancellation): give back what it holds.
        now = trio.current_time()
        self._after(self._state.cancel(ticket, now=now), now)


class SlotLease:
    """What :meth:`AdmissionGate.slot` returns: one request's hold on a slot, used once."""

    __slots__ = (
        "_already_waited",
        "_entered",
        "_gate",
        "_on_start",
        "_priority",
        "_prompt_tokens",
        "_tenant",
        "_ticket",
        "_woken",
    )

    def __init__(
        self,
        gate: AdmissionGate,
        priority: int,
        tenant: str,
        prompt_tokens: int,
        already_waited: float = 0.0,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self._gate = gate
        self._on_start = on_start
        #: Set when the gate moves the queued ticket (started, displaced, refused).
        self._woken: trio.Event | None = None
        self._already_waited = already_waited
        self._priority = priority
        self._tenant = tenant
        self._prompt_tokens = prompt_tokens
        self._ticket: Ticket | None = None
        self._entered = False

    @property
    def queue_wait(self) -> float:
        """Seconds (Trio time) the request waited in the queue before it started; 0.0 on the
        direct path (and before it started, or when it never did)."""
        ticket = self._ticket
        if ticket is None or (ticket.status is not _RUNNING and ticket.status is not _FINISHED):
            return 0.0
        return ticket.started - ticket.arrived

    def first_output(self) -> None:
        """The request produced its first output: give the waiting place back (idempotent)."""
        ticket = self._ticket
        if ticket is not None and ticket.waiting:
            gate = self._gate
            now = trio.current_time()
            gate._after(gate._state.first_output(ticket, now=now), now)

    def charge(self, generated_tokens: int) -> None:
        """Count generated tokens as the tenant's service."""
        ticket = self._ticket
        if ticket is not None:
            self._gate._state.charge(ticket, generated_tokens)

    def arrive(self) -> None:
        """Meet the gate now, without waiting: take a free slot, join the queue, or raise
        :class:`Rejection` (then nothing is held).

        For a caller that reads several requests at once and must have them meet the gate in
        the order they came, before each has a task of its own (the tasks of one batch first
        run in no set order). Entering the lease afterwards only waits, when it was queued; the
        ticket is given back when the block is left, as always, or when entering fails (a task
        cancelled before it got there). Without it, entering the lease arrives.
        """
        if self._ticket is not None:
            raise RuntimeError("a slot lease arrives only once")
        gate = self._gate
        state = gate._state
        now = trio.current_time()
        if state.slo is not None:
            gate._wake_all(state.tick(now))
        decision = state.arrive(
            self._priority,
            self._tenant,
            self._prompt_tokens,
            now=now,
            already_waited=self._already_waited,
        )
        if isinstance(decision, GateRefusal):
            raise Rejection(decision.reason)
        ticket = decision
        self._ticket = ticket
        if ticket.status is _RUNNING:
            if self._on_start is not None:
                self._on_start()
        else:
            # Armed now, not when a task first waits: the gate may start or displace the
            # ticket before then (arrive() runs before the request's task exists).
            self._woken = trio.Event()
            ticket.wake = self._moved
        victim = ticket.displaced
        if victim is not None:
            ticket.displaced = None
            gate._wake(victim)
        try:
            gate._changed()
        except BaseException:
            gate._withdraw(ticket)
            raise

    def cancel(self) -> None:
        """The request is cancelled: give its ticket back now if its block has not begun to run
        (it arrived but its task has not entered the lease, or it waits in the queue), so what
        arrives right after it finds the place free. A running block gives its slot back as it
        leaves (its engine holds the slot until then). Idempotent; the caller cancels the
        request's task as well.
        """
        ticket = self._ticket
        if ticket is None or (self._entered and ticket.status is _RUNNING):
            return
        self._gate._withdraw(ticket)

    def _moved(self) -> None:
        # The gate's wake of the queued ticket: it started, was displaced or refused.
        ticket = self._ticket
        if self._on_start is not None and ticket is not None and ticket.status is _RUNNING:
            self._on_start()
        if self._woken is not None:
            self._woken.set()

    async def _wait_until_started(self, ticket: Ticket) -> None:
        # Park until another request's exit starts this ticket (or an arrival displaces it), or
        # until the deadline the state's decision named.
        gate = self._gate
        state = gate._state
        try:
            # Checked before the first wait: a ticket that arrived before its task entered the
            # lease may have started, or been displaced, meanwhile.
            while True:
                status = ticket.status
                if status is not _HAND and status is not _CHANNEL:
                    break
                if state.deadline_passed(ticket, trio.current_time()):
                    gate._changed()
                    break
                woken = self._woken
                if woken is None or woken.is_set():
                    # Woken yet still queued: the next wait needs a fresh event, not a set one.
                    woken = self._woken = trio.Event()
                deadline = ticket.deadline
                if deadline is None:
                    await woken.wait()
                else:
                    with trio.move_on_at(deadline):
                        await woken.wait()
        except BaseException:
            # Cancelled while queued (place given back) or just after being started (slot freed).
            gate._withdraw(ticket)
            raise
        if ticket.status is _RUNNING:
            return
        reason = ticket.reason
        assert reason is not None
        raise Rejection(reason)

    async def __aenter__(self) -> SlotLease:
        if self._entered:
            raise RuntimeError("a slot lease can be entered only once")
        self._entered = True
        ticket = self._ticket
        # A caller that is already cancelled must not take a slot; this does not yield.
        if ticket is None:
            await trio.lowlevel.checkpoint_if_cancelled()
            self.arrive()
            ticket = self._ticket
            assert ticket is not None
        else:
            try:
                await trio.lowlevel.checkpoint_if_cancelled()
            except BaseException:
                self._gate._withdraw(ticket)  # it arrived, but its block never began
                raise
        if ticket.status is not _RUNNING:
            await self._wait_until_started(ticket)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        ticket = self._ticket
        if ticket is not None:
            self._gate._withdraw(ticket)
