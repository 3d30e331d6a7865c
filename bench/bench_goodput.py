"""Goodput under overload: the N+Q gate against no limit and against Ray Serve, side by side.

Run from the repository's root: ``python -m bench.bench_goodput [--seconds 10] [--repeats 3]
[--loads 0.5,1,2,4] [--json results.json]``.

The work: :mod:`bench.kit.fixed_engine`, 4 slots of 200 ms each, so a capacity of 20 requests/s
whoever serves it. Three systems serve it, each on CPU 0 (``taskset``), while this process, the
client, runs on CPU 1:

- ``shim N=4 Q=4``: ``worker-ingress --engine bench.kit.fixed_engine:create``
  ``--engine-request-limit 4`` with ``DYN_DYNAMO_REQUEST_QUEUE_LIMIT=4``, behind
  ``frontend-shim`` (no busy thresholds);
- ``shim no limit``: the same without ``--engine-request-limit``: every request is admitted and
  waits in the engine for a slot;
- ``Ray Serve N=4 Q=4``: ``bench/ray_fixed_app.py``, one replica sleeping 200 ms under a 4-slot
  semaphore, ``max_ongoing_requests=4``, ``max_queued_requests=4``. Needs
  ``pip install -e '.[ray]'`` (Ray Serve); the row is skipped, and says so, without it.

Load: open-loop Poisson arrivals of ``POST /v1/chat/completions`` at 0.5x, 1x, 2x and 4x the
capacity for ``--seconds``; each repeat draws one arrival sequence per load and plays the same
one to every system. The systems take turns within each repeat (their order rotates), and every
figure printed is the median over repeats. Per row:

- goodput: completions that took at most the SLO (``--slo``, default 1 s: five service times)
  and ended within the window, over what the capacity completes in the window;
- rejected: share of the requests sent answered 529 or 503 (an overload answer);
- late: share sent that completed past the SLO or had no answer ``--drain`` seconds after the
  window (then cancelled);
- p50/p99 of the completed, and of the time to a rejection, from the moment the client starts
  writing the request to the end of the answer. How far the client fell behind its schedule is
  printed apart (send lag), as is the count of connections it had to open mid-run.

The client is this process: Trio and h11 over a pool of keep-alive connections (32 opened before
each run, more opened when all are busy, counted in the output). Its own floor is printed for
each system, measured in the same run: p50/p99 of ``GET /live`` (Ray: ``GET /-/healthz``) sent the
same way at the highest load's rate. The targets are checked at the end, as figures, not as
asserts: at 4x, goodput >= 95% of capacity, p99 of the completed within 1.5x of its value
at 0.5x, rejections answered with p99 under 5 ms, and each ahead of Ray Serve.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import random
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Final

import trio

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.children import Child
from bench.kit.fixed_engine import SERVICE_ENV, SLOTS_ENV
from bench.kit.http import HTTP_ERRORS, Client, wait_connected_trio
from bench.kit.processes import clean_env, free_port, pin, raise_fd_limit
from bench.kit.shim import frontend_command, worker_command
from bench.kit.stats import median, percentile, poisson_arrivals
from bench.kit.table import Table, cell

ROOT: Final = Path(__file__).resolve().parent.parent
RAY_APP: Final = Path(__file__).resolve().with_name("ray_fixed_app.py")
SERVER_CPU: Final = 0
CLIENT_CPU: Final = 1
CHAT_PATH: Final = "/v1/chat/completions"
CHAT_BODY: Final = (
    b'{"model":"mock-model","messages":[{"role":"user","content":"hello there"}],"max_tokens":1}'
)
OVERLOAD_STATUSES: Final = frozenset({503, 529})
PREOPENED: Final = 32
FLOOR_SECONDS: Final = 3.0

# ----------------------------------------------------------------------------- pure parts


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What became of one request.

    ``kind`` is ``ok`` (2xx), ``rejected`` (an overload status), ``error`` (any other status or
    a failed connection) or ``unfinished`` (no answer by the end of the drain); ``seconds`` runs
    from the moment the client starts writing the request to the end of the answer (NaN when
    unfinished); ``sent_at`` is when it was sent, in seconds from the start of the window.
    """

    kind: str
    seconds: float
    sent_at: float


