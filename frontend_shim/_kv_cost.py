"""The ``kv`` router's choice among free workers: the cost of each free rank (pure, no I/O).

The router (:mod:`frontend_shim._router`) has already applied everything that decides *whether* a
worker may take a request (busy thresholds, overload marks, classes, the frontend queue); this
module decides *which* of the free ones, and which of its data-parallel ranks.

Rules:

1. Candidates: every rank of every free worker, except a rank that is busy itself (a worker is
   free while one of its reported ranks is not busy).
2. The cost of a rank, with ``P`` the prefill work in blocks (the prompt's tokens, plus the
   prefill tokens the rank already has in flight, over the rank's block size: an idle rank's
   ``P`` is the prompt's length in blocks), ``C`` the number of the prompt's first blocks the
   rank holds (:meth:`~frontend_shim._kv_index.KvIndex.depth`: the worker's cache as its
   events tell, and the router's own recent decisions) and ``D`` the rank's active blocks (the
   larger of what the worker reports and what this router has sent it, a block that several of
   its requests in flight there share counted once)::

       cost = prefill_load_scale * max(0, P - credit * C) + D - A

   ``A`` is the number of the prompt's first blocks that requests this router has in flight on
   the rank already hold (:meth:`~frontend_shim._sequences.RankSequences.held_run`): they are
   among ``D`` and the worker shares them, so sending this prompt there adds only its other
   blocks. ``D - A`` is thus the rank's active blocks once this request runs there, less the
   prompt's length (the same for every rank): Dynamo's projected decode blocks. Under load it
   keeps a conversation's next turn, queued behind the last, on the rank that holds both.

3. Temperature 0: the lowest cost wins; among equal costs the worker of the lower
   :attr:`~frontend_shim._free_sets.WorkerLoad.load_cost` (which also weighs a worker's
   effective limit under a TTFT objective), then the first in the order given, which the router
   rotates from pick to pick, so ties rotate. Temperature ``T > 0``: costs are normalised
   to ``x = (cost - min) / (max - min)`` and a rank is drawn with probability proportional to
   ``exp(-x / T)`` (all equal: uniformly).
4. A prompt that could not be read as token ids (the worker will judge it) counts 0 blocks: the
   choice is then by load alone, as it is for embeddings.
5. Only a prompt's first :data:`MAX_PROMPT_BLOCKS` blocks are named and matched (``C`` counts
   at most those), so that one huge prompt costs the frontend a bounded hash; ``P`` counts all
   its tokens.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Final

from frontend_shim._free_sets import WorkerLoad
from frontend_shim._kv_index import KvIndex, RankBlocks
from shim_common.prefix import block_names

__all__ = [
    "NamedPrompt",
    "DEFAULT_WEIGHTS",
    "MAX_PROMPT_BLOCKS",
    "NO_PROMPT",
    "CostWeights",
    "KvChoice",
    "KvScorer",
    "Prompt",
    "choose",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostWeights:
    """The cost rule's knobs (docs/configuration.md, section "Cache-aware routing")."""

    #: ``--router-kv-overlap-score-credit``: what a cached prompt block is worth (0: ignore).
    credit: float = 1.0
    #: ``--router-prefill-load-scale``: weight of the uncached prompt blocks against the decode
    #: blocks.
    prefill_load_scale: float = 1.0
    #: ``--router-temperature``: 0, the lowest cost wins; > 0, a softmax draw.
    temperature: float = 0.0

    def __post_init__(self) -> None:
        for name in ("credit", "prefill_load_scale", "temperature"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite value >= 0, got {value}")


DEFAULT_WEIGHTS: Final = CostWeights()
#: The most blocks of one prompt named and matched (rule 5): 131,072 tokens at 16 a block.
MAX_PROMPT_BLOCKS: Final = 8192


class Prompt:
    """One request's prompt as token ids, and its block names for each block size asked.

    Args:
        tokens: the prompt's token ids (empty: unknown, rule 4).
    """

    __slots__ = ("_names", "tokens")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens
        self._names: dict[int, list[int]] = {}

    def names(self, block_size: int) -> list[int]:
        """The names of the prompt's full blocks of ``block_size`` tokens (computed once)."""
        names = self._names.get(block_size)
        if names is None:
            size = max(1, block_size)
            names = (
                block_names(self.tokens[: MAX_PROMPT_BLOCKS * size], size) if self.tokens else []
            )
            self._names[block_size] = names
        return names


class NamedPrompt(Prompt):
    """A prompt known by its length and the names of its blocks, not by its tokens: what a
    process that tokenised it sends to the one that routes it. A block size it was not named
    for has no names (no cached prefix can be credited there)."""

    __slots__ = ()

    def __init__(self, length: int, names: Mapping[int, Sequence[int]] | None) -> None:
        super().__init__(range(length))
        self._names = {size: list(known) for size, known in (names or {}).items()}

    def names(self, block_size: int) -> list[int]:
        """The names given for ``block_size``, or none."""
        return self._names.get(block_size, [])


@dataclasses.dataclass(frozen=True, slots=True)
class KvChoice:
    """The rank chosen for a request, and what the choice assumed."""

    worker: WorkerLoad
    dp_rank: int
    #: The prompt's first blocks the rank holds (rule 2's ``C``).
    cached_blocks: int
    #: The names of the prompt's full blocks at the worker's block size.
    names: list[int]
    cost: float


def choose(
    candidates: Iterable[WorkerLoad],
    prompt: Prompt,
    index: KvIndex,
    now: float,
    weights: CostWeights = DEFAULT_WEIGHTS,
    rng: random.Random | None = None,
) -> KvChoice | None:
    """The rank of least cost among ``candidates`` (rules 1-3), ``None`` when none has one.

    Args:
        candidates: free workers, in the order ties are broken in.
        prompt: the request's prompt.
        index: who holds which blocks.
        now: current time (guesses expire).
        weights: the cost rule's knobs.
        rng: the source of the softmax draw (needed only with a temperature).
    """
    scale = weights.prefill_load_scale
    credit = weights.credit
    sampled = weights.temperature > 0
    tokens = len(prompt.tokens)
    kept_of = index.worker
    best: tuple[WorkerLoad, int, int, list[int]] | None = None
    best_cost = math.inf
    best_load = math.inf
    scored: list[tuple[float, WorkerLoad, int, int, list[int]]] = []
    # Per block size (the same for every worker of a model, as a rule): the names, the first
    # name, and the prefill cost of the prompt itself. The loop below runs once per free rank:
    # it is kept to a few attribute reads for a rank that holds nothing of the prompt (the
    # index names the ranks that may hold its first block: rule 7 of frontend_shim._kv_index).
    block_size = -1
    names: list[int] = []
    holders: Collection[RankBlocks] = ()
    per_token = 0.0
    for worker in candidates:
        config = worker.config
        if config.block_size != block_size:
            block_size = config.block_size
            names = prompt.names(block_size)
            holders = index.holders(names[0], now) if names else ()
            per_token = scale / max(1, block_size)
        kept = kept_of(config.worker_id) if holders else None
        kept_ranks = kept.ranks if kept is not None else None
        for rank_index, rank in enumerate(worker.ranks):
            if rank.busy:
                continue
            cached = 0
            decode = rank.effective_blocks
            own = rank.own
            if own.names:
                decode -= own.held_run(names)
            cost = per_token * (tokens + rank.effective_prefill) + decode
            if kept_ranks is not None:
                held = kept_ranks[rank_index]
                if held in holders:
                    cached = held.depth(names, now)
                    prefill = (tokens + rank.effective_prefill) / max(1, block_size)
                    cost = scale * max(0.0, prefill - credit * cached) + decode
            if sampled:
                scored.append((cost, worker, rank_index, cached, names))
            elif cost < best_cost or (cost == best_cost and worker.load_cost < best_load):
                best_cost = cost
                best_load = worker.load_cost
                best = (worker, rank_index, cached, names)
    if sampled:
        return _draw(scored, weights.temperature, rng or random.Random())
    if best is None:
        return None
    worker, rank_index, cached, names = best
    return KvChoice(worker, rank_index, cached, names, best_cost)


def _draw(
    scored: list[tuple[float, WorkerLoad, int, int, list[int]]],
    temperature: float,
    rng: random.Random,
) -> KvChoice | None:
    if not scored:
        return None
    low = min(entry[0] for entry in scored)
    high = max(entry[0] for entry in scored)
    spread = high - low
    if spread > 0:
        weights = [math.exp(-(entry[0] - low) / spread / temperature) for entry in scored]
        cost, worker, rank_index, cached, names = rng.choices(scored, weights)[0]
    else:
        cost, worker, rank_index, cached, names = rng.choice(scored)
    return KvChoice(worker, rank_index, cached, names, cost)


#: The prompt of a request that has none to score (embeddings; rule 4).
NO_PROMPT: Final = Prompt(())


class KvScorer:
    """The ``kv`` router's scorer: :func:`choose` over one index with one set of knobs.

    Args:
        index: who holds which blocks (shared with the links that feed it).
        weights: the cost rule's knobs.
        rng: the source of the softmax draw.
    """

    def __init__(
        self,
        index: KvIndex,
        weights: CostWeights = DEFAULT_WEIGHTS,
        rng: random.Random | None = None,
    ) -> None:
        self.index = index
        self.weights = weights
        self._rng = rng or random.Random()

    def choose(
        self, candidates: Iterable[WorkerLoad], prompt: Prompt, now: float
    ) -> KvChoice | None:
        """:func:`choose` with this scorer's index, knobs and random source."""
        return choose(candidates, prompt, self.index, now, self.weights, self._rng)
