"""The frontend's load state against a reference model, without I/O: the busy rule written out
again, a stateful machine of random events whose free sets must match it, and a batch of events
that must end where the same events one by one end.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from load_feed import Feed, config, is_free, state

from frontend_shim._free_sets import WorkerLoad, mark_admits
from frontend_shim._load import Fleet
from frontend_shim._queue_hold import picture
from shim_common import wire
from shim_common.wire import BusyThresholds

# ----------------------------------------------------------------------------- state machine


def reference_rank_busy(t: BusyThresholds, worker: WorkerLoad, blocks: int, prefill: int) -> bool:
    """The busy rule of one rank, written out again from docs/configuration.md."""
    total = worker.config.kv_total_blocks
    decode = (
        t.active_decode_blocks is not None and total > 0 and blocks / total > t.active_decode_blocks
    )
    absolute = t.active_prefill_tokens is not None and prefill > t.active_prefill_tokens
    frac = t.active_prefill_tokens_frac is not None and prefill > int(
        t.active_prefill_tokens_frac * worker.config.max_num_batched_tokens
    )
    return decode or absolute or frac


def reference_figures(worker: WorkerLoad, index: int) -> tuple[int, int]:
    """A rank's blocks and prefill recomputed from its report, charges and releases."""
    rank = worker.ranks[index]
    seq = rank.report_seq
    releases = [r for r in worker.releases if r.rank == index and r.started < seq <= r.ended]
    charges = [c for c in worker.sequences if c.rank == index]
    blocks = rank.reported_blocks - sum(r.blocks for r in releases)
    prefill = rank.reported_prefill - sum(r.prefill for r in releases if seq <= r.first_output)
    return (
        max(blocks, sum(c.blocks for c in charges)),
        max(prefill, sum(c.prefill_tokens for c in charges)),
    )


def reference_free(fleet: Fleet, now: float) -> set[str]:
    """The free set recomputed from scratch from every worker's raw state."""
    result = set()
    for worker in fleet.workers():
        thresholds = fleet.thresholds(worker.model)
        reported = [i for i, r in enumerate(worker.ranks) if r.reported]
        worker_busy = bool(reported) and all(
            reference_rank_busy(thresholds, worker, *reference_figures(worker, i)) for i in reported
        )
        # Stale past last_seen + stale_after, written as Fleet.expire writes it: as a difference,
        # float rounding could put the two on either side of the deadline.
        stale = worker.last_seen + worker.stale_after < now
        marked = worker.mark_until is not None and worker.mark_until > now
        if not (worker_busy or stale or marked or worker.draining):
            result.add(worker.worker_id)
    return result


WORKERS = [f"w{i}" for i in range(4)]