@dataclasses.dataclass(frozen=True)
class Row:
    """The figures of one system at one load (one run, or the median of several)."""

    sent: int
    goodput: float
    rejected: float
    late: float
    errors: float
    ok_p50_ms: float
    ok_p99_ms: float
    reject_p50_ms: float
    reject_p99_ms: float


def summarize(outcomes: Sequence[Outcome], *, capacity: float, seconds: float, slo: float) -> Row:
    """Turn the outcomes of one run into a row.

    Args:
        outcomes: One per request sent in the window.
        capacity: Requests per second the engine completes at most.
        seconds: The length of the arrival window.
        slo: A completion counts towards goodput when it took at most this long and ended
            within the window.

    Returns:
        Shares of what was sent (rejected, late, errors), goodput as a share of
        ``capacity * seconds``, and latency quantiles in milliseconds.
    """
    sent = len(outcomes)
    ok = [o.seconds for o in outcomes if o.kind == "ok"]
    rejected = [o.seconds for o in outcomes if o.kind == "rejected"]
    good = sum(
        1
        for o in outcomes
        if o.kind == "ok" and o.seconds <= slo and o.sent_at + o.seconds <= seconds
    )
    late = sum(1 for value in ok if value > slo) + sum(
        1 for o in outcomes if o.kind == "unfinished"
    )
    errors = sum(1 for o in outcomes if o.kind == "error")

    def share(count: int) -> float:
        return count / sent if sent else math.nan

    return Row(
        sent=sent,
        goodput=good / (capacity * seconds),
        rejected=share(len(rejected)),
        late=share(late),
        errors=share(errors),
        ok_p50_ms=percentile(ok, 0.5) * 1e3,
        ok_p99_ms=percentile(ok, 0.99) * 1e3,
        reject_p50_ms=percentile(rejected, 0.5) * 1e3,
        reject_p99_ms=percentile(rejected, 0.99) * 1e3,
    )


def median_row(rows: Sequence[Row]) -> Row:
    """Each figure's median over repeats (NaNs ignored; NaN when all are NaN)."""
    fields = [field.name for field in dataclasses.fields(Row)]
    medians = {name: median(float(getattr(row, name)) for row in rows) for name in fields}
    return Row(sent=round(medians.pop("sent")), **medians)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One target of the benchmark, as measured."""

    target: str
    figure: str
    met: bool | None


def check_targets(
    rows: Mapping[tuple[str, float], Row], ours: str, rival: str | None
) -> list[Verdict]:
    """Compare the gated system's rows with the targets (and with ``rival``'s rows): at 4x,
    goodput >= 95% of capacity, p99 of the completed within 1.5x of its value at 0.5x, rejections
    answered with p99 under 5 ms, and each ahead of ``rival``.

    Args:
        rows: Median rows by (system, load multiple); the loads 0.5 and 4 must be present for
            ``ours``.
        ours: The system the targets are about.
        rival: The system to be ahead of, when it was measured.

    Returns:
        One verdict per target; ``met`` is None when a figure is missing.
    """
    low, high = rows[(ours, 0.5)], rows[(ours, 4.0)]
    stretch = high.ok_p99_ms / low.ok_p99_ms
    verdicts = [
        Verdict("goodput at 4x >= 95%", f"{high.goodput:.0%}", high.goodput >= 0.95),
        Verdict("p99 completed at 4x <= 1.5x p99 at 0.5x", f"{stretch:.2f}x", stretch <= 1.5),
        Verdict(
            "rejection p99 at 4x < 5 ms",
            f"{high.reject_p99_ms:.1f} ms",
            None if math.isnan(high.reject_p99_ms) else high.reject_p99_ms < 5.0,
        ),
    ]
    if rival is not None and (rival, 4.0) in rows and (rival, 0.5) in rows:
        other_high, other_low = rows[(rival, 4.0)], rows[(rival, 0.5)]
        other_stretch = other_high.ok_p99_ms / other_low.ok_p99_ms
        verdicts += [
            Verdict(
                f"goodput at 4x ahead of {rival}",
                f"{high.goodput:.0%} vs {other_high.goodput:.0%}",
                high.goodput > other_high.goodput,
            ),
            Verdict(
                f"p99 stretch ahead of {rival}",
                f"{stretch:.2f}x vs {other_stretch:.2f}x",
                stretch < other_stretch,
            ),
            Verdict(
                f"rejection p99 ahead of {rival}",
                f"{high.reject_p99_ms:.1f} vs {other_high.reject_p99_ms:.1f} ms",
                None
                if math.isnan(other_high.reject_p99_ms) or math.isnan(high.reject_p99_ms)
                else high.reject_p99_ms < other_high.reject_p99_ms,
            ),
        ]
    return verdicts


def format_table(rows: Mapping[tuple[str, float], Row], capacity: float) -> str:
    """The rows as a Markdown table, in the order given."""
    table = Table(
        "system", "load", "sent", "goodput", "rejected", "late", "errors",
        "completed p50 / p99 ms", "rejection p50 / p99 ms",
    )  # fmt: skip
    for (system, load), row in rows.items():
        table.add(
            system,
            f"{load:g}x ({load * capacity:g}/s)",
            row.sent,
            *(cell(share, ".0%") for share in (row.goodput, row.rejected, row.late, row.errors)),
            f"{cell(row.ok_p50_ms, '.1f')} / {cell(row.ok_p99_ms, '.1f')}",
            f"{cell(row.reject_p50_ms, '.1f')} / {cell(row.reject_p99_ms, '.1f')}",
        )
    return str(table)


# ----------------------------------------------------------------------------- the client


class Pool:
    """Keep-alive connections to one server, opened ahead and on demand."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._idle: list[Client] = []
        self._all: set[Client] = set()
        self.opened_on_demand = 0

    async def _open(self) -> Client:
        client = Client(self.url)
        await client.connect()
        self._all.add(client)
        return client

    async def fill(self, count: int) -> None:
        for _ in range(count):
            self._idle.append(await self._open())

    async def acquire(self) -> Client:
        if self._idle:
            return self._idle.pop()
        self.opened_on_demand += 1
        return await self._open()

    def release(self, client: Client) -> None:
        """Take a connection back after an answer (it is dropped if the server closed it)."""
        if client.connected:
            self._idle.append(client)
        else:
            self._all.discard(client)

    def discard(self, client: Client) -> None:
        client.close()
        self._all.discard(client)

    def close(self) -> None:
        for client in self._all:
            client.close()
        self._all.clear()
        self._idle.clear()


