"""The frontend's load state and free sets (frontend_shim._load, _free_sets), without I/O: the busy
rule as the fleet applies it to each worker's ranks. The thresholds' own ranges and merging are
tested in tests/shim_common/test_busy.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from frontend_shim._free_sets import WorkerLoad, mark_admits
from frontend_shim._load import MAX_RELEASES, Fleet, RankGauge
from shim_common import wire
from shim_common._busy import BusyThresholds

MODEL = "m"


def config(
    worker_id: str = "w0",
    *,
    model: str = MODEL,
    total: int = 100,
    block_size: int = 16,
    max_batched: int = 1000,
    dp: int = 1,
    heartbeat: float = 1.0,
) -> wire.RuntimeConfig:
    return wire.RuntimeConfig(
        worker_id=worker_id,
        model=model,
        kv_total_blocks=total,
        block_size=block_size,
        max_num_batched_tokens=max_batched,
        max_num_seqs=256,
        data_parallel_size=dp,
        engine_request_limit=None,
        request_queue_limit=40000,
        heartbeat_interval=heartbeat,
    )


class Feed:
    """Makes events with increasing ``seq`` per worker."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.seq: dict[str, int] = {}

    def _next(self, worker_id: str) -> int:
        self.seq[worker_id] = self.seq.get(worker_id, 0) + 1
        return self.seq[worker_id]

    def load(
        self,
        worker_id: str = "w0",
        *,
        rank: int = 0,
        decode: int = 0,
        prefill: int = 0,
        used: int = 0,
        now: float = 0.0,
    ) -> bool:
        event = wire.LoadEvent(
            seq=self._next(worker_id),
            ts=0.0,
            load=wire.RankLoad(
                dp_rank=rank,
                active_decode_blocks=decode,
                active_prefill_tokens=prefill,
                kv_used_blocks=used,
            ),
            engine_requests=0,
            queued_requests=0,
        )
        return self.fleet.apply(worker_id, event, now)

    def heartbeat(
        self,
        worker_id: str = "w0",
        loads: list[tuple[int, int]] = (),  # type: ignore[assignment]
        *,
        status: str = "ready",
        now: float = 0.0,
    ) -> bool:
        event = wire.Heartbeat(
            seq=self._next(worker_id),
            ts=0.0,
            loads=[
                wire.RankLoad(
                    dp_rank=r, active_decode_blocks=d, active_prefill_tokens=0, kv_used_blocks=0
                )
                for r, d in loads
            ],
            engine_requests=0,
            queued_requests=0,
            status=status,
        )
        return self.fleet.apply(worker_id, event, now)


def fleet_with(thresholds: BusyThresholds, **kwargs: Any) -> tuple[Fleet, Feed]:
    fleet = Fleet(default_thresholds=thresholds, **kwargs)
    return fleet, Feed(fleet)


def is_free(fleet: Fleet, worker_id: str = "w0", now: float = 0.0) -> bool:
    free = fleet.free_workers(MODEL, now)
    assert free is not None
    return any(w.worker_id == worker_id for w in free)


def state(fleet: Fleet, worker_id: str = "w0") -> WorkerLoad:
    worker = fleet.worker(worker_id)
    assert worker is not None
    return worker


# ----------------------------------------------------------------------------- busy rules


def test_decode_threshold_alone_is_strict() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.5))
    fleet.register(config(total=100), 0.0)
    feed.load(decode=50, prefill=10**6)  # 50/100 is not > 0.5; prefill is not checked
    assert is_free(fleet)
    feed.load(decode=51)
    assert not is_free(fleet)
    assert state(fleet).busy


def test_decode_uses_larger_of_used_and_active_blocks() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.5))
    fleet.register(config(total=100), 0.0)
    feed.load(decode=10, used=60)
    assert not is_free(fleet)
    feed.load(decode=60, used=10)
    assert not is_free(fleet)
    feed.load(decode=10, used=10)
    assert is_free(fleet)


@pytest.mark.parametrize("total", [0, -1])
def test_decode_never_busy_without_total(total: int) -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.0))
    fleet.register(config(total=total), 0.0)
    feed.load(decode=1000, used=1000)
    assert is_free(fleet)


def test_prefill_threshold_alone_is_strict() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=100))
    fleet.register(config(), 0.0)
    feed.load(prefill=100, decode=10**6, used=10**6)
    assert is_free(fleet)
    feed.load(prefill=101)
    assert not is_free(fleet)


