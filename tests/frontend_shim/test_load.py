"""The frontend's load state and free sets (frontend_shim._load, _free_sets), without I/O: the busy
rule as the fleet applies it to each worker's ranks, the router's own count, time, thresholds,
the fleet's views and the effective limit. The thresholds' own ranges and merging are tested in
tests/shim_common/test_busy.py; the load state against a plain reference model in
test_load_state_machine.py.
"""

from __future__ import annotations

import pytest
from load_feed import MODEL, Feed, config, fleet_with, is_free, state

from frontend_shim._free_sets import mark_admits
from frontend_shim._load import MAX_RELEASES, Fleet, RankGauge
from shim_common import wire
from shim_common.wire import BusyThresholds

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
    assert state(fleet).ranks[0].own.blocks == 0


def end(started: int, first: int, ended: int, prompt: int = 16, completion: int = 20) -> wire.End:
    """A worker's final frame with its event window and its token counts."""
    return wire.End(
        request_id=1,
        prompt_tokens=prompt,
        completion_tokens=completion,
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


def test_a_request_the_worker_never_started_takes_nothing_off_its_reports() -> None:
    # Charged at the pick, then refused: no report ever counted it, so the reports read since
    # the pick are believed whole (a release would take its blocks off another's load).
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.0))
    fleet.register(config(total=10, block_size=16), 0.0)
    feed.load()  # seq 1: idle
    in_flight = fleet.request_sent("w0", prompt_tokens=32)
    assert in_flight is not None
    assert state(fleet).ranks[0].effective_blocks == 2
    feed.load(decode=2)  # seq 2: another frontend's request
    fleet.request_finished("w0", in_flight, held=False)
    assert state(fleet).releases == []
    assert state(fleet).ranks[0].own.blocks == 0
    assert state(fleet).ranks[0].effective_blocks == 2
    assert not is_free(fleet)


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
    total = 4 * MAX_RELEASES
    fleet.register(config(total=total, block_size=1), 0.0)
    feed.load(decode=total)
    for _ in range(MAX_RELEASES + 5):
        in_flight = fleet.request_sent("w0", prompt_tokens=1)
        assert in_flight is not None
        fleet.request_finished("w0", in_flight, end(0, 0, 10**9, 1, 0))  # never passed
    worker = state(fleet)
    assert len(worker.releases) == MAX_RELEASES
    assert worker.ranks[0].released_blocks == MAX_RELEASES
    assert worker.ranks[0].effective_blocks == total - MAX_RELEASES


def test_the_workers_token_counts_size_the_release_when_this_frontend_counted_fewer() -> None:
    # The last chunks came with the End, uncounted; or the prompt was tokenised otherwise here:
    # the worker's End says what it held, and its report is taken off in full.
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.0))
    fleet.register(config(total=10, block_size=16), 0.0)
    feed.load()  # seq 1: idle
    in_flight = fleet.request_sent("w0", prompt_tokens=10)
    assert in_flight is not None
    fleet.request_output("w0", in_flight, tokens=1)
    feed.load(decode=4)  # seq 2: 18 prompt tokens and 47 of output: 4 blocks
    fleet.request_finished("w0", in_flight, end(1, 1, 3, prompt=18, completion=48))
    assert state(fleet).ranks[0].effective_blocks == 0
    assert is_free(fleet)


def test_a_failed_request_is_released_by_this_frontends_count() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_decode_blocks=0.0))
    fleet.register(config(total=10, block_size=16), 0.0)
    feed.load()
    in_flight = fleet.request_sent("w0", prompt_tokens=20)
    assert in_flight is not None
    feed.load(decode=2)
    failed = wire.Failed(request_id=1, kind="engine", message="x", started_seq=1, ended_seq=3)
    fleet.request_finished("w0", in_flight, failed)
    assert is_free(fleet)