@dataclasses.dataclass
class RunResult:
    """The outcomes of one run and what the client saw of itself."""

    outcomes: list[Outcome]
    lag_p99_ms: float
    opened_on_demand: int


async def play(
    url: str,
    method: str,
    path: str,
    body: bytes,
    arrivals: Sequence[float],
    *,
    drain: float,
    window: float,
) -> RunResult:
    """Send one request at each arrival offset (open loop) and wait for the answers.

    Requests still unanswered ``drain`` seconds after the window are cancelled (their
    connections closed) and count as ``unfinished``.
    """
    pool = Pool(url)
    await pool.fill(PREOPENED)
    outcomes: dict[int, Outcome] = {}
    lags: list[float] = []

    async def one(index: int) -> None:
        client: Client | None = None
        sent = trio.current_time()
        try:
            client = await pool.acquire()
            sent = trio.current_time()
            status = (await client.request(method, path, body)).status
        except HTTP_ERRORS:
            if client is not None:
                pool.discard(client)
            outcomes[index] = Outcome("error", trio.current_time() - sent, sent - start)
            return
        except trio.Cancelled:
            if client is not None:
                pool.discard(client)
            raise
        elapsed = trio.current_time() - sent
        pool.release(client)
        if 200 <= status < 300:
            kind = "ok"
        elif status in OVERLOAD_STATUSES:
            kind = "rejected"
        else:
            kind = "error"
        outcomes[index] = Outcome(kind, elapsed, sent - start)

    start = trio.current_time() + 0.05
    try:
        with trio.move_on_at(start + window + drain):
            async with trio.open_nursery() as nursery:
                for index, offset in enumerate(arrivals):
                    scheduled = start + offset
                    await trio.sleep_until(scheduled)
                    lags.append(trio.current_time() - scheduled)
                    nursery.start_soon(one, index)
    finally:
        pool.close()
    return RunResult(
        outcomes=[
            outcomes.get(index, Outcome("unfinished", math.nan, offset))
            for index, offset in enumerate(arrivals)
        ],
        lag_p99_ms=percentile(lags, 0.99) * 1e3,
        opened_on_demand=pool.opened_on_demand,
    )


# ----------------------------------------------------------------------------- servers