def test_prefill_threshold_zero_busy_on_any_prefill() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=0))
    fleet.register(config(), 0.0)
    feed.load(prefill=0)
    assert is_free(fleet)
    feed.load(prefill=1)
    assert not is_free(fleet)


def test_frac_threshold_truncates_to_integer() -> None:
    # The limit is int(0.3339 * 10) = 3 tokens (for whole token counts, the same as > 3.339).
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens_frac=0.3339))
    fleet.register(config(max_batched=10), 0.0)
    feed.load(prefill=3)
    assert is_free(fleet)
    feed.load(prefill=4)
    assert not is_free(fleet)


def test_frac_threshold_uses_default_when_max_batched_unknown() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens_frac=1.0))
    fleet.register(config(max_batched=0), 0.0)
    feed.load(prefill=10_000_000)
    assert is_free(fleet)
    feed.load(prefill=10_000_001)
    assert not is_free(fleet)


def test_unset_thresholds_never_busy() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    feed.load(decode=10**6, prefill=10**6, used=10**6)
    assert is_free(fleet)


def test_checks_are_ored_within_a_rank() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.5, active_prefill_tokens=100))
    fleet.register(config(total=100), 0.0)
    feed.load(decode=10, prefill=10)
    assert is_free(fleet)
    feed.load(decode=10, prefill=101)
    assert not is_free(fleet)
    feed.load(decode=90, prefill=10)
    assert not is_free(fleet)


def test_ranks_are_anded_and_unreported_ranks_do_not_count() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=0))
    fleet.register(config(dp=3), 0.0)
    assert is_free(fleet)  # no rank reported: not busy
    feed.load(rank=0, prefill=5)
    assert not is_free(fleet)  # the only reported rank is busy (ranks 1, 2 never reported)
    feed.load(rank=1, prefill=0)
    assert is_free(fleet)
    feed.load(rank=1, prefill=5)
    assert not is_free(fleet)
    feed.load(rank=2, prefill=0)
    assert is_free(fleet)
    feed.load(rank=7, prefill=5)  # outside data_parallel_size: ignored
    assert is_free(fleet)
    assert state(fleet).reported_ranks == 3


def test_heartbeat_reports_every_rank() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.5))
    fleet.register(config(total=10, dp=2), 0.0)
    feed.heartbeat(loads=[(0, 9), (1, 9)])
    assert not is_free(fleet)
    feed.heartbeat(loads=[(0, 9), (1, 1)])
    assert is_free(fleet)


def test_old_and_unknown_events_are_ignored() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=0))
    fleet.register(config(), 0.0)
    assert not feed.load("nobody", prefill=5)
    old = wire.LoadEvent(
        seq=0,
        ts=0.0,
        load=wire.RankLoad(
            dp_rank=0, active_decode_blocks=0, active_prefill_tokens=5, kv_used_blocks=0
        ),
        engine_requests=0,
        queued_requests=0,
    )
    assert feed.load(prefill=0)
    assert not fleet.apply("w0", old, 0.0)
    assert is_free(fleet)


# ----------------------------------------------------------------------------- own count


def test_router_own_blocks_beat_a_lower_report() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.5))
    fleet.register(config(total=10, block_size=16), 0.0)
    feed.load(decode=0)
    in_flight = fleet.request_sent("w0", prompt_tokens=16 * 6)  # 6 blocks > 0.5 * 10
    assert in_flight is not None
    assert not is_free(fleet)
    feed.load(decode=1)  # the worker has not seen it yet: our count still wins
    assert not is_free(fleet)
    fleet.request_finished("w0", in_flight)
    assert is_free(fleet)
    fleet.request_finished("w0", in_flight)  # idempotent
    assert state(fleet).ranks[0].own_blocks == 0


def end(started: int, first: int, ended: int) -> wire.End:
    """A worker's final frame with its event window."""
    return wire.End(
        request_id=1,
        prompt_tokens=16,
        completion_tokens=20,
        started_seq=started,
        first_output_seq=first,
        ended_seq=ended,
    )


