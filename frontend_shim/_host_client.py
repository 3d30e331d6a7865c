"""An HTTP process's side of its host (``--processes N``): picks, tickets, the host's overview.

The host keeps the picture of the fleet (:mod:`frontend_shim._picker`); an HTTP process asks
it through one :class:`HostClient`:

1. Picks. :meth:`RemotePicture.pick` sends the request's class, the length of its prompt and
   the names of its blocks (tokenised here, in ``kv`` mode, for every block size the host's
   workers use) and the workers not to pick; it waits for the host's answer, a
   :class:`RemoteTicket` or a :class:`~frontend_shim._picture.NoRoute`.
2. A ticket's life goes back one way (:mod:`frontend_shim._host_wire` rule 3): its start, the
   outputs that move its charge (the first, and with ``--router-track-output-blocks`` each one
   that fills a new block), and its close. The start and the outputs wait for the channel's
   next frame (a turn of the loop at most), so a request that finishes within that turn, as a
   short one does, sends them with its close. Each close is counted on the shed board first
   (:mod:`frontend_shim._shed_board` rule 1), before the answer's last bytes are written: until
   the host has taken it in, no process sheds from a head, and the host's "no worker free"
   waits for it (:mod:`frontend_shim._picker` rule 3).
3. What the API answers without a pick (:class:`HostView`): the fast shed from the board; the
   models, the workers connected and the thresholds from the host's last overview.
4. A host that goes away ends the process (its supervisor is gone): the API's asks fail, and
   the process stops.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any, Final

import trio

from frontend_shim import _host_wire as msg
from frontend_shim._host_channel import Channel
from frontend_shim._kv_cost import NO_PROMPT, Prompt
from frontend_shim._picture import NoRoute, PickQuery
from frontend_shim._router import RejectionKind
from frontend_shim._sequences import blocks_of
from frontend_shim._shed_board import ShedBoard
from shim_common import wire
from shim_common.prefix import PromptTokenizer, prompt_token_ids
from shim_common.wire import BusyThresholds

__all__ = ["HostClient", "HostGone", "HostView", "RemotePicture", "RemoteTicket"]

_log = logging.getLogger(__name__)

_KINDS: Final = {0: RejectionKind.OVERLOADED, 1: RejectionKind.UNAVAILABLE, 2: None}
#: Worker ids whose link address a process remembers (one per worker, and those gone lately).
_MAX_KEYS: Final = 65536


class HostGone(Exception):
    """The host's channel ended (rule 4)."""