@contextlib.asynccontextmanager
async def server(
    args: Sequence[str], *, env: Mapping[str, str], log: IO[bytes], ready_within: float
) -> AsyncIterator[dict[str, str]]:
    """Start a server on the server CPU, yield the ``key=url`` fields of its ready line, stop
    it: SIGTERM and 30 s to exit, then whatever is left of its session is killed (Ray leaves
    agents behind that ignore SIGTERM)."""
    async with Child(
        args,
        env,
        cpu=SERVER_CPU,
        cwd=ROOT,
        log=log,
        session=True,
        grace=30.0,
        ready_within=ready_within,
    ) as child:
        yield child.addresses


@dataclasses.dataclass(frozen=True)
class System:
    """One way of serving the fixed work: how to start it and where its floor is."""

    name: str
    live_path: str
    start: Callable[[IO[bytes]], contextlib.AbstractAsyncContextManager[str]]


def shim_system(name: str, env: Mapping[str, str], limit: int | None) -> System:
    """The worker with the fixed engine (gated when ``limit`` is set) behind the frontend."""

    @contextlib.asynccontextmanager
    async def start(log: IO[bytes]) -> AsyncIterator[str]:
        worker = worker_command(
            "--engine", "bench.kit.fixed_engine:create", "--log-level", "warning",
            *(("--engine-request-limit", str(limit)) if limit is not None else ()),
        )  # fmt: skip
        async with server(worker, env=env, log=log, ready_within=60) as worker_urls:
            frontend = frontend_command("--worker", worker_urls["ws"], "--log-level", "warning")
            async with server(frontend, env=env, log=log, ready_within=60) as frontend_urls:
                with trio.fail_after(60):
                    await wait_connected_trio(frontend_urls["http"])
                yield frontend_urls["http"]

    return System(name, "/live", start)


def ray_system(name: str, env: Mapping[str, str], slots: int, service: float, queue: int) -> System:
    """Ray Serve with the same N, Q and work (``bench/ray_fixed_app.py``)."""

    @contextlib.asynccontextmanager
    async def start(log: IO[bytes]) -> AsyncIterator[str]:
        args = [
            sys.executable, str(RAY_APP), "--port", str(free_port()), "--slots", str(slots),
            "--service-seconds", str(service), "--queue", str(queue),
        ]  # fmt: skip
        async with server(args, env=env, log=log, ready_within=300) as urls:
            yield urls["http"]

    return System(name, "/-/healthz", start)


# ----------------------------------------------------------------------------- main


@dataclasses.dataclass
class Measured:
    """Every run of one (system, load), and the client's floor per system."""

    runs: dict[tuple[str, float], list[Row]] = dataclasses.field(default_factory=dict)
    floors: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    client: dict[str, list[tuple[float, int]]] = dataclasses.field(default_factory=dict)


async def measure(
    options: argparse.Namespace, systems: Sequence[System], scratch: Path
) -> Measured:
    capacity = options.slots / options.service_seconds
    loads: list[float] = options.loads
    measured = Measured()
    for repeat in range(options.repeats):
        turn = repeat % len(systems)
        for system in [*systems[turn:], *systems[:turn]]:
            log_path = scratch / f"{system.name.replace(' ', '_')}.{repeat}.log"
            with log_path.open("ab") as log:
                print(f"repeat {repeat + 1}: {system.name} starting", file=sys.stderr)
                async with system.start(log) as url:
                    rng = random.Random(f"floor {repeat}")
                    floor = await play(
                        url, "GET", system.live_path, b"",
                        poisson_arrivals(max(loads) * capacity, FLOOR_SECONDS, rng),
                        drain=2.0, window=FLOOR_SECONDS,
                    )  # fmt: skip
                    ok = [o.seconds for o in floor.outcomes if o.kind == "ok"]
                    measured.floors.setdefault(system.name, []).append(
                        (percentile(ok, 0.5) * 1e3, percentile(ok, 0.99) * 1e3)
                    )
                    # Warm the request path at half the capacity; not measured.
                    await play(
                        url, "POST", CHAT_PATH, CHAT_BODY,
                        poisson_arrivals(capacity / 2, 1.0, random.Random("warm")),
                        drain=2.0, window=1.0,
                    )  # fmt: skip
                    for load in loads:
                        await trio.sleep(options.settle)
                        rng = random.Random(f"{repeat} {load}")
                        arrivals = poisson_arrivals(load * capacity, options.seconds, rng)
                        result = await play(
                            url, "POST", CHAT_PATH, CHAT_BODY, arrivals,
                            drain=options.drain, window=options.seconds,
                        )  # fmt: skip
                        row = summarize(
                            result.outcomes,
                            capacity=capacity,
                            seconds=options.seconds,
                            slo=options.slo,
                        )
                        measured.runs.setdefault((system.name, load), []).append(row)
                        measured.client.setdefault(system.name, []).append(
                            (result.lag_p99_ms, result.opened_on_demand)
                        )
                        print(
                            f"  {system.name} {load:g}x: goodput {row.goodput:.0%}"
                            f" rejected {row.rejected:.0%} late {row.late:.0%}"
                            f" p99 {row.ok_p99_ms:.0f} ms",
                            file=sys.stderr,
                        )
    return measured


