"""Routing decisions (frontend_shim._router), without I/O."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_shim._free_sets import mark_admits
from frontend_shim._load import Fleet
from frontend_shim._router import (
    MARKED_LOOK,
    AllBusy,
    CompletionRate,
    FrontendQueue,
    NoWorkers,
    RejectionKind,
    Routed,
    Router,
    RouterMode,
    UnknownModel,
)
from shim_common import wire
from shim_common.wire import BusyThresholds

MODEL = "m"


def config(worker_id: str, *, model: str = MODEL, heartbeat: float = 100.0) -> wire.RuntimeConfig:
    return wire.RuntimeConfig(
        worker_id=worker_id,
        model=model,
        kv_total_blocks=100,
        block_size=16,
        max_num_batched_tokens=1000,
        max_num_seqs=256,
        data_parallel_size=1,
        engine_request_limit=None,
        request_queue_limit=40000,
        heartbeat_interval=heartbeat,
    )


class Feed:
    """Sends load events with increasing ``seq`` to a fleet."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.seq = 0

    def load(self, worker_id: str, *, decode: int = 0, prefill: int = 0) -> None:
        self.seq += 1
        load = wire.RankLoad(
            dp_rank=0, active_decode_blocks=decode, active_prefill_tokens=prefill, kv_used_blocks=0
        )
        event = wire.LoadEvent(
            seq=self.seq, ts=0.0, load=load, engine_requests=0, queued_requests=0
        )
        assert self.fleet.apply(worker_id, event, 0.0)


def fleet_of(
    count: int, thresholds: BusyThresholds | None = None, *, queue_threshold: float | None = None
) -> tuple[Fleet, Feed]:
    """``count`` workers ``w0``... of MODEL; by default busy on any prefill token."""
    fleet = Fleet(
        default_thresholds=thresholds or BusyThresholds(active_prefill_tokens=0),
        queue_threshold=queue_threshold,
    )
    for index in range(count):
        fleet.register(config(f"w{index}"), 0.0)
    return fleet, Feed(fleet)


def picked(outcome: object) -> str:
    assert isinstance(outcome, Routed), outcome
    return outcome.worker_id


# ----------------------------------------------------------------------------- outcomes


def test_no_worker_connected_is_503_for_every_model() -> None:
    router = Router(Fleet())
    assert router.pick("anything", 0.0) == NoWorkers()
    assert NoWorkers().http_status == 503


def test_unknown_model_is_404_once_some_worker_is_connected() -> None:
    fleet, _ = fleet_of(1)
    assert Router(fleet).pick("other", 0.0) == UnknownModel()
    assert UnknownModel().http_status == 404


def test_known_model_whose_workers_left_is_503() -> None:
    fleet, _ = fleet_of(1)
    fleet.register(config("x", model="other"), 0.0)
    fleet.remove("w0")
    assert Router(fleet).pick(MODEL, 0.0) == NoWorkers()


def test_stale_workers_only_is_503() -> None:
    fleet = Fleet()
    fleet.register(config("w0", heartbeat=1.0), 0.0)
    router = Router(fleet)
    assert picked(router.pick(MODEL, 2.0)) == "w0"
    assert router.pick(MODEL, 3.5) == NoWorkers()


def test_all_busy_is_529() -> None:
    fleet, feed = fleet_of(2)
    feed.load("w0", prefill=1)
    feed.load("w1", prefill=1)
    assert Router(fleet).pick(MODEL, 0.0) == AllBusy()
    assert AllBusy().http_status == 529


def test_all_marked_is_529_until_the_lease_ends() -> None:
    fleet, _ = fleet_of(2)
    router = Router(fleet)
    router.on_rejected("w0", wire.RejectReason.OVERLOADED, 0.0)
    router.on_rejected("w1", wire.RejectReason.DISPLACED_PRIORITY, 0.5)
    assert router.pick(MODEL, 0.9) == AllBusy()
    assert picked(router.pick(MODEL, 1.0)) == "w0"
    assert {picked(router.pick(MODEL, 1.5)) for _ in range(4)} == {"w0", "w1"}