def test_a_charge_made_at_the_pick_takes_the_workers_count_of_the_prompt() -> None:
    fleet, feed = fleet_with(BusyThresholds(active_prefill_tokens=40))
    fleet.register(config(total=10, block_size=16), 0.0)
    feed.load()
    in_flight = fleet.request_sent("w0", prompt_tokens=30)  # this frontend's tokeniser
    assert in_flight is not None
    assert is_free(fleet)
    fleet.request_started("w0", in_flight, 50)  # the worker's Started counts 50
    rank = state(fleet).ranks[0]
    assert (rank.own.prefill, rank.own.blocks) == (50, 4)
    assert not is_free(fleet)
    fleet.request_started("w0", in_flight, 0)  # a worker that does not say: unchanged
    assert (rank.own.prefill, rank.own.blocks) == (50, 4)
    fleet.request_output("w0", in_flight, 1)
    fleet.request_started("w0", in_flight, 20)  # past its prefill: only the blocks move
    assert (rank.own.prefill, rank.own.blocks) == (0, 2)
    fleet.request_finished("w0", in_flight, held=False)
    assert (rank.own.prefill, rank.own.blocks) == (0, 0)


def test_the_share_of_l_leaves_out_only_the_releases_the_newest_event_counts() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(total=0), 0.0)
    queue_event(feed, queued=0, engine=2, limit=4)  # seq 1: two running
    assert state(fleet).load_cost == 0.5
    first = fleet.request_sent("w0", prompt_tokens=0)
    assert first is not None
    fleet.request_finished("w0", first, end(0, 0, 5))  # seq 1 counts it: one running now
    assert state(fleet).load_cost == 0.25
    later = fleet.request_sent("w0", prompt_tokens=0)
    assert later is not None
    fleet.request_finished("w0", later, end(2, 2, 5))  # started after seq 1: not in it
    assert state(fleet).load_cost == 0.25
    assert len(state(fleet).releases) == 2


def queue_event(
    feed: Feed,
    queued: int,
    now: float = 0.0,
    worker_id: str = "w0",
    *,
    ahead: list[tuple[int, int]] | None = None,
    engine: int = 4,
    limit: int | None = None,
) -> None:
    """A load event of an idle rank whose worker queues ``queued`` requests (``ahead``: its
    figures by priority)."""
    event = wire.LoadEvent(
        seq=feed._next(worker_id),
        ts=0.0,
        load=wire.RankLoad(
            dp_rank=0, active_decode_blocks=0, active_prefill_tokens=0, kv_used_blocks=0
        ),
        engine_requests=engine,
        queued_requests=queued,
        effective_limit=limit,
        queue_ahead=ahead,
    )
    feed.fleet.apply(worker_id, event, now)


def test_an_objectives_refusal_is_held_at_the_depth_of_its_priority_not_the_whole_queue() -> None:
    # Ten queued, eight of them of a worse priority than the refused one: the worker would
    # take the next request of priority 0 (2 ahead of it, B = 4), so the frontend must too.
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    queue_event(feed, queued=10, ahead=[(0, 2), (5, 10)])
    assert fleet.mark_long_queue("w0", 0.0, priority=0, queue_bound=4)
    assert is_free(fleet)
    fleet.request_pending("w0", 0.0, priority=5)  # a worse one: not ahead of priority 0
    assert is_free(fleet)
    fleet.request_pending("w0", 0.0, priority=-1)
    fleet.request_pending("w0", 0.0, priority=0)  # 4 ahead of priority 0 now
    assert not is_free(fleet)
    assert not mark_admits(state(fleet), 5, "")
    assert mark_admits(state(fleet), -1, "")
    fleet.request_answered("w0", 0.01, priority=-1)
    assert is_free(fleet)
    queue_event(feed, queued=4, now=0.1, ahead=[(-3, 4)])  # four of a better priority
    assert not is_free(fleet, now=0.1)
    queue_event(feed, queued=1, now=0.2, ahead=[(7, 1)])  # one worse, about to start
    assert is_free(fleet, now=0.2)