class FreeSetMachine(RuleBasedStateMachine):
    """The incrementally kept free sets always equal a from-scratch recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.fleet = Fleet(
            default_thresholds=BusyThresholds(active_decode_blocks=0.5, active_prefill_tokens=20),
            track_output_blocks=True,
            mark_tenants=1,
        )
        self.feed = Feed(self.fleet)
        self.now = 0.0
        self.in_flight: list[tuple[str, Any]] = []
        #: The reference of class-aware marks: each worker's refusals since its mark was set.
        self.refusals: dict[str, list[tuple[int, str]]] = {w: [] for w in WORKERS}

    @rule(worker_id=st.sampled_from(WORKERS), dp=st.integers(1, 3), model=st.sampled_from("ab"))
    def register(self, worker_id: str, dp: int, model: str) -> None:
        self.fleet.register(config(worker_id, model=model, dp=dp, total=10, block_size=4), self.now)
        self.feed.seq.pop(worker_id, None)

    @rule(worker_id=st.sampled_from(WORKERS))
    def remove(self, worker_id: str) -> None:
        self.fleet.remove(worker_id)

    @rule(
        worker_id=st.sampled_from(WORKERS),
        rank=st.integers(0, 3),
        decode=st.integers(0, 12),
        prefill=st.integers(0, 40),
    )
    def load(self, worker_id: str, rank: int, decode: int, prefill: int) -> None:
        self.feed.load(worker_id, rank=rank, decode=decode, prefill=prefill, now=self.now)

    @rule(worker_id=st.sampled_from(WORKERS), draining=st.booleans())
    def heartbeat(self, worker_id: str, draining: bool) -> None:
        status = "draining" if draining else "ready"
        self.feed.heartbeat(worker_id, [(0, 3)], status=status, now=self.now)

    @rule(
        worker_id=st.sampled_from(WORKERS),
        priority=st.none() | st.integers(-1, 1),
        tenant=st.sampled_from("ab"),
    )
    def mark(self, worker_id: str, priority: int | None, tenant: str) -> None:
        worker = self.fleet.worker(worker_id)
        until = None if worker is None else worker.mark_until
        if until is None or until <= self.now or (worker is not None and worker.hold_marks):
            self.refusals[worker_id] = []  # a mark whose lease ran out starts afresh
        self.fleet.mark_overloaded(worker_id, self.now, priority, tenant)
        if worker is not None:
            # A refusal of unknown class: below every priority, so nothing beats it.
            refused = wire.PRIORITY_MIN - 1 if priority is None else priority
            self.refusals[worker_id].append((refused, tenant))

    @rule(
        worker_id=st.sampled_from(WORKERS),
        priority=st.integers(-1, 1),
        bound=st.none() | st.integers(1, 3),
    )
    def refuse_for_the_objective(self, worker_id: str, priority: int, bound: int | None) -> None:
        self.fleet.mark_long_queue(worker_id, self.now, priority, bound)

    @rule(worker_id=st.sampled_from(WORKERS), answered=st.booleans(), priority=st.integers(-1, 1))
    def pending_or_answered(self, worker_id: str, answered: bool, priority: int) -> None:
        if answered:
            self.fleet.request_answered(worker_id, self.now, priority)
        else:
            self.fleet.request_pending(worker_id, self.now, priority)

    @invariant()
    def an_objectives_mark_holds_exactly_while_the_queue_is_at_its_bound(self) -> None:
        for worker in self.fleet.workers():
            bound = worker.hold_bound
            if worker.hold_marks and bound is not None and worker.hold_until > self.now:
                assert picture(worker, worker.hold_priority) >= bound

    @rule(worker_id=st.sampled_from(WORKERS), prompt=st.integers(0, 30))
    def send(self, worker_id: str, prompt: int) -> None:
        in_flight = self.fleet.request_sent(worker_id, prompt)
        if in_flight is not None:
            self.in_flight.append((worker_id, in_flight))

    @rule(data=st.data(), tokens=st.integers(0, 10))
    def output(self, data: st.DataObject, tokens: int) -> None:
        if self.in_flight:
            worker_id, in_flight = data.draw(st.sampled_from(self.in_flight))
            self.fleet.request_output(worker_id, in_flight, tokens)

    @rule(data=st.data(), ahead=st.none() | st.integers(-1, 3), worker_tokens=st.integers(0, 60))
    def finish(self, data: st.DataObject, ahead: int | None, worker_tokens: int) -> None:
        # ahead: where the worker's End puts its events, from the last one applied.
        if self.in_flight:
            index = data.draw(st.integers(0, len(self.in_flight) - 1))
            worker_id, in_flight = self.in_flight.pop(index)
            window = None
            if ahead is not None:
                seq = self.feed.seq.get(worker_id, 0)
                window = wire.End(  # the worker's own count may be more than this frontend's
                    request_id=1,
                    prompt_tokens=worker_tokens // 2,
                    completion_tokens=worker_tokens - worker_tokens // 2,
                    started_seq=seq - 2,
                    first_output_seq=seq - 1 + ahead // 2,
                    ended_seq=seq + ahead,
                )
            self.fleet.request_finished(worker_id, in_flight, window)

    @rule(seconds=st.sampled_from([0.1, 0.5, 0.99, 1.0, 2.5, 4.0]))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @rule(
        model=st.sampled_from("ab"),
        decode=st.none() | st.sampled_from([0.0, 0.3, 1.0]),
        prefill=st.none() | st.integers(0, 30),
    )
    def set_thresholds(self, model: str, decode: float | None, prefill: int | None) -> None:
        if self.fleet.is_known_model(model):
            update = BusyThresholds(active_decode_blocks=decode, active_prefill_tokens=prefill)
            self.fleet.set_thresholds(model, update)

    @invariant()
    def the_share_of_l_leaves_out_the_releases_the_newest_event_counts(self) -> None:
        for worker in self.fleet.workers():
            seq = worker.last_seq
            counted = [r for r in worker.releases if r.started < seq <= r.ended]
            assert worker.released_requests == len(counted)

    @invariant()
    def free_sets_match_recomputation(self) -> None:
        incremental = set()
        for model in self.fleet.models():
            free = self.fleet.free_workers(model, self.now)
            assert free is not None
            incremental |= {w.worker_id for w in free}
        assert incremental == reference_free(self.fleet, self.now)

    @invariant()
    def a_mark_admits_a_class_iff_it_beats_every_refusal(self) -> None:
        for worker in self.fleet.workers():
            if worker.mark_until is None or worker.mark_until <= self.now or worker.hold_marks:
                continue
            refusals = self.refusals[worker.worker_id]
            best = min(p for p, _ in refusals)
            tenants = {t for p, t in refusals if p == best}
            for priority in range(-2, 3):
                for tenant in "abc":
                    # At most mark_tenants (1) named; past that, every tenant of the priority.
                    beats = priority < best or (
                        priority == best and len(tenants) <= 1 and tenant not in tenants
                    )
                    assert mark_admits(worker, priority, tenant) == beats

    @invariant()
    def load_cost_matches_recomputation(self) -> None:
        for worker in self.fleet.workers():
            figures = [reference_figures(worker, i) for i in range(len(worker.ranks))]
            blocks = sum(b for b, _ in figures)
            prefill = sum(p for _, p in figures)
            expected = (blocks / 10 + prefill / 1000) / len(worker.ranks)
            assert math.isclose(worker.load_cost, expected, abs_tol=1e-12)

    @invariant()
    def counts_match(self) -> None:
        now = self.now
        self.fleet.expire(now)  # the flags on WorkerLoad reflect time only once expired
        for model in self.fleet.models():
            workers = list(self.fleet.workers(model))
            available = [w for w in workers if w.available]
            assert self.fleet.available_count(model, now) == len(available)
        busy_everywhere = bool(self.fleet.models()) and all(
            self.fleet.available_count(m, now) > 0 and not self.fleet.free_workers(m, now)
            for m in self.fleet.models()
        )
        assert self.fleet.all_models_busy(now) == busy_everywhere
        marked = {w.worker_id for w in self.fleet.workers() if w.available and w.marked}
        incremental: set[str] = set()
        for model in self.fleet.models():
            in_pool = self.fleet.marked_workers(model, now)
            assert in_pool is not None
            incremental |= {w.worker_id for w in in_pool}
        assert incremental == marked
        held_by_mark_alone = any(
            w.available and w.marked and not w.busy for w in self.fleet.workers()
        )
        assert self.fleet.may_shed_unread(now) == (busy_everywhere and not held_by_mark_alone)


FreeSetMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestFreeSetMachine = FreeSetMachine.TestCase


# ----------------------------------------------------------------------------- batches


def _snapshot(fleet: Fleet, worker_id: str) -> dict[str, Any]:
    worker = state(fleet, worker_id)
    ranks = [
        {name: getattr(rank, name) for name in type(rank).__slots__ if name != "own"}
        | {f"own.{name}": getattr(rank.own, name) for name in type(rank.own).__slots__}
        for rank in worker.ranks
    ]
    plain = {
        name: getattr(worker, name)
        for name in type(worker).__slots__
        if isinstance(getattr(worker, name, None), (int, float, str, bool, type(None)))
    }
    return {"worker": plain, "ranks": ranks, "free": is_free(fleet, worker_id)}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["load", "beat", "old"]),
            st.integers(0, 3),  # rank (4 is outside the worker's ranks)
            st.integers(0, 120),  # decode blocks
            st.integers(0, 1500),  # prefill tokens
            st.integers(0, 9),  # engine requests
            st.sampled_from([None, 4, 8]),  # L
            st.sampled_from(["ready", "draining"]),
        ),
        max_size=12,
    )
)
def test_a_batch_ends_in_the_state_its_events_one_by_one_end_in(
    script: list[tuple[str, int, int, int, int, int | None, str]],
) -> None:
    # apply_batch settles the worker-wide figures once, from the newest event: the state must be
    # the one applying every event by itself leaves, whatever the events.
    thresholds = BusyThresholds(active_decode_blocks=0.5, active_prefill_tokens=800)
    fleets = [Fleet(default_thresholds=thresholds) for _ in range(2)]
    for fleet in fleets:
        fleet.register(config(dp=4), 0.0)
    events: list[wire.WorkerEvent] = []
    seq = 0
    for kind, rank, decode, prefill, engine, limit, status in script:
        if kind != "old":
            seq += 1
        load = wire.RankLoad(
            dp_rank=rank + (kind == "old"),
            active_decode_blocks=decode,
            active_prefill_tokens=prefill,
            kv_used_blocks=decode,
        )
        common: dict[str, Any] = {
            "seq": max(seq, 1),
            "ts": 0.0,
            "engine_requests": engine,
            "queued_requests": engine // 2,
            "effective_limit": limit,
        }
        if kind == "beat":
            events.append(wire.Heartbeat(loads=[load], status=status, **common))
        else:
            events.append(wire.LoadEvent(load=load, **common))
    one_by_one = sum(fleets[0].apply("w0", event, 1.0) for event in events)
    batched = fleets[1].apply_batch("w0", events, 1.0)
    assert one_by_one == batched
    assert _snapshot(fleets[0], "w0") == _snapshot(fleets[1], "w0")
