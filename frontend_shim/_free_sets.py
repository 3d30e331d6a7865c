"""What the frontend keeps per worker, and the free sets it maintains incrementally (pure).

Per worker (:class:`WorkerLoad`): its announced configuration, one :class:`RankState` per
data-parallel rank (the reported load, the router's own count, and the busy and saturated bits of
:mod:`frontend_shim._thresholds`), and what this frontend has in flight there
(:mod:`frontend_shim._sequences`). Per model
(:class:`ModelPool`): its thresholds, its workers and its :class:`FreeSet`. :class:`FreeSets`
holds every pool and the two fleet-wide counts the fast shed reads.

Rules:

1. A worker is busy when all its ranks that have *reported* (a load event or a heartbeat entry)
   are busy. A rank that never reported does not count; a worker with no reported rank is not
   busy. *Saturated* is the same AND over the frontend-queue check.
2. A worker is *available* when it is registered, not stale, not lagging and not draining; it
   is *free* when it is available, not busy and not marked overloaded. Free workers are routed
   to first; a marked one only by the class rule 4.
3. Incremental: a change to one rank updates that rank's bits and its worker's counts
   (:meth:`FreeSets.recompute_rank`), then :meth:`FreeSets.update_membership` moves the worker in
   or out of its model's free set and fixes the counts. Both are O(1): applying one event never
   scans the fleet.
4. A mark has a class: the priority ``p`` of the request the worker refused and the tenants
   refused at that priority (at most ``mark_tenants`` names; past that, every tenant). It covers
   the requests that could do no better there: a worse priority (a larger value), or ``p`` and
   a refused tenant. A request of a strictly better priority, or of ``p`` and another tenant, may
   still displace a waiting request at that worker (the gate's rule 5 in
   worker_ingress/_fair_queue.py), so the mark *admits* it (:func:`mark_admits`). A refusal
   while the mark is in force widens it: a better priority replaces the class (everything worse
   is covered then), an equal one adds its tenant, a worse one changes nothing. A refusal whose
   class is unknown covers every class. Each pool keeps the available marked workers in its own
   set (``marked``), so the class check reads only those, and only when no worker is free.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Generic, TypeVar

from frontend_shim._sequences import RankSequences, Sequences
from frontend_shim._thresholds import max_batched, rank_busy
from shim_common import wire
from shim_common.wire import BusyThresholds

__all__ = [
    "FreeSet",
    "FreeSets",
    "ModelPool",
    "RankState",
    "Release",
    "WorkerLoad",
    "mark_admits",
]

_T = TypeVar("_T")


class RankState:
    """One data-parallel rank of a worker."""

    __slots__ = (
        "busy",
        "effective_blocks",
        "effective_prefill",
        "own",
        "released_blocks",
        "released_prefill",
        "report_seq",
        "reported",
        "reported_blocks",
        "reported_prefill",
        "saturated",
    )

    def __init__(self, own: RankSequences) -> None:
        self.reported = False
        self.reported_blocks = 0
        self.reported_prefill = 0
        #: The ``seq`` of the newest event that reported this rank (-1: none yet).
        self.report_seq = -1
        #: What requests that finished here still weigh in the report: taken off it until an
        #: event produced after they ended is applied (:class:`Release`).
        self.released_blocks = 0
        self.released_prefill = 0
        #: The router's own count of what it sent here and not yet released
        #: (:mod:`frontend_shim._sequences`, its only writer).
        self.own = own
        self.effective_blocks = 0
        self.effective_prefill = 0
        self.busy = False
        #: Prefill over the frontend-queue threshold (meaningful only when it is set).
        self.saturated = False


class Release:
    """A finished request that reports of its rank may still count (a handle, opaque).

    A report of the rank whose ``seq`` is above :attr:`started` and at most :attr:`ended` was
    produced while the request held its slot: its blocks are taken off that report, and its
    prompt tokens too while the ``seq`` is at most :attr:`first_output`. A report above
    :attr:`ended` no longer counts it: the release is over.
    """

    __slots__ = ("blocks", "ended", "first_output", "prefill", "rank", "started")

    def __init__(
        self, rank: int, blocks: int, prefill: int, started: int, first_output: int, ended: int
    ) -> None:
        self.rank = rank
        self.blocks = blocks
        self.prefill = prefill
        self.started = started
        self.first_output = first_output
        self.ended = ended


class WorkerLoad:
    """What the fleet knows about one connected worker (read-only for callers)."""

    __slots__ = (
        "available",
        "busy_ranks",
        "config",
        "counted_marked_idle",
        "counted_unsaturated",
        "draining",
        "effective_limit",
        "engine_requests",
        "free",
        "hold_bound",
        "hold_marks",
        "hold_priority",
        "hold_until",
        "lagging",
        "last_seen",
        "last_seq",
        "load_cost",
        "mark_priority",
        "mark_tenants",
        "mark_until",
        "pending",
        "pool",
        "queue_ahead",
        "queued_for_mark",
        "queued_for_stale",
        "queued_requests",
        "ranks",
        "released_requests",
        "releases",
        "removed",
        "reported_ranks",
        "saturated_ranks",
        "sequences",
        "stale",
        "stale_after",
        "sum_blocks",
        "sum_prefill",
    )

    def __init__(
        self,
        config: wire.RuntimeConfig,
        pool: ModelPool,
        now: float,
        stale: float,
        track_output_blocks: bool = False,
    ) -> None:
        self.config = config
        self.pool = pool
        #: The requests this frontend has in flight here, per rank.
        self.sequences = Sequences(
            config.data_parallel_size, config.block_size, track_output_blocks
        )
        self.ranks = [RankState(own) for own in self.sequences.ranks]
        self.reported_ranks = 0
        self.busy_ranks = 0
        self.saturated_ranks = 0
        self.sum_blocks = 0
        self.sum_prefill = 0
        #: The ``kv`` router's cost: mean over ranks of ``blocks/kv_total_blocks +
        #: prefill_tokens/max_num_batched_tokens`` (both with the router's own count). Both
        #: terms are fractions of a rank's capacity, so a full KV cache and a full prefill
        #: batch weigh the same (1.0); an idle worker costs 0. A worker that reports an
        #: effective limit L (it has a TTFT objective) adds the share of L its gate holds,
        #: ``max(engine + queued requests, this router's in flight) / L``: 1.0 when it runs L and
        #: queues nothing, so a worker whose objective has lowered L draws fewer requests. Kept
        #: current by every rank and gauge update, so a pick reads it without computing.
        self.load_cost = 0.0
        #: The ingress gauges of the worker's last event, and L when it reports one.
        self.engine_requests = 0
        self.queued_requests = 0
        self.effective_limit: int | None = None
        self.last_seen = now
        self.last_seq = -1
        self.stale_after = stale
        self.stale = False
        #: This frontend reads the worker's events too far behind to route on them.
        self.lagging = False
        self.draining = False
        self.mark_until: float | None = None
        #: The class the mark covers (rule 4), meaningful only while ``mark_until`` is set: the
        #: best refused priority, and the tenants refused at it (``None``: every tenant).
        self.mark_priority = 0
        self.mark_tenants: set[str] | None = None
        self.queued_for_mark = False
        self.queued_for_stale = False
        #: The worker's last ``queue_ahead`` figures (``None``: it sends none), and by priority
        #: the requests sent it since its last event, less the first replies heard since: this
        #: frontend's picture of its queue (:mod:`frontend_shim._queue_hold`).
        self.queue_ahead: list[tuple[int, int]] | None = None
        self.pending: dict[int, int] = {}
        #: The queue depth a refusal that proves only a long queue holds the worker at
        #: (``None``: none in force), until ``hold_until``, for ``hold_priority`` and worse;
        #: ``hold_marks``: the mark in force is that hold's (:mod:`frontend_shim._queue_hold`).
        self.hold_bound: int | None = None
        self.hold_until = 0.0
        self.hold_priority = 0
        self.hold_marks = False
        self.available = False
        self.free = False
        #: Counted in its pool's ``unsaturated_free`` (remembered: saturation changes later).
        self.counted_unsaturated = False
        #: Counted in the fleet's ``marked_idle`` (available, marked, not busy).
        self.counted_marked_idle = False
        self.removed = False
        #: Finished requests its last reports may still count, oldest first (bounded), and how
        #: many of them its newest event's gauges count.
        self.releases: list[Release] = []
        self.released_requests = 0

    @property
    def worker_id(self) -> str:
        """The id the worker announced."""
        return self.config.worker_id

    @property
    def model(self) -> str:
        """The model the worker serves."""
        return self.config.model

    @property
    def busy(self) -> bool:
        """All reported ranks are busy (and at least one reported)."""
        return self.reported_ranks > 0 and self.busy_ranks == self.reported_ranks

    @property
    def saturated(self) -> bool:
        """All reported ranks exceed the frontend-queue threshold (and at least one reported)."""
        return self.reported_ranks > 0 and self.saturated_ranks == self.reported_ranks

    @property
    def marked(self) -> bool:
        """An overload mark is in force (until the fleet's ``expire`` drops it)."""
        return self.mark_until is not None

    @property
    def in_flight(self) -> int:
        """Requests the router has charged to this worker and not yet finished."""
        return len(self.sequences)


def mark_admits(worker: WorkerLoad, priority: int, tenant: str) -> bool:
    """Whether a request of ``priority`` and ``tenant`` beats the worker's mark (rule 4): it
    may be routed there although the worker refused another class. ``True`` when unmarked."""
    if worker.mark_until is None or priority < worker.mark_priority:
        return True
    tenants = worker.mark_tenants
    return priority == worker.mark_priority and tenants is not None and tenant not in tenants


def load_cost(worker: WorkerLoad) -> float:
    """See :attr:`WorkerLoad.load_cost`."""
    config = worker.config
    cost = worker.sum_prefill / max_batched(config)
    if config.kv_total_blocks > 0:
        cost += worker.sum_blocks / config.kv_total_blocks
    cost /= len(worker.ranks)
    limit = worker.effective_limit
    if limit is not None and limit > 0:
        reported = worker.engine_requests + worker.queued_requests - worker.released_requests
        held = max(reported, len(worker.sequences))
        cost += held / limit
    return cost


class FreeSet(Generic[_T]):
    """A set with O(1) add, discard and indexing (swap-remove), for picking by position.

    The order is arbitrary and changes when an item is removed; read it, never keep it.
    """

    __slots__ = ("_items", "_positions")

    def __init__(self) -> None:
        self._items: list[_T] = []
        self._positions: dict[_T, int] = {}

    def add(self, item: _T) -> None:
        if item not in self._positions:
            self._positions[item] = len(self._items)
            self._items.append(item)

    def discard(self, item: _T) -> None:
        position = self._positions.pop(item, None)
        if position is None:
            return
        last = self._items.pop()
        if position < len(self._items):
            self._items[position] = last
            self._positions[last] = position

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, position: int) -> _T:
        return self._items[position]

    def __contains__(self, item: object) -> bool:
        return item in self._positions

    def __iter__(self) -> Iterator[_T]:
        return iter(self._items)

    def rotated(self, start: int) -> Iterator[_T]:
        """The items from position ``start`` (mod size) to the end, then from the beginning."""
        if not self._items:
            return iter(())
        start %= len(self._items)
        return itertools.chain(self._items[start:], self._items[:start])


