"""Per-worker, per-rank load state and the busy rules (pure: no I/O, time passed in as ``now``).

A :class:`Fleet` holds what this frontend knows about every connected worker: its announced
:class:`~shim_common.wire.RuntimeConfig`, the latest load of each data-parallel rank, the
router's own count of what it sent there, an overload mark, and whether the worker is stale or
draining. From that it keeps, per model, the set of *free* workers incrementally, so applying one
event costs O(1) (O(ranks in the event) for a heartbeat), never a scan of the fleet.

Rules (CONTRACT §2 "Busy detection"; thresholds are per model, ``None`` means unset):

1. Rank busy = OR over the configured checks (strict ``>``, unset checks skipped):

   - decode: ``blocks / kv_total_blocks > active_decode_blocks``, never when the total is 0 or
     unknown. ``blocks`` is the larger of the worker's report (``max(kv_used_blocks,
     active_decode_blocks)``) and the router's own count (prompt blocks of requests in flight to
     that rank, plus their output blocks with ``track_output_blocks``).
   - prefill: ``prefill_tokens > active_prefill_tokens``.
   - prefill fraction: ``prefill_tokens > int(active_prefill_tokens_frac * max_num_batched_tokens)``
     (integer truncation as in Dynamo; ``max_num_batched_tokens <= 0`` counts as 10,000,000).

   ``prefill_tokens`` is likewise the larger of the report and the router's own count (prompt
   tokens of requests sent to the rank that have not produced output yet).
2. Worker busy = AND over the ranks that have *reported* (a load event or a heartbeat entry). A
   rank that never reported does not count; a worker with no reported rank is not busy. All
   thresholds unset: never busy.
3. A worker is *available* when it is registered, not stale and not draining; it is *free* when
   it is available, not busy and not marked overloaded. Only free workers are routed to.
4. Stale: no event or heartbeat for longer than ``stale_after_intervals * heartbeat_interval``.
   The next event makes it fresh again. Dynamo has no staleness: a silent worker keeps its last
   load forever; here a worker that stopped talking stops receiving requests.
5. Overload mark (a worker answered ``Server overloaded:``): the worker is not free until its next
   load event or heartbeat, or until the lease (1 s by default) runs out, whichever comes first.
   A mark can never stick (Dynamo #14213).
6. A threshold change (:meth:`Fleet.set_thresholds`) recomputes every worker of that model at
   once (one scan per change), so it takes effect immediately: sooner than the contract's "next
   load event or within one second".
7. Time-driven changes (staleness, mark expiry) are applied by :meth:`Fleet.expire`, which every
   query that depends on them calls first. Each uses a heap holding at most one entry per
   worker; an event only stores a time, so it stays O(1).

Router-own accounting. The frontend does not know which DP rank a worker gives a request, so
:meth:`Fleet.request_sent` charges it to the rank with the fewest own blocks (ties: lowest rank).
The returned :class:`InFlight` is the handle for :meth:`Fleet.request_output` and
:meth:`Fleet.request_finished`, which undo exactly what was charged. ``kv_total_blocks`` and
``max_num_batched_tokens`` are taken as per-rank figures, as Dynamo does.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Final, Generic, NamedTuple, TypeVar

from shim_common import wire

__all__ = [
    "DEFAULT_MARK_LEASE",
    "DEFAULT_STALE_AFTER_INTERVALS",
    "UNKNOWN_MAX_BATCHED_TOKENS",
    "FreeSet",
    "Fleet",
    "InFlight",
    "RankGauge",
    "ThresholdError",
    "Thresholds",
    "WorkerLoad",
    "validate_active_decode_blocks_threshold",
    "validate_active_prefill_tokens_threshold",
    "validate_active_prefill_tokens_threshold_frac",
]

#: Seconds an overload mark lasts at most without a load event from the worker.
DEFAULT_MARK_LEASE: Final = 1.0
#: A worker is stale after this many heartbeat intervals without an event or heartbeat.
DEFAULT_STALE_AFTER_INTERVALS: Final = 3.0
#: ``max_num_batched_tokens`` assumed when a worker announces none (Dynamo's default).
UNKNOWN_MAX_BATCHED_TOKENS: Final = 10_000_000


# ----------------------------------------------------------------------------- thresholds


class ThresholdError(ValueError):
    """A threshold value out of range; ``str(error)`` is the text the HTTP API returns (400).

    Attributes:
        field: the name of the threshold, as in the API (``active_decode_blocks_threshold``...).
        value: the value given.
    """

    def __init__(self, field: str, value: object, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


def validate_active_decode_blocks_threshold(value: float) -> float:
    """Check a decode-blocks threshold: a finite float in [0.0, 1.0].

    Args:
        value: the threshold given.

    Returns:
        ``value`` as a float.

    Raises:
        ThresholdError: out of range, NaN or infinite.
    """
    value = float(value)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        field = "active_decode_blocks_threshold"
        raise ThresholdError(field, value, f"{field} must be between 0.0 and 1.0, got {value}")
    return value


def validate_active_prefill_tokens_threshold(value: int) -> int:
    """Check an absolute prefill-tokens threshold: an integer >= 0.

    Args:
        value: the threshold given.

    Returns:
        ``value``.

    Raises:
        ThresholdError: negative.
    """
    if value < 0:
        field = "active_prefill_tokens_threshold"
        raise ThresholdError(field, value, f"{field} must be >= 0, got {value}")
    return value


def validate_active_prefill_tokens_threshold_frac(value: float) -> float:
    """Check a prefill-tokens fraction threshold: a finite float >= 0.0.

    Args:
        value: the threshold given.

    Returns:
        ``value`` as a float.

    Raises:
        ThresholdError: negative, NaN or infinite.
    """
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        field = "active_prefill_tokens_threshold_frac"
        raise ThresholdError(
            field,
            value,
            f"{field} must be a finite value greater than or equal to 0.0, got {value}",
        )
    return value


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Thresholds:
    """The busy thresholds of one model; ``None`` leaves a check unset (skipped)."""

    active_decode_blocks: float | None = None
    active_prefill_tokens: int | None = None
    active_prefill_tokens_frac: float | None = None

    def __post_init__(self) -> None:
        if self.active_decode_blocks is not None:
            validate_active_decode_blocks_threshold(self.active_decode_blocks)
        if self.active_prefill_tokens is not None:
            validate_active_prefill_tokens_threshold(self.active_prefill_tokens)
        if self.active_prefill_tokens_frac is not None:
            validate_active_prefill_tokens_threshold_frac(self.active_prefill_tokens_frac)

    @property
    def configured(self) -> bool:
        """Whether any check is set (with none set, no worker is ever busy)."""
        return (
            self.active_decode_blocks is not None
            or self.active_prefill_tokens is not None
            or self.active_prefill_tokens_frac is not None
        )

    def merged(self, update: Thresholds) -> Thresholds:
        """These thresholds with every non-``None`` value of ``update`` put in (the POST rule).

        Args:
            update: the values to set; its ``None`` fields leave ours unchanged.

        Returns:
            The merged thresholds.
        """
        return Thresholds(
            active_decode_blocks=_first_set(update.active_decode_blocks, self.active_decode_blocks),
            active_prefill_tokens=_first_set(
                update.active_prefill_tokens, self.active_prefill_tokens
            ),
            active_prefill_tokens_frac=_first_set(
                update.active_prefill_tokens_frac, self.active_prefill_tokens_frac
            ),
        )


_T = TypeVar("_T")


def _first_set(new: _T | None, old: _T | None) -> _T | None:
    return old if new is None else new


# ----------------------------------------------------------------------------- state


class RankGauge(NamedTuple):
    """One rank's figures for the frontend's per-worker gauges (read at scrape time)."""

    worker_id: str
    dp_rank: int
    #: The blocks the decode check uses: max(reported, router's own count).
    active_decode_blocks: int
    #: The tokens the prefill checks use: max(reported, router's own count).
    active_prefill_tokens: int
    kv_total_blocks: int


class _Rank:
    """One data-parallel rank of a worker."""

    __slots__ = (
        "busy",
        "effective_blocks",
        "effective_prefill",
        "own_blocks",
        "own_prefill",
        "reported",
        "reported_blocks",
        "reported_prefill",
        "saturated",
    )

    def __init__(self) -> None:
        self.reported = False
        self.reported_blocks = 0
        self.reported_prefill = 0
        self.own_blocks = 0
        self.own_prefill = 0
        self.effective_blocks = 0
        self.effective_prefill = 0
        self.busy = False
        #: Prefill over the frontend-queue threshold (meaningful only when it is set).
        self.saturated = False


class InFlight:
    """The router's own charge for one request sent to a worker (a handle, opaque to callers)."""

    __slots__ = ("blocks", "finished", "output_tokens", "prefill_tokens", "prompt_tokens", "rank")

    def __init__(self, rank: int, prompt_tokens: int, blocks: int) -> None:
        self.rank = rank
        self.prompt_tokens = prompt_tokens
        self.output_tokens = 0
        self.blocks = blocks
        #: Prompt tokens still charged as prefill (0 once output arrived).
        self.prefill_tokens = prompt_tokens
        self.finished = False


