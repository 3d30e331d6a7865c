"""Which data-parallel ranks of which workers hold which KV blocks (pure: no I/O, time passed in).

The ``kv`` router asks one question of this index: how many of a prompt's first blocks does this
rank hold? A block is known by its name (:func:`shim_common.prefix.block_names`), a hash of its
tokens and of the name of the block before it, so one name stands for the whole prefix up to it.

Rules:

1. Hashed chains, not a tree: each rank keeps the *set* of the names it holds (a dict with
   no values: a dict of integers is not tracked by the garbage collector, a set is, and a
   collection that walked 67 million names would stall the frontend for seconds). A prompt's cached
   prefix on a rank is the longest run of the prompt's names, from the first, that the rank holds
   (as the worker's own lookup counts it). Because names are chained, the set needs no parent
   links: a flat set per rank answers the run in one membership test per block, and costs one
   set entry and one integer per block held (docs/decisions.md: the measured comparison with a
   shared radix tree, and the bytes per block at 1,024 workers x 4 ranks x 16,384 blocks).
2. Two layers per rank. *Cached*: what the worker's KV events say it holds. *Predicted*: the
   router's own guesses, the blocks of each prompt it sent to the rank, each believed for a
   time-to-live from when it was sent (a burst of one conversation's turns lands together before
   the worker's events arrive). A block counts as held when either layer holds it. A worker that
   sends KV events has its guesses believed for :data:`EVENTS_PREDICTION_TTL` seconds (the events
   confirm or deny them); one that does not (``--no-router-kv-events``, or an older worker) for
   the router's ``prediction_ttl`` (``--router-ttl-secs``), the only picture there is.
3. Bounded: a rank holds at most ``cap`` names in each layer, where ``cap`` is the worker's
   announced ``kv_total_blocks`` (a cache cannot hold more), and at most
   :data:`MAX_BLOCKS_PER_WORKER` over all of a worker's ranks, whatever its hello claims. Names
   stored past the cap are not kept (counted in :attr:`IndexStats.overflow`); the oldest guess
   gives way to a new one. So a worker with a cache of C blocks costs at most ``2 C`` entries.
4. Event order. A worker numbers its KV events consecutively from 1 across all its ranks. After a
   connect the index expects a :class:`~shim_common.wire.KvSnapshot` first (the subscription
   asks for one). A snapshot replaces the cached layer of every rank and sets the last number
   seen to its ``seq``; an event numbered at or below that is already in it and is skipped. An
   event whose number is not the next one is a gap: it is still applied (the picture stays as
   current as it can), and :meth:`KvIndex.apply` answers ``True``, which asks the link to request
   a fresh snapshot; while one is awaited another gap asks again only after
   :data:`SNAPSHOT_RETRY` seconds.
5. A removal or a clear of a rank also drops the router's guesses of those blocks there: the
   worker's word is the newer one. An event naming a rank the worker does not have is ignored
   and counted (:attr:`IndexStats.invalid`); it loses nothing else.
6. Who may hold a prompt's first block (:meth:`KvIndex.holders`), so that a pick probes the
   ranks that do instead of every rank's set: the index remembers, for at most
   :data:`MAX_FIRST_NAMES` first block names the router has asked about (oldest forgotten first),
   a superset of the ranks that hold it. The first question about a name scans every rank once;
   from then on every way a rank comes to hold that name (stored, snapshot, guessed) adds the
   rank, and a rank that no longer holds it is dropped when the name is next asked about. So the
   answer never misses a holder, and a pick checks each rank it names with
   :meth:`RankBlocks.depth`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Final

from shim_common import wire

__all__ = [
    "DEFAULT_PREDICTION_TTL",
    "EVENTS_PREDICTION_TTL",
    "MAX_BLOCKS_PER_WORKER",
    "MAX_FIRST_NAMES",
    "SNAPSHOT_RETRY",
    "IndexStats",
    "KvIndex",
    "RankBlocks",
    "WorkerBlocks",
]

#: ``--router-ttl-secs``' default: seconds a guess is believed without KV events (Dynamo's 120).
DEFAULT_PREDICTION_TTL: Final = 120.0
#: Seconds a guess is believed on a worker that sends KV events: long enough for a prompt to be
#: admitted, prefilled and reported, short enough that a wrong guess does not linger.
EVENTS_PREDICTION_TTL: Final = 10.0
#: The most block names the index keeps for one worker, over all its ranks and per layer.
MAX_BLOCKS_PER_WORKER: Final = 1 << 20
#: Cache size assumed for a worker that announces ``kv_total_blocks`` 0 (unknown).
DEFAULT_RANK_CAP: Final = 16384
#: Seconds after a snapshot request before another gap asks again (rule 4).
SNAPSHOT_RETRY: Final = 5.0
#: First block names whose holders the index remembers (rule 6).
MAX_FIRST_NAMES: Final = 65536


@dataclasses.dataclass(slots=True)
class IndexStats:
    """Counts of what the index was told (for the docs' figures and for tests)."""

    events: int = 0
    snapshots: int = 0
    gaps: int = 0
    #: Events numbered at or below the last one seen (covered by a snapshot).
    skipped: int = 0
    #: Events naming a rank the worker does not have.
    invalid: int = 0
    #: Block names not kept because a rank's layer was full.
    overflow: int = 0


class RankBlocks:
    """The two layers of one rank (rule 2)."""

    __slots__ = ("cached", "predicted")

    def __init__(self) -> None:
        #: Names the worker's events say this rank holds (keys; rule 1 says why not a set).
        self.cached: dict[int, None] = {}
        #: The router's guesses: name -> time until which it is believed. Insertion-ordered by
        #: that time (a guess made again moves to the end), so the oldest is first.
        self.predicted: dict[int, float] = {}

    def depth(self, names: Sequence[int], now: float) -> int:
        """How many of ``names``, from the first, this rank holds (either layer)."""
        if not names:
            return 0
        cached = self.cached
        predicted = self.predicted
        first = names[0]
        if first not in cached and predicted.get(first, now) <= now:
            return 0  # the common case, one or two lookups
        if not predicted:
            return len(list(itertools.takewhile(cached.__contains__, names)))
        count = 0
        for name in names:
            if name not in cached and predicted.get(name, now) <= now:
                break
            count += 1
        return count


class WorkerBlocks:
    """What the index keeps for one worker."""

    __slots__ = ("asked_at", "awaiting", "cap", "events", "last_seq", "model", "ranks", "ttl")

    def __init__(self, config: wire.RuntimeConfig, *, events: bool, ttl: float, now: float):
        count = max(1, config.data_parallel_size)
        self.model = config.model
        self.ranks = [RankBlocks() for _ in range(count)]
        total = config.kv_total_blocks if config.kv_total_blocks > 0 else DEFAULT_RANK_CAP
        #: Names a rank keeps at most, per layer (rule 3).
        self.cap = max(1, min(total, MAX_BLOCKS_PER_WORKER // count))
        #: The worker sends KV events (rule 2).
        self.events = events
        #: Seconds a guess is believed on this worker.
        self.ttl = ttl
        self.last_seq = 0
        #: A snapshot is expected (after the connect, or asked for after a gap).
        self.awaiting = events
        self.asked_at = now


class KvIndex:
    """Per worker and rank, the block names held (rules at the top of the module).

    Args:
        prediction_ttl: seconds a guess is believed on a worker without KV events
            (``--router-ttl-secs``).
        use_events: the frontend subscribes to KV events (``--router-kv-events``); without, every
            worker is predicted from the router's own decisions.
    """

    def __init__(
        self, *, prediction_ttl: float = DEFAULT_PREDICTION_TTL, use_events: bool = True
    ) -> None:
        if not prediction_ttl > 0:
            raise ValueError(f"prediction_ttl must be > 0, got {prediction_ttl}")
        self.prediction_ttl = prediction_ttl
        self.use_events = use_events
        self.stats = IndexStats()
        self._workers: dict[str, WorkerBlocks] = {}
        #: First block name -> a superset of the ranks holding it (rule 6), oldest first.
        self._first: dict[int, set[RankBlocks]] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def worker(self, worker_id: str) -> WorkerBlocks | None:
        """What the index keeps for a worker, ``None`` when it is not known."""
        return self._workers.get(worker_id)

    def add_worker(self, config: wire.RuntimeConfig, now: float, *, events: bool) -> bool:
        """A worker connected: start its picture empty (its previous one, if any, is dropped).

        Args:
            config: the worker's hello.
            now: current time.
            events: the worker lists :data:`~shim_common.wire.FEATURE_KV_EVENTS`; it is
                subscribed to them when the index uses events.

        Returns:
            Whether to subscribe to the worker's KV events.
        """
        self.remove_worker(config.worker_id)  # its old picture, and its place in rule 6's sets
        subscribe = events and self.use_events
        ttl = EVENTS_PREDICTION_TTL if subscribe else self.prediction_ttl
        ttl = min(ttl, self.prediction_ttl)
        self._workers[config.worker_id] = WorkerBlocks(config, events=subscribe, ttl=ttl, now=now)
        return subscribe

    def remove_worker(self, worker_id: str) -> None:
        """The worker went away: forget everything about it."""
        worker = self._workers.pop(worker_id, None)
        if worker is not None and self._first:
            gone = set(worker.ranks)
            for holders in self._first.values():
                holders -= gone

    # ------------------------------------------------------------------ the worker's events

    def apply(self, worker_id: str, events: Iterable[wire.KvEvent], now: float) -> bool:
        """Apply a worker's KV events, in order (rules 4 and 5).

        Returns:
            ``True`` when the link should ask the worker for a fresh snapshot.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        stats = self.stats
        ask = False
        for event in events:
            if isinstance(event, wire.KvSnapshot):
                self._replace(worker, event)
                continue
            stats.events += 1
            seq = event.seq
            if seq <= worker.last_seq:
                stats.skipped += 1
                continue
            if seq != worker.last_seq + 1:
                stats.gaps += 1
                if not worker.awaiting or now - worker.asked_at >= SNAPSHOT_RETRY:
                    ask = True
                    worker.awaiting = True
                    worker.asked_at = now
            worker.last_seq = seq
            if not 0 <= event.dp_rank < len(worker.ranks):
                stats.invalid += 1
                continue
            rank = worker.ranks[event.dp_rank]
            if isinstance(event, wire.KvStored):
                self._store(rank, event.blocks, worker.cap)
                self._note(rank, event.blocks)
            elif isinstance(event, wire.KvRemoved):
                cached = rank.cached
                predicted = rank.predicted
                for name in event.blocks:
                    cached.pop(name, None)
                    predicted.pop(name, None)
            else:
                rank.cached.clear()
                rank.predicted.clear()
        return ask

    def _store(self, rank: RankBlocks, names: Iterable[int], cap: int) -> None:
        cached = rank.cached
        room = cap - len(cached)
        if room <= 0:
            self.stats.overflow += sum(1 for name in names if name not in cached)
            return
        for name in names:
            if name in cached:
                continue
            if room <= 0:
                self.stats.overflow += 1
                continue
            cached[name] = None
            room -= 1

    def _replace(self, worker: WorkerBlocks, snapshot: wire.KvSnapshot) -> None:
        self.stats.snapshots += 1
        if len(snapshot.ranks) > len(worker.ranks):
            self.stats.invalid += 1
        for index, rank in enumerate(worker.ranks):
            rank.cached = {}
            if index < len(snapshot.ranks):
                self._store(rank, snapshot.ranks[index], worker.cap)
                self._note(rank, snapshot.ranks[index])
        worker.last_seq = snapshot.seq
        worker.awaiting = False

    # ------------------------------------------------------------------ the router's guesses

    def predict(self, worker_id: str, dp_rank: int, names: Sequence[int], now: float) -> None:
        """The router sent a prompt of these block names to this rank (rule 2)."""
        worker = self._workers.get(worker_id)
        if worker is None or not names or not 0 <= dp_rank < len(worker.ranks):
            return
        predicted = worker.ranks[dp_rank].predicted
        # Expired guesses are at the front (rule 2's order): drop them as new ones come.
        for name, until in list(itertools.islice(predicted.items(), len(names))):
            if until > now:
                break
            del predicted[name]
        until = now + worker.ttl
        rank = worker.ranks[dp_rank]
        self._note(rank, names)
        for name in names[: worker.cap]:
            predicted.pop(name, None)
            predicted[name] = until
        excess = len(predicted) - worker.cap
        if excess > 0:
            for name in list(itertools.islice(predicted, excess)):
                del predicted[name]

    def _note(self, rank: RankBlocks, names: Sequence[int]) -> None:
        # Rule 6: a rank that comes to hold a remembered first name is added to its holders.
        first = self._first
        if not first:
            return
        if len(names) > len(first):
            for name in first.keys() & set(names):
                first[name].add(rank)
            return
        for name in names:
            holders = first.get(name)
            if holders is not None:
                holders.add(rank)

    def _remember(self, name: int, holders: set[RankBlocks]) -> None:
        first = self._first
        if len(first) >= MAX_FIRST_NAMES:
            del first[next(iter(first))]
        first[name] = holders

    def holders(self, name: int, now: float) -> set[RankBlocks]:
        """The ranks that hold ``name`` (either layer), and perhaps a few that held it (rule 6).

        The caller checks each with :meth:`RankBlocks.depth`; a rank not in the answer holds
        nothing of a prompt whose first block ``name`` is.
        """
        holders = self._first.get(name)
        if holders is None:
            holders = {
                rank
                for worker in self._workers.values()
                for rank in worker.ranks
                if name in rank.cached or rank.predicted.get(name, now) > now
            }
            self._remember(name, holders)
        elif len(holders) > 8:
            # Drop the ones that no longer hold it, so the set does not grow with turnover.
            holders.intersection_update(
                [r for r in holders if name in r.cached or r.predicted.get(name, now) > now]
            )
        return holders

    def depth(self, worker_id: str, dp_rank: int, names: Sequence[int], now: float) -> int:
        """How many of ``names``, from the first, the worker's rank holds (0 when unknown)."""
        worker = self._workers.get(worker_id)
        if worker is None or not 0 <= dp_rank < len(worker.ranks):
            return 0
        return worker.ranks[dp_rank].depth(names, now)