def test_a_queue_timeout_is_held_at_the_depth_pictured_when_it_came() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    queue_event(feed, queued=3, ahead=[(0, 3)])
    fleet.mark_long_queue("w0", 0.0, priority=0)  # no depth named: 3, the picture's
    assert not is_free(fleet)
    queue_event(feed, queued=2, now=0.1, ahead=[(0, 2)])
    assert is_free(fleet, now=0.1)
    queue_event(feed, queued=3, now=0.2, ahead=[(0, 3)])
    assert not is_free(fleet, now=0.2)
    assert is_free(fleet, now=1.1)  # the lease ran out


def test_an_objectives_refusal_holds_the_worker_only_while_its_queue_is_that_deep() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    queue_event(feed, queued=3)
    assert fleet.mark_long_queue("w0", 0.0, priority=0, queue_bound=4)
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
    assert state(fleet).hold_bound is None


def test_an_objectives_refusal_leaves_an_ordinary_mark_alone() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    queue_event(feed, queued=0)
    fleet.mark_overloaded("w0", 0.0, 0, "")  # queue full: marked until the next event
    fleet.mark_long_queue("w0", 0.1, priority=0, queue_bound=3)
    assert not is_free(fleet, now=0.1)
    queue_event(feed, queued=0, now=0.2)  # the event clears the mark; the queue is short
    assert is_free(fleet, now=0.2)


def test_an_older_workers_objective_refusal_holds_at_the_pictured_depth() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(), 0.0)
    queue_event(feed, queued=2)
    fleet.mark_long_queue("w0", 0.0, priority=0)  # no bound in the refusal: the depth pictured, 2
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
    assert state(fleet).ranks[0].own.blocks == (6 if track else 1)
    fleet.request_finished("w0", in_flight)
    assert state(fleet).ranks[0].own.blocks == 0


@pytest.mark.parametrize("track", [False, True])
def test_blocks_several_requests_in_flight_share_are_counted_once(track: bool) -> None:
    fleet, feed = fleet_with(BusyThresholds(), track_output_blocks=track)
    fleet.register(config(total=100, block_size=10), 0.0)
    feed.load()
    rank = state(fleet).ranks[0]
    # Two turns of one conversation: the second resends the first's 3 blocks and adds 2, and
    # its prompt ends in a partial block (6 blocks, 5 of them named).
    first = fleet.request_sent("w0", prompt_tokens=30, names=[1, 2, 3])
    second = fleet.request_sent("w0", prompt_tokens=55, names=[1, 2, 3, 4, 5])
    assert first is not None
    assert second is not None
    assert rank.own.blocks == 5 + 1  # the shared three once, the partial block apart
    fleet.request_output("w0", first, tokens=15)  # into a 5th block when output is tracked
    assert rank.own.blocks == 6 + (2 if track else 0)
    fleet.request_finished("w0", second)
    assert rank.own.blocks == 3 + (2 if track else 0)  # the first still holds its own
    assert sorted(rank.own.names) == [1, 2, 3]
    fleet.request_finished("w0", first)
    fleet.request_finished("w0", first)  # idempotent
    assert (rank.own.blocks, rank.own.names) == (0, {})


def test_a_worker_that_counts_fewer_tokens_than_the_names_charges_no_negative_block() -> None:
    fleet, feed = fleet_with(BusyThresholds())
    fleet.register(config(total=100, block_size=10), 0.0)
    feed.load()
    in_flight = fleet.request_sent("w0", prompt_tokens=40, names=[7, 8, 9, 10])
    assert in_flight is not None
    fleet.request_started("w0", in_flight, prompt_tokens=25)  # its own count: 3 blocks
    rank = state(fleet).ranks[0]
    assert rank.own.blocks == 4  # the names stand; nothing anonymous is owed
    fleet.request_finished("w0", in_flight)
    assert (rank.own.blocks, rank.own.names) == (0, {})


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
    assert [r.own.blocks for r in state(fleet).ranks] == [5, 3]
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
