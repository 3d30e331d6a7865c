"""bench_slo's end-to-end mode: one configuration measured through real processes.

What runs, for one configuration: one ``worker-ingress`` process (the mocker, shaped as the
workload says) and one ``frontend-shim`` in front of it, both pinned to CPU 0 with ``taskset``;
the load generator is a process of its own pinned to CPU 1 (``bench/slo_e2e.py``), so the
client's own work does not slow the servers it measures. It plays an open loop of arrivals (or a
closed loop of clients) as streamed completions and records, for each request, the time from
sending it to the first streamed token (the time to first token the client sees: the frontend's
share and the worker's together) and its status. Beside the records: the frontend's own 529s
answered ``marked`` against the worker's ``slo`` refusals (from both processes' ``/metrics``):
how much a refusal's mark costs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import trio

from bench.kit.children import Child
from bench.kit.http import fetch, wait_connected_trio
from bench.kit.metrics import metric_sum
from bench.kit.processes import clean_env, pinned
from bench.kit.shim import frontend_command, worker_command

__all__ = ["LoadResult", "measure"]

#: The load generator's process (an entry point of its own).
LOAD_GENERATOR: Final = Path(__file__).resolve().parents[1] / "slo_e2e.py"


class LoadResult:
    """One run: the client's records and the refusal counts of both processes."""

    def __init__(
        self, records: list[list[Any]], marked: float, worker_slo: float, worker_refused: float
    ) -> None:
        #: ``[sent offset, ttft (NaN unless a token came), status]`` per request.
        self.records = records
        #: The frontend's 529s answered ``marked``, the worker's ``slo`` refusals, and all of
        #: the worker's refusals (queue full, displaced, queue timeout, slo).
        self.marked = marked
        self.worker_slo = worker_slo
        self.worker_refused = worker_refused


async def measure(
    *,
    worker_flags: Sequence[str],
    queue: int,
    body: dict[str, Any],
    arrivals: Sequence[float] | None = None,
    clients: int = 0,
    seconds: float = 0.0,
) -> LoadResult:
    """Start a worker and a frontend on CPU 0, play the load from CPU 1, stop them."""
    env = clean_env(DYN_DYNAMO_REQUEST_QUEUE_LIMIT=str(queue))
    async with Child(worker_command(*worker_flags), env, cpu=0, grace=5.0) as worker_child:
        ws, system = worker_child.addresses["ws"], worker_child.addresses["system"]
        frontend = frontend_command("--worker", ws)
        async with Child(frontend, env, cpu=0, grace=5.0) as frontend_child:
            url = frontend_child.addresses["http"]
            with trio.fail_after(10):
                await wait_connected_trio(url)
            gen = [sys.executable, str(LOAD_GENERATOR), "loadgen", url, json.dumps(body)]
            if arrivals is not None:
                gen += ["open", json.dumps(list(arrivals))]
            else:
                gen += ["closed", str(clients), str(seconds)]
            done = await trio.run_process(pinned(1, gen), capture_stdout=True, env=env)
            records = json.loads(done.stdout)
            front = (await fetch(url, "GET", "/metrics")).body.decode()
            back = (await fetch(system, "GET", "/metrics")).body.decode()
    marked = metric_sum(front, "dynamo_frontend_rejection_by_reason_total", reason="marked")
    slo = metric_sum(back, "dynamo_rejection_request_by_reason_total", reason="slo")
    refused = metric_sum(back, "dynamo_rejection_request_by_reason_total")
    return LoadResult(records, marked, slo, refused)
