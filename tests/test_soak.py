"""The soak, shortened to 30 seconds: ``scripts/soak`` must pass on a small, busy machine.

It starts real processes (three workers and a frontend) on loopback with free ports, overloads
them about three times, kills a worker and starts it again, changes a threshold, and checks the
caps, the counters, the answers and the memory (see ``bench/soak.py``). The run's own verdict
is what is asserted; no figure is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import trio

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


async def test_a_30_second_soak_passes(tmp_path: Path) -> None:
    report_path = tmp_path / "soak.json"
    args = [
        str(ROOT / "scripts" / "soak"), "--seconds", "30", "--json", str(report_path),
        "--logs", str(tmp_path / "logs"),
    ]  # fmt: skip
    with trio.fail_after(240):
        completed = await trio.run_process(
            args,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**os.environ, "PYTHON": sys.executable},
        )
    stdout = completed.stdout.decode()
    assert completed.returncode == 0, stdout + completed.stderr.decode()[-4000:]
    report = json.loads(report_path.read_text())
    assert report["passed"], stdout
    assert report["outcomes"]["answered"] > 0
    assert report["outcomes"]["shed"] > 0
    cap = report["engine_request_limit"] + report["queue_limit"]
    assert all(book["peak_in_flight"] <= cap for book in report["books"])
    assert any(book["restarted"] for book in report["books"])