def test_a_queue_timeout_marks_the_worker_only_while_its_queue_is_as_deep() -> None:
    # It shows a long wait, not a full worker: with nothing queued there any more, the next
    # request of its class would start at once, so the worker stays free.
    fleet, _ = fleet_of(1)
    router = Router(fleet)
    router.on_rejected("w0", wire.RejectReason.QUEUE_TIMEOUT, 0.0, priority=0)
    assert picked(router.pick(MODEL, 0.1)) == "w0"
    fleet.request_pending("w0", 0.1, 0)
    fleet.request_pending("w0", 0.1, 0)
    router.on_rejected("w0", wire.RejectReason.QUEUE_TIMEOUT, 0.2, priority=0)
    assert router.pick(MODEL, 0.3) == AllBusy()  # two queued, as when it came
    fleet.request_answered("w0", 0.4, 0)
    assert picked(router.pick(MODEL, 0.5)) == "w0"


def test_busy_and_marked_workers_are_skipped() -> None:
    fleet, feed = fleet_of(3)
    feed.load("w0", prefill=1)
    fleet.mark_overloaded("w1", 0.0)
    router = Router(fleet)
    assert {picked(router.pick(MODEL, 0.0)) for _ in range(6)} == {"w2"}


def test_an_exempt_pick_takes_the_least_loaded_busy_worker_but_never_a_marked_one() -> None:
    fleet, feed = fleet_of(3)
    feed.load("w0", prefill=50)
    feed.load("w1", prefill=5)
    feed.load("w2", prefill=1)
    router = Router(fleet)
    assert router.pick(MODEL, 0.0) == AllBusy()
    assert not fleet.every_worker_marked(MODEL)
    fleet.mark_overloaded("w2", 0.0)
    # Busy ones may take it; the marked one may not, however lightly loaded.
    assert router.pick_exempt(MODEL, 0.0) == Routed("w1")
    assert router.pick_exempt(MODEL, 0.0, exclude={"w1"}) == Routed("w0")
    assert router.pick_exempt(MODEL, 0.0, exclude={"w0", "w1"}) is None
    fleet.mark_overloaded("w0", 0.0)
    fleet.mark_overloaded("w1", 0.0)
    assert fleet.every_worker_marked(MODEL)
    assert fleet.every_worker_marked()
    assert router.pick_exempt(MODEL, 0.0) is None
    assert router.pick_exempt("other-model", 0.0) is None


# ----------------------------------------------------------------------------- class-aware marks


def test_a_batch_refusal_leaves_the_worker_open_to_a_better_priority() -> None:
    fleet, _ = fleet_of(1, BusyThresholds())
    router = Router(fleet)
    router.on_rejected("w0", wire.RejectReason.OVERLOADED, 0.0, 10, "batch")
    # Free sets first: the marked worker is not free, so plain pick() says all busy.
    assert router.pick(MODEL, 0.1) == AllBusy()
    assert fleet.every_worker_marked(MODEL)
    # The refused class, and anything worse, is refused at once.
    assert router.pick_class(MODEL, 0.1, 10, "batch") == AllBusy()
    assert router.pick_class(MODEL, 0.1, 11, "other") == AllBusy()
    # A better priority may still displace there; so may another tenant of the same one.
    assert router.pick_class(MODEL, 0.1, 0, "batch") == Routed("w0")
    assert router.pick_class(MODEL, 0.1, 10, "other") == Routed("w0")
    # Never a worker that already refused this very request.
    assert router.pick_class(MODEL, 0.1, 0, "x", exclude={"w0"}) == AllBusy()
    # The lease still ends the mark for everyone.
    assert router.pick_class(MODEL, 1.0, 10, "batch") == Routed("w0")


def test_a_refusal_of_a_better_class_widens_the_mark() -> None:
    fleet, _ = fleet_of(1, BusyThresholds())
    router = Router(fleet)
    router.on_rejected("w0", wire.RejectReason.OVERLOADED, 0.0, 10, "a")
    router.on_rejected("w0", wire.RejectReason.DISPLACED_SHARE, 0.0, 10, "b")
    assert router.pick_class(MODEL, 0.0, 10, "b") == AllBusy()
    assert router.pick_class(MODEL, 0.0, 10, "c") == Routed("w0")
    router.on_rejected("w0", wire.RejectReason.OVERLOADED, 0.0, 5, "c")
    assert router.pick_class(MODEL, 0.0, 10, "d") == AllBusy()
    assert router.pick_class(MODEL, 0.0, 5, "c") == AllBusy()
    assert router.pick_class(MODEL, 0.0, 5, "d") == Routed("w0")
    assert router.pick_class(MODEL, 0.0, 4, "c") == Routed("w0")
    # A worse refusal (e.g. routed before the mark) changes nothing.
    router.on_rejected("w0", wire.RejectReason.OVERLOADED, 0.0, 7, "e")
    assert router.pick_class(MODEL, 0.0, 5, "d") == Routed("w0")
    # A refusal whose class is unknown covers every class; so does any other caller's mark.
    router.on_rejected("w0", wire.RejectReason.OVERLOADED, 0.0)
    assert router.pick_class(MODEL, 0.0, wire.PRIORITY_MIN, "z") == AllBusy()