def test_a_finished_request_leaves_every_report_of_its_window() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.0))
    fleet.register(config(total=10, block_size=16), 0.0)
    feed.load()  # seq 1: idle
    in_flight = fleet.request_sent("w0", prompt_tokens=16)
    assert in_flight is not None
    fleet.request_output("w0", in_flight, tokens=20)  # 36 tokens: 3 blocks on the worker
    feed.load(decode=3)  # seq 2: the worker reports the request running
    assert not is_free(fleet)
    # Started at seq 1, done by seq 3: events 2 and 3 count it, later ones do not.
    fleet.request_finished("w0", in_flight, end(1, 1, 3))
    assert is_free(fleet)
    feed.load(decode=3)  # seq 3: produced before the end, read after it: still released
    assert is_free(fleet)
    assert state(fleet).ranks[0].effective_blocks == 0
    feed.load(decode=2)  # seq 4: after the end, the load of another frontend's request
    assert not is_free(fleet)
    assert state(fleet).releases == []
    assert state(fleet).ranks[0].released_blocks == 0


def test_a_report_from_before_the_request_keeps_what_it_says() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=10))
    fleet.register(config(total=10, block_size=16), 0.0)
    feed.load(prefill=30)  # seq 1: another frontend's prompts
    in_flight = fleet.request_sent("w0", prompt_tokens=16)
    assert in_flight is not None
    fleet.request_output("w0", in_flight, tokens=20)
    fleet.request_finished("w0", in_flight, end(1, 2, 3))
    assert state(fleet).ranks[0].effective_prefill == 30  # seq 1 never counted it
    feed.load(prefill=46)  # seq 2: during its prefill: its 16 prompt tokens are taken off
    assert state(fleet).ranks[0].effective_prefill == 30
    feed.load(prefill=30, decode=3)  # seq 3: after its first output: only its blocks
    assert state(fleet).ranks[0].effective_prefill == 30
    assert state(fleet).ranks[0].effective_blocks == 0


def test_without_the_workers_window_the_next_report_ends_the_release() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=0))
    fleet.register(config(), 0.0)
    feed.load()
    in_flight = fleet.request_sent("w0", prompt_tokens=50)
    assert in_flight is not None
    feed.load(prefill=50)  # read after the request was sent: it may count it
    fleet.request_finished("w0", in_flight)  # an older worker: no window in its End
    assert is_free(fleet)
    feed.load(prefill=50)  # the next report is believed
    assert not is_free(fleet)


def test_no_release_once_an_event_after_the_end_was_applied() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.0))
    fleet.register(config(total=10, block_size=16), 0.0)
    feed.load(decode=1)  # seq 1
    in_flight = fleet.request_sent("w0", prompt_tokens=16)
    assert in_flight is not None
    feed.load(decode=1)  # seq 2: already after the end (another request's block)
    fleet.request_finished("w0", in_flight, end(0, 1, 1))
    assert state(fleet).releases == []
    assert not is_free(fleet)


def test_releases_per_worker_are_bounded_and_the_oldest_goes_first() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.5))
    fleet.register(config(total=1000, block_size=1), 0.0)
    feed.load(decode=1000)
    for _ in range(MAX_RELEASES + 5):
        in_flight = fleet.request_sent("w0", prompt_tokens=1)
        assert in_flight is not None
        fleet.request_finished("w0", in_flight, end(0, 0, 10**9))  # never passed
    worker = state(fleet)
    assert len(worker.releases) == MAX_RELEASES
    assert worker.ranks[0].released_blocks == MAX_RELEASES
    assert worker.ranks[0].effective_blocks == 1000 - MAX_RELEASES


def queue_event(feed: Feed, queued: int, now: float = 0.0, worker_id: str = "w0") -> None:
    """A load event of an idle rank whose worker queues ``queued`` requests."""
    event = wire.LoadEvent(
        seq=feed._next(worker_id),
        ts=0.0,
        load=wire.RankLoad(
            dp_rank=0, active_decode_blocks=0, active_prefill_tokens=0, kv_used_blocks=0
        ),
        engine_requests=4,
        queued_requests=queued,
    )
    feed.fleet.apply(worker_id, event, now)


def test_an_objectives_refusal_holds_the_worker_only_while_its_queue_is_that_deep() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    queue_event(feed, queued=3)
    assert fleet.mark_slo("w0", 0.0, priority=0, queue_bound=4)
    assert is_free(fleet)  # 3 queued: an arrival would be the 4th, still admitted
    fleet.request_pending("w0", 0.0)  # on its way: 4 in the picture
    assert not is_free(fleet)
    assert mark_admits(state(fleet), -1, "")
    assert not mark_admits(state(fleet), 0, "x")
    fleet.request_answered("w0", 0.01)  # it started
    assert is_free(fleet)
    queue_event(feed, queued=5, now=0.1)  # the worker's queue grew: held again
    assert not is_free(fleet, now=0.1)
    queue_event(feed, queued=1, now=0.2)  # and shrank: routed to again, lease or not
    assert is_free(fleet, now=0.2)
    queue_event(feed, queued=9, now=1.5)  # the lease ran out: the refusal is forgotten
    assert is_free(fleet, now=1.5)
    assert state(fleet).slo_bound is None