class WorkerLoad:
    """What the fleet knows about one connected worker (read-only for callers)."""

    __slots__ = (
        "_in_flight",
        "_pool",
        "available",
        "busy_ranks",
        "config",
        "counted_unsaturated",
        "draining",
        "free",
        "last_seen",
        "last_seq",
        "load_cost",
        "mark_until",
        "queued_for_mark",
        "queued_for_stale",
        "ranks",
        "removed",
        "reported_ranks",
        "saturated_ranks",
        "stale",
        "stale_after",
        "sum_blocks",
        "sum_prefill",
    )

    def __init__(self, config: wire.RuntimeConfig, pool: _ModelPool, now: float, stale: float):
        self.config = config
        self._pool = pool
        self.ranks = [_Rank() for _ in range(max(1, config.data_parallel_size))]
        self.reported_ranks = 0
        self.busy_ranks = 0
        self.saturated_ranks = 0
        self.sum_blocks = 0
        self.sum_prefill = 0
        #: The ``kv`` router's cost: mean over ranks of ``blocks/kv_total_blocks +
        #: prefill_tokens/max_num_batched_tokens`` (both with the router's own count). Both
        #: terms are fractions of a rank's capacity, so a full KV cache and a full prefill
        #: batch weigh the same (1.0); an idle worker costs 0. Kept current by every rank
        #: update, so a pick reads it without computing.
        self.load_cost = 0.0
        self.last_seen = now
        self.last_seq = -1
        self.stale_after = stale
        self.stale = False
        self.draining = False
        self.mark_until: float | None = None
        self.queued_for_mark = False
        self.queued_for_stale = False
        self.available = False
        self.free = False
        #: Counted in its pool's ``unsaturated_free`` (remembered: saturation changes later).
        self.counted_unsaturated = False
        self.removed = False
        self._in_flight: set[InFlight] = set()

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
        """An overload mark is in force (its lease is dropped by :meth:`Fleet.expire`)."""
        return self.mark_until is not None

    @property
    def in_flight(self) -> int:
        """Requests the router has charged to this worker and not yet finished."""
        return len(self._in_flight)


