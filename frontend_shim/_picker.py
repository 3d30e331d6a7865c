"""The host process's side of its HTTP processes: one picture of the fleet, asked by all.

With ``--processes N`` the host keeps the only :class:`~frontend_shim._picture.LocalPicture`
of the fleet (it follows every worker's events once) and answers the picks of its N HTTP
processes over their channels (:mod:`frontend_shim._host_channel`, messages in
:mod:`frontend_shim._host_wire`). A request picked by one process is counted in the picture
before the host answers the next pick, whichever process asks: one picture, one writer.

Rules:

1. Books per process. Each ticket the host hands out is kept, by number, in the books of the
   process that asked; that process's messages move and close it
   (:mod:`frontend_shim._picture` rules). A message for a ticket the books do not hold is
   ignored (rule 5 of :mod:`frontend_shim._host_wire`).
2. A process gone (it exited, crashed, or broke the frames): every ticket in its books is
   closed at once, as held when the worker had started its request, as never started
   otherwise; the workers cancel those requests themselves when that process's connections
   drop. Nothing it picked stays counted.
3. No stale "all busy". Before the host answers that no worker is free, it reads what every
   process's channel already holds and takes it in, then picks again; and while a process has
   counted a close on the shed board that has not reached the host yet (it is on its way: the
   process counts a close before it sends it), the answer waits for it, for
   :data:`CLOSE_WAIT` at most. A request's close is counted before its answer's last bytes
   are written, so a client whose next request is asked of any process finds the worker free
   (contract: a finished request is gone at once).
4. The board. After every batch of messages, fleet change and tick, the host writes on the
   shed board (:mod:`frontend_shim._shed_board`) whether a request may be shed unread, and the
   closes it has taken in; and, on a slower tick and when thresholds change, it sends every
   process an :class:`~frontend_shim._host_wire.Overview` when the models, the workers
   connected or the thresholds changed (building it reads every worker).
5. The frontend queue (``--router-queue-threshold``) is the host's: a pick that must wait parks
   here, in a task of its process's, and is answered when the queue releases it (or 529 when
   the queue is full); a busy-exempt request never parks.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Final

import trio

from frontend_shim import _host_wire as msg
from frontend_shim._admin import FleetThresholds
from frontend_shim._host_channel import Channel, ChannelClosed
from frontend_shim._kv_cost import NamedPrompt
from frontend_shim._load import Fleet
from frontend_shim._picture import LocalPicture, LocalTicket, NoRoute, PickQuery
from frontend_shim._router import RejectionKind
from frontend_shim._shed_board import ShedBoard
from frontend_shim._waiting import WaitingRoom
from shim_common import wire
from shim_common.wire import BusyThresholds

__all__ = ["Picker", "ProcessBooks"]

_log = logging.getLogger(__name__)

#: Seconds a "no worker free" answer waits, at most, for closes on their way (rule 3).
CLOSE_WAIT: Final = 0.01

_KIND_CODE: Final = {RejectionKind.OVERLOADED: 0, RejectionKind.UNAVAILABLE: 1, None: 2}


class ProcessBooks:
    """What the host holds for one HTTP process (rule 1)."""

    __slots__ = ("channel", "index", "last_samples", "tickets")

    def __init__(self, index: int, channel: Channel[msg.FromProcess, msg.FromHost]) -> None:
        self.index = index
        self.channel = channel
        self.tickets: dict[int, LocalTicket] = {}
        #: Its metrics as of the last snapshot (rule 2 of frontend_shim._metrics_merge).
        self.last_samples: list[msg.SampleFamily] = []


class Picker:
    """The host's picture, serving its HTTP processes (rules at the top of the module).

    Args:
        picture: the host's picture of the fleet.
        board: the shed board the processes read.
        waiting: the frontend queue (``None``: no ``--router-queue-threshold``).
        thresholds: where the processes' ``/busy_threshold`` changes are made (its ``on_change``
            passes them to the workers).
        key_of: the link address of a worker the fleet knows (the bridge's), told to the
            process with each pick so that it finds the same worker's link.
    """

    def __init__(
        self,
        picture: LocalPicture,
        board: ShedBoard,
        waiting: WaitingRoom | None = None,
        thresholds: FleetThresholds | None = None,
        key_of: Callable[[str], str | None] = lambda _worker_id: None,
    ) -> None:
        self._picture = picture
        self._fleet: Fleet = picture.fleet
        self._board = board
        self._waiting = waiting
        self._thresholds = thresholds if thresholds is not None else FleetThresholds(self._fleet)
        #: The bridge's ``key_of`` (rule 1 of the pick's answer); settable once the bridge is.
        self.key_of = key_of
        #: Told each :class:`~frontend_shim._host_wire.Samples` a process sends, and the
        #: messages that are not the picture's (``Ready``, ``MetricsAsk``): the supervisor's.
        self.on_samples: Callable[[ProcessBooks, msg.Samples], None] = lambda _b, _s: None
        self.on_message: Callable[[ProcessBooks, msg.FromProcess], None] = lambda _b, _m: None
        self._books: dict[int, ProcessBooks] = {}
        self._tickets = itertools.count(1)
        #: Per process slot, the ticket closes taken in (rule 4): those of its process now,
        #: after those its slot counted for the processes before it.
        self._closes: dict[int, int] = {}
        self._published: tuple[bool, bool, float, int] | None = None
        self._overview: msg.Overview | None = None
        self._catching_up = False

    @property
    def processes(self) -> list[ProcessBooks]:
        """The books of every process connected now."""
        return list(self._books.values())

    # ------------------------------------------------------------------ a process's life

    async def serve(self, books: ProcessBooks) -> None:
        """Answer one process until its channel ends (rule 2 then); run it in a task."""
        self._books[books.index] = books
        # Its slot's count so far: its predecessors' closes, all written off or taken in.
        self._closes[books.index] = self._board.closes_of(books.index)
        if self._overview is not None:
            books.channel.post(self._overview)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(books.channel.run_sender)
                while True:
                    try:
                        messages = await books.channel.receive()
                    except ChannelClosed as exc:
                        _log.debug("HTTP process %d: %s", books.index, exc)
                        nursery.cancel_scope.cancel()
                        return
                    self.take_in(books, messages, trio.current_time(), nursery)
                    self.publish_board(trio.current_time())
        finally:
            self.process_gone(books, trio.current_time())

    def process_gone(self, books: ProcessBooks, now: float) -> None:
        """Rule 2; and the closes its slot counted that never reached the host are written
        off, so the board's sums still agree."""
        if self._books.get(books.index) is not books:
            return
        del self._books[books.index]
        for ticket in books.tickets.values():
            ticket.abandon(now)
        books.tickets.clear()
        self._closes[books.index] = self._board.closes_of(books.index)
        self.publish(now)

    # ------------------------------------------------------------------ messages

    def take_in(
        self,
        books: ProcessBooks,
        messages: list[msg.FromProcess],
        now: float,
        nursery: trio.Nursery | None = None,
    ) -> None:
        """Apply what one process sent (rules 1, 3 and 5)."""
        tickets = books.tickets
        for message in messages:
            if isinstance(message, msg.PickAsk):
                self._pick(books, message, now, nursery)
            elif isinstance(message, msg.TicketOutput):
                ticket = tickets.get(message.ticket)
                if ticket is not None:
                    ticket.output(message.tokens)
            elif isinstance(message, msg.TicketStarted):
                ticket = tickets.get(message.ticket)
                if ticket is not None:
                    ticket.started(message.prompt_tokens, message.label, now)
            elif isinstance(message, msg.TicketFinished | msg.TicketRefused):
                self._closes[books.index] += 1
                ticket = tickets.pop(message.ticket, None)
                if ticket is None:
                    continue
                if isinstance(message, msg.TicketFinished):
                    if message.started is not None:
                        ticket.started(message.started[0], message.started[1], now)
                    if message.output:
                        ticket.output(message.output)
                    ticket.finished(message.final)
                else:
                    reason = wire.RejectReason.parse(message.reason)
                    bound = message.queue_bound
                    ticket.refused(reason, message.priority, message.tenant, bound, now)
            elif isinstance(message, msg.TicketFailed | msg.TicketUnsent):
                self._closes[books.index] += 1
                ticket = tickets.pop(message.ticket, None)
                if ticket is not None:
                    ticket.unsent(now)
            elif isinstance(message, msg.SetThresholds):
                answer = msg.ThresholdsSet(ask=message.ask, thresholds=self._set(message))
                books.channel.post(answer)
            elif isinstance(message, msg.Samples):
                books.last_samples = message.families
                self.on_samples(books, message)
            else:  # Ready and MetricsAsk: the supervisor's (frontend_shim._processes)
                self.on_message(books, message)

    def _set(self, message: msg.SetThresholds) -> BusyThresholds | None:
        current = self._thresholds.set_now(message.model, message.update)
        self.publish(trio.current_time())
        return current

    def _pick(
        self, books: ProcessBooks, ask: msg.PickAsk, now: float, nursery: trio.Nursery | None
    ) -> None:
        prompt = NamedPrompt(ask.prompt_tokens, ask.names) if ask.prompt_tokens else None
        query = PickQuery(ask.model, ask.priority, ask.tenant, ask.exempt)
        if prompt is not None:
            query.prompt = prompt
        query.exclude.update(ask.exclude)
        query.retry = ask.retry
        waiting = self._waiting
        if (
            waiting is not None
            and nursery is not None
            and not ask.exempt
            and waiting.should_park(ask.model, now)
        ):
            nursery.start_soon(self._parked_pick, books, ask.ask, query, waiting)
            return
        self._answer(books, ask.ask, query, now, nursery)

    async def _parked_pick(
        self, books: ProcessBooks, ask: int, query: PickQuery, waiting: WaitingRoom
    ) -> None:
        if await waiting.wait(query.model):
            self._answer(books, ask, query, trio.current_time())
        else:
            books.channel.post(msg.NotPicked(ask=ask, kind=0, reason="busy"))

    def _answer(
        self,
        books: ProcessBooks,
        ask: int,
        query: PickQuery,
        now: float,
        nursery: trio.Nursery | None = None,
    ) -> None:
        pick = self._picture.pick(query, now)
        overloaded = isinstance(pick, NoRoute) and pick.kind is RejectionKind.OVERLOADED
        if overloaded and self._catch_up(now):
            pick = self._picture.pick(query, now)
            overloaded = isinstance(pick, NoRoute) and pick.kind is RejectionKind.OVERLOADED
        if overloaded and nursery is not None and self._closes_on_the_way():
            # A close is still in a process's hands (counted, not yet written): the answer
            # waits for it, a few milliseconds at most (rule 3).
            nursery.start_soon(self._pick_after_closes, books, ask, query)
            return
        self._reply(books, ask, pick)

    async def _pick_after_closes(self, books: ProcessBooks, ask: int, query: PickQuery) -> None:
        with trio.move_on_after(CLOSE_WAIT):
            while self._closes_on_the_way():
                await trio.sleep(CLOSE_WAIT / 8)
                self._catch_up(trio.current_time())
        self._reply(books, ask, self._picture.pick(query, trio.current_time()))

    def _reply(self, books: ProcessBooks, ask: int, pick: LocalTicket | NoRoute) -> None:
        if isinstance(pick, NoRoute):
            code = _KIND_CODE[pick.kind]
            books.channel.post(msg.NotPicked(ask=ask, kind=code, reason=pick.reason))
            return
        number = next(self._tickets)
        books.tickets[number] = pick
        worker = self._fleet.worker(pick.worker_id)
        books.channel.post(
            msg.Picked(
                ask=ask,
                ticket=number,
                worker_id=pick.worker_id,
                dp_rank=pick.dp_rank,
                block_size=worker.config.block_size if worker is not None else 16,
                key=self.key_of(pick.worker_id) or "",
            )
        )

    def _catch_up(self, now: float) -> bool:
        """Rule 3: take in what every process's channel holds; whether anything came."""
        if self._catching_up:
            return False
        self._catching_up = True
        took = False
        try:
            for books in list(self._books.values()):
                try:
                    messages = books.channel.catch_up()
                except ChannelClosed:
                    continue  # its serving task finds out and closes its books
                if messages:
                    took = True
                    self.take_in(books, messages, now)
        finally:
            self._catching_up = False
        return took

    # ------------------------------------------------------------------ what processes read

    def publish(self, now: float) -> None:
        """Rule 4: the board, and the overview when it changed (after a fleet change or a
        tick: the overview reads every worker, so not after every message)."""
        self.publish_board(now)
        fleet = self._fleet
        overview = msg.Overview(
            models=[(m, fleet.available_count(m, now) > 0) for m in fleet.models()],
            connected=fleet.connected_count,
            thresholds=fleet.all_thresholds(),
            block_sizes=sorted({worker.config.block_size for worker in fleet.workers()}),
        )
        if overview != self._overview:
            self._overview = overview
            for books in self._books.values():
                books.channel.post(overview)

    def publish_board(self, now: float) -> None:
        """Rule 4's board alone (O(1)): after every batch of a process's messages."""
        fleet = self._fleet
        state = (
            fleet.may_shed_unread(now),
            fleet.every_worker_marked(),
            fleet.slot_share(),
            self._closes_total(),
        )
        if state != self._published:
            self._published = state
            self._board.publish(*state)

    def _closes_total(self) -> int:
        return sum(self._closes.values())

    def _closes_on_the_way(self) -> bool:
        # A process counted a close on its slot that has not reached the host yet (rule 3).
        return sum(
            self._board.closes_of(index) for index in self._books
        ) > sum(self._closes[index] for index in self._books)