def test_an_objectives_refusal_leaves_an_ordinary_mark_alone() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    queue_event(feed, queued=0)
    fleet.mark_overloaded("w0", 0.0, 0, "")  # queue full: marked until the next event
    fleet.mark_slo("w0", 0.1, priority=0, queue_bound=3)
    assert not is_free(fleet, now=0.1)
    queue_event(feed, queued=0, now=0.2)  # the event clears the mark; the queue is short
    assert is_free(fleet, now=0.2)


def test_an_older_workers_objective_refusal_holds_at_the_pictured_depth() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    queue_event(feed, queued=2)
    fleet.mark_slo("w0", 0.0, priority=0)  # no bound in the refusal: the depth pictured, 2
    assert not is_free(fleet)
    queue_event(feed, queued=1, now=0.1)
    assert is_free(fleet, now=0.1)


def test_prompt_blocks_round_up() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.5))
    fleet.register(config(total=10, block_size=16), 0.0)
    feed.load()
    fleet.request_sent("w0", prompt_tokens=16 * 5)  # 5 blocks: 5/10 is not > 0.5
    assert is_free(fleet)
    fleet.request_sent("w0", prompt_tokens=1)  # one more block
    assert not is_free(fleet)


@pytest.mark.parametrize("track", [False, True])
def test_track_output_blocks(track: bool) -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.5), track_output_blocks=track)
    fleet.register(config(total=10, block_size=10), 0.0)
    feed.load()
    in_flight = fleet.request_sent("w0", prompt_tokens=10)
    assert in_flight is not None
    fleet.request_output("w0", in_flight, tokens=50)  # 60 tokens: 6 blocks when tracked
    assert is_free(fleet) is not track
    assert state(fleet).ranks[0].own_blocks == (6 if track else 1)
    fleet.request_finished("w0", in_flight)
    assert state(fleet).ranks[0].own_blocks == 0


def test_own_prefill_counts_until_first_output() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=100))
    fleet.register(config(), 0.0)
    feed.load()
    in_flight = fleet.request_sent("w0", prompt_tokens=101)
    assert in_flight is not None
    assert not is_free(fleet)
    fleet.request_output("w0", in_flight, tokens=0)
    assert is_free(fleet)


def test_requests_spread_over_ranks() -> None:
    fleet, _ = fleet_with(BusyThresholds())
    fleet.register(config(dp=2, block_size=1), 0.0)
    fleet.request_sent("w0", prompt_tokens=5)
    fleet.request_sent("w0", prompt_tokens=3)
    assert [r.own_blocks for r in state(fleet).ranks] == [5, 3]
    assert fleet.request_sent("nobody", 5) is None


# ----------------------------------------------------------------------------- time


def test_stale_worker_is_not_free_until_it_speaks() -> None:
    fleet, feed = fleet_with(BusyThresholds(), stale_after_intervals=3.0)
    fleet.register(config(heartbeat=1.0), 0.0)
    feed.load(now=1.0)
    assert is_free(fleet, now=4.0)  # 3 s of silence: not more than 3 intervals
    assert not is_free(fleet, now=4.01)
    assert state(fleet).stale
    assert fleet.available_count(MODEL, 4.01) == 0
    feed.load(now=5.0)
    assert is_free(fleet, now=5.0)
    assert is_free(fleet, now=7.9)
    assert not is_free(fleet, now=8.1)


def test_no_heartbeat_interval_never_stale() -> None:
    fleet, _ = fleet_with(BusyThresholds())
    fleet.register(config(heartbeat=0.0), 0.0)
    assert is_free(fleet, now=1e9)


def test_mark_lease_expires_after_one_second() -> None:
    fleet, _ = fleet_with(BusyThresholds())
    fleet.register(config(heartbeat=100.0), 0.0)
    assert fleet.mark_overloaded("w0", 10.0)
    assert not is_free(fleet, now=10.0)
    assert not is_free(fleet, now=10.99)
    assert is_free(fleet, now=11.0)


