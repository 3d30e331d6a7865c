"""Smoke test of ``bench/bench_fleet.py``, with either simulator: a small fleet, sane output.

It starts real processes (the benchmark, its simulator and the frontend) on loopback with port 0.
Only that it ran is checked: every worker came up, flips produced a 529 and a 200, events were
counted. No figure is asserted: the machine running the tests may be small and busy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import trio

from bench.bench_fleet import _protocols
from bench.fleet.figures import HEADER, SizeResult, event_metrics, table_row

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_fleet.py"
WORKERS = 8


@pytest.mark.parametrize("simulator", ["lean", "workers"])
async def test_fleet_benchmark_runs_at_a_small_size(tmp_path: Path, simulator: str) -> None:
    report = tmp_path / "fleet.json"
    args = [
        sys.executable, str(BENCH), "--sizes", str(WORKERS), "--seconds", "2", "--flips", "2",
        "--settle", "0.1", "--start-timeout", "60", "--up-timeout", "60", "--flip-timeout", "20",
        "--simulator", simulator, "--json", str(report),
    ]  # fmt: skip
    with trio.fail_after(240):
        completed = await trio.run_process(
            args, capture_stdout=True, capture_stderr=True, check=False
        )
    stdout = completed.stdout.decode()
    stderr = completed.stderr.decode()
    assert completed.returncode == 0, stderr
    assert f"| {WORKERS} x 4 | new | {simulator} |" in stdout
    [result] = json.loads(report.read_text())
    assert result["error"] is None, stderr
    assert result["simulator"] == simulator
    assert result["workers"] == WORKERS
    assert result["all_up_s"] is not None
    assert result["connected_after"] == WORKERS
    assert result["saw_529"]
    assert result["saw_200"]
    assert result["busy_ms"]["n"] >= 1
    assert result["free_ms"]["n"] >= 1
    assert result["offered_events_per_s"] > 0
    assert result["generated_per_s"] > 0
    assert result["live_ms"]["n"] > 0
    assert result["frontend_rss_mb"] > 0


async def test_fleet_benchmark_reports_a_size_that_does_not_come_up(tmp_path: Path) -> None:
    # No frontend connects to its workers within 10 ms of its start: the size must be reported
    # as not up, and the run must still end normally with its table row.
    report = tmp_path / "fleet.json"
    args = [
        sys.executable, str(BENCH), "--sizes", "2", "--seconds", "1", "--flips", "1",
        "--start-timeout", "60", "--up-timeout", "0.01", "--json", str(report),
    ]  # fmt: skip
    with trio.fail_after(120):
        completed = await trio.run_process(
            args, capture_stdout=True, capture_stderr=True, check=False
        )
    assert completed.returncode == 0, completed.stderr.decode()
    assert "| 2 x 4 |" in completed.stdout.decode()
    [result] = json.loads(report.read_text())
    assert "not all 2 workers up" in result["error"]
    assert result["all_up_s"] is None


def test_event_metrics_reads_the_budget_the_interval_the_batches_and_the_lag() -> None:
    text = "\n".join(
        [
            "# HELP dynamo_frontend_event_batches_total Load-event batches",
            "dynamo_frontend_event_batches_total 1234.0",
            'dynamo_frontend_worker_event_lag_seconds{worker_id="a"} 0.25',
            'dynamo_frontend_worker_event_lag_seconds{worker_id="b"} 0.5',
            "dynamo_frontend_event_budget_messages_per_second 6000.0",
            "dynamo_frontend_event_interval_seconds 0.341",
            "dynamo_frontend_event_message_cost_seconds 4.5e-05",
        ]
    )
    found = event_metrics(text)
    assert found.applied == 1234.0
    assert found.lag == 0.5
    assert found.budget == 6000.0
    assert found.interval == 0.341
    assert found.cost == 4.5e-05
    # A frontend without them: every figure absent, none made up.
    assert event_metrics("dynamo_frontend_workers_connected 3") == type(found)()


def test_protocols_are_checked_and_a_row_has_every_column() -> None:
    assert _protocols("current, v1") == ["current", "v1"]
    with pytest.raises(argparse.ArgumentTypeError):
        _protocols("v2")
    result = SizeResult(workers=8, ranks=4, simulators=1, rate=20.0, protocol="v1")
    columns = HEADER.count(" |")
    assert table_row(result).count(" |") == columns  # not up: the error fills the row
    result.all_up_s = 1.0
    result.live_ms = [1.0, 2.0, 3.0]
    result.completion_ms = [4.0, 5.0]
    row = table_row(result)
    assert row.count(" |") == columns
    assert "| v1 |" in row
    assert "| 4 / 5 |" in row
