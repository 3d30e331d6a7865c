"""The cost meter: what an event message costs, and the budget it gives (sans-IO)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend_shim._event_budget import EventBudget
from frontend_shim._event_cost import (
    DEFAULT_CORE_SHARE,
    MAX_MEASURED_BUDGET,
    MIN_MEASURED_BUDGET,
    EventCostMeter,
)

LINKS = 2048


class Process:
    """Running totals of a frontend whose every message costs ``cost`` CPU seconds."""

    def __init__(self, meter: EventCostMeter, base: float = 0.0) -> None:
        self.meter = meter
        self.base = base
        self.now = self.cpu = 0.0
        self.messages = self.connects = 0
        meter.sample(now=0.0, cpu=0.0, messages=0, connects=0, links=LINKS)

    def window(self, messages: int, cost: float, seconds: float = 2.0, connects: int = 0) -> bool:
        self.now += seconds
        self.cpu += self.base * seconds + messages * cost
        self.messages += messages
        self.connects += connects
        return self.meter.sample(
            now=self.now,
            cpu=self.cpu,
            messages=self.messages,
            connects=self.connects,
            links=LINKS,
        )


def test_a_steady_cost_gives_the_share_of_a_core_over_it() -> None:
    meter = EventCostMeter()
    process = Process(meter)
    for _ in range(2):  # the first estimate waits for three windows
        assert not process.window(10_000, 30e-6)
        assert meter.cost == 0
        assert meter.budget == 6000  # the default until measured
    assert process.window(10_000, 30e-6)
    assert meter.cost == pytest.approx(30e-6)
    assert meter.budget == pytest.approx(DEFAULT_CORE_SHARE / 30e-6)  # 15,000
    assert meter.windows == 3


def test_one_outlier_window_does_not_move_the_budget() -> None:
    meter = EventCostMeter(hold=0.0)
    process = Process(meter)
    for _ in range(5):
        process.window(10_000, 50e-6)
    assert meter.budget == pytest.approx(DEFAULT_CORE_SHARE / 50e-6)  # 9,600
    # A burst of HTTP work charged to one window's messages: eight times the cost.
    assert not process.window(10_000, 400e-6)
    assert meter.cost == pytest.approx(50e-6)
    # A step that lasts is followed once it holds for most of the samples.
    assert not process.window(10_000, 100e-6)
    assert process.window(10_000, 100e-6)
    assert meter.budget == pytest.approx(DEFAULT_CORE_SHARE / 100e-6)  # 4,800


def test_the_budget_is_where_the_whole_frontend_uses_its_share() -> None:
    # The other work (here 10 % of a core) is charged to the messages: taking what the budget
    # allows, the meter settles where the whole process uses the share.
    meter = EventCostMeter(change_share=0.0, hold=0.0)
    process = Process(meter, base=0.10)
    for _ in range(60):
        process.window(int(meter.budget * 2.0), 40e-6)
    assert meter.budget == pytest.approx((DEFAULT_CORE_SHARE - 0.10) / 40e-6, rel=0.01)


@given(
    cost=st.floats(1e-6, 1e-3),
    start=st.floats(1e-6, 1e-3),
    noise=st.lists(st.floats(0.8, 1.25), min_size=12, max_size=12),
)
def test_it_converges_on_a_steady_cost_and_stays_in_range(
    cost: float, start: float, noise: list[float]
) -> None:
    meter = EventCostMeter()
    process = Process(meter)
    process.window(5000, start)
    for factor in noise:  # +-25 % per window around the true cost
        process.window(5000, cost * factor)
        assert MIN_MEASURED_BUDGET <= meter.budget <= MAX_MEASURED_BUDGET
    for _ in range(8):
        process.window(5000, cost)
    lowest = DEFAULT_CORE_SHARE / MAX_MEASURED_BUDGET
    highest = DEFAULT_CORE_SHARE / MIN_MEASURED_BUDGET
    assert meter.cost == pytest.approx(min(highest, max(lowest, cost)), rel=1e-9)
    wanted = min(MAX_MEASURED_BUDGET, max(MIN_MEASURED_BUDGET, DEFAULT_CORE_SHARE / cost))
    # Hysteresis: the budget in force is within the change share of the one wanted.
    assert abs(meter.budget - wanted) <= 0.2 * meter.budget * 1.001


@pytest.mark.parametrize(
    ("cost", "budget"),
    [(1e-8, MAX_MEASURED_BUDGET), (0.05, MIN_MEASURED_BUDGET)],
)
def test_an_absurd_cost_is_clamped_to_the_range(cost: float, budget: float) -> None:
    meter = EventCostMeter(first_samples=1)
    process = Process(meter)
    process.window(1000, cost)
    assert meter.budget == budget
    assert meter.cost == pytest.approx(DEFAULT_CORE_SHARE / budget)


#: The cost per message whose budget is 10,000 a second.
COST_OF_10K = DEFAULT_CORE_SHARE / 10_000


def test_the_budget_moves_only_past_the_change_share() -> None:
    meter = EventCostMeter(samples=1, first_samples=1, hold=0.0)
    process = Process(meter)
    assert process.window(10_000, COST_OF_10K)  # 10,000
    assert meter.budget == pytest.approx(10_000)
    assert not process.window(10_000, COST_OF_10K / 1.15)  # wants 11,500: within 20 %
    assert meter.budget == pytest.approx(10_000)
    assert not process.window(10_000, COST_OF_10K / 0.85)  # wants 8,500: within 20 %
    assert process.window(10_000, COST_OF_10K / 1.3)  # wants 13,000
    assert meter.budget == pytest.approx(13_000)


def test_a_budget_stays_in_force_for_the_hold() -> None:
    meter = EventCostMeter(samples=1, first_samples=1, hold=10.0)
    process = Process(meter)
    assert process.window(10_000, COST_OF_10K)  # the first estimate is taken at once: 10,000
    for _ in range(4):  # 8 s: held however far the cost moved
        assert not process.window(10_000, 2 * COST_OF_10K)
    assert meter.budget == pytest.approx(10_000)
    assert process.window(10_000, 2 * COST_OF_10K)  # 10 s after the last move
    assert meter.budget == pytest.approx(5000)


def test_windows_without_enough_messages_or_with_set_up_are_not_counted() -> None:
    meter = EventCostMeter(first_samples=1, min_messages=200, max_window=30.0)
    process = Process(meter)
    # Link set-up of many workers is not event work: dropped.
    assert not process.window(10_000, 1e-3, connects=500)
    assert meter.windows == 0
    assert meter.cost == 0
    # Too few messages: the window goes on until it has them...
    assert not process.window(150, 50e-6)
    assert meter.windows == 0
    assert process.window(150, 50e-6)  # 300 messages over two looks
    assert meter.windows == 1
    assert meter.cost == pytest.approx(50e-6)
    # ...or is dropped when it is too old, so a quiet spell is not charged to a few messages.
    meter = EventCostMeter(first_samples=1, min_messages=200, max_window=30.0)
    process = Process(meter, base=0.05)
    for _ in range(15):
        assert not process.window(10, 50e-6)
    process.window(10_000, 50e-6)
    assert meter.cost == pytest.approx(50e-6 + 0.05 * 2 / 10_000, rel=0.02)


def test_a_total_that_went_down_starts_a_new_window() -> None:
    meter = EventCostMeter(first_samples=1)
    meter.sample(now=0, cpu=0, messages=5000, connects=10, links=10)
    assert not meter.sample(now=2, cpu=0.1, messages=100, connects=10, links=9)  # a link went
    assert meter.windows == 0
    assert meter.sample(now=4, cpu=0.2, messages=2100, connects=10, links=9)
    assert meter.cost == pytest.approx(50e-6)


@pytest.mark.parametrize(
    "bad",
    [
        {"core_share": 0.0},
        {"core_share": 1.5},
        {"min_budget": 0.0},
        {"min_budget": 10.0, "max_budget": 5.0},
        {"first_samples": 0},
        {"first_samples": 6, "samples": 5},
        {"min_messages": 0},
        {"initial_budget": float("nan")},
    ],
)
def test_bad_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"must be|need"):
        EventCostMeter(**bad)  # type: ignore[arg-type]


def test_a_retargeted_budget_gives_its_interval_at_once() -> None:
    budget = EventBudget(6000)
    budget.resize(2048)
    assert budget.interval == pytest.approx(2048 / 6000)
    # 6,000 -> 7,000 moves the interval by 14 %: resize would keep it, retarget does not.
    assert budget.retarget(7000)
    assert budget.interval == pytest.approx(2048 / 7000)
    assert not budget.retarget(7000)
    with pytest.raises(ValueError, match="finite"):
        budget.retarget(0)


@pytest.mark.parametrize("timed_share", [1.0, 0.95, 0.5])
def test_timed_reads_are_measured_by_their_own_cpu_not_the_processes(timed_share: float) -> None:
    # A frontend serving HTTP with 17 % of a core and reading 76 messages a second, each of
    # which costs 40 us: the process's CPU charged the HTTP work to the reads (2.2 ms a read,
    # the floor's 480 us after the clamp) and the budget sat at 1,000. When the reads were timed
    # where they ran (in place, by the pacer), their own CPU says what they cost.
    meter = EventCostMeter(first_samples=1, hold=0.0)
    cpu = timed_cpu = 0.0
    messages = timed = 0
    meter.sample(now=0.0, cpu=0.0, messages=0, connects=0, links=8)
    now = 0.0
    for _ in range(3):
        now += 4.0
        window = 304  # 76 a second
        messages += window
        timed += round(window * timed_share)
        timed_cpu += round(window * timed_share) * 40e-6
        cpu += 0.17 * 4.0
        meter.sample(
            now=now,
            cpu=cpu,
            messages=messages,
            connects=0,
            links=8,
            timed_cpu=timed_cpu,
            timed_messages=timed,
        )
    if timed_share >= 0.9:
        assert meter.cost == pytest.approx(40e-6)
        assert meter.budget == pytest.approx(DEFAULT_CORE_SHARE / 40e-6)  # 12,000
    else:
        # Too many reads out of sight (read in their links' tasks): the process's CPU bounds it.
        assert meter.cost == pytest.approx(DEFAULT_CORE_SHARE / MIN_MEASURED_BUDGET)
        assert meter.budget == MIN_MEASURED_BUDGET
