"""Routing decisions over a :class:`~frontend_shim._load.Fleet` (pure: no I/O, time passed in).

What the I/O side does for one request, and which piece here answers each question::

    if fleet.may_shed_unread(now) and the head rules out a busy-exempt priority:
        529 before reading the body                                 (Fleet, O(1))
    if queue.should_park(fleet, model, now):                        (FrontendQueue)
        queue.park(model, waiter) or 529 (queue full); wait until queue.release(fleet, now)
        hands the waiter back (called after applying events and on completions)
    loop (the request's dispatch, frontend_shim._dispatch, keeps the workers that refused it):
        outcome = router.pick_class(model, now, priority, tenant, refused_by, exempt)
        Routed -> send; on Rejected(text): reason = wire.RejectReason.parse(text), once;
                  router.on_rejected(id, reason, now, priority, tenant, bound) marks the
                  worker; pick again while the migration limit allows, else 529
        AllBusy -> 529 (frontend_shim._retry_advice says when) | NoWorkers -> 503
        UnknownModel -> 404

Rules:

1. Only *free* workers are picked: registered for the model, fresh, not draining, not busy, not
   marked (see :mod:`frontend_shim._free_sets`), and not in ``exclude``.
2. Outcomes, checked in this order: no worker connected at all -> :class:`NoWorkers` (503; the
   frontend cannot tell an unknown model from one whose workers are down); a model no worker
   ever announced -> :class:`UnknownModel` (404); no available worker for the model ->
   :class:`NoWorkers` (503); available workers but none free (busy, marked, or excluded) ->
   :class:`AllBusy` (529); else :class:`Routed`.
3. Modes: ``round-robin`` cycles a cursor over the free set (O(1); the set is an array with
   swap-remove, so the cycle order changes as workers come and go, but no free worker is
   skipped for long); ``random`` draws uniformly from the free set (O(1)); ``kv`` scores every
   free rank of the free set by the cost rule of :mod:`frontend_shim._kv_cost` (the prompt's
   uncached blocks against the rank's active blocks, the router's own count included), starting
   the scan at the cursor so that ties rotate, and names the rank chosen in :class:`Routed`.
   ``kv`` is O(free ranks) per pick (see bench/bench_router.py).
4. A rejection ``Server overloaded: ...`` marks the worker (lease, cleared by its next event)
   for the refused request's class, but one that proves only a long wait (an objective's
   ``slo``, a ``queue_timeout``) only while the worker's queue, at the refused priority, is as
   deep as the one it refused at (:mod:`frontend_shim._queue_hold`); ``Server unavailable:
   ...`` takes it out until it reports ``ready``. Either way the request never
   started, so it may go to another worker while ``migration_limit`` allows, never to one that
   already rejected it. A text with neither prefix marks nothing and is not tried elsewhere.
   The text is read into a :class:`~shim_common.wire.RejectReason` once, where the reply is
   read; the router takes that.
5. Class-aware marks (:meth:`Router.pick_class`; the mark's class is
   :mod:`frontend_shim._free_sets` rule 4). Free workers come first, chosen by the mode, so the
   common path costs what rule 3 says. Only when none is free (and, for a busy-exempt request,
   no unmarked worker either): a look at no more than :data:`MARKED_LOOK` marked workers of the
   model, from a rotating cursor, for the least loaded one whose mark the request's class beats
   (not busy, unless the request is busy-exempt). So a request of a better priority, or of
   equal priority and another tenant, still reaches the worker where it may displace a
   waiting request; the cost per request stays bounded however many workers are marked, at
   the price that a look over more than :data:`MARKED_LOOK` marked workers may miss one. None
   found: :class:`AllBusy`, which the HTTP layer answers ``marked`` when every available worker
   of the model is marked. A client's retry of a refused request beats every mark
   (frontend_shim._retry_advice, rule 3): a mark is a guess for a second, the gate decides.
6. Frontend queue (``--router-queue-threshold f``): a request parks instead of being routed when
   the model has free workers but all of them are saturated (every reported rank has more
   prefill tokens than ``int(f * max_num_batched_tokens)``), or when it has free workers and
   requests of that model already wait (first come, first served). With no free worker there
   is nothing to wait for: the request gets its 529 (or 503) at once. The queue is bounded
   (one bound for all models); full means 529. A release hands back at most one waiter per
   unsaturated free worker (each routed request adds to the
   router's own prefill count, so the next release sees it), or every waiter of a model that
   has no free worker left (they then get their 529/503 at once instead of waiting).
7. Retry-After: the rate at which requests complete is measured here (:class:`CompletionRate`);
   what an overload answer advises is in :mod:`frontend_shim._retry_advice`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
import random
from collections.abc import Collection, Hashable, Iterable
from typing import Final, Generic, TypeVar

from frontend_shim._free_sets import FreeSet, WorkerLoad, mark_admits
from frontend_shim._kv_cost import NO_PROMPT, KvChoice, KvScorer, Prompt
from frontend_shim._kv_index import KvIndex
from frontend_shim._load import Fleet
from shim_common import wire

__all__ = [
    "MARKED_LOOK",
    "AllBusy",
    "CompletionRate",
    "FrontendQueue",
    "NoWorkers",
    "Outcome",
    "RejectionKind",
    "Routed",
    "Router",
    "RouterMode",
    "UnknownModel",
]

#: Marked workers one request looks at, at most, for one whose mark its class beats (rule 5).
MARKED_LOOK: Final = 16
#: Refusals that prove only a long wait, held by the queue's depth (rule 4).
_LONG_QUEUE: Final = frozenset({wire.RejectReason.SLO, wire.RejectReason.QUEUE_TIMEOUT})


class RouterMode(enum.StrEnum):
    """``--router-mode``."""

    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    KV = "kv"


# ----------------------------------------------------------------------------- outcomes


@dataclasses.dataclass(frozen=True, slots=True)
class Routed:
    """Send the request to this worker."""

    worker_id: str
    #: The rank the ``kv`` router chose, with what it assumed (``None`` in the other modes).
    kv: KvChoice | None = dataclasses.field(default=None, compare=False)

    @property
    def dp_rank(self) -> int | None:
        """The data-parallel rank chosen, when the mode chooses one."""
        return self.kv.dp_rank if self.kv is not None else None


@dataclasses.dataclass(frozen=True, slots=True)
class AllBusy:
    """Workers are available for the model but none is free: answer the overload status (529)."""

    http_status: int = 529


@dataclasses.dataclass(frozen=True, slots=True)
class NoWorkers:
    """No worker available for the model (or none connected at all): answer 503."""

    http_status: int = 503


@dataclasses.dataclass(frozen=True, slots=True)
class UnknownModel:
    """No worker ever announced this model (while some worker is connected): answer 404."""

    http_status: int = 404


Outcome = Routed | AllBusy | NoWorkers | UnknownModel

_by_load_cost: Final = operator.attrgetter("load_cost")

_ALL_BUSY: Final = AllBusy()
_NO_WORKERS: Final = NoWorkers()
_UNKNOWN_MODEL: Final = UnknownModel()


RejectionKind = wire.RejectionKind


# ----------------------------------------------------------------------------- router


class Router:
    """Chooses a free worker for a request.

    Args:
        fleet: the load state the choices are made from (shared with the I/O side).
        mode: the selection policy.
        migration_limit: times a rejected request may be retried on another worker (>= 0).
        rng: random source for ``random`` mode (seed it in tests).
        kv: the ``kv`` mode's scorer (its index is fed by the links); ``None``: one over an
            empty index, which scores by load alone.
        cursor: where round-robin starts and ``kv``'s ties first rotate from. A frontend starts
            it anywhere (several frontends of one fleet, each starting at the first worker,
            would send their first requests of a burst to the same worker).
    """

    def __init__(
        self,
        fleet: Fleet,
        mode: RouterMode = RouterMode.ROUND_ROBIN,
        *,
        migration_limit: int = 0,
        rng: random.Random | None = None,
        kv: KvScorer | None = None,
        cursor: int = 0,
    ) -> None:
        if migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {migration_limit}")
        self.fleet = fleet
        self.mode = RouterMode(mode)
        self.migration_limit = migration_limit
        self._rng = rng or random.Random()
        self._cursor = cursor
        self.kv = kv if kv is not None else KvScorer(KvIndex(), rng=self._rng)

    def pick(
        self,
        model: str,
        now: float,
        exclude: Collection[str] = (),
        prompt: Prompt = NO_PROMPT,
    ) -> Outcome:
        """Choose a free worker for a request of ``model`` (rules 1-3 of the module docstring).

        Args:
            model: the requested model.
            now: current time (expires marks and stale workers first).
            exclude: ids of workers not to choose (those that already rejected this request).
            prompt: the request's prompt, which the ``kv`` mode scores.

        Returns:
            :class:`Routed` with the worker, or why there is none.
        """
        fleet = self.fleet
        free = fleet.free_workers(model, now)
        if fleet.connected_count == 0:
            return _NO_WORKERS
        if free is None:
            return _UNKNOWN_MODEL
        if fleet.available_count(model, now) == 0:
            return _NO_WORKERS
        count = len(free)
        if count == 0:
            return _ALL_BUSY
        chosen: WorkerLoad | None
        if self.mode is RouterMode.KV:
            return self._cheapest(free, count, exclude, prompt, now)
        if self.mode is RouterMode.RANDOM:
            chosen = self._random(free, count, exclude)
        else:
            chosen = self._round_robin(free, count, exclude)
        return _ALL_BUSY if chosen is None else Routed(chosen.config.worker_id)

    def _round_robin(
        self, free: FreeSet[WorkerLoad], count: int, exclude: Collection[str]
    ) -> WorkerLoad | None:
        # At most len(exclude) + 1 steps: only excluded workers are stepped over.
        for _ in range(min(count, len(exclude) + 1)):
            worker = free[self._cursor % count]
            self._cursor += 1
            if worker.config.worker_id not in exclude:
                return worker
        return self._first_not_excluded(free, exclude)

    def _random(
        self, free: FreeSet[WorkerLoad], count: int, exclude: Collection[str]
    ) -> WorkerLoad | None:
        worker = free[self._rng.randrange(count)]
        if worker.config.worker_id not in exclude:
            return worker
        candidates = [w for w in free if w.config.worker_id not in exclude]
        return self._rng.choice(candidates) if candidates else None

    def _cheapest(
        self,
        free: FreeSet[WorkerLoad],
        count: int,
        exclude: Collection[str],
        prompt: Prompt,
        now: float,
    ) -> Outcome:
        # Starting at the cursor makes ties rotate.
        start = self._cursor % count
        self._cursor += 1
        candidates: Iterable[WorkerLoad] = free.rotated(start)
        if exclude:
            candidates = [w for w in candidates if w.config.worker_id not in exclude]
        choice = self.kv.choose(candidates, prompt, now)
        return _ALL_BUSY if choice is None else Routed(choice.worker.config.worker_id, choice)

    @staticmethod
    def _first_not_excluded(
        free: FreeSet[WorkerLoad], exclude: Collection[str]
    ) -> WorkerLoad | None:
        for worker in free:
            if worker.config.worker_id not in exclude:
                return worker
        return None

    def pick_exempt(self, model: str, now: float, exclude: Collection[str] = ()) -> Routed | None:
        """For a busy-exempt request that found no free worker: the least loaded worker that
        is available and not marked, busy or not (``None``: every one is marked or excluded).

        Only that worker's own cap (and displacement) can then refuse the request.
        """
        workers = self.fleet.unmarked_workers(model, now)
        if not workers:
            return None
        candidates: Iterable[WorkerLoad] = workers
        if exclude:
            candidates = [w for w in workers if w.config.worker_id not in exclude]
        chosen = min(candidates, key=_by_load_cost, default=None)
        return None if chosen is None else Routed(chosen.config.worker_id)

    def _pick_marked(
        self, model: str, now: float, priority: int, tenant: str, exclude: Collection[str],
        busy_ok: bool, beats_marks: bool = False,
    ) -> Routed | None:  # fmt: skip
        # Rule 5: the least loaded of at most MARKED_LOOK marked workers whose mark the class
        # beats (busy ones only for a busy-exempt request); None: none among those looked at.
        marked = self.fleet.marked_workers(model, now)
        if not marked:
            return None
        count = len(marked)
        start = self._cursor % count
        self._cursor += 1
        chosen: WorkerLoad | None = None
        for step in range(min(count, MARKED_LOOK)):
            worker = marked[(start + step) % count]
            if (
                (busy_ok or not worker.busy)
                and (beats_marks or mark_admits(worker, priority, tenant))
                and worker.config.worker_id not in exclude
                and (chosen is None or worker.load_cost < chosen.load_cost)
            ):
                chosen = worker
        return None if chosen is None else Routed(chosen.config.worker_id)

    def pick_class(
        self,
        model: str,
        now: float,
        priority: int,
        tenant: str,
        exclude: Collection[str] = (),
        *,
        exempt: bool = False,
        prompt: Prompt = NO_PROMPT,
        retry: bool = False,
    ) -> Outcome:
        """Choose a worker for a request of a class (rules 1-3, then 5).

        Args:
            model: the requested model.
            now: current time.
            priority: the request's priority.
            tenant: the request's tenant.
            exclude: ids of workers not to choose (those that already rejected this request).
            exempt: the request is busy-exempt: a busy worker may take it.
            prompt: the request's prompt, which the ``kv`` mode scores.
            retry: a client's retry of a refused request: a mark does not turn it away
                (rule 5: its class beats every mark).

        Returns:
            As :meth:`pick`.
        """
        outcome = self.pick(model, now, exclude, prompt)
        if not isinstance(outcome, AllBusy):
            return outcome
        routed = self.pick_exempt(model, now, exclude) if exempt else None
        if routed is None:
            routed = self._pick_marked(model, now, priority, tenant, exclude, exempt, retry)
        return outcome if routed is None else routed

    # ------------------------------------------------------------------ rejections, migration

    def on_rejected(
        self,
        worker_id: str,
        reason: wire.RejectReason,
        now: float,
        priority: int | None = None,
        tenant: str = "",
        queue_bound: int | None = None,
    ) -> RejectionKind:
        """Take note that a worker rejected a request (rule 4).

        Args:
            worker_id: the worker that rejected.
            reason: why, as the worker's text was read where it was decoded
                (:meth:`~shim_common.wire.RejectReason.parse`).
            now: current time.
            priority: the rejected request's priority (``None``: unknown; an overload mark
                then covers every class).
            tenant: the rejected request's tenant.
            queue_bound: for an objective's refusal, the queue depth the worker refuses at
                (:attr:`~shim_common.wire.Rejected.queue_bound`; ``None``: the depth of this
                frontend's picture).

        Returns:
            The kind of rejection.
        """
        kind = reason.kind
        if reason in _LONG_QUEUE:
            # Rule 4: it proves only that the worker's queue is long; held while it is.
            refused = wire.PRIORITY_MIN - 1 if priority is None else priority
            self.fleet.mark_long_queue(worker_id, now, refused, queue_bound)
        elif kind is RejectionKind.OVERLOADED:
            self.fleet.mark_overloaded(worker_id, now, priority, tenant)
        elif kind is RejectionKind.UNAVAILABLE:
            self.fleet.mark_draining(worker_id)
        return kind


_W = TypeVar("_W", bound=Hashable)


class FrontendQueue(Generic[_W]):
    """The bounded frontend queue: per-model FIFOs of opaque waiters, one bound for all.

    Use it only with a fleet that has a ``queue_threshold`` (without one, no worker is ever
    saturated and :meth:`should_park` is ``False`` unless requests already wait).

    A waiter is anything hashable the I/O side uses to wake a parked request (a ``trio.Event``,
    a request id...). Each waiter may be parked once at a time.

    Args:
        capacity: the most waiters parked at once, all models together (>= 1).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._size = 0
        # dicts as ordered sets: O(1) append, O(1) cancel, oldest first.
        self._by_model: dict[str, dict[_W, None]] = {}

    def __len__(self) -> int:
        return self._size

    def waiting(self, model: str) -> int:
        """Waiters parked for ``model``."""
        waiters = self._by_model.get(model)
        return len(waiters) if waiters else 0

    def models_waiting(self) -> list[str]:
        """Models that have waiters."""
        return list(self._by_model)

    def park(self, model: str, waiter: _W) -> bool:
        """Park a waiter at the back of its model's line.

        Args:
            model: the requested model.
            waiter: the waiter.

        Returns:
            ``False`` when the queue is full (the request is rejected with 529).

        Raises:
            ValueError: the waiter is already parked.
        """
        if self._size >= self.capacity:
            return False
        waiters = self._by_model.setdefault(model, {})
        if waiter in waiters:
            raise ValueError("waiter already parked")
        waiters[waiter] = None
        self._size += 1
        return True

    def cancel(self, model: str, waiter: _W) -> bool:
        """Take a waiter out (its client went away or its wait timed out).

        Returns:
            Whether it was parked.
        """
        waiters = self._by_model.get(model)
        if waiters is None or waiter not in waiters:
            return False
        del waiters[waiter]
        self._size -= 1
        if not waiters:
            del self._by_model[model]
        return True

    def should_park(self, fleet: Fleet, model: str, now: float) -> bool:
        """Whether a new request of ``model`` must wait here (rule 6 of the module docstring).

        When it is ``True`` the caller parks the request with :meth:`park` (which answers
        ``False`` when the queue is full: reject with 529).

        Args:
            fleet: the load state (its ``queue_threshold`` defines saturation).
            model: the requested model.
            now: current time.
        """
        if not fleet.free_workers(model, now):
            return False  # busy, unknown or no workers: pick() answers 529/404/503 at once
        return self.waiting(model) > 0 or fleet.unsaturated_free_count(model, now) == 0

    def release(self, fleet: Fleet, now: float) -> list[_W]:
        """Waiters that may go on now (rule 6), oldest first per model.

        The I/O side calls this after applying a batch of events and after a request ends,
        wakes each returned waiter, and each then calls :meth:`Router.pick_class`.

        Args:
            fleet: the load state.
            now: current time.

        Returns:
            The released waiters, no longer parked.
        """
        released: list[_W] = []
        for model in self.models_waiting():
            if fleet.free_workers(model, now):
                allowed = fleet.unsaturated_free_count(model, now)
            else:
                allowed = self.waiting(model)
            released.extend(self.pop(model, allowed))
        return released

    def pop(self, model: str, count: int) -> list[_W]:
        """Take up to ``count`` waiters of ``model``, oldest first.

        Args:
            model: the model.
            count: the most to take.

        Returns:
            The waiters taken.
        """
        waiters = self._by_model.get(model)
        if not waiters or count <= 0:
            return []
        taken: list[_W] = []
        for waiter in waiters:
            if len(taken) >= count:
                break
            taken.append(waiter)
        for waiter in taken:
            del waiters[waiter]
        self._size -= len(taken)
        if not waiters:
            del self._by_model[model]
        return taken


# ----------------------------------------------------------------------------- Retry-After


class CompletionRate:
    """An exponentially weighted rate of request completions (per second) of the whole fleet.

    ``rate = sum(exp(-(now - t_i) / tau)) / tau`` over completion times ``t_i``, divided by
    ``1 - exp(-(now - start) / tau)`` so the first seconds are not underestimated. Feed it
    every completed request (failed and cancelled ones too: they free capacity as well).

    The rate stays unknown for ``warmup`` seconds after the first completion: one completion
    seen a moment ago says nothing about the fleet's pace, and taking it as "one per
    ``tau``" would tell every shed client to wait the full cap at start-up.

    Args:
        time_constant: ``tau``, seconds (larger: smoother, slower to follow).
        warmup: seconds of observation before :meth:`rate` answers.
    """

    def __init__(self, time_constant: float = 5.0, warmup: float = 1.0) -> None:
        if not time_constant > 0:
            raise ValueError(f"time_constant must be > 0, got {time_constant}")
        self.time_constant = time_constant
        self.warmup = warmup
        self._weighted = 0.0
        self._last: float | None = None
        self._start: float | None = None

    def record(self, now: float, count: int = 1) -> None:
        """Count ``count`` completions at time ``now``."""
        if self._last is None:
            self._start = self._last = now
        self._weighted = self._decayed(now) + count
        self._last = max(self._last, now)

    def _decayed(self, now: float) -> float:
        if self._last is None:
            return 0.0
        return self._weighted * math.exp(-max(0.0, now - self._last) / self.time_constant)

    def rate(self, now: float) -> float | None:
        """Completions per second around ``now``; ``None`` until ``warmup`` has passed."""
        if self._start is None:
            return None
        elapsed = max(0.0, now - self._start)
        if elapsed < self.warmup:
            return None
        # Bias correction; at least the first completion's own window so t=start is finite.
        coverage = max(1.0 - math.exp(-elapsed / self.time_constant), 1.0 / self.time_constant)
        return self._decayed(now) / self.time_constant / coverage
