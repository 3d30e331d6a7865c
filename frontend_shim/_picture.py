"""The frontend's picture of the fleet, as one request's life sees it: a pick that reserves (pure).

A request asks the picture for a worker with a :class:`PickQuery`; the answer is either a
:class:`Ticket` (the worker, the rank, and the request already counted there) or a
:class:`NoRoute` (why there is none). Picking and charging are one step, so that a request
picked a moment ago is in the picture that the next pick reads, whichever task or process
makes it. :class:`~frontend_shim._dispatch.Dispatch` holds the ticket and closes it exactly
once; what the ticket does to the picture is here.

:class:`LocalPicture` is the picture a frontend process keeps itself (its
:class:`~frontend_shim._load.Fleet`, :class:`~frontend_shim._router.Router` and the ``kv``
mode's :class:`~frontend_shim._kv_routing.KvRouting`); a picture kept elsewhere (another
process) answers the same :class:`Picture` protocol with tickets of its own.

Rules of a :class:`LocalTicket`:

1. At the pick: in ``kv`` mode the index is told what was sent to the chosen rank, and a prompt
   the router tokenised is charged to that rank at once (the picks of a burst see it); the
   request counts as queued at the worker, for the refusals that hold a worker by the depth of
   its queue (:mod:`frontend_shim._queue_hold`), until its first reply.
2. At the worker's ``Started``: no longer queued; a request not charged at the pick is charged
   now with the worker's count of the prompt, and one charged at the pick takes that count; the
   ``kv`` mode's hit metrics count the choice.
3. Output moves the charge (:meth:`~frontend_shim._load.Fleet.request_output`); the worker's
   final frame, or the request's end without one, releases it, with the frame's word on which
   of the worker's events still count the request (:meth:`LocalTicket.finished`).
4. A request that never started (refused, failed, never sent, or given up before its first
   reply) is no longer queued and its charge comes off without a release: no report of the
   worker counted it. A refusal also marks the worker for what it proves
   (:meth:`~frontend_shim._router.Router.on_rejected`).
5. Every closing call (:meth:`LocalTicket.finished`, :meth:`~LocalTicket.refused`,
   :meth:`~LocalTicket.failed`, :meth:`~LocalTicket.unsent`) is meant to be made once; each is
   harmless a second time (the fleet's calls are idempotent), but the dispatch never makes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

from frontend_shim._kv_cost import NO_PROMPT, KvChoice, Prompt
from frontend_shim._kv_routing import KvRouting
from frontend_shim._load import Fleet
from frontend_shim._router import AllBusy, NoWorkers, RejectionKind, Router, UnknownModel
from frontend_shim._sequences import InFlight
from shim_common import wire

__all__ = [
    "LocalPicture",
    "LocalTicket",
    "NoRoute",
    "PickQuery",
    "Picture",
    "Ticket",
]


@dataclasses.dataclass(slots=True)
class PickQuery:
    """What one request asks of every pick."""

    model: str
    priority: int
    tenant: str
    #: A busy-exempt request (``--busy-exempt-priority``): a busy worker may take it.
    exempt: bool
    prompt: Prompt = NO_PROMPT
    #: Workers not to pick: those that refused the request or went away before it reached them.
    exclude: set[str] = dataclasses.field(default_factory=set)
    #: The client's retry of a request answered 529 (``x-stainless-retry-count`` above 0): the
    #: frontend's marks alone do not turn it away (frontend_shim._retry_advice, rule 3).
    retry: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class NoRoute:
    """No worker for the request: ``kind`` says which answer (``None``: the model is unknown,
    404), ``reason`` the ``x-dynamo-reject-reason``."""

    kind: RejectionKind | None
    reason: str


class Ticket(Protocol):
    """A request counted at the worker picked for it (rules of :class:`LocalTicket`)."""

    @property
    def worker_id(self) -> str:
        """The worker picked."""
        ...

    @property
    def dp_rank(self) -> int | None:
        """The rank picked (``None``: the worker chooses)."""
        ...

    def started(self, prompt_tokens: int, label: str, now: float) -> None:
        """The worker started the request and counted ``prompt_tokens`` of prompt."""
        ...

    def output(self, tokens: int) -> None:
        """The worker generated ``tokens`` more."""
        ...

    def finished(self, final: wire.End | wire.Failed | None) -> None:
        """The started request left the worker (closes the ticket)."""
        ...

    def refused(
        self,
        reason: wire.RejectReason,
        priority: int,
        tenant: str,
        queue_bound: int | None,
        now: float,
    ) -> RejectionKind:
        """The worker refused the request (closes the ticket); the kind of refusal."""
        ...

    def failed(self, now: float) -> None:
        """The worker failed the request before it started (closes the ticket)."""
        ...

    def unsent(self, now: float) -> None:
        """The request ended before any reply of the worker: never sent, or given up while
        waiting (closes the ticket)."""
        ...


class Picture(Protocol):
    """Where a request's picks come from."""

    def pick(self, query: PickQuery, now: float) -> Ticket | NoRoute:
        """A worker for the request, counted there already, or why there is none."""
        ...


