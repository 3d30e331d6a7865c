"""What this frontend sent a worker and still holds there, per data-parallel rank (pure).

The "sequences" half of routing: the worker's reports say what it runs, but only after its next
event; between two events the router counts what it sent itself, so that the next pick sees it.
This module is the only writer of that count. Per worker, a :class:`Sequences` keeps one
:class:`RankSequences` per rank and the :class:`InFlight` handle of every request charged there.

Rules:

1. A charge. A request sent to a rank is charged with its prompt: its prompt tokens as prefill
   (until its first output) and the blocks they fill. A block the router named (the ``kv`` mode's
   chained block names) counts once however many requests in flight on the rank hold it, as the
   worker's prefix cache shares it; a block without a name (a partial last block, the output,
   a prompt the router did not name) counts for its request alone.
2. The rank. The rank the router chose, when it chose one the worker has; otherwise the rank
   with the fewest charged blocks (ties: the lowest), as a worker that spreads its requests
   would place it.
3. Moves. The worker's ``Started`` brings the charge to the worker's count of the prompt
   (:meth:`Sequences.started`); the first output ends its prefill and, with
   ``track_output_blocks``, every output token grows its blocks (:meth:`Sequences.output`).
4. The end. :meth:`Sequences.finished` takes everything the charge added off the rank, once:
   a second call, or a call after the worker was forgotten (:meth:`Sequences.forget`), does
   nothing. Every method returns the rank it changed, or ``None``, so the fleet re-judges only
   that rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Final

__all__ = ["InFlight", "RankSequences", "Sequences", "blocks_of"]

_NO_NAMES: Final[Sequence[int]] = ()


def blocks_of(tokens: int, block_size: int) -> int:
    """KV blocks holding ``tokens`` tokens (a block size <= 0 counts as 1)."""
    return -(-tokens // max(1, block_size))


class InFlight:
    """The charge of one request sent to a worker (a handle, opaque to callers)."""

    __slots__ = (
        "anonymous",
        "blocks",
        "finished",
        "first_output_seq",
        "names",
        "output_tokens",
        "prefill_tokens",
        "prompt_tokens",
        "rank",
        "sent_seq",
    )

    def __init__(
        self,
        rank: int,
        prompt_tokens: int,
        blocks: int,
        sent_seq: int,
        names: Sequence[int] = _NO_NAMES,
    ) -> None:
        self.rank = rank
        #: The names of its prompt's full blocks (none when the router did not name them), and
        #: how many of its :attr:`blocks` are charged without a name.
        self.names = names
        self.anonymous = 0
        #: The ``seq`` of the rank's report when the request was sent, and when its first
        #: output arrived (``None`` before): the window of a worker that names none.
        self.sent_seq = sent_seq
        self.first_output_seq: int | None = None
        self.prompt_tokens = prompt_tokens
        self.output_tokens = 0
        self.blocks = blocks
        #: Prompt tokens still charged as prefill (0 once output arrived).
        self.prefill_tokens = prompt_tokens
        self.finished = False


class RankSequences:
    """What the requests in flight on one rank hold there (read-only outside this module)."""

    __slots__ = ("blocks", "names", "prefill")

    def __init__(self) -> None:
        #: Blocks charged here: every named block once, plus the blocks without a name.
        self.blocks = 0
        #: The named blocks, each with the number of requests in flight holding it.
        self.names: dict[int, int] = {}
        #: Prompt tokens of requests that have not produced output yet.
        self.prefill = 0

    def held_run(self, names: Sequence[int]) -> int:
        """How many of ``names``, from the first, requests in flight here already hold (a
        chained name stands for its whole prefix, so the run stops at the first one missing)."""
        held = self.names
        if not names or names[0] not in held:
            return 0  # the common case, one lookup
        return len(list(itertools.takewhile(held.__contains__, names)))

    def _hold(self, names: Sequence[int]) -> None:
        held = self.names
        for name in names:
            count = held.get(name, 0)
            if not count:
                self.blocks += 1
            held[name] = count + 1

    def _release(self, names: Sequence[int]) -> None:
        held = self.names
        for name in names:
            count = held.get(name, 0)
            if count > 1:
                held[name] = count - 1
            elif count:
                del held[name]
                self.blocks -= 1

    def _charge_anonymous(self, in_flight: InFlight) -> None:
        # Bring what the request charges here without a name to its blocks less its names.
        anonymous = max(0, in_flight.blocks - len(in_flight.names))
        self.blocks += anonymous - in_flight.anonymous
        in_flight.anonymous = anonymous


class Sequences:
    """The requests this frontend has in flight on one worker (rules at the top of the module).

    Args:
        ranks: the worker's data-parallel ranks (at least 1).
        block_size: the worker's KV block size.
        track_output_blocks: output tokens grow a request's blocks (rule 3).
    """

    __slots__ = ("_block_size", "_charges", "_track_output", "ranks")

    def __init__(self, ranks: int, block_size: int, track_output_blocks: bool) -> None:
        self.ranks = [RankSequences() for _ in range(max(1, ranks))]
        self._block_size = block_size
        self._track_output = track_output_blocks
        self._charges: set[InFlight] = set()

    def __len__(self) -> int:
        """Requests charged and not finished."""
        return len(self._charges)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(self._charges)

    def rank_for(self, dp_rank: int | None) -> int:
        """The rank a request goes on (rule 2): ``dp_rank`` when the worker has it, else the
        rank with the fewest charged blocks (ties: the lowest)."""
        ranks = self.ranks
        if dp_rank is not None and 0 <= dp_rank < len(ranks):
            return dp_rank
        return min(range(len(ranks)), key=lambda r: ranks[r].blocks)

    def sent(
        self, rank: int, prompt_tokens: int, report_seq: int, names: Sequence[int] = _NO_NAMES
    ) -> InFlight:
        """Charge a request sent to the worker's rank ``rank`` (from :meth:`rank_for`; rule 1).

        Args:
            rank: the rank.
            prompt_tokens: its prompt length in tokens (an estimate is fine).
            report_seq: the ``seq`` of the rank's newest report (the release window's start).
            names: the names of its prompt's full blocks, when the router named them.
        """
        prompt_tokens = max(0, prompt_tokens)
        blocks = blocks_of(prompt_tokens, self._block_size)
        in_flight = InFlight(rank, prompt_tokens, blocks, report_seq, names[:blocks])
        self._charges.add(in_flight)
        held = self.ranks[rank]
        held._hold(in_flight.names)
        held._charge_anonymous(in_flight)
        held.prefill += prompt_tokens
        return in_flight

    def _live(self, in_flight: InFlight) -> RankSequences | None:
        if in_flight.finished or in_flight not in self._charges:
            return None
        return self.ranks[in_flight.rank]

    def started(self, in_flight: InFlight, prompt_tokens: int) -> int | None:
        """The worker started the request and counted ``prompt_tokens`` (0: it did not say, the
        estimate stays): the charge takes that count (rule 3). Returns the rank changed."""
        rank = self._live(in_flight)
        if rank is None or prompt_tokens <= 0 or prompt_tokens == in_flight.prompt_tokens:
            return None
        if in_flight.prefill_tokens:
            rank.prefill += prompt_tokens - in_flight.prefill_tokens
            in_flight.prefill_tokens = prompt_tokens
        in_flight.prompt_tokens = prompt_tokens
        output = in_flight.output_tokens if self._track_output else 0
        in_flight.blocks = blocks_of(prompt_tokens + output, self._block_size)
        rank._charge_anonymous(in_flight)
        return in_flight.rank

    def output(self, in_flight: InFlight, tokens: int, report_seq: int) -> int | None:
        """``tokens`` generated since the last call (0 is fine: prefill is over); rule 3.

        Args:
            in_flight: the request's charge.
            tokens: tokens generated since the last call.
            report_seq: the ``seq`` of the rank's newest report (the first output's, once).

        Returns:
            The rank whose figures changed, or ``None`` (most chunks change nothing).
        """
        rank = self._live(in_flight)
        if rank is None:
            return None
        if in_flight.first_output_seq is None:
            in_flight.first_output_seq = report_seq
        in_flight.output_tokens += max(0, tokens)
        changed = in_flight.prefill_tokens > 0
        rank.prefill -= in_flight.prefill_tokens
        in_flight.prefill_tokens = 0
        if self._track_output:
            blocks = blocks_of(in_flight.prompt_tokens + in_flight.output_tokens, self._block_size)
            if blocks != in_flight.blocks:
                in_flight.blocks = blocks
                rank._charge_anonymous(in_flight)
                changed = True
        return in_flight.rank if changed else None

    def finished(self, in_flight: InFlight) -> int | None:
        """The request left the worker (rule 4): its charge comes off, once. Returns the rank."""
        rank = self._live(in_flight)
        if rank is None:
            return None
        in_flight.finished = True
        self._charges.discard(in_flight)
        rank.blocks -= in_flight.anonymous
        in_flight.anonymous = 0
        rank._release(in_flight.names)
        rank.prefill -= in_flight.prefill_tokens
        return in_flight.rank

    def forget(self) -> None:
        """The worker is gone: every charge ends here (their later calls do nothing)."""
        for in_flight in self._charges:
            in_flight.finished = True
        self._charges.clear()