class ModelPool:
    """The workers of one model and its thresholds."""

    __slots__ = (
        "available",
        "free",
        "marked",
        "name",
        "thresholds",
        "unmarked",
        "unsaturated_free",
        "workers",
    )

    def __init__(self, name: str, thresholds: BusyThresholds) -> None:
        self.name = name
        self.thresholds = thresholds
        self.workers: dict[str, WorkerLoad] = {}
        self.free: FreeSet[WorkerLoad] = FreeSet()
        #: Workers available and not marked overloaded, busy or not: where a request of a
        #: busy-exempt priority may go, and what tells "busy" from "marked" when none is free.
        self.unmarked: FreeSet[WorkerLoad] = FreeSet()
        #: Workers available and marked, busy or not: where rule 4 looks when none is free.
        self.marked: FreeSet[WorkerLoad] = FreeSet()
        #: Workers registered, fresh and not draining.
        self.available = 0
        #: Free workers under the frontend-queue threshold.
        self.unsaturated_free = 0


class FreeSets:
    """Every model's :class:`ModelPool`, with the fleet-wide counts, kept current in O(1).

    Args:
        queue_threshold: ``--router-queue-threshold`` (``None``: no rank is ever saturated).
    """

    __slots__ = (
        "_models_available",
        "_models_with_free",
        "marked_idle",
        "pools",
        "queue_threshold",
    )

    def __init__(self, queue_threshold: float | None) -> None:
        self.queue_threshold = queue_threshold
        #: Every model announced and not forgotten since, in order of first announcement.
        self.pools: dict[str, ModelPool] = {}
        self._models_available = 0
        self._models_with_free = 0
        #: Workers (of every model) available, marked and not busy: while there is one, a
        #: request's class may still find a worker (rule 4), so the fast shed must not answer
        #: before the class is known.
        self.marked_idle = 0

    def pool(self, model: str, thresholds: BusyThresholds) -> ModelPool:
        """The pool of ``model``, created with ``thresholds`` when the model is new."""
        pool = self.pools.get(model)
        if pool is None:
            pool = self.pools[model] = ModelPool(model, thresholds)
        return pool

    def all_busy(self) -> bool:
        """Every known model has available workers and none of them is free."""
        models = len(self.pools)
        return models > 0 and self._models_available == models and self._models_with_free == 0

    def recompute_rank(self, worker: WorkerLoad, rank: RankState) -> None:
        """Refresh one rank's effective figures and busy bit, keeping the worker's counts."""
        own = rank.own
        blocks = max(rank.reported_blocks - rank.released_blocks, own.blocks)
        prefill = max(rank.reported_prefill - rank.released_prefill, own.prefill)
        worker.sum_blocks += blocks - rank.effective_blocks
        worker.sum_prefill += prefill - rank.effective_prefill
        rank.effective_blocks = blocks
        rank.effective_prefill = prefill
        worker.load_cost = load_cost(worker)
        if not rank.reported:
            return
        busy = rank_busy(worker.config, worker.pool.thresholds, blocks, prefill)
        if busy != rank.busy:
            rank.busy = busy
            worker.busy_ranks += 1 if busy else -1
        saturated = self.queue_threshold is not None and prefill > int(
            self.queue_threshold * max_batched(worker.config)
        )
        if saturated != rank.saturated:
            rank.saturated = saturated
            worker.saturated_ranks += 1 if saturated else -1

    def update_membership(self, worker: WorkerLoad) -> None:
        """Put the worker in or out of its model's free set and fix the counts (O(1))."""
        pool = worker.pool
        available = not (worker.removed or worker.stale or worker.lagging or worker.draining)
        free = available and not worker.busy and worker.mark_until is None
        had_available = pool.available > 0
        had_free = len(pool.free) > 0
        if available != worker.available:
            worker.available = available
            pool.available += 1 if available else -1
        if available and worker.mark_until is None:
            pool.unmarked.add(worker)
            pool.marked.discard(worker)
        elif available:
            pool.unmarked.discard(worker)
            pool.marked.add(worker)
        else:
            pool.unmarked.discard(worker)
            pool.marked.discard(worker)
        marked_idle = available and worker.mark_until is not None and not worker.busy
        if marked_idle != worker.counted_marked_idle:
            worker.counted_marked_idle = marked_idle
            self.marked_idle += 1 if marked_idle else -1
        if free != worker.free:
            worker.free = free
            if free:
                pool.free.add(worker)
            else:
                pool.free.discard(worker)
        unsaturated = free and not worker.saturated
        if unsaturated != worker.counted_unsaturated:
            worker.counted_unsaturated = unsaturated
            pool.unsaturated_free += 1 if unsaturated else -1
        self._models_available += (pool.available > 0) - had_available
        self._models_with_free += (len(pool.free) > 0) - had_free