def test_mark_cleared_by_next_load_event_or_heartbeat() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    fleet.mark_overloaded("w0", 0.0)
    assert not is_free(fleet, now=0.1)
    feed.load(now=0.2)
    assert is_free(fleet, now=0.2)
    fleet.mark_overloaded("w0", 0.3)
    feed.heartbeat(now=0.4)
    assert is_free(fleet, now=0.4)


def test_remark_extends_the_lease() -> None:
    fleet, _ = fleet_with(BusyThresholds())
    fleet.register(config(heartbeat=100.0), 0.0)
    fleet.mark_overloaded("w0", 0.0)
    fleet.mark_overloaded("w0", 0.5)
    assert not is_free(fleet, now=1.2)
    assert is_free(fleet, now=1.5)
    assert not fleet.mark_overloaded("nobody", 0.0)


def test_draining_heartbeat_and_ready_again() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    feed.heartbeat(status="draining")
    assert fleet.available_count(MODEL, 0.0) == 0
    feed.heartbeat(status="ready")
    assert is_free(fleet)


# ----------------------------------------------------------------------------- thresholds


def test_threshold_change_takes_effect_at_once() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(total=100), 0.0)
    feed.load(decode=60)
    assert is_free(fleet)
    now_in_force = fleet.set_thresholds(MODEL, BusyThresholds(active_decode_blocks=0.5))
    assert now_in_force.active_decode_blocks == 0.5
    assert not is_free(fleet)
    fleet.set_thresholds(MODEL, BusyThresholds(active_decode_blocks=0.7))
    assert is_free(fleet)
    assert fleet.thresholds(MODEL).active_decode_blocks == 0.7


def test_thresholds_are_per_model() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=10))
    fleet.register(config("a", model="m1"), 0.0)
    fleet.register(config("b", model="m2"), 0.0)
    fleet.set_thresholds("m1", BusyThresholds(active_prefill_tokens=100))
    feed.load("a", prefill=50)
    feed.load("b", prefill=50)
    assert len(fleet.free_workers("m1", 0.0) or ()) == 1
    assert len(fleet.free_workers("m2", 0.0) or ()) == 0
    assert fleet.all_thresholds() == [
        ("m1", BusyThresholds(active_prefill_tokens=100)),
        ("m2", BusyThresholds(active_prefill_tokens=10)),
    ]
    with pytest.raises(KeyError):
        fleet.set_thresholds("unknown", BusyThresholds(active_prefill_tokens=1))
    assert fleet.thresholds("unknown") == BusyThresholds(active_prefill_tokens=10)


# ----------------------------------------------------------------------------- fleet views


def test_all_models_busy() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=0))
    assert not fleet.all_models_busy(0.0)  # nothing known
    fleet.register(config("a", model="m1"), 0.0)
    fleet.register(config("b", model="m2"), 0.0)
    feed.load("a", prefill=1)
    assert not fleet.all_models_busy(0.0)
    feed.load("b", prefill=1)
    assert fleet.all_models_busy(0.0)
    fleet.remove("b")  # m2 has no worker now: a request for it gets 503, not 529
    assert not fleet.all_models_busy(0.0)


def test_rank_gauges_and_removal() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config("a", dp=2, total=64), 0.0)
    feed.load("a", rank=1, decode=3, used=5, prefill=7)
    assert sorted(fleet.rank_gauges()) == [
        RankGauge("a", 0, 0, 0, 64),
        RankGauge("a", 1, 5, 7, 64),
    ]
    in_flight = fleet.request_sent("a", 1)
    assert fleet.remove("a")
    assert not fleet.remove("a")
    assert list(fleet.rank_gauges()) == []
    assert fleet.is_known_model(MODEL)  # a model stays known
    assert in_flight is not None
    fleet.request_finished("a", in_flight)  # harmless after removal


def test_reregister_replaces_state() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=0))
    fleet.register(config(), 0.0)
    feed.load(prefill=5)
    assert not is_free(fleet)
    fleet.register(config(), 1.0)
    assert is_free(fleet, now=1.0)
    assert fleet.connected_count == 1