def _parse_loads(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="arrival window per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loads", type=_parse_loads, default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--service-seconds", type=float, default=0.2)
    parser.add_argument("--queue", type=int, default=4, help="Q of the gate and of Ray Serve")
    parser.add_argument("--slo", type=float, default=1.0, help="seconds a good completion takes")
    parser.add_argument("--drain", type=float, default=5.0, help="seconds to wait after arrivals")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds idle between runs")
    parser.add_argument("--no-ray", action="store_true", help="skip Ray Serve even if installed")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--logs", type=Path, default=None, help="keep the servers' logs here")
    options = parser.parse_args()
    pin(CLIENT_CPU)
    # An ungated server under overload holds hundreds of connections of this client.
    raise_fd_limit()
    env = clean_env(**{SLOTS_ENV: str(options.slots), SERVICE_ENV: str(options.service_seconds)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    gated_env = {**env, "DYN_DYNAMO_REQUEST_QUEUE_LIMIT": str(options.queue)}
    gated = f"shim N={options.slots} Q={options.queue}"
    systems = [
        shim_system(gated, gated_env, options.slots),
        shim_system("shim no limit", env, None),
    ]
    rival: str | None = None
    if options.no_ray:
        print("Ray Serve: skipped (--no-ray)")
    elif importlib.util.find_spec("ray") is None:
        print("Ray Serve: skipped, not installed (pip install -e '.[ray]')")
    else:
        rival = f"Ray Serve N={options.slots} Q={options.queue}"
        systems.append(
            ray_system(rival, env, options.slots, options.service_seconds, options.queue)
        )
    with tempfile.TemporaryDirectory() as tmp:
        scratch = options.logs or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        measured = trio.run(measure, options, systems, scratch)
    capacity = options.slots / options.service_seconds
    rows = {
        (system.name, load): median_row(measured.runs[(system.name, load)])
        for system in systems
        for load in options.loads
    }
    print(
        f"work: {options.slots} slots x {options.service_seconds * 1e3:g} ms = capacity"
        f" {capacity:g} req/s; SLO {options.slo:g} s; {options.seconds:g} s of Poisson arrivals"
        f" per run; medians of {options.repeats} repeats"
    )
    print()
    print(format_table(rows, capacity))
    print()
    floor = Table(
        "client floor (same client, same run)", "p50 ms", "p99 ms",
        "send lag p99 ms, worst run", "connections opened mid-run, most",
    )  # fmt: skip
    for system in systems:
        floors = measured.floors[system.name]
        client = measured.client[system.name]
        floor.add(
            f"{system.name}: GET {system.live_path}",
            cell(median(f[0] for f in floors), ".1f"),
            cell(median(f[1] for f in floors), ".1f"),
            cell(max(c[0] for c in client), ".1f"),
            max(c[1] for c in client),
        )
    print(floor)
    if 0.5 in options.loads and 4.0 in options.loads:
        print()
        targets = Table("target", "measured", "met")
        for verdict in check_targets(rows, gated, rival):
            met = "n/a" if verdict.met is None else ("yes" if verdict.met else "no")
            targets.add(verdict.target, verdict.figure, met)
        print(targets)
    if options.json is not None:
        options.json.write_text(
            json.dumps(
                {
                    "capacity": capacity,
                    "rows": [
                        {"system": name, "load": load, **dataclasses.asdict(row)}
                        for (name, load), row in rows.items()
                    ],
                    "runs": [
                        {"system": name, "load": load, **dataclasses.asdict(row)}
                        for (name, load), runs in measured.runs.items()
                        for row in runs
                    ],
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
