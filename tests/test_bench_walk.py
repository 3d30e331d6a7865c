"""Tests of ``bench/bench_walk.py``: the walk it measures is the real one.

One in-process worker and frontend on loopback (port 0). A profiler that saw nothing, or a
completion that did not stream, fails these: the gate's core, the class reader and the fair
queue must be among the modules touched, and one more token must cost calls in the worker's
planes and in the tenant's charge.
"""

from __future__ import annotations

import trio

from bench.bench_walk import _measure


def test_the_walk_touches_the_gate_and_the_class_and_charges_each_token() -> None:
    report = trio.run(_measure, 1, 1000.0)
    touched = report["touched"]
    assert "worker_ingress/_admission_state" in touched["worker_ingress"]
    assert "frontend_shim/_request_class" in touched["frontend_shim"]
    assert "shim_common/_http_cycle" in touched["shim_common"]
    per_token = report["per_token"]
    assert per_token["worker_ingress/_planes"] > 0
    assert per_token["worker_ingress/_fair_queue"] > 0  # each token is charged to its tenant