class LocalPicture:
    """The picture this process keeps itself.

    Args:
        fleet: the load state.
        router: picks workers over ``fleet``.
        kv: ``--router-mode kv``'s per-request part (tokenisation, guesses, hit metrics).
    """

    __slots__ = ("fleet", "kv", "router")

    def __init__(self, fleet: Fleet, router: Router, kv: KvRouting | None = None) -> None:
        self.fleet = fleet
        self.router = router
        self.kv = kv

    def prompt(self, endpoint: wire.Endpoint, body: Mapping[str, object]) -> Prompt:
        """The request's prompt as the router scores it (tokenised only in ``kv`` mode)."""
        return self.kv.prompt(endpoint, body) if self.kv is not None else NO_PROMPT

    def pick(self, query: PickQuery, now: float) -> LocalTicket | NoRoute:
        """A worker for the request (the router's rules), counted there (rule 1)."""
        outcome = self.router.pick_class(
            query.model,
            now,
            query.priority,
            query.tenant,
            query.exclude,
            exempt=query.exempt,
            prompt=query.prompt,
            retry=query.retry,
        )
        if isinstance(outcome, AllBusy):
            marked = self.fleet.every_worker_marked(query.model)
            return NoRoute(RejectionKind.OVERLOADED, "marked" if marked else "busy")
        if isinstance(outcome, NoWorkers):
            return NoRoute(RejectionKind.UNAVAILABLE, "no_workers")
        if isinstance(outcome, UnknownModel):
            return NoRoute(None, "")
        return LocalTicket(self, outcome.worker_id, outcome.kv, query, now)


class LocalTicket:
    """A request counted in a :class:`LocalPicture` (rules at the top of the module)."""

    __slots__ = ("_charge", "_choice", "_pending", "_picture", "_priority", "_prompt", "worker_id")

    def __init__(
        self,
        picture: LocalPicture,
        worker_id: str,
        choice: KvChoice | None,
        query: PickQuery,
        now: float,
    ) -> None:
        self._picture = picture
        self.worker_id = worker_id
        self._choice = choice
        self._prompt = query.prompt
        self._priority = query.priority
        fleet = picture.fleet
        self._charge: InFlight | None = None
        kv = picture.kv
        if kv is not None and choice is not None:
            kv.sent(choice, now)
            if query.prompt.tokens:
                self._charge = fleet.request_sent(
                    worker_id, len(query.prompt.tokens), choice.dp_rank, choice.names
                )
        fleet.request_pending(worker_id, now, query.priority)
        self._pending = True

    @property
    def dp_rank(self) -> int | None:
        """The rank the ``kv`` router chose (``None`` in the other modes)."""
        return self._choice.dp_rank if self._choice is not None else None

    def _answered(self, now: float) -> None:
        if self._pending:
            self._pending = False
            self._picture.fleet.request_answered(self.worker_id, now, self._priority)

    def _drop_charge(self) -> None:
        # Rule 4: never started, so no report counted it.
        charge = self._charge
        if charge is not None:
            self._charge = None
            self._picture.fleet.request_finished(self.worker_id, charge, held=False)

    def started(self, prompt_tokens: int, label: str, now: float) -> None:
        """Rule 2."""
        self._answered(now)
        picture = self._picture
        kv, choice = picture.kv, self._choice
        if kv is not None and choice is not None:
            kv.started(label, choice, self._prompt)
        if self._charge is None:
            self._charge = picture.fleet.request_sent(self.worker_id, prompt_tokens, self.dp_rank)
        else:
            picture.fleet.request_started(self.worker_id, self._charge, prompt_tokens)

    def output(self, tokens: int) -> None:
        """Rule 3."""
        charge = self._charge
        if charge is not None and tokens:
            self._picture.fleet.request_output(self.worker_id, charge, tokens)

    def finished(self, final: wire.End | wire.Failed | None) -> None:
        """Rule 3."""
        charge = self._charge
        if charge is not None:
            self._charge = None
            self._picture.fleet.request_finished(self.worker_id, charge, final)

    def refused(
        self,
        reason: wire.RejectReason,
        priority: int,
        tenant: str,
        queue_bound: int | None,
        now: float,
    ) -> RejectionKind:
        """Rule 4."""
        self._answered(now)
        self._drop_charge()
        return self._picture.router.on_rejected(
            self.worker_id, reason, now, priority, tenant, queue_bound
        )

    def failed(self, now: float) -> None:
        """Rule 4."""
        self._answered(now)
        self._drop_charge()

    def unsent(self, now: float) -> None:
        """Rule 4."""
        self._answered(now)
        self._drop_charge()

    def abandon(self, now: float) -> None:
        """The request's end went unheard (its HTTP process is gone): closed as held when the
        worker had started it, as never started otherwise."""
        if self._pending:
            self.unsent(now)
        else:
            self.finished(None)
