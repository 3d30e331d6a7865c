"""The pure parts of ``bench/bench_cores.py``: CPU lists, and whose CPU a process's is."""

from __future__ import annotations

import os

from bench.bench_cores import cpus, role_seconds


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert cpus("0-2,5") == {0, 1, 2, 5}
    assert cpus("7") == {7}


def test_a_process_that_is_no_worker_counts_for_its_root() -> None:
    seconds = role_seconds({"frontend": [os.getpid()], "workers": []})
    assert seconds["frontend"] > 0
    assert seconds["workers"] == 0