class HostClient:
    """The process's end of its host channel: asks by id, and the host's news.

    Args:
        channel: the channel to the host.
        board: the shed board the host writes.
        index: this process's slot on the board.
    """

    def __init__(
        self, channel: Channel[msg.FromHost, msg.FromProcess], board: ShedBoard, index: int
    ) -> None:
        self.channel = channel
        channel.before_frame = self._flush_tickets
        self.board = board
        self.index = index
        #: Tickets holding back a start or an output until the next frame (rule 2).
        self._held: list[RemoteTicket] = []
        #: The link address of each worker picked lately, by the id the host knows it by.
        self._keys: dict[str, str] = {}
        self._asks = itertools.count(1)
        self._waiting: dict[int, tuple[trio.Event, list[Any]]] = {}
        self.overview = msg.Overview(models=[], connected=0, thresholds=[])
        self._known: set[str] = set()
        self._collect: Any = None
        self.gone = False

    def hold(self, ticket: RemoteTicket) -> None:
        """``ticket`` holds back news until the next frame (unless it finishes first)."""
        if not self._held:
            self.channel.wake()
        self._held.append(ticket)

    def _flush_tickets(self) -> None:
        held, self._held = self._held, []
        for ticket in held:
            ticket.flush()

    def on_collect(self, collect: Any) -> None:
        """Who answers the host's :class:`~frontend_shim._host_wire.Collect` (the metrics)."""
        self._collect = collect

    async def run(self) -> None:
        """Read the host's messages until its channel ends (then :class:`HostGone`)."""
        try:
            while True:
                self.take(await self.channel.receive())
        except Exception as exc:
            self.gone = True
            for event, _ in self._waiting.values():
                event.set()
            raise HostGone(str(exc)) from exc

    def take(self, messages: list[msg.FromHost]) -> None:
        """Apply what the host sent."""
        for message in messages:
            self._take(message)

    def _take(self, message: msg.FromHost) -> None:
        if isinstance(message, msg.Picked | msg.NotPicked | msg.ThresholdsSet | msg.MetricsText):
            waiter = self._waiting.pop(message.ask, None)
            if waiter is not None:
                waiter[1].append(message)
                waiter[0].set()
        elif isinstance(message, msg.Overview):
            self.overview = message
            self._known = {model for model, _ in message.models}
        elif isinstance(message, msg.Collect) and self._collect is not None:
            self.channel.post(msg.Samples(ask=message.ask, families=self._collect()))

    async def ask(self, make: Any) -> Any:
        """Send ``make(ask_id)`` and wait for the host's answer to it."""
        if self.gone:
            raise HostGone("the host is gone")
        ask = next(self._asks)
        event = trio.Event()
        answer: list[Any] = []
        self._waiting[ask] = (event, answer)
        self.channel.post(make(ask))
        try:
            await event.wait()
        finally:
            self._waiting.pop(ask, None)
        if not answer:
            raise HostGone("the host is gone")
        return answer[0]

    def is_known_model(self, model: str) -> bool:
        return model in self._known

    def key_of(self, worker_id: str) -> str | None:
        """The link address the host gave with its last pick of ``worker_id``."""
        return self._keys.get(worker_id)

    def note_key(self, worker_id: str, key: str) -> None:
        keys = self._keys
        if key and keys.get(worker_id) != key:
            keys.pop(worker_id, None)
            keys[worker_id] = key
            if len(keys) > _MAX_KEYS:
                del keys[next(iter(keys))]  # the least recently changed

    def all_thresholds(self) -> list[tuple[str, BusyThresholds]]:
        """The thresholds in force, as of the host's last overview (a ``ThresholdBook``)."""
        return list(self.overview.thresholds)

    async def set_thresholds(self, model: str, update: BusyThresholds) -> BusyThresholds | None:
        """Set them at the host, which passes them on to every process and worker."""
        answer = await self.ask(lambda ask: msg.SetThresholds(ask=ask, model=model, update=update))
        assert isinstance(answer, msg.ThresholdsSet)
        return answer.thresholds


class RemotePicture:
    """The host's picture, as a process asks it (rule 1).

    Args:
        host: the channel's client.
        tokenizer: the ``kv`` mode's tokeniser; ``None``: prompts are not tokenised.
    """

    def __init__(
        self, host: HostClient, tokenizer: PromptTokenizer | None, track_output_blocks: bool
    ) -> None:
        self._host = host
        self._tokenizer = tokenizer
        self._track_output = track_output_blocks

    def prompt(self, endpoint: wire.Endpoint, body: Mapping[str, object]) -> Prompt:
        """As :meth:`~frontend_shim._picture.LocalPicture.prompt`."""
        if self._tokenizer is None or endpoint == "embeddings":
            return NO_PROMPT
        try:
            return Prompt(prompt_token_ids(endpoint, body, self._tokenizer))
        except ValueError:
            return NO_PROMPT

    async def pick(self, query: PickQuery) -> RemoteTicket | NoRoute:
        """Ask the host for a worker (rule 1)."""
        prompt = query.prompt
        names = None
        if prompt.tokens:
            names = {size: prompt.names(size) for size in self._host.overview.block_sizes}

        def ask(ask_id: int) -> msg.PickAsk:
            return msg.PickAsk(
                ask=ask_id,
                model=query.model,
                priority=query.priority,
                tenant=query.tenant,
                exempt=query.exempt,
                prompt_tokens=len(prompt.tokens),
                names=names,
                exclude=sorted(query.exclude),
                retry=query.retry,
            )

        answer = await self._host.ask(ask)
        if isinstance(answer, msg.NotPicked):
            return NoRoute(_KINDS.get(answer.kind, RejectionKind.UNAVAILABLE), answer.reason)
        self._host.note_key(answer.worker_id, answer.key)
        return RemoteTicket(
            self._host,
            answer.ticket,
            answer.worker_id,
            answer.dp_rank,
            answer.block_size if self._track_output else 0,
        )