def test_past_the_tenant_bound_a_mark_covers_every_tenant_of_its_priority() -> None:
    fleet = Fleet(mark_tenants=2)
    fleet.register(config("w0"), 0.0)
    router = Router(fleet)
    for tenant in ("a", "b"):
        fleet.mark_overloaded("w0", 0.0, 3, tenant)
    assert router.pick_class(MODEL, 0.0, 3, "c") == Routed("w0")
    fleet.mark_overloaded("w0", 0.0, 3, "c")
    assert router.pick_class(MODEL, 0.0, 3, "d") == AllBusy()
    assert router.pick_class(MODEL, 0.0, 2, "a") == Routed("w0")
    with pytest.raises(ValueError, match="mark_tenants"):
        Fleet(mark_tenants=0)


def test_the_next_load_event_clears_the_whole_class_mark() -> None:
    fleet, feed = fleet_of(1, BusyThresholds())
    router = Router(fleet)
    fleet.mark_overloaded("w0", 0.0, -5, "a")
    assert router.pick_class(MODEL, 0.0, 0, "b") == AllBusy()
    feed.load("w0")
    assert router.pick(MODEL, 0.0) == Routed("w0")
    # A new mark starts from its own class, not from the one before.
    fleet.mark_overloaded("w0", 0.0, 10, "a")
    assert router.pick_class(MODEL, 0.0, 0, "b") == Routed("w0")


def test_free_workers_come_first_and_a_marked_one_takes_only_what_beats_its_mark() -> None:
    fleet, feed = fleet_of(3, BusyThresholds(active_prefill_tokens=10))
    router = Router(fleet)
    fleet.mark_overloaded("w0", 0.0, 10, "")
    # w1 and w2 are free: the class check never runs, the marked worker gets nothing.
    assert {picked(router.pick_class(MODEL, 0.0, 0, "")) for _ in range(6)} == {"w1", "w2"}
    fleet.mark_overloaded("w1", 0.0, 0, "")
    feed.load("w2", prefill=50)  # busy, unmarked
    assert fleet.marked_workers(MODEL, 0.0) is not None
    # Among the marked, the one whose mark the class beats; busy thresholds still apply...
    assert router.pick_class(MODEL, 0.0, 0, "") == Routed("w0")
    assert router.pick_class(MODEL, 0.0, -1, "") in (Routed("w0"), Routed("w1"))
    assert router.pick_class(MODEL, 0.0, 11, "") == AllBusy()
    assert not fleet.every_worker_marked(MODEL)  # w2 is busy, not marked: reason "busy"
    # ...except for a busy-exempt request: an unmarked busy worker first, then a marked one.
    assert router.pick_class(MODEL, 0.0, 11, "", exempt=True) == Routed("w2")
    fleet.mark_overloaded("w2", 0.0, 5, "")
    assert fleet.every_worker_marked(MODEL)
    assert router.pick_class(MODEL, 0.0, 3, "", exempt=True) == Routed("w0")
    assert router.pick_class(MODEL, 0.0, 11, "", exempt=True) == AllBusy()


def test_a_busy_exempt_request_may_pass_the_mark_of_a_busy_worker() -> None:
    fleet, feed = fleet_of(1)
    feed.load("w0", prefill=5)  # busy
    fleet.mark_overloaded("w0", 0.0, 5, "")
    router = Router(fleet)
    assert router.pick_exempt(MODEL, 0.0) is None
    assert router.pick_class(MODEL, 0.0, 0, "") == AllBusy()  # not exempt: busy still sheds
    assert router.pick_class(MODEL, 0.0, 0, "", exempt=True) == Routed("w0")
    assert router.pick_class(MODEL, 0.0, 5, "", exempt=True) == AllBusy()


