"""The pure parts of ``bench/bench_slo.py`` (``bench/slo/figures.py``), and one short run of its
driver on a virtual clock.

No figure of a real run is asserted: the arithmetic is checked on made-up records, and the driver
only for what must hold whatever the figures (every request accounted for, L within its bounds).
"""

from __future__ import annotations

import math
import random

import pytest

from bench.bench_slo import configs_for, e2e_records, mocker_for, play, run_async
from bench.kit.stats import poisson_arrivals
from bench.slo.figures import (
    WORKLOADS,
    Config,
    Record,
    best_fixed,
    check_targets,
    every,
    recovery_seconds,
    summarize,
)


def test_summarize_counts_goodput_at_the_objective_in_the_window_only() -> None:
    records = [
        Record(arrived=0.5, ttft=0.1, completed=True, refused=False),  # warm-up: not counted
        Record(arrived=1.0, ttft=0.1, completed=True, refused=False),
        Record(arrived=1.5, ttft=0.4, completed=True, refused=False),  # late
        Record(arrived=2.0, ttft=math.nan, completed=False, refused=True),
        Record(arrived=2.5, ttft=0.2, completed=True, refused=False),
    ]
    row = summarize(records, objective=0.3, start=1.0, end=3.0, limits=[(0.5, 9), (1.0, 4)])
    assert row.sent == 4
    assert row.goodput == pytest.approx(1.0)  # two good in two seconds
    assert row.completed == pytest.approx(1.5)
    assert row.refused == pytest.approx(0.25)
    assert row.p50_ms == pytest.approx(200.0)
    assert (row.limit_median, row.limit_min, row.limit_max) == (4, 4, 4)


def test_recovery_is_measured_to_the_last_excursion_from_the_band() -> None:
    limits = [(0.0, 10), (1.0, 10), (2.0, 40), (3.0, 90), (4.0, 100), (5.0, 95), (6.0, 100)]
    limits += [(7.0 + i, 100) for i in range(6)]
    steady, seconds = recovery_seconds(limits, drop_at=1.0, end=13.0)
    assert steady == 100
    assert seconds == pytest.approx(2.0)  # 90 at 3.0 s is within 10% of 100
    assert math.isnan(recovery_seconds([], drop_at=1.0, end=2.0)[1])


def test_every_takes_the_first_sample_of_each_period() -> None:
    limits = [(0.0, 1), (0.26, 2), (1.99, 3), (2.01, 4), (3.0, 5), (6.5, 6)]
    assert every(limits, 2.0) == [1, 4, 6]


def test_configurations_and_the_best_fixed_one() -> None:
    short = WORKLOADS[0]
    configs = configs_for(short, [8, 64, 128], 0.3)
    labels = [c.label for c in configs]
    assert labels == [
        "usual N=64 Q=64",
        "fixed N=8 Q=2",
        "fixed N=64 Q=2",
        "adaptive N=64 Q=64",
    ]
    row = summarize([], objective=0.3, start=0.0, end=1.0)
    rows = {label: row for label in labels}
    better = summarize(
        [Record(0.5, 0.1, completed=True, refused=False)], objective=0.3, start=0.0, end=1.0
    )
    rows["fixed N=8 Q=2"] = better
    rows["adaptive N=64 Q=64"] = better
    assert best_fixed(rows, configs).label == "fixed N=8 Q=2"
    verdicts = check_targets({("short", 2.0): rows}, {"short": configs}, {"short": (64, 3.0)})
    assert [v.met for v in verdicts] == [True, True, True]


def test_a_short_adaptive_run_accounts_for_every_request() -> None:
    workload = WORKLOADS[1]
    arrivals = poisson_arrivals(60.0, 3.0, random.Random("smoke"))
    config = Config("adaptive", 32, 4, 0.3)

    async def run() -> tuple[list[Record], list[tuple[float, int]]]:
        return await play(
            workload, config, arrivals, make_engine=mocker_for(workload, 2.0), drain=30.0
        )

    records, limits = run_async("virtual", run)
    assert len(records) == len(arrivals)
    assert all(r.completed != r.refused for r in records)
    assert all(1 <= value <= 32 for _, value in limits)
    assert any(r.completed for r in records)


def test_the_load_generators_records_become_the_tables_records() -> None:
    raw = [[0.5, 0.12, 200], [0.6, math.nan, 529], [0.7, math.nan, 503], [0.8, math.nan, 500]]
    records = e2e_records(raw)
    assert [r.completed for r in records] == [True, False, False, False]
    assert [r.refused for r in records] == [False, True, True, False]
    assert records[0].ttft == pytest.approx(0.12)


@pytest.mark.e2e
def test_the_end_to_end_mode_measures_through_real_processes_at_the_client() -> None:
    import trio

    from bench.slo.e2e import measure

    body = {"model": "mock-model", "prompt": "a b c d", "max_tokens": 4, "stream": True}

    async def run() -> None:
        with trio.fail_after(60):
            closed = await measure(
                worker_flags=["--speedup-ratio", "20"], queue=2, body=body, clients=2, seconds=1.0
            )
            opened = await measure(
                worker_flags=["--speedup-ratio", "20", "--engine-request-limit", "1"],
                queue=2,
                body=body,
                arrivals=[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5],
            )
        assert closed.records
        assert all(status == 200 and ttft > 0 for _, ttft, status in closed.records)
        statuses = sorted(status for _, _, status in opened.records)
        assert len(statuses) == 7  # every request accounted for, served or refused
        assert set(statuses) <= {200, 529}
        assert 200 in statuses

    trio.run(run)
