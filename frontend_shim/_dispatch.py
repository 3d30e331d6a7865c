"""One completion request's life in the frontend, from its first pick to its end (pure).

A :class:`Dispatch` is the frontend's side of one request, as the gate's ``decide`` is the
worker's: it takes events and returns actions, and keeps every book the request opens. The Trio
handler (:mod:`frontend_shim._api`) only waits, talks to the worker's link and moves bytes::

    action = dispatch.start()
    loop:
        Pick(query)   -> dispatch.picked(picture.pick(query, now), now)
        Send(worker)  -> open the request on the worker's link (or dispatch.unreachable(now)),
                         then dispatch.first(reply, now) with the worker's first reply
        Serve(wait)   -> answer from the stream; dispatch.output / written / ended / completed
        Answer(...)   -> the overload, unavailable or not-found answer
        Fail(failed)  -> the worker's failure, as an HTTP error
    finally: dispatch.close(now)

What the request holds at a worker is a :class:`~frontend_shim._picture.Ticket`, handed out by
the picture that picked the worker (the pick and the charge are one step: the next pick, in this
task or another, already sees the request). Its rules are in :mod:`frontend_shim._picture`.

States::

    PICKING --picked: a ticket--------------------------------> SENT
    PICKING --picked: no worker (busy, none, unknown)---------> DONE (Answer)
    SENT ----first: Started ----------------------------------> SERVING (Serve)
    SENT ----first: Rejected / Failed(unavailable), or unreachable
                  --> PICKING (Pick) while the attempt may migrate, else DONE (Answer)
    SENT ----first: any other Failed -------------------------> DONE (Fail)
    SERVING --ended (End / Failed) ---------------------------> DONE
    any -----close (the answer went out, the client left, an exception) --> DONE

Rules:

1. One ticket at a time. A request holds at most one ticket; it is taken at the pick and
   closed exactly once, on every path: by the worker's refusal or a failure before the start
   (never held: nothing of it is in the worker's reports), by the worker's final frame (held:
   the frame names the events that still count it), by :meth:`Dispatch.close` otherwise (the
   client left, the handler raised, a worker that never answered). A closed ticket is dropped,
   so no path can close it twice; ``tests/frontend_shim/test_dispatch.py`` checks both halves
   over random orders of events.
2. The attempt. A refusal (``Rejected``, a ``Failed(unavailable)`` before the start, or a worker
   whose link went away between the pick and the send) marks what it proves through the
   ticket (:mod:`frontend_shim._router` rule 4) and adds the worker to those this request will
   not be sent to again. Another pick follows while the migration limit allows and the refusal
   can be placed; a worker whose link went away was never reached, so trying elsewhere costs no
   migration (at most once per worker). Otherwise the answer: 529 for ``Server overloaded:``,
   503 for ``Server unavailable:`` and for a refusal it cannot place (``other``), and 503
   ``no_workers`` when a worker went away before the request reached it and no other worker
   can take it (nothing drains there: the worker is gone).
3. Serving. After ``Started`` only the worker's stream decides the answer: each chunk moves the
   ticket's charge (its first ends the prompt's prefill), the time to first token is observed
   when the first output has been written to the client, the duration when the answer went out
   in full, and the worker's final frame closes the ticket before the answer's last bytes are
   written, so a client that sends its next request on the last byte finds the worker free.
4. Time is an argument: every event takes ``now`` from the caller.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from frontend_shim._accounting import Exchange
from frontend_shim._metrics import FrontendMetrics
from frontend_shim._picture import NoRoute, PickQuery, Ticket
from frontend_shim._router import RejectionKind
from shim_common import wire

__all__ = [
    "Action",
    "Answer",
    "Dispatch",
    "Fail",
    "Pick",
    "Send",
    "Serve",
]


# ----------------------------------------------------------------------------- actions


@dataclasses.dataclass(frozen=True, slots=True)
class Pick:
    """Ask the picture for a worker (:meth:`~frontend_shim._picture.Picture.pick`)."""

    query: PickQuery


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    """Open the request on this worker's link, at this rank (``None``: the worker's choice)."""

    worker_id: str
    dp_rank: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class Serve:
    """The worker started the request: answer from its stream."""

    queue_wait_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """Answer without a worker's output: an overload (529), unavailable (503) or unknown model
    (404) answer, with the reason for ``x-dynamo-reject-reason``."""

    kind: RejectionKind | None
    reason: str

    @property
    def unknown_model(self) -> bool:
        """The answer is the 404 of a model no worker ever announced."""
        return self.kind is None


@dataclasses.dataclass(frozen=True, slots=True)
class Fail:
    """The worker failed the request before it started: answer its failure."""

    failed: wire.Failed


Action = Pick | Send | Serve | Answer | Fail

_UNKNOWN_MODEL: Final = Answer(None, "")
_NO_WORKERS: Final = Answer(RejectionKind.UNAVAILABLE, "no_workers")


# ----------------------------------------------------------------------------- the machine


class Dispatch:
    """One request's life in the frontend (rules at the top of the module).

    Args:
        query: what the picture is asked for each pick (the request's model, class and prompt);
            its ``exclude`` grows with every worker that refused the request.
        migration_limit: times a refused request may be tried on another worker.
        exchange: the request's counters' book (its status is noted on it).
        metrics: where the time to first token and the duration are observed.
    """

    __slots__ = (
        "_awaiting_output",
        "_first_unwritten",
        "_metrics",
        "_migration_limit",
        "_migrations",
        "_query",
        "_started",
        "_ticket",
        "_unreachable",
        "exchange",
    )

    def __init__(
        self,
        query: PickQuery,
        migration_limit: int,
        exchange: Exchange,
        metrics: FrontendMetrics,
    ) -> None:
        self._query = query
        self._migration_limit = migration_limit
        self._migrations = 0
        self._unreachable = 0
        self.exchange = exchange
        self._metrics = metrics
        self._ticket: Ticket | None = None
        #: The worker started the request (the ticket, while held, is closed as held).
        self._started = False
        #: Started, and no output arrived yet; then output arrived but none was written yet
        #: (the time to first token is observed at the first write after it).
        self._awaiting_output = False
        self._first_unwritten = False

    @property
    def query(self) -> PickQuery:
        """What each pick is asked (the request's model, class, prompt and exclusions)."""
        return self._query

    # ------------------------------------------------------------------ routing

    def start(self) -> Action:
        """The first action: a pick."""
        return Pick(self._query)

    def picked(self, pick: Ticket | NoRoute, now: float) -> Action:
        """What the picture answered the last :class:`Pick`."""
        assert self._ticket is None, "a pick while a ticket is held"
        if isinstance(pick, NoRoute):
            if pick.kind is None:
                return _UNKNOWN_MODEL
            if self._unreachable:
                return _NO_WORKERS  # rule 2: what it was sent to went away, nothing else is free
            return Answer(pick.kind, pick.reason)
        self._ticket = pick
        return Send(pick.worker_id, pick.dp_rank)

    def unreachable(self, now: float) -> Action:
        """The worker of the last :class:`Send` has no link any more (it went away after the
        pick): the request never reached it (rule 2)."""
        ticket = self._take_ticket()
        ticket.unsent(now)
        self._query.exclude.add(ticket.worker_id)
        self._unreachable += 1
        return Pick(self._query)

    def first(self, reply: wire.Rejected | wire.Started | wire.Failed, now: float) -> Action:
        """The worker's first reply to the last :class:`Send`."""
        ticket = self._ticket
        assert ticket is not None, "a first reply without a ticket"
        if isinstance(reply, wire.Started):
            ticket.started(reply.prompt_tokens, self.exchange.label, now)
            self._started = self._awaiting_output = True
            return Serve(reply.queue_wait_ms)
        queue_bound: int | None = None
        if isinstance(reply, wire.Rejected):
            reason = wire.RejectReason.parse(reply.reason)
            queue_bound = reply.queue_bound
        elif reply.kind == "unavailable":
            reason = wire.RejectReason.OTHER_UNAVAILABLE
        else:
            self._take_ticket().failed(now)
            return Fail(reply)
        self._take_ticket()
        query = self._query
        kind = ticket.refused(reason, query.priority, query.tenant, queue_bound, now)
        query.exclude.add(ticket.worker_id)
        self._migrations += 1
        if kind is not RejectionKind.OTHER and self._migrations <= self._migration_limit:
            return Pick(query)
        if kind is RejectionKind.OVERLOADED:
            return Answer(kind, reason.key)
        # Going away (``draining``), or a refusal it cannot place (``other``).
        return Answer(RejectionKind.UNAVAILABLE, reason.key)

    # ------------------------------------------------------------------ serving (OutputTally)

    @property
    def status(self) -> int:
        """The status counted for the request (that of its :class:`Exchange`)."""
        return self.exchange.status

    @status.setter
    def status(self, status: int) -> None:
        self.exchange.status = status

    def output(self, reply: wire.Chunk) -> None:
        """One chunk of output arrived from the worker (rule 3)."""
        if self._awaiting_output:
            self._awaiting_output = False
            self._first_unwritten = True
        ticket = self._ticket
        if ticket is not None:
            ticket.output(reply.tokens)

    def written(self, now: float) -> None:
        """The output so far reached the client: the time to first token, at the first call
        after the first output (from the request's arrival at the frontend)."""
        if self._first_unwritten:
            self._first_unwritten = False
            exchange = self.exchange
            self._metrics.observe_ttft(exchange.label, now - exchange.arrival)

    def ended(self, final: wire.End | wire.Failed) -> None:
        """The worker's final frame, once every chunk read before it was counted (rule 3)."""
        ticket = self._ticket
        if ticket is not None:
            self._ticket = None
            ticket.finished(final)

    def completed(self, now: float) -> None:
        """The answer went out in full."""
        exchange = self.exchange
        self._metrics.observe_duration(exchange.label, now - exchange.arrival)

    # ------------------------------------------------------------------ the end

    def close(self, now: float) -> None:
        """The request is over, however it ended: the ticket still held, if any, is closed
        (rule 1). Idempotent."""
        ticket = self._ticket
        if ticket is None:
            return
        self._ticket = None
        if self._started:
            ticket.finished(None)
        else:
            ticket.unsent(now)

    def _take_ticket(self) -> Ticket:
        ticket = self._ticket
        assert ticket is not None
        self._ticket = None
        return ticket