def test_the_look_at_marked_workers_is_bounded_and_prefers_the_least_loaded() -> None:
    count = 4 * MARKED_LOOK
    fleet, feed = fleet_of(count, BusyThresholds(active_prefill_tokens=10_000))
    router = Router(fleet)
    for index in range(count):
        feed.load(f"w{index}", prefill=index)
        fleet.mark_overloaded(f"w{index}", 0.0, 10, "")
    looked: list[int] = []
    for _ in range(8):
        index = int(picked(router.pick_class(MODEL, 0.0, 0, ""))[1:])
        looked.append(index)
    # Each pick looks at MARKED_LOOK workers from a rotating cursor, and takes the least
    # loaded of those: not always the fleet's least loaded (w0), but spread over the fleet.
    assert len(set(looked)) > 1
    marked = fleet.marked_workers(MODEL, 0.0)
    assert marked is not None
    assert len(marked) == count


class _Mark:
    """The reference: the refusals a worker had since its mark was last cleared."""

    def __init__(self) -> None:
        self.refusals: list[tuple[int, str]] = []

    def admits(self, priority: int, tenant: str, bound: int) -> bool:
        if not self.refusals:
            return True
        best = min(p for p, _ in self.refusals)
        tenants = {t for p, t in self.refusals if p == best}
        if priority < best:
            return True
        return priority == best and len(tenants) <= bound and tenant not in tenants


_refusal = st.tuples(st.integers(-2, 2), st.sampled_from("abcd"))


@settings(max_examples=300, deadline=None)
@given(
    marks=st.lists(st.lists(_refusal, max_size=5), min_size=1, max_size=24),
    loads=st.lists(st.integers(0, 50), min_size=24, max_size=24),
    request=_refusal,
    bound=st.integers(1, 3),
)
def test_a_marked_worker_is_eligible_iff_the_class_beats_its_mark(
    marks: list[list[tuple[int, str]]],
    loads: list[int],
    request: tuple[int, str],
    bound: int,
) -> None:
    fleet = Fleet(mark_tenants=bound)
    feed = Feed(fleet)
    references: dict[str, _Mark] = {}
    for index, refusals in enumerate(marks):
        worker_id = f"w{index}"
        fleet.register(config(worker_id), 0.0)
        feed.load(worker_id, prefill=loads[index])
        references[worker_id] = _Mark()
        for priority, tenant in refusals:
            fleet.mark_overloaded(worker_id, 0.0, priority, tenant)
            references[worker_id].refusals.append((priority, tenant))
    priority, tenant = request
    eligible = set()
    for worker_id, reference in references.items():
        worker = fleet.worker(worker_id)
        assert worker is not None
        assert mark_admits(worker, priority, tenant) == reference.admits(priority, tenant, bound)
        if reference.admits(priority, tenant, bound):
            eligible.add(worker_id)
    outcome = Router(fleet).pick_class(MODEL, 0.5, priority, tenant)
    unmarked = {w for w, r in references.items() if not r.refusals}
    if unmarked:
        assert picked(outcome) in unmarked
    elif len(marks) <= MARKED_LOOK and eligible:
        # The whole marked set is looked at: the least loaded eligible worker.
        chosen = picked(outcome)
        assert chosen in eligible
        assert loads[int(chosen[1:])] == min(loads[int(w[1:])] for w in eligible)
    elif eligible:
        assert outcome == AllBusy() or picked(outcome) in eligible
    else:
        assert outcome == AllBusy()
    # The lease ends every mark: then any class is routed.
    assert isinstance(Router(fleet).pick_class(MODEL, 1.0, 1000, "z"), Routed)


# ----------------------------------------------------------------------------- modes


def test_round_robin_cycles_over_free_workers() -> None:
    fleet, feed = fleet_of(4)
    feed.load("w2", prefill=1)
    router = Router(fleet, RouterMode.ROUND_ROBIN)
    picks = [picked(router.pick(MODEL, 0.0)) for _ in range(9)]
    assert Counter(picks) == {"w0": 3, "w1": 3, "w3": 3}
    assert picks[:3] == picks[3:6] == picks[6:]


