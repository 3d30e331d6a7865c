"""The SLO controller (worker_ingress/_slo.py): its rules, and its properties under Hypothesis.

The synthetic plant below stands for an engine whose in-engine time to first token is flat up to
a knee (its batch is not yet saturated) and grows linearly past it (prefill queues inside the
engine), offered a steady demand of concurrent requests: that is the shape the mocker shows with
chunked prefill (docs/mocker.md) and the shape the law is built for.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_ingress._slo import UNBOUNDED_QUEUE, SloController, SloTuning, percentile

OBJECTIVE = 0.3


def feed_window(
    controller: SloController,
    now: float,
    *,
    engine_ttft: float,
    samples: int = 20,
    queued: bool = False,
    queue_wait: float = 0.0,
    running: int = 0,
) -> float:
    """One window of identical samples that started after the window opened; returns the time
    at which it is closed (one window later)."""
    end = now + controller.tuning.window_seconds
    for index in range(samples):
        started = now + (index + 1) * (end - now) / (samples + 2)
        request = object()
        if running:
            controller.observe_start(request, started=started, running=running)
        controller.observe_first_output(
            request,
            arrived=started - queue_wait,
            started=started,
            first_output=started + engine_ttft,
        )
    if queued:
        controller.observe_backlog()
    controller.update(end)
    return end


@dataclasses.dataclass(frozen=True)
class Plant:
    """A steady load: ``demand`` requests want to be in the engine; past ``knee`` of them each
    one more adds ``slope`` seconds to the in-engine time to first token."""

    demand: int
    knee: int
    base: float
    slope: float

    def engine_ttft(self, limit: int) -> float:
        return self.base + self.slope * max(0, min(limit, self.demand) - self.knee)

    def binding(self, limit: int) -> bool:
        return self.demand > limit


plants = st.builds(
    Plant,
    demand=st.integers(1, 600),
    knee=st.integers(1, 300),
    base=st.floats(0.005, 0.1),
    slope=st.floats(0.0005, 0.08),
)


def run_plant(controller: SloController, plant: Plant, windows: int, now: float = 0.0) -> list[int]:
    limits = []
    for _ in range(windows):
        limit = controller.limit
        now = feed_window(
            controller,
            now,
            engine_ttft=plant.engine_ttft(limit),
            queued=plant.binding(limit),
            running=min(limit, plant.demand),
        )
        limits.append(controller.limit)
    return limits


# -- rules, one by one ---------------------------------------------------------------------------


def test_starts_at_n_with_no_bound() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=64, now=0.0)
    assert controller.limit == 64
    assert controller.queue_bound == UNBOUNDED_QUEUE


def test_too_few_samples_hold_however_long() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=64, now=0.0)
    for index in range(15):
        controller.observe_first_output(
            object(), arrived=index, started=index, first_output=index + 5.0
        )
    assert not controller.update(1000.0)
    assert controller.limit == 64
    assert controller.windows == 0


def test_a_window_needs_its_time_as_well_as_its_samples() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=64, now=0.0)
    for _ in range(100):
        controller.observe_first_output(object(), arrived=0.0, started=0.0, first_output=5.0)
    assert not controller.update(0.5)
    assert controller.update(1.0)
    assert controller.limit == 8  # far over: the first cut from N, by eight at most


def test_max_samples_closes_a_window_early() -> None:
    tuning = SloTuning(max_samples=32)
    controller = SloController(objective=OBJECTIVE, max_limit=64, tuning=tuning, now=0.0)
    for _ in range(40):
        controller.observe_first_output(object(), arrived=0.0, started=0.0, first_output=5.0)
    assert controller.update(0.01)
    assert controller.windows == 1


def test_decrease_follows_the_gradient_and_sets_a_ceiling() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=100, now=0.0)
    # p90 = 0.2 s against the engine's share 0.15 s: L * 0.75.
    feed_window(controller, 0.0, engine_ttft=0.2)
    assert controller.limit == 75
    assert controller.ceiling == 100


def test_a_limit_that_was_not_reached_is_cut_from_what_ran() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=100, now=0.0)
    # 20 ran at most, 0.2 s against 0.15 s: 20 * 0.75 = 15, at once (the first cut from N).
    now = feed_window(controller, 0.0, engine_ttft=0.2, running=20)
    assert controller.limit == 15
    # Later cuts take half at most: 15 -> max(7, floor(15 * 0.15 / 1.0)).
    feed_window(controller, now, engine_ttft=1.0, running=20)
    assert controller.limit == 7


def test_the_first_cut_from_n_meets_an_overload_within_one_window() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=256, now=0.0)
    # 256 ran, 1.2 s against 0.15 s: the gradient says 32, and the first cut goes there.
    feed_window(controller, 0.0, engine_ttft=1.2, running=256)
    assert controller.limit == 32
    assert controller.ceiling == 256


def test_a_small_overshoot_still_moves_by_one() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=10, now=0.0)
    feed_window(controller, 0.0, engine_ttft=0.151)
    assert controller.limit == 9


def test_dead_band_holds() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=100, now=0.0)
    feed_window(controller, 0.0, engine_ttft=0.2)
    assert controller.limit == 75
    feed_window(controller, 1.0, engine_ttft=0.13, queued=True)  # in (0.1125, 0.15]
    assert controller.limit == 75


def test_increase_only_while_the_limit_is_in_use_and_under_the_ceiling() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=100, now=0.0)
    now = feed_window(controller, 0.0, engine_ttft=0.2)
    assert controller.limit == 75
    now = feed_window(controller, now, engine_ttft=0.05, queued=True)
    assert controller.limit == 99  # the gradient says more: ceiling 100, minus one
    now = feed_window(controller, now, engine_ttft=0.05, queued=True)
    assert controller.limit == 100  # the ceiling's first life ran out: probe it


def test_an_increase_goes_toward_where_the_engine_would_just_be_comfortable() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=100, now=0.0)
    now = feed_window(controller, 0.0, engine_ttft=0.2)
    now = feed_window(controller, now, engine_ttft=0.1, queued=True)
    assert controller.limit == 84  # floor(75 * 0.1125 / 0.1), at most proportionally slower


def test_a_failed_probe_makes_increases_single_steps_and_the_ceiling_live_longer() -> None:
    tuning = SloTuning()
    controller = SloController(objective=OBJECTIVE, max_limit=100, now=0.0)
    now = feed_window(controller, 0.0, engine_ttft=0.2)  # 75, ceiling 100
    now = feed_window(controller, now, engine_ttft=0.05, queued=True)  # raised to 99
    assert controller.limit == 99
    now = feed_window(controller, now, engine_ttft=0.2, queued=True)  # the probe failed
    assert controller.limit == 75
    assert controller.ceiling == 76
    for _ in range(3):  # the ceiling now lives twice as long: still capped at 75
        now = feed_window(controller, now, engine_ttft=0.05, queued=True)
        assert controller.limit == 75
    now = feed_window(controller, now, engine_ttft=0.05, queued=True)
    assert controller.limit == 75 + max(1, math.floor(75 * tuning.increase_share))  # one step


def test_an_attack_of_long_prompts_cannot_pin_the_limit_once_it_is_over() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=16, now=0.0)
    now = 0.0
    for _ in range(15):  # long prompts: in-engine first tokens far over the engine's share
        now = feed_window(controller, now, engine_ttft=2.0, queued=True)
    assert controller.limit == 1
    # One request past its first output holds the only slot: no sample for a long while. A
    # window that the held slot starves, with nothing late in the engine, raises L anyway.
    controller.observe_backlog()
    assert not controller.update(now + 2.0)
    assert controller.update(now + 3.0)
    assert controller.limit == 2
    now += 3.0
    # The attack is over: short prompts, comfortable, queued behind the limit. Within a few
    # windows L is back within 10% of N.
    windows = 0
    while controller.limit < 0.9 * 16:
        now = feed_window(controller, now, engine_ttft=0.02, queued=True)
        windows += 1
        assert windows <= 6, controller.limit


def test_one_very_long_request_moves_the_hold_time_as_a_few_ordinary_ones() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=4, now=0.0)
    for index in range(50):
        controller.observe_finish(index, started=0.0, finished=0.5)
    controller.observe_finish("long", started=0.0, finished=38.0)  # max_tokens 6000
    hold = controller.hold_seconds
    assert hold is not None
    tuning = controller.tuning
    assert hold <= 0.5 * (1 + tuning.hold_smoothing * (tuning.hold_outlier - 1)) + 1e-9


def test_recovery_when_nobody_waits() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=256, min_limit=2, now=0.0)
    now = 0.0
    for _ in range(10):
        now = feed_window(controller, now, engine_ttft=5.0)
    assert controller.limit == 2
    for _ in range(7):
        now = feed_window(controller, now, engine_ttft=0.02)
    assert controller.limit == 256
    assert controller.ceiling is None


def test_samples_that_started_before_the_change_are_not_samples() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=64, now=0.0)
    now = feed_window(controller, 0.0, engine_ttft=5.0)
    assert controller.limit == 8
    for _ in range(50):  # admitted under L = 64: say nothing about 8
        controller.observe_first_output(object(), arrived=0.5, started=0.5, first_output=now + 3.0)
    assert not controller.update(now + 2.0)
    assert controller.limit == 8


def test_queue_bound_leaves_room_for_the_spread_of_the_wait() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=10, now=0.0)
    controller.observe_finish(object(), started=0.0, finished=0.5)
    feed_window(controller, 0.0, engine_ttft=0.1)  # comfortable, not in use: L stays 10
    assert controller.limit == 10
    # r = 10 / 0.5 = 20 starts/s; room R = (0.3 - 0.1) * 20 = 4 starts; x + 1.28 sqrt(x) <= 4.
    assert controller.queue_bound == 2
    x = controller.queue_bound
    assert x + 1.2816 * math.sqrt(x) <= 4 < (x + 1) + 1.2816 * math.sqrt(x + 1)
    assert controller.engine_ttft_p90 == pytest.approx(0.1)


def test_the_bound_of_an_arrival_that_spent_time_upstream_is_that_of_the_rest_of_s() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=10, now=0.0)
    assert controller.queue_bound_after(0.1) == controller.queue_bound  # no evidence: none
    controller.observe_finish(object(), started=0.0, finished=0.5)
    feed_window(controller, 0.0, engine_ttft=0.1)
    assert controller.queue_bound_after(0.0) == controller.queue_bound == 2
    # R = (0.3 - 0.1 - 0.1) * 20 = 2 starts: x + 1.28 sqrt(x) <= 2 for x = 0.5 at most.
    assert controller.queue_bound_after(0.1) == 1
    assert controller.queue_bound_after(0.2) == 0  # nothing left past the engine's p90
    # A later finish moves the hold but not the bound, fresh or not, until the next window.
    controller.observe_finish(object(), started=1.0, finished=1.05)
    assert controller.queue_bound_after(1e-9) == 2
    bounds = [controller.queue_bound_after(waited / 100) for waited in range(40)]
    assert bounds == sorted(bounds, reverse=True)


def test_a_little_room_still_keeps_one_request_ready() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=1, now=0.0)
    controller.observe_finish(object(), started=0.0, finished=2.0)
    feed_window(controller, 0.0, engine_ttft=0.1)
    # R = 0.2 * 1 / 2 = 0.1 start: no queued request would make it on average, but one in the
    # dispatcher's hand keeps the engine busy, and the deadline refuses it if it waits too long.
    assert controller.queue_bound == 1


def test_no_room_at_all_refuses_every_queued_arrival() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=10, now=0.0)
    controller.observe_finish(object(), started=0.0, finished=1.0)
    feed_window(controller, 0.0, engine_ttft=0.5)
    assert controller.queue_bound == 0
    assert controller.queue_deadline == 0.0


def test_queue_deadline_leaves_room_for_the_engine() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=10, now=0.0)
    assert controller.queue_deadline == OBJECTIVE  # no evidence yet: S itself
    feed_window(controller, 0.0, engine_ttft=0.05)
    assert controller.queue_deadline == pytest.approx(OBJECTIVE - 0.05)


def test_requests_still_waiting_for_a_first_output_count_once_overdue() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=64, now=0.0)
    for index in range(20):  # in the engine since 0.1 s, no first output by 1.0 s
        controller.observe_start(index, started=0.1)
    assert controller.update(1.0)
    assert controller.limit == 10  # 0.9 s overdue against 0.15 s: floor(64 * 0.15 / 0.9)
    # The change forgets them: they were admitted under the old L.
    assert not controller.update(2.5)


def test_young_open_samples_are_no_evidence() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=64, now=0.0)
    for index in range(20):
        controller.observe_start(index, started=0.95)
    assert not controller.update(1.0)
    assert controller.limit == 64


def test_a_request_that_leaves_without_first_output_is_no_sample() -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=64, now=0.0)
    for index in range(20):
        controller.observe_start(index, started=0.1)
        controller.observe_finish(index, started=0.1, finished=0.2)  # cancelled
    assert not controller.update(1.0)
    assert controller.limit == 64


def test_hold_is_a_smoothed_mean() -> None:
    tuning = SloTuning(hold_smoothing=0.5)
    controller = SloController(objective=OBJECTIVE, max_limit=10, tuning=tuning, now=0.0)
    controller.observe_finish(object(), started=0.0, finished=1.0)
    controller.observe_finish(object(), started=0.0, finished=3.0)
    assert controller.hold_seconds == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"objective": 0.0, "max_limit": 4}, "objective"),
        ({"objective": math.inf, "max_limit": 4}, "objective"),
        ({"objective": 1.0, "max_limit": 0}, "max_limit"),
        ({"objective": 1.0, "max_limit": 4, "min_limit": 5}, "min_limit"),
        ({"objective": 1.0, "max_limit": 4, "min_limit": 0}, "min_limit"),
    ],
)
def test_bad_arguments(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SloController(**kwargs, now=0.0)  # type: ignore[arg-type]


def test_bad_tuning() -> None:
    with pytest.raises(ValueError, match="comfort"):
        SloTuning(comfort=1.0)


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 0.9) == 9.0
    assert percentile(values, 0.5) == 5.0
    assert percentile([3.0], 0.9) == 3.0


# -- properties ----------------------------------------------------------------------------------

observations = st.lists(
    st.tuples(
        st.sampled_from(["sample", "queued", "finish", "update"]),
        st.floats(0.0, 2.0),  # time step
        st.floats(0.0, 10.0),  # a duration
    ),
    max_size=300,
)


@settings(max_examples=200, deadline=None)
@given(
    max_limit=st.integers(1, 512),
    min_share=st.floats(0.0, 1.0),
    program=observations,
)
def test_limit_stays_in_bounds_and_moves_in_bounded_steps(
    max_limit: int, min_share: float, program: list[tuple[str, float, float]]
) -> None:
    min_limit = max(1, math.floor(min_share * max_limit))
    controller = SloController(
        objective=OBJECTIVE, max_limit=max_limit, min_limit=min_limit, now=0.0
    )
    tuning = controller.tuning
    now = 0.0
    for action, step, duration in program:
        now += step
        if action == "sample":
            controller.observe_first_output(
                object(), arrived=now - duration, started=now - duration / 2, first_output=now
            )
        elif action == "queued":
            controller.observe_backlog()
        elif action == "finish":
            controller.observe_finish(object(), started=now - duration, finished=now)
        else:
            before = controller.limit
            controller.update(now)
            after = controller.limit
            assert min_limit <= after <= max_limit
            assert after >= max(min_limit, math.floor(before * tuning.min_decrease_factor))
            assert after <= min(max_limit, math.ceil(before * tuning.recovery_factor))
        assert min_limit <= controller.limit <= max_limit
        assert controller.queue_bound >= 0


@settings(max_examples=200, deadline=None)
@given(plant=plants, max_limit=st.integers(1, 512), low_load=st.floats(0.001, 0.1))
def test_limit_recovers_to_n_once_the_load_falls(
    plant: Plant, max_limit: int, low_load: float
) -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=max_limit, now=0.0)
    run_plant(controller, plant, 60)
    # The load falls: nobody waits, the engine answers fast.
    now = 60.0
    windows = 0
    while controller.limit < max_limit:
        now = feed_window(controller, now, engine_ttft=low_load)
        windows += 1
        assert windows <= math.ceil(math.log2(max_limit)) + 1
    assert controller.limit == max_limit


@settings(max_examples=300, deadline=None)
@given(plant=plants, max_limit=st.integers(1, 512))
def test_no_oscillation_on_a_steady_load(plant: Plant, max_limit: int) -> None:
    controller = SloController(objective=OBJECTIVE, max_limit=max_limit, now=0.0)
    tuning = controller.tuning
    settle = 120
    horizon = 120
    limits = run_plant(controller, plant, settle + horizon)
    settled = limits[settle:]
    changes = sum(1 for a, b in itertools.pairwise(settled) if a != b)
    # At most one probe of the ceiling per probe_seconds, each a step up and back.
    probes = math.ceil(horizon * tuning.window_seconds / tuning.probe_seconds) + 1
    assert changes <= 3 * probes, settled
    # And between probes L sits still on one level or next to it (no sawtooth).
    assert max(settled) - min(settled) <= max(2, math.ceil(max(settled) * 0.1)), settled
    # Where it settles serves the objective, or is as low as it may go.
    final = min(settled)
    target = tuning.engine_share * OBJECTIVE
    assert plant.engine_ttft(final) <= target or final == controller.min_limit


@settings(max_examples=100, deadline=None)
@given(plant=plants, max_limit=st.integers(8, 512), seed=st.integers(0, 2**32 - 1))
def test_noisy_steady_load_stays_in_bounds_and_serves_the_objective(
    plant: Plant, max_limit: int, seed: int
) -> None:
    rng = random.Random(seed)
    controller = SloController(objective=OBJECTIVE, max_limit=max_limit, now=0.0)
    now = 0.0
    limits = []
    for _ in range(200):
        limit = controller.limit
        end = now + 1.0
        for index in range(30):
            started = now + (index + 1) / 32
            ttft = plant.engine_ttft(limit) * rng.uniform(0.8, 1.2)
            controller.observe_first_output(
                object(), arrived=started, started=started, first_output=started + ttft
            )
        if plant.binding(limit):
            controller.observe_backlog()
        controller.update(end)
        now = end
        limits.append(controller.limit)
    assert all(1 <= value <= max_limit for value in limits)
    settled = sorted(limits[100:])
    median = settled[len(settled) // 2]
    target = controller.tuning.engine_share * OBJECTIVE
    assert plant.engine_ttft(median) <= target * 1.2 or median == 1
