"""bench_slo's end-to-end mode: the same table, measured through real processes at the client.

``python -m bench.bench_slo --mode e2e [--seconds 10] [--loads 0.5,2] [--sweep 8,16,32]``

What runs, for each configuration of the table (the usual N and Q, each fixed N of the sweep with
Q = 2, the adaptive limit with ``--ttft-slo S``): one ``worker-ingress`` process (the mocker,
shaped as the workload says) and one ``frontend-shim`` in front of it, both pinned to CPU 0 with
``taskset``; the load generator is a process of its own pinned to CPU 1 (this module's
``loadgen`` entry point), so the client's own work does not slow the servers it measures. The
generator plays one seeded Poisson arrival sequence per load (the same for every configuration)
as streamed completions, each on its own connection, and records for each request the time from
sending it to the first streamed token (the time to first token the client sees: the frontend's
share and the worker's together) and its status. The capacity is measured the same way with a
closed loop as many as the engine's batch and no limit.

Beside the rows: the frontend's own 529s answered ``marked`` against the worker's ``slo``
refusals (from both processes' ``/metrics``): how much a refusal's mark costs. Figures on a
shared 2-core machine are noisy: keep runs short, repeat them, compare ratios measured in one
run.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import urllib.parse
from collections.abc import Sequence
from typing import Any, Final

import h11
import trio

from bench.bench_goodput import poisson_arrivals
from bench.trio_servers import http_get, pinned, started

__all__ = ["LoadResult", "main", "measure", "metric_sum"]

#: Seconds a request may take at the client before it counts as failed.
REQUEST_TIMEOUT: Final = 30.0


# ----------------------------------------------------------------------------- the load generator


async def _one(url: str, body: bytes, origin: float, offset: float, out: list[list[Any]]) -> None:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    sent = trio.current_time()
    ttft = math.nan
    status = 0
    try:
        with trio.fail_after(REQUEST_TIMEOUT):
            stream = await trio.open_tcp_stream(parts.hostname, parts.port)
            async with stream:
                conn = h11.Connection(h11.CLIENT)
                head = [
                    ("host", parts.netloc),
                    ("content-type", "application/json"),
                    ("content-length", str(len(body))),
                ]
                request = h11.Request(method="POST", target="/v1/completions", headers=head)
                data = conn.send(request) + conn.send(h11.Data(data=body))
                await stream.send_all(data + conn.send(h11.EndOfMessage()))
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await stream.receive_some(65536)
                        if not data:
                            break
                        conn.receive_data(data)
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, h11.Data):
                        if status == 200 and math.isnan(ttft) and b'"text"' in event.data:
                            ttft = trio.current_time() - sent
                    elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                        break
    except (OSError, trio.TooSlowError, h11.ProtocolError):
        status = -1
    out.append([sent - origin, ttft, status])


async def _open_loop(url: str, body: bytes, arrivals: Sequence[float]) -> list[list[Any]]:
    out: list[list[Any]] = []
    async with trio.open_nursery() as nursery:
        origin = trio.current_time()
        for offset in arrivals:
            await trio.sleep_until(origin + offset)
            nursery.start_soon(_one, url, body, origin, offset, out)
    return out


async def _closed_loop(url: str, body: bytes, clients: int, seconds: float) -> list[list[Any]]:
    out: list[list[Any]] = []
    origin = trio.current_time()

    async def client() -> None:
        while trio.current_time() - origin < seconds:
            await _one(url, body, origin, 0.0, out)

    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
    return out


def loadgen(argv: Sequence[str]) -> None:
    """The generator's process: ``loadgen URL BODY_JSON open ARRIVALS_JSON`` or ``loadgen URL
    BODY_JSON closed CLIENTS SECONDS``; prints ``[[sent, ttft, status], ...]`` as JSON."""
    url, body, mode = argv[0], argv[1].encode(), argv[2]
    if mode == "open":
        records = trio.run(_open_loop, url, body, json.loads(argv[3]))
    else:
        records = trio.run(_closed_loop, url, body, int(argv[3]), float(argv[4]))
    json.dump(records, sys.stdout)


# ----------------------------------------------------------------------------- the processes


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{([^}}]*)\}})? (\S+)", line)
        if not match:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match[1] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match[2])
    return total


async def _wait_connected(frontend: str) -> None:
    for _ in range(500):
        health = json.loads(await http_get(frontend, "/health"))
        if health.get("workers_connected") == 1:
            return
        await trio.sleep(0.02)
    raise RuntimeError("the frontend never connected to its worker")


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
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    env["DYN_DYNAMO_REQUEST_QUEUE_LIMIT"] = str(queue)
    python = sys.executable
    worker = [python, "-m", "worker_ingress", "--port", "0", "--system-port", "0", *worker_flags]
    async with started(pinned(0, worker), env) as (ws, system):
        frontend = [python, "-m", "frontend_shim", "--http-port", "0", "--worker", ws]
        async with started(pinned(0, frontend), env) as (url,):
            await _wait_connected(url)
            payload = json.dumps(body)
            gen = [python, "-m", "bench.slo_e2e", "loadgen", url, payload]
            if arrivals is not None:
                gen += ["open", json.dumps(list(arrivals))]
            else:
                gen += ["closed", str(clients), str(seconds)]
            done = await trio.run_process(pinned(1, gen), capture_stdout=True, env=env)
            records = json.loads(done.stdout)
            front = await http_get(url, "/metrics")
            back = await http_get(system, "/metrics")
    marked = metric_sum(front, "dynamo_frontend_rejection_by_reason_total", reason="marked")
    slo = metric_sum(back, "dynamo_rejection_request_by_reason_total", reason="slo")
    refused = metric_sum(back, "dynamo_rejection_request_by_reason_total")
    return LoadResult(records, marked, slo, refused)


def arrivals_for(rate: float, seconds: float, seed: str) -> list[float]:
    """The seeded Poisson arrivals of one load (the same for every configuration)."""
    return poisson_arrivals(rate, seconds, random.Random(seed))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the generator's process (``python -m bench.slo_e2e loadgen ...``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "loadgen":
        raise SystemExit("usage: python -m bench.bench_slo --mode e2e (this module is its helper)")
    loadgen(args[1:])


if __name__ == "__main__":
    main()
