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
   gives way to a new one. So a worker with a cache of C blocks costs at most ``2 C`` entries
   (``3 C`` while a snapshot's parts come in, rule 5).
4. Event order. A worker numbers its KV events consecutively from 1 across all its ranks. After a
   connect the index expects a :class:`~shim_common.wire.KvSnapshot` first (the subscription
   asks for one). A snapshot replaces the cached layer of every rank and sets the last number
   seen to its ``seq``; an event numbered at or below that is already in it and is skipped. An
   event whose number is not the next one is a gap: it is still applied (the picture stays as
   current as it can), and :meth:`KvIndex.apply` answers ``True``, which asks the link to request
   a fresh snapshot; while one is awaited another gap asks again only after
   :data:`SNAPSHOT_RETRY` seconds (and the link asks a worker at most once per as many seconds,
   whatever the index answers: rule 4 of :mod:`frontend_shim._kv_feed`).
5. Snapshots in parts (``wire.FEATURE_KV_PARTS``): the first part of a snapshot starts a new
   cached layer for every rank, beside the one in use; each part adds its names to it (under
   the cap of rule 3), and the last (no ``more``) puts it in use, all ranks at once: routing never
   sees a cache half filled, and a part costs what its names cost, whatever the cache's size.
   A whole snapshot is one part. Anything but the next part of the same snapshot (an event, a
   part of another ``seq``) while one is under way breaks the protocol: :meth:`KvIndex.apply`
   raises :class:`KvStreamError` and the link ends the session.
6. A removal or a clear of a rank also drops the router's guesses of those blocks there: the
   worker's word is the newer one. An event naming a rank the worker does not have is ignored
   and counted (:attr:`IndexStats.invalid`); it loses nothing else.
7. Who may hold a prompt's first block (:meth:`KvIndex.holders`), so that a pick probes the
   ranks that do instead of every rank's set: the index remembers, for at most
   :data:`MAX_FIRST_NAMES` first block names the router has asked about (oldest forgotten first),
   a superset of the ranks that hold it. The first question about a name scans every rank once;
   from then on every way a rank comes to hold that name (stored, snapshot, guessed) adds the
   rank, and a rank that no longer holds it is dropped when the name is next asked about (once
   more than 8 are named). So the answer never misses a holder, and a pick checks each rank it
   names with :meth:`RankBlocks.depth`. A name held by nobody costs its entry alone, a name held
   by one rank that rank alone, by a few a tuple (a set only past 8), and each rank keeps the
   names it is named for
   (:attr:`RankBlocks.firsts`), so forgetting a worker (:meth:`KvIndex.remove_worker`, on every
   reconnect) costs what its ranks are named for, not the whole map. Measured under tracemalloc
   (``tests/frontend_shim/test_kv_index.py``): about 150 bytes a remembered name held by one
   rank, 10 MB at the bound.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Iterable, Sequence
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
    "KvStreamError",
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
#: First block names whose holders the index remembers (rule 7).
MAX_FIRST_NAMES: Final = 65536
#: Holders of a remembered name past which a question about it drops those that let it go.
_PRUNE_ABOVE: Final = 8


class KvStreamError(ValueError):
    """A worker's KV events broke the protocol's order (rule 5): the session is to end."""


@dataclasses.dataclass(slots=True)
class IndexStats:
    """Counts of what the index was told (exported as ``dynamo_frontend_kv_index_*``)."""

    events: int = 0
    #: Snapshots put in use (a snapshot in parts counts once, when its last part came).
    snapshots: int = 0
    #: Parts of snapshots applied (a whole snapshot is one).
    snapshot_parts: int = 0
    gaps: int = 0
    #: Events numbered at or below the last one seen (covered by a snapshot).
    skipped: int = 0
    #: Events naming a rank the worker does not have.
    invalid: int = 0
    #: Block names not kept because a rank's layer was full.
    overflow: int = 0


class RankBlocks:
    """The two layers of one rank (rule 2), and the first names it is named a holder of."""

    __slots__ = ("cached", "firsts", "predicted")

    def __init__(self) -> None:
        #: Names the worker's events say this rank holds (keys; rule 1 says why not a set).
        self.cached: dict[int, None] = {}
        #: The router's guesses: name -> time until which it is believed. Insertion-ordered by
        #: that time (a guess made again moves to the end), so the oldest is first.
        self.predicted: dict[int, float] = {}
        #: Remembered first names whose holders name this rank (rule 7).
        self.firsts: dict[int, None] = {}

    def holds(self, name: int, now: float) -> bool:
        """Whether either layer holds ``name`` now."""
        return name in self.cached or self.predicted.get(name, now) > now

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


#: The holders of a remembered first name (rule 7): nobody, one rank, a tuple of a few (at most
#: :data:`_PRUNE_ABOVE`: 104 bytes for 8, where a set takes 728), or a set of more.
_Holders = RankBlocks | tuple[RankBlocks, ...] | set[RankBlocks] | None


class WorkerBlocks:
    """What the index keeps for one worker."""

    __slots__ = (
        "asked_at",
        "awaiting",
        "building",
        "building_seq",
        "cap",
        "events",
        "last_seq",
        "model",
        "ranks",
        "ttl",
    )

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
        #: The cached layers of a snapshot whose parts are coming in, and its ``seq`` (rule 5).
        self.building: list[dict[int, None]] | None = None
        self.building_seq = 0


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
        #: First block name -> the ranks that may hold it (rule 7), oldest first.
        self._first: dict[int, _Holders] = {}

    def __len__(self) -> int:
        return len(self._workers)

    @property
    def remembered(self) -> int:
        """First block names whose holders the index remembers (rule 7)."""
        return len(self._first)

    def worker(self, worker_id: str) -> WorkerBlocks | None:
        """What the index keeps for a worker, ``None`` when it is not known."""
        return self._workers.get(worker_id)

    def add_worker(self, config: wire.RuntimeConfig, now: float, *, events: bool) -> bool:
        """A worker connected: start its picture empty (its previous one, if any, is dropped).

        Args:
            config: the worker's hello.
            now: current time.
            events: the worker sends KV events (the link subscribed to them); they are used
                when the index uses events.

        Returns:
            Whether the index takes the worker's KV events.
        """
        self.remove_worker(config.worker_id)  # its old picture, and its place in rule 7's map
        subscribe = events and self.use_events
        ttl = EVENTS_PREDICTION_TTL if subscribe else self.prediction_ttl
        ttl = min(ttl, self.prediction_ttl)
        self._workers[config.worker_id] = WorkerBlocks(config, events=subscribe, ttl=ttl, now=now)
        return subscribe

    def remove_worker(self, worker_id: str) -> None:
        """The worker went away: forget everything about it, at the cost of what its ranks are
        named for in rule 7's map."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        for rank in worker.ranks:
            for name in rank.firsts:
                self._drop_holder(name, rank)
            rank.firsts.clear()

    # ------------------------------------------------------------------ the worker's events

    def apply(self, worker_id: str, events: Iterable[wire.KvEvent], now: float) -> bool:
        """Apply a worker's KV events, in order (rules 4 to 6).

        Returns:
            ``True`` when the link should ask the worker for a fresh snapshot.

        Raises:
            KvStreamError: the events break rule 5 (the session is to end).
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        stats = self.stats
        ask = False
        for event in events:
            if isinstance(event, wire.KvSnapshot):
                self._snapshot_part(worker, event)
                continue
            if worker.building is not None:
                raise KvStreamError(
                    f"event {event.seq} inside the parts of snapshot {worker.building_seq}"
                )
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
                self._note(rank, self._store(rank.cached, event.blocks, worker.cap))
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

    def _store(self, cached: dict[int, None], names: Sequence[int], cap: int) -> Sequence[int]:
        """Add ``names`` to a cached layer under its cap (rule 3); returns the names it holds
        of them."""
        room = cap - len(cached)
        if room >= len(names):
            cached.update(dict.fromkeys(names))  # all fit: the common case, in C
            return names
        kept: list[int] = []
        overflow = 0
        for name in names:
            if name not in cached:
                if room <= 0:
                    overflow += 1
                    continue
                cached[name] = None
                room -= 1
            kept.append(name)
        self.stats.overflow += overflow
        return kept

    def _snapshot_part(self, worker: WorkerBlocks, part: wire.KvSnapshot) -> None:
        """Rule 5: add a part to the snapshot under way (starting one), and put it in use with
        its last part."""
        building = worker.building
        if building is None:
            building = worker.building = [{} for _ in worker.ranks]
            worker.building_seq = part.seq
        elif part.seq != worker.building_seq:
            raise KvStreamError(
                f"a part of snapshot {part.seq} inside the parts of snapshot {worker.building_seq}"
            )
        stats = self.stats
        stats.snapshot_parts += 1
        if len(part.ranks) > len(worker.ranks):
            stats.invalid += 1
        for rank, layer, names in zip(worker.ranks, building, part.ranks, strict=False):
            self._note(rank, self._store(layer, names, worker.cap))
        if part.more:
            return
        for rank, layer in zip(worker.ranks, building, strict=True):
            rank.cached = layer
        worker.building = None
        worker.last_seq = part.seq
        worker.awaiting = False
        stats.snapshots += 1

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
        guessed = names[: worker.cap]
        self._note(rank, guessed)
        for name in guessed:
            predicted.pop(name, None)
            predicted[name] = until
        excess = len(predicted) - worker.cap
        if excess > 0:
            for name in list(itertools.islice(predicted, excess)):
                del predicted[name]

    # ------------------------------------------------------------------ rule 7's map

    def _note(self, rank: RankBlocks, names: Sequence[int]) -> None:
        # A rank that comes to hold a remembered first name is added to its holders.
        first = self._first
        if not first:
            return
        if len(names) > len(first):
            for name in first.keys() & set(names):
                self._add_holder(name, rank)
            return
        for name in names:
            if name in first:
                self._add_holder(name, rank)

    def _add_holder(self, name: int, rank: RankBlocks) -> None:
        first = self._first
        holders = first[name]
        if holders is None:
            first[name] = rank
        elif isinstance(holders, RankBlocks):
            if holders is rank:
                return
            first[name] = (holders, rank)
        elif rank in holders:
            return
        elif isinstance(holders, tuple):
            first[name] = (*holders, rank) if len(holders) < _PRUNE_ABOVE else {*holders, rank}
        else:
            holders.add(rank)
        rank.firsts[name] = None

    def _drop_holder(self, name: int, rank: RankBlocks) -> None:
        """Take ``rank`` off the holders of ``name`` (the caller updates ``rank.firsts``)."""
        first = self._first
        holders = first.get(name)
        if holders is rank:
            first[name] = None
        elif isinstance(holders, tuple):
            left = tuple(holder for holder in holders if holder is not rank)
            first[name] = left[0] if len(left) == 1 else left
        elif isinstance(holders, set):
            holders.discard(rank)
            if len(holders) <= _PRUNE_ABOVE:
                first[name] = tuple(holders)

    def _remember(self, name: int, holders: list[RankBlocks]) -> None:
        first = self._first
        if len(first) >= MAX_FIRST_NAMES:
            oldest = next(iter(first))
            for rank in _ranks_of(first.pop(oldest)):
                rank.firsts.pop(oldest, None)
        first[name] = None
        for rank in holders:
            self._add_holder(name, rank)

    def holders(self, name: int, now: float) -> Collection[RankBlocks]:
        """The ranks that hold ``name`` (either layer), and perhaps a few that held it (rule 7).

        The caller checks each with :meth:`RankBlocks.depth`; a rank not in the answer holds
        nothing of a prompt whose first block ``name`` is.
        """
        first = self._first
        if name not in first:
            found = [
                rank
                for worker in self._workers.values()
                for rank in worker.ranks
                if rank.holds(name, now)
            ]
            self._remember(name, found)
        holders = first[name]
        if isinstance(holders, set):  # more than _PRUNE_ABOVE
            # Drop the ones that no longer hold it, so the set does not grow with turnover.
            for rank in [rank for rank in holders if not rank.holds(name, now)]:
                self._drop_holder(name, rank)
                del rank.firsts[name]
            holders = first[name]
        return _ranks_of(holders)

    def depth(self, worker_id: str, dp_rank: int, names: Sequence[int], now: float) -> int:
        """How many of ``names``, from the first, the worker's rank holds (0 when unknown)."""
        worker = self._workers.get(worker_id)
        if worker is None or not 0 <= dp_rank < len(worker.ranks):
            return 0
        return worker.ranks[dp_rank].depth(names, now)


def _ranks_of(holders: _Holders) -> Collection[RankBlocks]:
    if holders is None:
        return ()
    if isinstance(holders, RankBlocks):
        return (holders,)
    return holders