def test_random_picks_only_free_workers() -> None:
    fleet, feed = fleet_of(5)
    feed.load("w1", prefill=1)
    feed.load("w3", prefill=1)
    router = Router(fleet, RouterMode.RANDOM, rng=random.Random(7))
    picks = Counter(picked(router.pick(MODEL, 0.0)) for _ in range(300))
    assert set(picks) == {"w0", "w2", "w4"}
    assert min(picks.values()) > 50  # uniform, to an order of magnitude


def test_kv_picks_the_least_loaded() -> None:
    fleet, feed = fleet_of(3, BusyThresholds())
    feed.load("w0", decode=70, prefill=100)
    feed.load("w1", decode=10, prefill=100)
    feed.load("w2", decode=10, prefill=500)
    router = Router(fleet, RouterMode.KV)
    assert picked(router.pick(MODEL, 0.0)) == "w1"
    # The router's own count matters too: 60 more blocks on w1 make w2 the lighter one.
    fleet.request_sent("w1", prompt_tokens=16 * 60)
    assert picked(router.pick(MODEL, 0.0)) == "w2"


def test_kv_rotates_among_equally_loaded() -> None:
    fleet, _ = fleet_of(3, BusyThresholds())
    router = Router(fleet, RouterMode.KV)
    assert {picked(router.pick(MODEL, 0.0)) for _ in range(3)} == {"w0", "w1", "w2"}


@pytest.mark.parametrize("mode", list(RouterMode))
def test_every_mode_honours_thresholds_and_exclusion(mode: RouterMode) -> None:
    fleet, feed = fleet_of(3)
    feed.load("w0", prefill=1)
    router = Router(fleet, mode, rng=random.Random(1))
    for _ in range(10):
        assert picked(router.pick(MODEL, 0.0, exclude={"w1"})) == "w2"
    assert router.pick(MODEL, 0.0, exclude={"w1", "w2"}) == AllBusy()


# ----------------------------------------------------------------------------- migration


def test_a_rejection_is_the_kind_its_reason_says() -> None:
    router = Router(fleet_of(1)[0])
    reason = wire.RejectReason
    assert router.on_rejected("w0", reason.OVERLOADED, 0.0) is RejectionKind.OVERLOADED
    assert router.on_rejected("w0", reason.QUEUE_TIMEOUT, 0.0) is RejectionKind.OVERLOADED
    assert router.on_rejected("w0", reason.parse("Unknown: x"), 0.0) is RejectionKind.OTHER
    assert router.on_rejected("w0", reason.DRAINING, 0.0) is RejectionKind.UNAVAILABLE


def test_a_negative_migration_limit_is_refused() -> None:
    fleet, _ = fleet_of(2)
    with pytest.raises(ValueError, match="migration_limit"):
        Router(fleet, migration_limit=-1)


# ----------------------------------------------------------------------------- frontend queue


def queued_fleet(count: int) -> tuple[Fleet, Feed, FrontendQueue[int]]:
    fleet, feed = fleet_of(count, BusyThresholds(active_prefill_tokens=900), queue_threshold=0.5)
    return fleet, feed, FrontendQueue(capacity=3)


def test_requests_park_only_when_every_free_worker_is_saturated() -> None:
    fleet, feed, queue = queued_fleet(2)
    assert not queue.should_park(fleet, MODEL, 0.0)
    feed.load("w0", prefill=501)  # over 0.5 * 1000
    assert not queue.should_park(fleet, MODEL, 0.0)
    feed.load("w1", prefill=600)
    assert queue.should_park(fleet, MODEL, 0.0)
    feed.load("w0", prefill=901)
    feed.load("w1", prefill=901)  # busy now: no free worker, so 529 rather than a wait
    assert not queue.should_park(fleet, MODEL, 0.0)


def test_queue_bound_and_order() -> None:
    fleet, feed, queue = queued_fleet(1)
    feed.load("w0", prefill=600)
    assert [queue.park(MODEL, n) for n in range(4)] == [True, True, True, False]
    assert len(queue) == 3
    assert queue.should_park(fleet, MODEL, 0.0)
    assert queue.release(fleet, 0.0) == []
    feed.load("w0", prefill=10)  # load fell: one waiter per unsaturated free worker
    assert queue.release(fleet, 0.0) == [0]
    assert queue.should_park(fleet, MODEL, 0.0)  # others still wait: no overtaking
    assert queue.cancel(MODEL, 2)
    assert not queue.cancel(MODEL, 2)
    assert queue.release(fleet, 0.0) == [1]
    assert len(queue) == 0
    assert not queue.should_park(fleet, MODEL, 0.0)