class RemoteTicket:
    """A ticket the host handed out (rule 2; the :class:`~frontend_shim._picture.Ticket`
    protocol). Its start and the outputs that move its charge are held back until the channel's
    next frame, so a request that finishes before that sends one message after its pick."""

    __slots__ = (
        "_block_size",
        "_blocks",
        "_held",
        "_host",
        "_number",
        "_output",
        "_prompt_tokens",
        "_start",
        "_unsent_output",
        "dp_rank",
        "worker_id",
    )

    def __init__(
        self,
        host: HostClient,
        number: int,
        worker_id: str,
        dp_rank: int | None,
        output_block_size: int,
    ) -> None:
        self._host = host
        self._number = number
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        #: The worker's block size when output blocks are tracked; 0: they are not.
        self._block_size = output_block_size
        self._output = 0
        #: Output tokens the host has not heard of (sent with the next output it must hear).
        self._unsent_output = 0
        self._prompt_tokens = 0
        self._blocks = 0
        #: A start not sent yet, and whether the host is owed news (held back: rule 2).
        self._start: tuple[int, str] | None = None
        self._held = False

    def _hold(self) -> None:
        if not self._held:
            self._held = True
            self._host.hold(self)

    def flush(self) -> None:
        """Send what was held back (the channel makes a frame)."""
        if not self._held:
            return
        self._held = False
        channel = self._host.channel
        if self._start is not None:
            prompt_tokens, label = self._start
            self._start = None
            channel.post(
                msg.TicketStarted(ticket=self._number, prompt_tokens=prompt_tokens, label=label)
            )
        if self._unsent_output:
            channel.post(msg.TicketOutput(ticket=self._number, tokens=self._unsent_output))
            self._unsent_output = 0

    def started(self, prompt_tokens: int, label: str, now: float) -> None:
        self._prompt_tokens = prompt_tokens
        self._start = (prompt_tokens, label)
        self._hold()

    def output(self, tokens: int) -> None:
        if not tokens:
            return
        first = self._output == 0
        self._output += tokens
        self._unsent_output += tokens
        if self._block_size:
            blocks = blocks_of(self._prompt_tokens + self._output, self._block_size)
            changed = blocks != self._blocks
            self._blocks = blocks
            if first or changed:
                self._hold()
        elif first:
            self._hold()  # only the first output moves the charge (its prefill ends)

    def _close(self, message: msg.FromProcess) -> None:
        host = self._host
        host.board.note_close(host.index)
        host.channel.post(message)

    def finished(self, final: wire.End | wire.Failed | None) -> None:
        owed = self._held
        self._held = False  # what was held goes with the close
        start, self._start = self._start, None
        output = self._unsent_output if owed else 0
        self._close(
            msg.TicketFinished(ticket=self._number, final=final, started=start, output=output)
        )

    def refused(
        self,
        reason: wire.RejectReason,
        priority: int,
        tenant: str,
        queue_bound: int | None,
        now: float,
    ) -> RejectionKind:
        self._close(
            msg.TicketRefused(
                ticket=self._number,
                reason=reason.value,
                priority=priority,
                tenant=tenant,
                queue_bound=queue_bound,
            )
        )
        return reason.kind

    def failed(self, now: float) -> None:
        self._close(msg.TicketFailed(ticket=self._number))

    def unsent(self, now: float) -> None:
        self._close(msg.TicketUnsent(ticket=self._number))


class HostView:
    """What the API reads of the fleet without a pick, in a process (rule 3)."""

    def __init__(self, host: HostClient) -> None:
        self._host = host

    def may_shed_unread(self, now: float) -> bool:
        return self._host.board.verdict().may_shed

    def every_worker_marked(self, model: str | None = None) -> bool:
        return self._host.board.verdict().every_marked

    def slot_share(self) -> float:
        return self._host.board.verdict().slot_share

    def is_known_model(self, model: str) -> bool:
        return self._host.is_known_model(model)

    def models(self) -> list[str]:
        return [model for model, _ in self._host.overview.models]

    def available_count(self, model: str, now: float) -> int:
        models = self._host.overview.models
        return sum(1 for name, available in models if name == model and available)

    @property
    def connected_count(self) -> int:
        return self._host.overview.connected

    def all_thresholds(self) -> list[tuple[str, BusyThresholds]]:
        return list(self._host.overview.thresholds)