def _load_cost(worker: WorkerLoad) -> float:
    """See :attr:`WorkerLoad.load_cost`."""
    config = worker.config
    cost = worker.sum_prefill / _max_batched(config)
    if config.kv_total_blocks > 0:
        cost += worker.sum_blocks / config.kv_total_blocks
    return cost / len(worker.ranks)


def _max_batched(config: wire.RuntimeConfig) -> int:
    if config.max_num_batched_tokens > 0:
        return config.max_num_batched_tokens
    return UNKNOWN_MAX_BATCHED_TOKENS


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


class _ModelPool:
    """The workers of one model and its thresholds."""

    __slots__ = ("available", "free", "name", "thresholds", "unsaturated_free", "workers")

    def __init__(self, name: str, thresholds: Thresholds) -> None:
        self.name = name
        self.thresholds = thresholds
        self.workers: dict[str, WorkerLoad] = {}
        self.free: FreeSet[WorkerLoad] = FreeSet()
        #: Workers registered, fresh and not draining.
        self.available = 0
        #: Free workers under the frontend-queue threshold.
        self.unsaturated_free = 0


# ----------------------------------------------------------------------------- the fleet


class Fleet:
    """Load state of every connected worker, grouped by model, with the free sets kept current.

    The I/O side calls :meth:`register` when a worker's hello arrives, :meth:`apply` for every
    event of its event plane, :meth:`remove` when it disconnects, and the request-accounting
    methods as requests start, stream and finish. All methods take the current time as ``now``
    (seconds, e.g. ``trio.current_time()``) where time matters; times must not go backwards.

    Args:
        default_thresholds: thresholds every model starts with (the CLI flags).
        track_output_blocks: charge generated tokens to the router's own block count.
        queue_threshold: ``--router-queue-threshold``: a worker whose reported ranks all have
            more prefill tokens than ``int(queue_threshold * max_num_batched_tokens)`` is
            *saturated* (see :meth:`unsaturated_free_count`); ``None``: never.
        stale_after_intervals: heartbeat intervals of silence after which a worker is stale.
        mark_lease: seconds an overload mark lasts at most.
    """

    def __init__(
        self,
        *,
        default_thresholds: Thresholds | None = None,
        track_output_blocks: bool = False,
        queue_threshold: float | None = None,
        stale_after_intervals: float = DEFAULT_STALE_AFTER_INTERVALS,
        mark_lease: float = DEFAULT_MARK_LEASE,
    ) -> None:
        if queue_threshold is not None and not (
            math.isfinite(queue_threshold) and queue_threshold > 0
        ):
            raise ValueError(f"queue_threshold must be a finite value > 0, got {queue_threshold}")
        if not stale_after_intervals > 0:
            raise ValueError(f"stale_after_intervals must be > 0, got {stale_after_intervals}")
        if not mark_lease > 0:
            raise ValueError(f"mark_lease must be > 0, got {mark_lease}")
        self.default_thresholds = default_thresholds or Thresholds()
        self.track_output_blocks = track_output_blocks
        self.queue_threshold = queue_threshold
        self.stale_after_intervals = stale_after_intervals
        self.mark_lease = mark_lease
        self._pools: dict[str, _ModelPool] = {}
        self._workers: dict[str, WorkerLoad] = {}
        self._models_available = 0
        self._models_with_free = 0
        # (deadline, tie-breaker, worker): at most one live entry per worker and heap.
        self._stale_heap: list[tuple[float, int, WorkerLoad]] = []
        self._mark_heap: list[tuple[float, int, WorkerLoad]] = []
        self._tie = itertools.count()

    # ------------------------------------------------------------------ membership

    def register(self, config: wire.RuntimeConfig, now: float) -> WorkerLoad:
        """Add a worker from its announced configuration; a known id is replaced (a reconnect).

        The model becomes known (and stays known after its workers leave). The worker starts
        free, with no reported rank.

        Args:
            config: the worker's runtime configuration from its hello.
            now: current time.

        Returns:
            The worker's new state.
        """
        self.remove(config.worker_id)
        pool = self._pools.get(config.model)
        if pool is None:
            pool = _ModelPool(config.model, self.default_thresholds)
            self._pools[config.model] = pool
        # A worker that announces no heartbeat interval cannot be judged stale.
        interval = config.heartbeat_interval
        stale_after = self.stale_after_intervals * interval if interval > 0 else math.inf
        worker = WorkerLoad(config, pool, now, stale_after)
        pool.workers[config.worker_id] = worker
        self._workers[config.worker_id] = worker
        self._push_stale_deadline(worker)
        self._update_membership(worker)
        return worker

    def remove(self, worker_id: str) -> bool:
        """Forget a worker: its load, marks, gauges and in-flight charges.

        Args:
            worker_id: the worker's id.

        Returns:
            Whether the worker was known.
        """
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return False
        worker.removed = True
        self._update_membership(worker)
        del worker._pool.workers[worker_id]
        for in_flight in worker._in_flight:
            in_flight.finished = True
        worker._in_flight.clear()
        return True

    def worker(self, worker_id: str) -> WorkerLoad | None:
        """The state of one worker, or ``None`` when it is not connected."""
        return self._workers.get(worker_id)

    def workers(self, model: str | None = None) -> Iterator[WorkerLoad]:
        """Every connected worker, or those of one model."""
        if model is None:
            return iter(list(self._workers.values()))
        pool = self._pools.get(model)
        return iter(list(pool.workers.values()) if pool else [])

    @property
    def connected_count(self) -> int:
        """Workers registered (stale or draining ones included)."""
        return len(self._workers)

    def models(self) -> list[str]:
        """Every model ever announced by a worker, in order of first announcement."""
        return list(self._pools)

    def is_known_model(self, model: str) -> bool:
        """Whether some worker has announced ``model`` since start."""
        return model in self._pools

    # ------------------------------------------------------------------ events

    def apply(self, worker_id: str, event: wire.WorkerEvent, now: float) -> bool:
        """Apply one load event or heartbeat of a worker.

        Clears the worker's overload mark, makes it fresh, and recomputes only its own ranks.
        Events older than one already applied (by ``seq``) are ignored; a rank outside
        ``[0, data_parallel_size)`` is ignored. A heartbeat whose ``status`` is ``draining``
        makes the worker unavailable until a heartbeat says ``ready``.

        Args:
            worker_id: the worker the event came from.
            event: a :class:`~shim_common.wire.LoadEvent` or
                :class:`~shim_common.wire.Heartbeat`.
            now: current time.

        Returns:
            Whether it was applied (``False``: unknown worker or an old ``seq``).
        """
        worker = self._workers.get(worker_id)
        if worker is None or event.seq <= worker.last_seq:
            return False
        worker.last_seq = event.seq
        worker.last_seen = now
        worker.stale = False
        worker.mark_until = None
        if not worker.queued_for_stale:
            self._push_stale_deadline(worker)
        if isinstance(event, wire.LoadEvent):
            self._report(worker, event.load)
        else:
            worker.draining = event.status == "draining"
            for load in event.loads:
                self._report(worker, load)
        self._update_membership(worker)
        return True

    def apply_batch(self, worker_id: str, events: Iterable[wire.WorkerEvent], now: float) -> int:
        """Apply the events of one :class:`~shim_common.wire.EventBatch`, oldest first.

        Returns:
            How many were applied.
        """
        return sum(self.apply(worker_id, event, now) for event in events)

    def _report(self, worker: WorkerLoad, load: wire.RankLoad) -> None:
        if not 0 <= load.dp_rank < len(worker.ranks):
            return
        rank = worker.ranks[load.dp_rank]
        if not rank.reported:
            # From now on this rank takes part in the AND of rule 2.
            rank.reported = True
            worker.reported_ranks += 1
        rank.reported_blocks = max(load.kv_used_blocks, load.active_decode_blocks)
        rank.reported_prefill = load.active_prefill_tokens
        self._recompute_rank(worker, rank)

    def _recompute_rank(self, worker: WorkerLoad, rank: _Rank) -> None:
        """Refresh one rank's effective figures and busy bit, keeping the worker's counts."""
        blocks = max(rank.reported_blocks, rank.own_blocks)
        prefill = max(rank.reported_prefill, rank.own_prefill)
        worker.sum_blocks += blocks - rank.effective_blocks
        worker.sum_prefill += prefill - rank.effective_prefill
        rank.effective_blocks = blocks
        rank.effective_prefill = prefill
        worker.load_cost = _load_cost(worker)
        if not rank.reported:
            return
        busy = _rank_busy(worker.config, worker._pool.thresholds, blocks, prefill)
        if busy != rank.busy:
            rank.busy = busy
            worker.busy_ranks += 1 if busy else -1
        saturated = self.queue_threshold is not None and prefill > int(
            self.queue_threshold * _max_batched(worker.config)
        )
        if saturated != rank.saturated:
            rank.saturated = saturated
            worker.saturated_ranks += 1 if saturated else -1

    def _update_membership(self, worker: WorkerLoad) -> None:
        """Put the worker in or out of its model's free set and fix the counts (O(1))."""
        pool = worker._pool
        available = not (worker.removed or worker.stale or worker.draining)
        free = available and not worker.busy and worker.mark_until is None
        had_available = pool.available > 0
        had_free = len(pool.free) > 0
        if available != worker.available:
            worker.available = available
            pool.available += 1 if available else -1
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

    # ------------------------------------------------------------------ time

    def expire(self, now: float) -> None:
        """Apply what time alone changes: stale workers, and marks whose lease ran out.

        Cheap when nothing is due (a look at two heap tops); the queries below call it first.

        Args:
            now: current time.
        """
        heap = self._stale_heap
        while heap and heap[0][0] < now:
            _, _, worker = heapq.heappop(heap)
            worker.queued_for_stale = False
            if worker.removed or worker.stale:
                continue
            if now - worker.last_seen > worker.stale_after:
                worker.stale = True
                self._update_membership(worker)
            else:
                self._push_stale_deadline(worker)
        heap = self._mark_heap
        while heap and heap[0][0] <= now:
            _, _, worker = heapq.heappop(heap)
            worker.queued_for_mark = False
            if worker.removed or worker.mark_until is None:
                continue
            if worker.mark_until <= now:
                worker.mark_until = None
                self._update_membership(worker)
            else:
                self._push(self._mark_heap, worker.mark_until, worker)
                worker.queued_for_mark = True

    def _push_stale_deadline(self, worker: WorkerLoad) -> None:
        if math.isfinite(worker.stale_after):
            self._push(self._stale_heap, worker.last_seen + worker.stale_after, worker)
            worker.queued_for_stale = True

    def _push(self, heap: list[tuple[float, int, WorkerLoad]], at: float, w: WorkerLoad) -> None:
        heapq.heappush(heap, (at, next(self._tie), w))

    def mark_overloaded(self, worker_id: str, now: float) -> bool:
        """Mark a worker overloaded (it answered ``Server overloaded:``) for one lease.

        Args:
            worker_id: the worker that rejected.
            now: current time.

        Returns:
            Whether the worker is known.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.mark_until = now + self.mark_lease
        if not worker.queued_for_mark:
            self._push(self._mark_heap, worker.mark_until, worker)
            worker.queued_for_mark = True
        self._update_membership(worker)
        return True

    def mark_draining(self, worker_id: str) -> bool:
        """Take a worker out of routing because it answered ``Server unavailable:``.

        It stays unavailable until a heartbeat with status ``ready`` or a new registration.

        Returns:
            Whether the worker is known.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.draining = True
        self._update_membership(worker)
        return True

    # ------------------------------------------------------------------ thresholds

    def thresholds(self, model: str) -> Thresholds:
        """The thresholds in force for ``model`` (the defaults for a model not seen yet)."""
        pool = self._pools.get(model)
        return pool.thresholds if pool else self.default_thresholds

    def all_thresholds(self) -> list[tuple[str, Thresholds]]:
        """``(model, thresholds)`` for every known model (what ``GET /busy_threshold`` lists)."""
        return [(name, pool.thresholds) for name, pool in self._pools.items()]

    def set_thresholds(self, model: str, update: Thresholds) -> Thresholds:
        """Set the non-``None`` values of ``update`` for ``model`` and re-judge its workers now.

        A threshold cannot be unset this way (as in Dynamo's API). The scan is O(workers of the
        model), once per change.

        Args:
            model: a known model.
            update: the values to set.

        Returns:
            The thresholds now in force for the model.

        Raises:
            KeyError: no worker ever announced ``model`` (the API answers 404).
        """
        pool = self._pools[model]
        pool.thresholds = pool.thresholds.merged(update)
        for worker in pool.workers.values():
            for rank in worker.ranks:
                self._recompute_rank(worker, rank)
            self._update_membership(worker)
        return pool.thresholds

    # ------------------------------------------------------------------ router's own count

    def request_sent(self, worker_id: str, prompt_tokens: int) -> InFlight | None:
        """Charge a request sent to a worker to the rank with the fewest own blocks.

        Args:
            worker_id: the worker chosen.
            prompt_tokens: the request's prompt length in tokens (an estimate is fine).

        Returns:
            The handle to pass to :meth:`request_output` and :meth:`request_finished`, or
            ``None`` when the worker is not connected.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return None
        prompt_tokens = max(0, prompt_tokens)
        rank_index = min(range(len(worker.ranks)), key=lambda r: worker.ranks[r].own_blocks)
        in_flight = InFlight(rank_index, prompt_tokens, _blocks(prompt_tokens, worker.config))
        worker._in_flight.add(in_flight)
        rank = worker.ranks[rank_index]
        rank.own_blocks += in_flight.blocks
        rank.own_prefill += prompt_tokens
        self._recompute_rank(worker, rank)
        self._update_membership(worker)
        return in_flight

    def request_output(self, worker_id: str, in_flight: InFlight, tokens: int) -> None:
        """Record generated tokens: ends the request's prefill charge, and with
        ``track_output_blocks`` grows its block charge.

        Args:
            worker_id: the worker the request went to.
            in_flight: the handle from :meth:`request_sent`.
            tokens: tokens generated since the last call (0 is fine: prefill is over).
        """
        worker = self._workers.get(worker_id)
        if worker is None or in_flight.finished or in_flight not in worker._in_flight:
            return
        rank = worker.ranks[in_flight.rank]
        in_flight.output_tokens += max(0, tokens)
        # Called once per streamed chunk: after the first one, nothing changes unless output
        # blocks are tracked and the request just crossed into a new block.
        changed = in_flight.prefill_tokens > 0
        rank.own_prefill -= in_flight.prefill_tokens
        in_flight.prefill_tokens = 0
        if self.track_output_blocks:
            blocks = _blocks(in_flight.prompt_tokens + in_flight.output_tokens, worker.config)
            if blocks != in_flight.blocks:
                rank.own_blocks += blocks - in_flight.blocks
                in_flight.blocks = blocks
                changed = True
        if changed:
            self._recompute_rank(worker, rank)
            self._update_membership(worker)

    def request_finished(self, worker_id: str, in_flight: InFlight) -> None:
        """Remove a request's charge (completed, failed, rejected or cancelled); idempotent.

        Args:
            worker_id: the worker the request went to.
            in_flight: the handle from :meth:`request_sent`.
        """
        worker = self._workers.get(worker_id)
        if worker is None or in_flight.finished or in_flight not in worker._in_flight:
            return
        in_flight.finished = True
        worker._in_flight.discard(in_flight)
        rank = worker.ranks[in_flight.rank]
        rank.own_blocks -= in_flight.blocks
        rank.own_prefill -= in_flight.prefill_tokens
        self._recompute_rank(worker, rank)
        self._update_membership(worker)

    # ------------------------------------------------------------------ queries

    def free_workers(self, model: str, now: float) -> FreeSet[WorkerLoad] | None:
        """The free workers of a model (a live view: do not keep it), ``None`` if unknown."""
        self.expire(now)
        pool = self._pools.get(model)
        return pool.free if pool else None

    def available_count(self, model: str, now: float) -> int:
        """Workers of ``model`` registered, fresh and not draining (busy or marked included)."""
        self.expire(now)
        pool = self._pools.get(model)
        return pool.available if pool else 0

    def unsaturated_free_count(self, model: str, now: float) -> int:
        """Free workers of ``model`` not over the frontend-queue threshold."""
        self.expire(now)
        pool = self._pools.get(model)
        return pool.unsaturated_free if pool else 0

    def all_models_busy(self, now: float) -> bool:
        """O(1): every known model has available workers and none of them is free.

        The HTTP layer can answer 529 before reading a request body when this holds: whatever
        the model, the request could not be routed.
        """
        self.expire(now)
        models = len(self._pools)
        return models > 0 and self._models_available == models and self._models_with_free == 0

    def rank_gauges(self) -> Iterator[RankGauge]:
        """Figures for the per-worker, per-rank gauges of every connected worker.

        Meant to be read at scrape time (e.g. from a custom Prometheus collector); a removed
        worker simply stops appearing.
        """
        for worker in list(self._workers.values()):
            for index, rank in enumerate(worker.ranks):
                yield RankGauge(
                    worker.config.worker_id,
                    index,
                    rank.effective_blocks,
                    rank.effective_prefill,
                    worker.config.kv_total_blocks,
                )


def _rank_busy(config: wire.RuntimeConfig, t: Thresholds, blocks: int, prefill: int) -> bool:
    """The busy rule of one rank (see the module docstring, rule 1)."""
    if (
        t.active_decode_blocks is not None
        and config.kv_total_blocks > 0
        and blocks / config.kv_total_blocks > t.active_decode_blocks
    ):
        return True
    if t.active_prefill_tokens is not None and prefill > t.active_prefill_tokens:
        return True
    return t.active_prefill_tokens_frac is not None and prefill > int(
        t.active_prefill_tokens_frac * _max_batched(config)
    )


def _blocks(tokens: int, config: wire.RuntimeConfig) -> int:
    """KV blocks holding ``tokens`` tokens (a block size <= 0 counts as 1)."""
    block_size = max(1, config.block_size)
    return -(-tokens // block_size)
