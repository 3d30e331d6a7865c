"""The frontend's load state of every worker (pure: no I/O, the time passed in as ``now``).

A :class:`Fleet` holds what this frontend knows about every connected worker: its announced
:class:`~shim_common.wire.RuntimeConfig`, the latest load of each data-parallel rank, the
router's own count of what it sent there, an overload mark, and whether the worker is stale or
draining. The busy rule of a rank is in :mod:`frontend_shim._thresholds`; how a worker counts as
busy, available and free, and how the free set of each model is kept current in O(1) per event, is
in :mod:`frontend_shim._free_sets`. This module adds what depends on events and time:

1. Load. A rank's figures are the larger of the worker's report (blocks: ``max(kv_used_blocks,
   active_decode_blocks)``; prefill: ``active_prefill_tokens``) and the router's own count
   (prompt blocks of requests in flight to that rank, plus their output blocks with
   ``track_output_blocks``; prompt tokens of requests sent to the rank that have not produced
   output yet).
   A finished request is gone at once (:meth:`Fleet.request_finished`): its charge is dropped,
   and it is taken off every report of its rank produced while it ran, which the frontend may
   read after the end (a :class:`~frontend_shim._free_sets.Release`): its blocks (prompt and
   output) from a report produced while it held its slot, its prompt tokens from one produced
   before its first output, at the larger of this frontend's count and the worker's own. The
   worker's final frame names that window in its event ``seq``; a report past the window ends
   the release. The rules of the window, the size and the bound (:data:`MAX_RELEASES`) are in
   :mod:`frontend_shim._releases`.
2. Stale: no event or heartbeat for longer than ``stale_after_intervals * heartbeat_interval``.
   The next event makes it fresh again. Dynamo has no staleness: a silent worker keeps its last
   load forever; here a worker that stopped talking stops receiving requests. Likewise a worker
   whose events this frontend reads too far behind (:meth:`Fleet.set_lagging`, from the link's
   lag measurement) is not routed to until the link has caught up: a frontend that cannot keep
   up says so instead of routing on old load.
3. Overload mark (a worker answered ``Server overloaded:``): the worker is not free until its next
   load event or heartbeat, or until the lease (1 s by default) runs out, whichever comes first.
   A mark can never stick (Dynamo issue #14213). The mark has the class of the request refused
   (:mod:`frontend_shim._free_sets` rule 4): a request of a better class may still be routed to a
   marked worker when none is free, and a refusal of it widens the mark.
3b. A refusal that proves only a long queue (``slo``, ``queue_timeout``) marks only what it
   proves (:meth:`Fleet.mark_long_queue`): for one lease, renewed by each such refusal, the
   worker is marked, for the refused priority and worse, exactly while this frontend's picture
   of what that priority would queue behind there is at least the depth it was refused at (the
   rules are in :mod:`frontend_shim._queue_hold`; :meth:`Fleet.request_pending` and
   :meth:`Fleet.request_answered` keep the picture). Each event re-judges it with the new
   queue, so a worker whose queue went down is routed to again at once, not after the lease.
4. A threshold change (:meth:`Fleet.set_thresholds`) recomputes every worker of that model at
   once (one scan per change), so it takes effect immediately: sooner than Dynamo's documented
   "next load event or within one second".
5. Time-driven changes (staleness, mark expiry) are applied by :meth:`Fleet.expire`, which every
   query that depends on them calls first. Each uses a heap holding at most one entry per
   worker; an event only stores a time, so it stays O(1).
6. Effective limit. A worker with a time-to-first-token objective reports L, the engine limit in
   force, with its ingress gauges in every event. The ``kv`` router weighs its gate's occupancy
   of L (see :attr:`~frontend_shim._free_sets.WorkerLoad.load_cost`), and the fleet keeps, in
   O(1) per event, the sum of L and of requests running over the workers that report it:
   :meth:`Fleet.slot_share` (below 1 right after L fell, while more run than L allows).

Router-own accounting. :meth:`Fleet.request_sent` charges a request to the DP rank the ``kv``
router chose for it, at the pick (so the next pick sees it), and ``held=False`` at its end undoes
the charge of a request the worker never started, while the worker's ``Started`` brings it to
the worker's count of the prompt (:meth:`Fleet.request_started`); in the other modes the
frontend does not know which rank a worker gives a request, so it charges the rank with the
fewest own blocks (ties: lowest rank), at the worker's first reply, with the worker's count.
The returned :class:`~frontend_shim._sequences.InFlight` is the handle for
:meth:`Fleet.request_output` and :meth:`Fleet.request_finished`, which undo exactly what was
charged.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Final, NamedTuple

from frontend_shim import _queue_hold, _releases
from frontend_shim._free_sets import FreeSet, FreeSets, RankState, WorkerLoad, load_cost
from frontend_shim._releases import MAX_RELEASES
from frontend_shim._sequences import InFlight
from shim_common import wire
from shim_common.wire import BusyThresholds

__all__ = [
    "DEFAULT_MARK_LEASE",
    "DEFAULT_MARK_TENANTS",
    "DEFAULT_STALE_AFTER_INTERVALS",
    "MAX_RELEASES",
    "Fleet",
    "RankGauge",
]

#: Seconds an overload mark lasts at most without a load event from the worker.
DEFAULT_MARK_LEASE: Final = 1.0
#: A worker is stale after this many heartbeat intervals without an event or heartbeat.
DEFAULT_STALE_AFTER_INTERVALS: Final = 3.0
#: Tenants a mark names at its priority; past that it covers every tenant of the priority.
DEFAULT_MARK_TENANTS: Final = 8


class RankGauge(NamedTuple):
    """One rank's figures for the frontend's per-worker gauges (read at scrape time)."""

    worker_id: str
    dp_rank: int
    #: The blocks the decode check uses: max(reported, router's own count).
    active_decode_blocks: int
    #: The tokens the prefill checks use: max(reported, router's own count).
    active_prefill_tokens: int
    kv_total_blocks: int


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
        mark_tenants: tenants a mark names at its priority before it covers them all (>= 1).
    """

    def __init__(
        self,
        *,
        default_thresholds: BusyThresholds | None = None,
        track_output_blocks: bool = False,
        queue_threshold: float | None = None,
        stale_after_intervals: float = DEFAULT_STALE_AFTER_INTERVALS,
        mark_lease: float = DEFAULT_MARK_LEASE,
        mark_tenants: int = DEFAULT_MARK_TENANTS,
    ) -> None:
        if queue_threshold is not None and not (
            math.isfinite(queue_threshold) and queue_threshold > 0
        ):
            raise ValueError(f"queue_threshold must be a finite value > 0, got {queue_threshold}")
        if not stale_after_intervals > 0:
            raise ValueError(f"stale_after_intervals must be > 0, got {stale_after_intervals}")
        if not mark_lease > 0:
            raise ValueError(f"mark_lease must be > 0, got {mark_lease}")
        if mark_tenants < 1:
            raise ValueError(f"mark_tenants must be >= 1, got {mark_tenants}")
        self.default_thresholds = default_thresholds or BusyThresholds()
        self.track_output_blocks = track_output_blocks
        self.queue_threshold = queue_threshold
        self.stale_after_intervals = stale_after_intervals
        self.mark_lease = mark_lease
        self.mark_tenants = mark_tenants
        self._sets = FreeSets(queue_threshold)
        self._pools = self._sets.pools
        self._workers: dict[str, WorkerLoad] = {}
        # (deadline, tie-breaker, worker): at most one live entry per worker and heap.
        self._stale_heap: list[tuple[float, int, WorkerLoad]] = []
        self._mark_heap: list[tuple[float, int, WorkerLoad]] = []
        self._tie = itertools.count()
        # Over the workers that report an effective limit: the sum of L, and of what they run.
        self._limit_sum = 0
        self._limited_running = 0

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
        pool = self._sets.pool(config.model, self.default_thresholds)
        # A worker that announces no heartbeat interval cannot be judged stale.
        interval = config.heartbeat_interval
        stale_after = self.stale_after_intervals * interval if interval > 0 else math.inf
        worker = WorkerLoad(config, pool, now, stale_after, self.track_output_blocks)
        pool.workers[config.worker_id] = worker
        self._workers[config.worker_id] = worker
        self._push_stale_deadline(worker)
        self._sets.update_membership(worker)
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
        self._set_gauges(worker, 0, 0, None)
        self._sets.update_membership(worker)
        del worker.pool.workers[worker_id]
        worker.sequences.forget()
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
        """Every model announced by a worker and not forgotten since (:meth:`forget_model`), in
        order of first announcement."""
        return list(self._pools)

    def is_known_model(self, model: str) -> bool:
        """Whether some worker has announced ``model`` and it was not forgotten since."""
        return model in self._pools

    def forget_model(self, model: str) -> bool:
        """Forget ``model`` and its thresholds, if no worker of it is registered now; returns
        whether it was forgotten (the caller knows no worker will announce it again soon)."""
        pool = self._pools.get(model)
        if pool is None or pool.workers:
            return False
        del self._pools[model]
        return True

    # ------------------------------------------------------------------ events

    def apply(self, worker_id: str, event: wire.WorkerEvent, now: float) -> bool:
        """Apply one load event or heartbeat of a worker (:meth:`apply_batch` of one event).

        Returns:
            Whether it was applied (``False``: unknown worker or an old ``seq``).
        """
        return self.apply_batch(worker_id, (event,), now) == 1

    def apply_batch(self, worker_id: str, events: Iterable[wire.WorkerEvent], now: float) -> int:
        """Apply the load events and heartbeats of one worker, oldest first.

        Clears the worker's overload mark, makes it fresh, and recomputes only its own ranks.
        Events older than one already applied (by ``seq``) are ignored; a rank outside
        ``[0, data_parallel_size)`` is ignored. A heartbeat whose ``status`` is ``draining``
        makes the worker unavailable until a heartbeat says ``ready``. What belongs to the
        worker as a whole (its gauges and L, freshness, its place in the free set) is settled
        once, from the newest event: applying the events one by one would end in the same state.

        Args:
            worker_id: the worker the events came from.
            events: :class:`~shim_common.wire.LoadEvent` and
                :class:`~shim_common.wire.Heartbeat` values, in increasing ``seq``.
            now: current time.

        Returns:
            How many were applied.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        newest: wire.WorkerEvent | None = None
        applied = 0
        for event in events:
            if event.seq <= worker.last_seq:
                continue
            worker.last_seq = event.seq
            newest = event
            applied += 1
            if isinstance(event, wire.LoadEvent):
                self._report(worker, event.load, event.seq)
            else:
                worker.draining = event.status == "draining"
                for load in event.loads:
                    self._report(worker, load, event.seq)
        if newest is None:
            return 0
        worker.last_seen = now
        worker.stale = False
        worker.mark_until = None
        worker.hold_marks = False
        worker.pending.clear()
        worker.queue_ahead = newest.queue_ahead
        if not worker.queued_for_stale:
            self._push_stale_deadline(worker)
        self._set_gauges(
            worker, newest.engine_requests, newest.queued_requests, newest.effective_limit
        )
        if worker.releases:
            _releases.fit(worker, self._sets)
        if worker.hold_bound is not None:
            self._judge_hold(worker, now)
        self._sets.update_membership(worker)
        return applied

    def slot_share(self) -> float:
        """L in force over the requests running, summed over the workers that report L, at most
        1 (1 when none does, or nothing runs): the share of today's completion pace that will
        hold once the workers have come down to their limits."""
        if self._limited_running <= self._limit_sum or self._limited_running == 0:
            return 1.0
        return self._limit_sum / self._limited_running

    def _set_gauges(self, worker: WorkerLoad, engine: int, queued: int, limit: int | None) -> None:
        # Rule 6: the worker's gauges and L, and the fleet's sums over the workers with an L.
        if worker.effective_limit is not None:
            self._limit_sum -= worker.effective_limit
            self._limited_running -= worker.engine_requests
        worker.engine_requests = engine
        worker.queued_requests = queued
        worker.effective_limit = limit
        if limit is not None:
            self._limit_sum += limit
            self._limited_running += engine
        worker.load_cost = load_cost(worker)

    def _report(self, worker: WorkerLoad, load: wire.RankLoad, seq: int) -> None:
        if not 0 <= load.dp_rank < len(worker.ranks):
            return
        rank = worker.ranks[load.dp_rank]
        rank.report_seq = seq
        if not rank.reported:
            # From now on this rank takes part in the AND of _free_sets.py's rule 1.
            rank.reported = True
            worker.reported_ranks += 1
        rank.reported_blocks = max(load.kv_used_blocks, load.active_decode_blocks)
        rank.reported_prefill = load.active_prefill_tokens
        self._sets.recompute_rank(worker, rank)

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
            # The same sum as the heap key: written as a difference, float rounding could call
            # a worker due here and not stale there, and the loop would never end.
            if worker.last_seen + worker.stale_after < now:
                worker.stale = True
                self._sets.update_membership(worker)
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
                if worker.hold_marks:
                    worker.hold_marks = False
                    worker.hold_bound = None
                self._sets.update_membership(worker)
            else:
                self._push(self._mark_heap, worker.mark_until, worker)
                worker.queued_for_mark = True

    def _push_stale_deadline(self, worker: WorkerLoad) -> None:
        if math.isfinite(worker.stale_after):
            self._push(self._stale_heap, worker.last_seen + worker.stale_after, worker)
            worker.queued_for_stale = True

    def _push(self, heap: list[tuple[float, int, WorkerLoad]], at: float, w: WorkerLoad) -> None:
        heapq.heappush(heap, (at, next(self._tie), w))

    def mark_overloaded(
        self, worker_id: str, now: float, priority: int | None = None, tenant: str = ""
    ) -> bool:
        """Mark a worker overloaded (it answered ``Server overloaded:``) for one lease.

        The mark covers the class of the refused request, widened by every refusal while it is
        in force (:mod:`frontend_shim._free_sets` rule 4). Each refusal renews the lease.

        Args:
            worker_id: the worker that rejected.
            now: current time.
            priority: the refused request's priority; ``None``: unknown, the mark covers every
                class.
            tenant: the refused request's tenant.

        Returns:
            Whether the worker is known.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        # A mark held for a long queue is not a refusal of this kind: start afresh.
        fresh = worker.mark_until is None or worker.mark_until <= now or worker.hold_marks
        if priority is None:
            # Below every valid priority, with every tenant: nothing beats it.
            worker.mark_priority, worker.mark_tenants = wire.PRIORITY_MIN - 1, None
        elif fresh or priority < worker.mark_priority:
            worker.mark_priority, worker.mark_tenants = priority, {tenant}
        elif priority == worker.mark_priority and worker.mark_tenants is not None:
            worker.mark_tenants.add(tenant)
            if len(worker.mark_tenants) > self.mark_tenants:
                worker.mark_tenants = None
        worker.mark_until = now + self.mark_lease
        worker.hold_marks = False
        if not worker.queued_for_mark:
            self._push(self._mark_heap, worker.mark_until, worker)
            worker.queued_for_mark = True
        self._sets.update_membership(worker)
        return True

    def mark_long_queue(
        self, worker_id: str, now: float, priority: int, queue_bound: int | None = None
    ) -> bool:
        """Take note of a refusal that proves only a long queue (``slo``, ``queue_timeout``;
        rule 3b): the worker is held back, for the refused priority and worse, only while this
        frontend's picture of its queue at that priority is at least the depth it refused at;
        for one lease, renewed by each such refusal.

        Args:
            worker_id: the worker that refused.
            now: current time.
            priority: the refused request's priority.
            queue_bound: the depth the worker said it refuses at (its ``Rejected``); ``None``
                (a queue timeout, or an older worker): the depth of this frontend's picture now.

        Returns:
            Whether the worker is known.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        _queue_hold.note_refusal(worker, now, self.mark_lease, priority, queue_bound)
        self._judge_hold(worker, now)
        self._sets.update_membership(worker)
        return True

    def request_pending(self, worker_id: str, now: float, priority: int = 0) -> None:
        """A request of ``priority`` goes to the worker: in its queue until its first reply."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            _queue_hold.pending(worker, priority)
            self._rejudge_hold(worker, now)

    def request_answered(self, worker_id: str, now: float, priority: int = 0) -> None:
        """The worker's first reply to a request of ``priority`` (started, refused or failed)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            _queue_hold.answered(worker, priority)
            self._rejudge_hold(worker, now)

    def _rejudge_hold(self, worker: WorkerLoad, now: float) -> None:
        if worker.hold_bound is not None:
            self._judge_hold(worker, now)
            self._sets.update_membership(worker)

    def _judge_hold(self, worker: WorkerLoad, now: float) -> None:
        # Rule 3b; the caller updates the membership.
        if _queue_hold.judge(worker, now) and worker.mark_until is not None:
            self._push(self._mark_heap, worker.mark_until, worker)
            worker.queued_for_mark = True

    def set_lagging(self, worker_id: str, lagging: bool) -> bool:
        """Take a worker out of routing while its events are read too far behind, or back.

        Its link measures the lag of its event stream; routing on load that old would be
        routing blind, so the worker counts as unavailable (like a stale one) until the link
        has caught up.

        Returns:
            Whether the worker is known.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.lagging = lagging
        self._sets.update_membership(worker)
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
        self._sets.update_membership(worker)
        return True

    # ------------------------------------------------------------------ thresholds

    def thresholds(self, model: str) -> BusyThresholds:
        """The thresholds in force for ``model`` (the defaults for a model not seen yet)."""
        pool = self._pools.get(model)
        return pool.thresholds if pool else self.default_thresholds

    def all_thresholds(self) -> list[tuple[str, BusyThresholds]]:
        """``(model, thresholds)`` for every known model (what ``GET /busy_threshold`` lists)."""
        return [(name, pool.thresholds) for name, pool in self._pools.items()]

    def set_thresholds(self, model: str, update: BusyThresholds) -> BusyThresholds:
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
                self._sets.recompute_rank(worker, rank)
            self._sets.update_membership(worker)
        return pool.thresholds

    # ------------------------------------------------------------------ router's own count

    def request_sent(
        self,
        worker_id: str,
        prompt_tokens: int,
        dp_rank: int | None = None,
        names: Sequence[int] = (),
    ) -> InFlight | None:
        """Charge a request sent to a worker to the rank chosen for it, else to the rank with
        the fewest own blocks (:mod:`frontend_shim._sequences`, rules 1 and 2).

        Args:
            worker_id: the worker chosen.
            prompt_tokens: the request's prompt length in tokens (an estimate is fine).
            dp_rank: the rank the ``kv`` router chose (``None``, or out of range: the rule above).
            names: the names of the prompt's full blocks (the ``kv`` router's): a block that
                another request in flight on the rank holds is counted once, as the worker's
                cache shares it.

        Returns:
            The handle to pass to :meth:`request_output` and :meth:`request_finished`, or
            ``None`` when the worker is not connected.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return None
        sequences = worker.sequences
        index = sequences.rank_for(dp_rank)
        rank = worker.ranks[index]
        in_flight = sequences.sent(index, prompt_tokens, rank.report_seq, names)
        self._rejudge_rank(worker, rank)
        return in_flight

    def _rejudge_rank(self, worker: WorkerLoad, rank: RankState) -> None:
        self._sets.recompute_rank(worker, rank)
        self._sets.update_membership(worker)

    def request_started(self, worker_id: str, in_flight: InFlight, prompt_tokens: int) -> None:
        """The worker started a request charged at the pick: the charge takes the worker's count
        of the prompt (``prompt_tokens``; 0, a worker that did not say: the estimate stays).

        Args:
            worker_id: the worker the request went to.
            in_flight: the handle from :meth:`request_sent`.
            prompt_tokens: the prompt's tokens as the worker counted them (its ``Started``).
        """
        worker = self._workers.get(worker_id)
        if worker is not None:
            changed = worker.sequences.started(in_flight, prompt_tokens)
            if changed is not None:
                self._rejudge_rank(worker, worker.ranks[changed])

    def request_output(self, worker_id: str, in_flight: InFlight, tokens: int) -> None:
        """Record generated tokens: ends the request's prefill charge, and with
        ``track_output_blocks`` grows its block charge.

        Args:
            worker_id: the worker the request went to.
            in_flight: the handle from :meth:`request_sent`.
            tokens: tokens generated since the last call (0 is fine: prefill is over).
        """
        worker = self._workers.get(worker_id)
        if worker is not None:
            seq = worker.ranks[in_flight.rank].report_seq
            changed = worker.sequences.output(in_flight, tokens, seq)
            if changed is not None:
                self._rejudge_rank(worker, worker.ranks[changed])

    def request_finished(
        self,
        worker_id: str,
        in_flight: InFlight,
        window: wire.End | wire.Failed | None = None,
        *,
        held: bool = True,
    ) -> None:
        """Remove a request from the worker's load at once (completed, failed or cancelled):
        its charge, and what reports of the worker produced while it ran still count of it
        (rule 1); idempotent.

        Args:
            worker_id: the worker the request went to.
            in_flight: the handle from :meth:`request_sent`.
            window: the worker's final frame, whose ``*_seq`` fields say which of its events
                count the request; ``None``, or fields unset: the frontend's own view. An
                ``End``'s token counts size the release when they are larger than this
                frontend's (rule 1).
            held: ``False`` for a request charged at the pick that the worker never started
                (refused, failed or cancelled first): no report counted it, so none is released.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        changed = worker.sequences.finished(in_flight)
        if changed is None:
            return
        rank = worker.ranks[changed]
        self._sets.recompute_rank(worker, rank)
        if held:
            release = _releases.release_of(worker, in_flight, window)
            if release is not None:
                _releases.add(worker, release, self._sets)
        self._sets.update_membership(worker)

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

    def unmarked_workers(self, model: str, now: float) -> FreeSet[WorkerLoad] | None:
        """Available workers of a model not marked overloaded, busy or not (a live view)."""
        self.expire(now)
        pool = self._sets.pools.get(model)
        return pool.unmarked if pool else None

    def marked_workers(self, model: str, now: float) -> FreeSet[WorkerLoad] | None:
        """Available workers of a model that are marked overloaded, busy or not (a live view)."""
        self.expire(now)
        pool = self._sets.pools.get(model)
        return pool.marked if pool else None

    def every_worker_marked(self, model: str | None = None) -> bool:
        """Whether no available worker (of ``model``, or of any model) is unmarked: a request
        that found nothing free was refused by overload marks, not by the busy thresholds.
        O(1) per model."""
        pools = self._sets.pools
        if model is not None:
            pool = pools.get(model)
            return pool is not None and not pool.unmarked
        return all(not pool.unmarked for pool in pools.values())

    def all_models_busy(self, now: float) -> bool:
        """O(1): every known model has available workers and none of them is free.

        Whatever the model, a request could not be routed to a free worker; whether its class
        could still pass a mark is :meth:`may_shed_unread`'s question.
        """
        self.expire(now)
        return self._sets.all_busy()

    def may_shed_unread(self, now: float) -> bool:
        """O(1): :meth:`all_models_busy`, and no worker is held back by a mark alone (marked and
        not busy): then no request's class can find a worker, and the HTTP layer may answer
        529 before reading the body. While some worker is marked but not busy, a request of a
        better class may still go there (:mod:`frontend_shim._free_sets` rule 4), and its class
        may be in the body."""
        return self.all_models_busy(now) and self._sets.marked_idle == 0

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