def test_released_request_counts_before_the_next_release() -> None:
    fleet, feed, queue = queued_fleet(1)
    feed.load("w0", prefill=0)
    queue.park(MODEL, 1)
    queue.park(MODEL, 2)
    (first,) = queue.release(fleet, 0.0)
    fleet.request_sent("w0", prompt_tokens=600)  # the router's own prefill count saturates w0
    assert first == 1
    assert queue.release(fleet, 0.0) == []


def test_waiters_are_released_to_fail_fast_when_no_worker_is_free() -> None:
    fleet, feed, queue = queued_fleet(1)
    feed.load("w0", prefill=600)
    queue.park(MODEL, 1)
    queue.park(MODEL, 2)
    feed.load("w0", prefill=901)
    assert not queue.should_park(fleet, MODEL, 0.0)  # waiters or not: 529 at once
    assert queue.release(fleet, 0.0) == [1, 2]


def test_queue_rejects_double_park_and_bad_capacity() -> None:
    queue: FrontendQueue[int] = FrontendQueue(capacity=2)
    queue.park(MODEL, 1)
    with pytest.raises(ValueError, match="already"):
        queue.park(MODEL, 1)
    with pytest.raises(ValueError, match="capacity"):
        FrontendQueue(capacity=0)


# ----------------------------------------------------------------------------- Retry-After


def test_completion_rate_follows_the_rate() -> None:
    rate = CompletionRate(time_constant=2.0)
    assert rate.rate(0.0) is None
    now = 0.0
    for _ in range(200):  # 20 per second for 10 s
        now += 0.05
        rate.record(now)
    measured = rate.rate(now)
    assert measured is not None
    assert 10 < measured < 40
    later = rate.rate(now + 20.0)
    assert later is not None
    assert later < 0.1  # nothing completes: the rate decays


def test_completion_rate_is_not_underestimated_at_start() -> None:
    rate = CompletionRate(time_constant=10.0)
    for step in range(1, 11):  # 10 per second for 1 s
        rate.record(step * 0.1)
    measured = rate.rate(1.1)
    assert measured is not None
    assert 3 < measured < 30


def test_completion_rate_is_unknown_during_warmup() -> None:
    rate = CompletionRate(time_constant=5.0, warmup=1.0)
    rate.record(10.0)
    # One completion a moment ago must not read as "one per tau" (a 30 s Retry-After).
    assert rate.rate(10.01) is None
    assert rate.rate(10.5) is None
    assert rate.rate(11.0) is not None


def test_kv_prefers_the_worker_with_room_under_its_effective_limit() -> None:
    fleet = Fleet()
    for worker_id in ("full", "room"):
        fleet.register(config(worker_id), 0.0)
    for seq, (worker_id, engine, queued, limit) in enumerate(
        (("full", 4, 3, 4), ("room", 4, 0, 16)), start=1
    ):
        load = wire.RankLoad(
            dp_rank=0, active_decode_blocks=0, active_prefill_tokens=0, kv_used_blocks=0
        )
        event = wire.LoadEvent(
            seq=seq,
            ts=0.0,
            load=load,
            engine_requests=engine,
            queued_requests=queued,
            effective_limit=limit,
        )
        assert fleet.apply(worker_id, event, 0.0)
    router = Router(fleet, RouterMode.KV)
    picks = {router.pick(MODEL, 0.0) for _ in range(4)}
    assert picks == {Routed("room")}


def test_a_retry_is_not_turned_away_by_a_mark_alone() -> None:
    fleet, _ = fleet_of(1, BusyThresholds())
    router = Router(fleet)
    router.on_rejected("w0", wire.RejectReason.OVERLOADED, 0.0)  # every class marked
    assert router.pick_class(MODEL, 0.1, 0, "t") == AllBusy()
    # The client's retry of a refused request: the mark is a guess, the worker's gate decides.
    assert router.pick_class(MODEL, 0.1, 0, "t", retry=True) == Routed("w0")
    assert router.pick_class(MODEL, 0.1, 0, "t", {"w0"}, retry=True) == AllBusy()