def test_queue_threshold_saturation() -> None:
    fleet, feed = fleet_with(BusyThresholds(), queue_threshold=0.5)
    fleet.register(config(max_batched=100, dp=2), 0.0)
    feed.load(rank=0, prefill=51)
    assert fleet.unsaturated_free_count(MODEL, 0.0) == 0
    feed.load(rank=1, prefill=50)
    assert fleet.unsaturated_free_count(MODEL, 0.0) == 1
    with pytest.raises(ValueError, match="queue_threshold"):
        Fleet(queue_threshold=0.0)


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
    charges = [c for c in worker.charges if c.rank == index]
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
            reference_rank_busy(thresholds, worker, *reference_figures(worker, i))
            for i in reported
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
        if until is None or until <= self.now or (worker is not None and worker.slo_holds):
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
        self.fleet.mark_slo(worker_id, self.now, priority, bound)

    @rule(worker_id=st.sampled_from(WORKERS), answered=st.booleans())
    def pending_or_answered(self, worker_id: str, answered: bool) -> None:
        if answered:
            self.fleet.request_answered(worker_id, self.now)
        else:
            self.fleet.request_pending(worker_id, self.now)

    @invariant()
    def an_objectives_mark_holds_exactly_while_the_queue_is_at_its_bound(self) -> None:
        for worker in self.fleet.workers():
            if worker.slo_holds and worker.slo_bound is not None and worker.slo_until > self.now:
                assert worker.queued_requests + worker.queue_delta >= worker.slo_bound

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

    @rule(data=st.data(), ahead=st.none() | st.integers(-1, 3))
    def finish(self, data: st.DataObject, ahead: int | None) -> None:
        # ahead: where the worker's End puts its events, from the last one applied.
        if self.in_flight:
            index = data.draw(st.integers(0, len(self.in_flight) - 1))
            worker_id, in_flight = self.in_flight.pop(index)
            window = None
            if ahead is not None:
                seq = self.feed.seq.get(worker_id, 0)
                window = wire.End(
                    request_id=1,
                    prompt_tokens=0,
                    completion_tokens=0,
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
            if worker.mark_until is None or worker.mark_until <= self.now or worker.slo_holds:
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


# ----------------------------------------------------------------------------- effective limit


def gauges(
    fleet: Fleet, feed: Feed, worker_id: str, engine: int, queued: int, limit: int | None
) -> None:
    event = wire.LoadEvent(
        seq=feed._next(worker_id),
        ts=0.0,
        load=wire.RankLoad(
            dp_rank=0, active_decode_blocks=0, active_prefill_tokens=0, kv_used_blocks=0
        ),
        engine_requests=engine,
        queued_requests=queued,
        effective_limit=limit,
    )
    assert fleet.apply(worker_id, event, 0.0)


def test_slot_share_follows_the_workers_that_report_l() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    for worker_id in ("a", "b", "c"):
        fleet.register(config(worker_id), 0.0)
    assert fleet.slot_share() == 1.0
    gauges(fleet, feed, "a", 8, 0, 8)
    gauges(fleet, feed, "c", 100, 0, None)  # no objective: not counted
    assert fleet.slot_share() == 1.0
    gauges(fleet, feed, "b", 8, 2, 2)  # L fell to 2 with 8 still running
    assert fleet.slot_share() == pytest.approx(10 / 16)
    gauges(fleet, feed, "b", 2, 2, 2)
    assert fleet.slot_share() == 1.0
    gauges(fleet, feed, "b", 8, 2, 2)
    fleet.remove("b")
    assert fleet.slot_share() == 1.0
    # A reconnect forgets what the old connection reported.
    gauges(fleet, feed, "a", 8, 0, 4)
    assert fleet.slot_share() == pytest.approx(0.5)
    fleet.register(config("a"), 0.0)
    assert fleet.slot_share() == 1.0


def test_load_cost_weighs_the_gates_share_of_l_only_when_reported() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config("a"), 0.0)
    gauges(fleet, feed, "a", 4, 0, None)
    assert state(fleet, "a").load_cost == 0.0
    gauges(fleet, feed, "a", 4, 2, 4)
    assert state(fleet, "a").load_cost == pytest.approx(1.5)
    # What this router has in flight there counts when the worker's report lags behind.
    for _ in range(8):
        fleet.request_sent("a", 0)
    assert state(fleet, "a").load_cost == pytest.approx(2.0)


# ----------------------------------------------------------------------------- batches


def _snapshot(fleet: Fleet, worker_id: str) -> dict[str, Any]:
    worker = state(fleet, worker_id)
    ranks = [
        {name: getattr(rank, name) for name in type(rank).__slots__} for rank in worker.ranks
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
