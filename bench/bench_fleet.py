"""Fleet benchmark: the real frontend following the events of 64 to 4,096 simulated workers.

Run: ``python bench/bench_fleet.py [--sizes 64,256,1024,2048,4096] [--protocols new,current,v1]
[--simulator lean|workers] [--seconds 10] [--flips 5] [--frontend-arg=--event-budget=6000 ...]``.

Two simulators, same command line and control protocol, named in every row (``--simulator``):

- ``lean`` (the default): ``bench/lean_sim.py``, one ``selectors`` loop that speaks the workers'
  wire protocol by the same rules and costs microseconds per message, so that one simulator
  core offers a fleet of thousands and the figures measure the frontend;
- ``workers``: ``bench/fleet_sim.py``, real ``worker_ingress`` workers in one Trio process, the
  frames the worker's own code writes, byte for byte; from a few hundred workers on it saturates
  its core and its share of every latency column grows with it.

Every size is measured once per protocol the simulated workers speak:
``new`` (the workers as they are), ``current`` (the protocol of the fleet work: busy edges and
the workers' own 0.1 s publish interval, without the additions negotiated since) and ``v1``
(version-1 workers as first released: no publish interval, every change sent at once, 20 a
second; no busy edges).

Per size K, with the frontend pinned to CPU 0 and everything else to CPU 1 (when there are two):

1. Simulator processes (one per ``--workers-per-sim`` workers; by default one for ``lean`` and
   one per 1,024 workers for ``workers``) run K workers with 4 data-parallel ranks each.
2. ``python -m frontend_shim --router-mode kv --active-decode-blocks-threshold 0.5 --http-port 0``
   with one ``--worker`` per worker. Measured from its start: the first ``GET /live`` answered,
   and ``/health`` reporting ``workers_connected == K``; the ready line's time is noted too.
   Meanwhile the workers send heartbeats only: a simulator core busy with 1,024 workers' load
   changes answers a websocket handshake in seconds, and the frontend's 5 s connect bound would
   then measure the simulator (``--startup-under-load`` changes loads from the start anyway).
3. Every rank's load then changes 20 times a second, the fleet free; after ``--warmup`` s,
   for ``--seconds`` while events flow: events the workers sent (counted in the simulator) and
   the frontend's CPU share (``/proc/<pid>/stat``), its RSS, the simulators' CPU share, the bytes
   the frontend had not read yet from its worker sockets (``/proc/net/tcp``), and ``GET /live``
   latency (one request every 10 ms on a keep-alive connection), and completion latency (one
   small completion every 20 ms on another connection: a real 200 from a worker, through the
   router and the request plane, while the events flow).
4. ``--flips`` times: the whole fleet goes busy (decode blocks above 0.5 of the total), then free
   again. Each time, from the command to the simulators, a cheap completion is sent back to back
   until the answer changes (busy: 529; free: a real 200 from a worker); the time to that first
   changed answer is the propagation. The simulators stamp when they had applied the flip: that
   share of the propagation is theirs, not the frontend's (``lean`` stamps once it has also
   written the batches due at once; ``workers`` before its workers send them).

From the frontend's ``/metrics``: the event batches it applied
(``dynamo_frontend_*event*_total``), the largest event lag (``*_lag_seconds``) and, when it has
them, its event budget, the interval it asks or reads its workers at and the CPU it measured per
event message (``dynamo_frontend_event_budget_messages_per_second``,
``dynamo_frontend_event_interval_seconds``, ``dynamo_frontend_event_message_cost_seconds``); a
column whose metric is absent says ``n/a``.
Several simulator processes (``--workers-per-sim``) share their CPU: they spread the sockets over
processes (each holds four per worker), not the work over cores. A size that does not come up
within its time bounds is reported as such. Figures only, no verdict: a 2-core machine shared
with other work is noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import IO, Any, Final

import h11
import trio

FRONTEND_CPU: Final = 0
SIM_CPU: Final = 1
#: The fleet simulators ``--simulator`` chooses from (same command line and control protocol).
SIMULATORS: Final = {
    "lean": Path(__file__).resolve().with_name("lean_sim.py"),
    "workers": Path(__file__).resolve().with_name("fleet_sim.py"),
}
#: Workers per simulator process by default: fleet_sim's real workers hold many sockets and
#: objects each; the lean loop holds three descriptors and a few objects per worker.
WORKERS_PER_SIM: Final = {"lean": 8192, "workers": 1024}
COMPLETION: Final = b'{"model":"mock-model","prompt":"ping","max_tokens":1}'
LIVE_PERIOD: Final = 0.010
COMPLETION_PERIOD: Final = 0.020
HEALTH_PERIOD: Final = 0.050
CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
DEFAULT_SIZES: Final = "64,256,1024,2048,4096"
PROTOCOLS: Final = ("new", "current", "v1")
BUDGET_METRIC: Final = "dynamo_frontend_event_budget_messages_per_second"
INTERVAL_METRIC: Final = "dynamo_frontend_event_interval_seconds"
COST_METRIC: Final = "dynamo_frontend_event_message_cost_seconds"


def _pin(pid: int, cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(pid, {cpu})


def _raise_fd_limit() -> None:
    # Children inherit it: the frontend holds two sockets per worker.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ----------------------------------------------------------------------------- /proc readers


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def wait_seconds(pid: int) -> float:
    """Seconds the process's main thread spent runnable but waiting for a CPU.

    On a machine shared with other work this says how much of a window a process lost to them.
    """
    with open(f"/proc/{pid}/schedstat") as schedstat:
        return int(schedstat.read().split()[1]) / 1e9


def rss_mb(pid: int) -> tuple[float, float]:
    """Resident and peak resident memory of a process, in MiB."""
    values: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values.get("VmRSS", math.nan), values.get("VmHWM", math.nan)


def unread_bytes(remote_ports: set[int]) -> int:
    """Bytes received but not yet read on established IPv4 sockets to ``remote_ports``.

    The frontend's sockets to the workers are the only ones whose remote port is a worker's, so
    this is what the frontend has not read yet of what the workers sent.
    """
    total = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[3] != "01":
                continue
            if int(fields[2].rsplit(":", 1)[1], 16) in remote_ports:
                total += int(fields[4].split(":")[1], 16)
    return total


# ----------------------------------------------------------------------------- HTTP client


class HttpClient:
    """One keep-alive HTTP/1.1 connection (h11 over a Trio socket), reopened when closed."""

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._stream: trio.SocketStream | None = None
        self._conn = h11.Connection(h11.CLIENT)

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None

    async def request(self, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
        """Send one request and read its whole response.

        Raises:
            OSError, trio.BrokenResourceError, h11.ProtocolError: the connection failed (the
                next request opens a new one).
        """
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self._host, self._port)
            self._conn = h11.Connection(h11.CLIENT)
        try:
            return await self._exchange(method, target, body)
        except BaseException:
            stream, self._stream = self._stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()
            raise

    async def _exchange(self, method: str, target: str, body: bytes) -> tuple[int, bytes]:
        assert self._stream is not None
        conn = self._conn
        headers = [("host", f"{self._host}:{self._port}"), ("content-length", str(len(body)))]
        if body:
            headers.append(("content-type", "application/json"))
        data = conn.send(h11.Request(method=method, target=target, headers=headers))
        if body:
            data = (data or b"") + (conn.send(h11.Data(data=body)) or b"")
        data = (data or b"") + (conn.send(h11.EndOfMessage()) or b"")
        await self._stream.send_all(data)
        status = 0
        chunks: list[bytes] = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                received = await self._stream.receive_some(65536)
                conn.receive_data(received)
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            await self.aclose()
        return status, b"".join(chunks)


# ----------------------------------------------------------------------------- child processes


class Child:
    """A child process whose stdout is read line by line and whose stdin takes commands."""

    def __init__(self, process: trio.Process, name: str) -> None:
        self.process = process
        self.name = name
        self._buffer = b""

    @classmethod
    async def start(cls, args: Sequence[str], *, cpu: int, stderr: IO[bytes], name: str) -> Child:
        env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
        process = await trio.lowlevel.open_process(
            list(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
        )
        _pin(process.pid, cpu)
        return cls(process, name)

    async def readline(self) -> str:
        stdout = self.process.stdout
        assert stdout is not None
        while b"\n" not in self._buffer:
            data = await stdout.receive_some(65536)
            if not data:
                raise EOFError(f"{self.name} exited (code {self.process.poll()})")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    async def send(self, line: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(line.encode() + b"\n")

    async def stop(self) -> None:
        """Terminate, wait up to 10 s, then kill (shielded: always reaps)."""
        with trio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.terminate()
                with trio.move_on_after(10):
                    await self.process.wait()
                if self.process.returncode is None:
                    self.process.kill()
                    await self.process.wait()


class Simulator:
    """One ``fleet_sim.py`` process."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.ports: list[int] = []

    async def ready(self) -> None:
        while True:
            line = await self.child.readline()
            if line.startswith("fleet-sim ready "):
                ports = line.split("ports=", 1)[1]
                self.ports = [int(port) for port in ports.split(",") if port]
                return

    async def answer(self, prefix: str) -> str:
        line = await self.child.readline()
        if not line.startswith(prefix):
            raise RuntimeError(f"{self.child.name}: expected {prefix!r}, got {line!r}")
        return line

    async def stats(self) -> dict[str, float]:
        await self.child.send("stats")
        line = await self.answer("stats ")
        stats: dict[str, float] = json.loads(line.split(" ", 1)[1])
        return stats


async def fleet_stats(sims: Sequence[Simulator]) -> dict[str, float]:
    total: dict[str, float] = {}
    for sim in sims:
        for key, value in (await sim.stats()).items():
            total[key] = total.get(key, 0.0) + value
    return total


async def flip_fleet(sims: Sequence[Simulator], mode: str) -> None:
    for sim in sims:
        await sim.child.send(mode)


async def flip_acks(sims: Sequence[Simulator], mode: str) -> float:
    """Read every simulator's answer to a flip; return the latest ``time.monotonic()`` at which
    one of them had applied it."""
    applied = 0.0
    for sim in sims:
        line = await sim.answer(f"ok {mode}")
        applied = max(applied, float(line.split()[2]))
    return applied


# ----------------------------------------------------------------------------- figures


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclasses.dataclass
class EventMetrics:
    """What the frontend's ``/metrics`` says about the events it follows (``None``: absent)."""

    #: The sum of ``dynamo_frontend_*event*_total`` samples.
    applied: float | None = None
    #: The largest ``*_lag_seconds`` gauge sample (or a histogram's mean).
    lag: float | None = None
    #: :data:`BUDGET_METRIC`.
    budget: float | None = None
    #: The largest :data:`INTERVAL_METRIC` sample.
    interval: float | None = None
    #: :data:`COST_METRIC` (CPU seconds per event message, as the frontend measured it).
    cost: float | None = None


def event_metrics(text: str) -> EventMetrics:
    """The event figures of a Prometheus text exposition (see :class:`EventMetrics`)."""
    found = EventMetrics()
    applied: float | None = None
    lag: float | None = None
    lag_sum: float | None = None
    lag_count: float | None = None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value_part = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            value = float(value_part)
        except ValueError:
            continue
        if name == BUDGET_METRIC:
            found.budget = value
        elif name == COST_METRIC:
            found.cost = value
        elif name == INTERVAL_METRIC:
            found.interval = value if found.interval is None else max(found.interval, value)
        elif name.startswith("dynamo_frontend_") and "event" in name and name.endswith("_total"):
            applied = (applied or 0.0) + value
        elif "lag_seconds" in name:
            if name.endswith("_sum"):
                lag_sum = (lag_sum or 0.0) + value
            elif name.endswith("_count"):
                lag_count = (lag_count or 0.0) + value
            elif not name.endswith(("_bucket", "_created")):
                lag = value if lag is None else max(lag, value)
    if lag is None and lag_sum is not None and lag_count:
        lag = lag_sum / lag_count
    found.applied, found.lag = applied, lag
    return found


@dataclasses.dataclass
class SizeResult:
    """Everything measured for one fleet size (``None``: not measured or not reached)."""

    workers: int
    ranks: int
    simulators: int
    rate: float
    protocol: str = "new"
    #: Which simulator ran the fleet (a key of :data:`SIMULATORS`).
    simulator: str = "lean"
    error: str | None = None
    sims_ready_s: float | None = None
    ready_line_s: float | None = None
    http_first_s: float | None = None
    all_up_s: float | None = None
    connected_after: int | None = None
    window_s: float | None = None
    generated_per_s: float | None = None
    offered_events_per_s: float | None = None
    offered_messages_per_s: float | None = None
    #: With ``--kv-blocks``: KV events the simulators sent per second, and their messages.
    kv_events_per_s: float | None = None
    kv_messages_per_s: float | None = None
    applied_events_per_s: float | None = None
    frontend_cpu: float | None = None
    #: Share of the window the frontend was runnable but waited for its CPU (other work on it).
    frontend_wait: float | None = None
    simulator_cpu: float | None = None
    simulator_wait: float | None = None
    frontend_rss_mb: float | None = None
    frontend_peak_rss_mb: float | None = None
    simulator_rss_mb: float | None = None
    unread_kb_start: float | None = None
    unread_kb_end: float | None = None
    live_ms: list[float] = dataclasses.field(default_factory=list)
    live_errors: int = 0
    #: Completions answered 200 during the steady window, and the others.
    completion_ms: list[float] = dataclasses.field(default_factory=list)
    completion_errors: int = 0
    #: ``(seconds since the frontend started, workers connected)`` while it came up.
    up_curve: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    busy_ms: list[float] = dataclasses.field(default_factory=list)
    #: Per flip: from the command until every simulator had given its engines the new load.
    sim_apply_ms: list[float] = dataclasses.field(default_factory=list)
    free_ms: list[float] = dataclasses.field(default_factory=list)
    flip_timeouts: int = 0
    saw_529: bool = False
    saw_200: bool = False
    metrics_scrape_ms: float | None = None
    lag_s: float | None = None
    budget: float | None = None
    interval_s: float | None = None
    cost_s: float | None = None
    #: What was being done last (names the phase a timeout interrupted).
    phase: str = "starting the simulators"

    @property
    def target_events_per_s(self) -> float:
        return self.workers * self.ranks * self.rate

    def summary(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("live_ms", "completion_ms", "busy_ms", "free_ms", "sim_apply_ms"):
            values = data.pop(name)
            data[name] = {
                "n": len(values),
                "p50": quantile(values, 0.5),
                "p99": quantile(values, 0.99),
            }
        data["target_events_per_s"] = self.target_events_per_s
        return data


# ----------------------------------------------------------------------------- one size


@dataclasses.dataclass(frozen=True)
class Options:
    seconds: float
    flips: int
    ranks: int
    rate: float
    workers_per_sim: int
    start_timeout: float
    up_timeout: float
    flip_timeout: float
    settle: float
    warmup: float
    startup_under_load: bool
    frontend_args: tuple[str, ...] = ()
    #: A key of :data:`SIMULATORS`.
    simulator: str = "lean"
    #: Blocks per stored chain of the lean simulator's KV events (0: none; lean_sim rule 6).
    kv_blocks: int = 0


async def _wait_live(client: HttpClient, deadline: float) -> bool:
    while trio.current_time() < deadline:
        with contextlib.suppress(OSError, trio.BrokenResourceError, h11.ProtocolError):
            status, _ = await client.request("GET", "/live")
            if status == 200:
                return True
        await trio.sleep(0.005)
    return False


async def _connected(client: HttpClient) -> int:
    status, body = await client.request("GET", "/health")
    if status != 200:
        return -1
    connected: int = json.loads(body)["workers_connected"]
    return connected


async def _wait_connected(
    client: HttpClient, want: int, began: float, deadline: float, curve: list[tuple[float, int]]
) -> bool:
    """Poll ``/health`` until ``want`` workers are connected; note the count every 0.5 s."""
    noted = -math.inf
    while trio.current_time() < deadline:
        with contextlib.suppress(OSError, trio.BrokenResourceError, h11.ProtocolError):
            connected = await _connected(client)
            now = trio.current_time()
            if now - noted >= 0.5 or connected >= want:
                curve.append((round(now - began, 2), connected))
                noted = now
            if connected >= want:
                return True
        await trio.sleep(HEALTH_PERIOD)
    return False


async def _watch_exits(
    children: Sequence[Child], result: SizeResult, stop: trio.CancelScope
) -> None:
    """Stop the measurement as soon as one of the processes exits (a crash, say)."""
    async with trio.open_nursery() as nursery:
        for child in children:
            nursery.start_soon(_watch_exit, child, result, stop)


async def _watch_exit(child: Child, result: SizeResult, stop: trio.CancelScope) -> None:
    code = await child.process.wait()
    if result.error is None:
        result.error = f"the {child.name} exited with code {code} ({result.phase})"
    stop.cancel()


async def _probe_live(client: HttpClient, until: float, result: SizeResult) -> None:
    result.live_errors += await _probe(
        client, "GET", "/live", b"", until, LIVE_PERIOD, result.live_ms
    )


async def _probe_completions(client: HttpClient, until: float, result: SizeResult) -> None:
    result.completion_errors += await _probe(
        client,
        "POST",
        "/v1/completions",
        COMPLETION,
        until,
        COMPLETION_PERIOD,
        result.completion_ms,
    )


async def _probe(
    client: HttpClient,
    method: str,
    target: str,
    body: bytes,
    until: float,
    period: float,
    latencies_ms: list[float],
) -> int:
    """Send one request every ``period`` until ``until``; note the latency of each 200.

    Returns:
        How many answers were not 200 (or failed).
    """
    errors = 0
    next_at = trio.current_time()
    while next_at < until:
        await trio.sleep_until(next_at)
        started = trio.current_time()
        try:
            status, _ = await client.request(method, target, body)
        except (OSError, trio.BrokenResourceError, h11.ProtocolError):
            status = 0
        if status == 200:
            latencies_ms.append((trio.current_time() - started) * 1000)
        else:
            errors += 1
        next_at = max(next_at + period, trio.current_time())
    return errors


async def _flip(
    sims: Sequence[Simulator], client: HttpClient, mode: str, bound: float
) -> tuple[float | None, float]:
    """Flip the fleet.

    Returns:
        Seconds from the command to the first changed answer (``None``: none within ``bound``),
        and seconds from the command until the simulators had applied it (their share).
    """
    want = 529 if mode == "busy" else 200
    # time.monotonic(), not trio's clock: the simulators stamp their answers with it.
    began = time.monotonic()
    await flip_fleet(sims, mode)
    elapsed: float | None = None
    with trio.move_on_after(bound):
        while True:
            try:
                status, _ = await client.request("POST", "/v1/completions", COMPLETION)
            except (OSError, trio.BrokenResourceError, h11.ProtocolError):
                await trio.sleep(0.01)
                continue
            if status == want:
                elapsed = time.monotonic() - began
                break
    applied = await flip_acks(sims, mode)
    return elapsed, applied - began


async def _scrape(client: HttpClient, result: SizeResult) -> tuple[float, float | None]:
    started = trio.current_time()
    _, body = await client.request("GET", "/metrics")
    finished = trio.current_time()
    result.metrics_scrape_ms = (finished - started) * 1000
    found = event_metrics(body.decode())
    if found.lag is not None:
        result.lag_s = found.lag if result.lag_s is None else max(result.lag_s, found.lag)
    if found.budget is not None:
        result.budget = found.budget
    if found.interval is not None:
        result.interval_s = found.interval
    if found.cost is not None:
        result.cost_s = found.cost
    return finished, found.applied


@contextlib.asynccontextmanager
async def _children(children: list[Child]) -> AsyncIterator[list[Child]]:
    try:
        yield children
    finally:
        # The frontend first: workers vanishing under it would only add reconnect work.
        for child in reversed(children):
            await child.stop()


async def measure_size(
    workers: int, options: Options, logs: Path, protocol: str = "new"
) -> SizeResult:
    """Run one fleet size end to end; a size that fails is recorded as such, never raised."""
    shards = max(1, math.ceil(workers / options.workers_per_sim))
    result = SizeResult(
        workers=workers,
        ranks=options.ranks,
        simulators=shards,
        rate=options.rate,
        protocol=protocol,
        simulator=options.simulator,
    )
    budget = (
        2 * options.start_timeout
        + options.up_timeout
        + options.seconds
        + options.warmup
        + options.flips * 2 * (options.flip_timeout + options.settle)
        + 60
    )
    with trio.move_on_after(budget) as overall:
        # Nurseries wrap what escapes them in exception groups, hence except*.
        try:
            await _measure(workers, shards, options, logs, result)
        except* _Failed as group:
            result.error = "; ".join(str(leaf) for leaf in _leaves(group))
        except* _MEASURE_ERRORS as group:
            result.error = f"{result.phase}: " + "; ".join(
                f"{type(leaf).__name__}: {leaf}" for leaf in _leaves(group)
            )
    if overall.cancelled_caught:
        result.error = f"no result within {budget:.0f} s ({result.phase})"
    return result


#: What a failing process or connection raises into a measurement (reported, not raised).
_MEASURE_ERRORS: Final = (
    OSError,
    EOFError,
    RuntimeError,
    trio.BrokenResourceError,
    h11.ProtocolError,
)


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def _log_files(logs: Path, name: str) -> tuple[IO[bytes], IO[bytes]]:
    return (
        open(logs / f"simulator-{name}.log", "wb"),
        open(logs / f"frontend-{name}.log", "wb"),
    )


class _Failed(Exception):
    """A phase did not complete within its bound."""


async def _start_simulators(
    workers: int,
    shards: int,
    options: Options,
    protocol: str,
    log: IO[bytes],
    children: list[Child],
) -> list[Simulator]:
    sims: list[Simulator] = []
    for shard in range(shards):
        count = min(options.workers_per_sim, workers - shard * options.workers_per_sim)
        args = [
            sys.executable, str(SIMULATORS[options.simulator]), "--workers", str(count),
            "--ranks", str(options.ranks), "--rate", str(options.rate),
            "--id-prefix", f"sim{shard}", "--protocol", protocol,
        ]  # fmt: skip
        if not options.startup_under_load:
            args.append("--paused")
        if options.kv_blocks:
            args += ["--kv-blocks", str(options.kv_blocks)]
        child = await Child.start(args, cpu=SIM_CPU, stderr=log, name=f"simulator {shard}")
        children.append(child)
        sims.append(Simulator(child))
    with trio.move_on_after(options.start_timeout):
        for sim in sims:
            await sim.ready()
    if any(not sim.ports for sim in sims):
        raise _Failed(f"simulators not ready within {options.start_timeout:.0f} s")
    return sims


async def _start_frontend(
    ports: Sequence[int], options: Options, log: IO[bytes], children: list[Child]
) -> tuple[Child, str, int]:
    args = [
        sys.executable, "-m", "frontend_shim", "--router-mode", "kv",
        "--active-decode-blocks-threshold", "0.5", "--http-port", "0",
        *options.frontend_args,
    ]  # fmt: skip
    for port in ports:
        args += ["--worker", f"ws://127.0.0.1:{port}"]
    frontend = await Child.start(args, cpu=FRONTEND_CPU, stderr=log, name="frontend")
    children.append(frontend)
    line = ""
    with trio.move_on_after(options.start_timeout):
        line = await frontend.readline()
    match = re.search(r"frontend-shim ready http=http://([\d.]+):(\d+)", line)
    if match is None:
        raise _Failed(f"no frontend ready line within {options.start_timeout:.0f} s: {line!r}")
    return frontend, match[1], int(match[2])


async def _measure(
    workers: int, shards: int, options: Options, logs: Path, result: SizeResult
) -> None:
    children: list[Child] = []
    sim_log, frontend_log = _log_files(logs, _run_name(workers, result.protocol))
    with sim_log, frontend_log:
        async with _children(children):
            began = trio.current_time()
            sims = await _start_simulators(
                workers, shards, options, result.protocol, sim_log, children
            )
            result.sims_ready_s = trio.current_time() - began
            ports = [port for sim in sims for port in sim.ports]

            result.phase = "starting the frontend"
            began = trio.current_time()
            frontend, host, port = await _start_frontend(ports, options, frontend_log, children)
            result.ready_line_s = trio.current_time() - began
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_exits, list(children), result, nursery.cancel_scope)
                await _measure_frontend(sims, frontend, host, port, began, options, result)
                nursery.cancel_scope.cancel()


async def _measure_frontend(
    sims: Sequence[Simulator],
    frontend: Child,
    host: str,
    port: int,
    began: float,
    options: Options,
    result: SizeResult,
) -> None:
    workers = result.workers
    worker_ports = {worker_port for sim in sims for worker_port in sim.ports}
    pid = frontend.process.pid
    probe = HttpClient(host, port)
    if not await _wait_live(probe, began + options.start_timeout):
        raise _Failed("the frontend never answered /live")
    result.http_first_s = trio.current_time() - began
    result.phase = "waiting for every worker"
    if not await _wait_connected(
        probe, workers, began, began + options.up_timeout, result.up_curve
    ):
        raise _Failed(f"not all {workers} workers up within {options.up_timeout:.0f} s")
    result.all_up_s = trio.current_time() - began

    result.phase = "steady window"
    # The load starts now (unless it ran from the start), fleet free.
    await flip_fleet(sims, "free")
    await flip_acks(sims, "free")
    await trio.sleep(options.warmup)
    _, applied0 = await _scrape(probe, result)
    stats0 = await fleet_stats(sims)
    window_start = trio.current_time()
    cpu0, wait0 = cpu_seconds(pid), wait_seconds(pid)
    sim_pids = [sim.child.process.pid for sim in sims]
    sim_cpu0 = sum(cpu_seconds(sim_pid) for sim_pid in sim_pids)
    sim_wait0 = sum(wait_seconds(sim_pid) for sim_pid in sim_pids)
    result.unread_kb_start = unread_bytes(worker_ports) / 1024
    live = HttpClient(host, port)
    completions = HttpClient(host, port)
    async with trio.open_nursery() as probes:
        probes.start_soon(_probe_live, live, window_start + options.seconds, result)
        probes.start_soon(_probe_completions, completions, window_start + options.seconds, result)
    await live.aclose()
    await completions.aclose()
    result.unread_kb_end = unread_bytes(worker_ports) / 1024
    cpu1, wait1 = cpu_seconds(pid), wait_seconds(pid)
    sim_cpu1 = sum(cpu_seconds(sim_pid) for sim_pid in sim_pids)
    sim_wait1 = sum(wait_seconds(sim_pid) for sim_pid in sim_pids)
    window = trio.current_time() - window_start
    stats1 = await fleet_stats(sims)
    scraped_at, applied1 = await _scrape(probe, result)
    result.window_s = window
    result.frontend_cpu = (cpu1 - cpu0) / window
    result.frontend_wait = (wait1 - wait0) / window
    result.simulator_cpu = (sim_cpu1 - sim_cpu0) / window
    result.simulator_wait = (sim_wait1 - sim_wait0) / window
    result.frontend_rss_mb, result.frontend_peak_rss_mb = rss_mb(pid)
    result.simulator_rss_mb = sum(rss_mb(sim_pid)[0] for sim_pid in sim_pids)
    delta = {key: stats1[key] - stats0[key] for key in stats1}
    result.generated_per_s = delta["generated"] / window
    result.offered_events_per_s = (delta["load_events"] + delta["heartbeats"]) / window
    result.offered_messages_per_s = delta["batches"] / window
    if options.kv_blocks:
        result.kv_events_per_s = delta.get("kv_events", 0) / window
        result.kv_messages_per_s = delta.get("kv_messages", 0) / window
    if applied0 is not None and applied1 is not None:
        result.applied_events_per_s = (applied1 - applied0) / (scraped_at - window_start)

    result.phase = "flips"
    for _ in range(options.flips):
        for mode in ("busy", "free"):
            elapsed, applied = await _flip(sims, probe, mode, options.flip_timeout)
            result.sim_apply_ms.append(applied * 1000)
            if elapsed is None:
                result.flip_timeouts += 1
            elif mode == "busy":
                result.busy_ms.append(elapsed * 1000)
                result.saw_529 = True
            else:
                result.free_ms.append(elapsed * 1000)
                result.saw_200 = True
            await trio.sleep(options.settle)
    with contextlib.suppress(OSError, trio.BrokenResourceError, h11.ProtocolError):
        result.connected_after = await _connected(probe)
    await probe.aclose()
    result.phase = "done"


# ----------------------------------------------------------------------------- report


def _ms(values: Sequence[float]) -> str:
    p50, p99 = quantile(values, 0.5), quantile(values, 0.99)
    if p50 is None or p99 is None:
        return "n/a"
    return f"{p50:.0f} / {p99:.0f}"


def _num(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


HEADER: Final = (
    "| workers x ranks | protocol | simulator | target ev/s | offered ev/s (msg/s) | applied msg/s "
    "| budget msg/s (interval s; measured us/msg) "
    "| frontend CPU (run-queue wait) | sim CPU (wait) | frontend RSS MB "
    "| ready line / HTTP up / all up s | busy->529 ms p50/p99 "
    "| free->200 ms p50/p99 | sim's share of a flip ms p50/p99 | /live ms p50/p99 "
    "| completions ms p50/p99 | unread KB start->end | max lag | note |"
)


def table_row(r: SizeResult) -> str:
    if r.all_up_s is None:
        return (
            f"| {r.workers} x {r.ranks} | {r.protocol} | {r.simulator} "
            f"| {r.target_events_per_s:.0f} | {r.error or 'not up'} |" + " |" * 14
        )
    lag = "n/a (no lag metric)" if r.lag_s is None else f"{r.lag_s * 1000:.0f} ms"
    applied = (
        "n/a (no counter)" if r.applied_events_per_s is None else f"{r.applied_events_per_s:.0f}"
    )
    busy = _ms(r.busy_ms) + (f" ({r.flip_timeouts} timed out)" if r.flip_timeouts else "")
    completions = _ms(r.completion_ms) + (
        f" ({r.completion_errors} not 200)" if r.completion_errors else ""
    )
    kv = ""
    if r.kv_events_per_s is not None:
        kv = f" + kv {r.kv_events_per_s:.0f} ({_num(r.kv_messages_per_s, '.0f')})"
    return (
        f"| {r.workers} x {r.ranks} | {r.protocol} | {r.simulator} "
        f"| {r.target_events_per_s:.0f} "
        f"| {_num(r.offered_events_per_s, '.0f')} ({_num(r.offered_messages_per_s, '.0f')}){kv} "
        f"| {applied} | {_num(r.budget, '.0f')} ({_num(r.interval_s, '.2f')}; "
        f"{_num(r.cost_s, '.0f', 1e6)}) "
        f"| {_num(r.frontend_cpu, '.0f', 100)}% ({_num(r.frontend_wait, '.0f', 100)}%) "
        f"| {_num(r.simulator_cpu, '.0f', 100)}% ({_num(r.simulator_wait, '.0f', 100)}%) "
        f"| {_num(r.frontend_rss_mb, '.0f')} "
        f"| {_num(r.ready_line_s, '.2f')} / {_num(r.http_first_s, '.2f')} "
        f"/ {_num(r.all_up_s, '.1f')} | {busy} | {_ms(r.free_ms)} | {_ms(r.sim_apply_ms)} "
        f"| {_ms(r.live_ms)} | {completions} "
        f"| {_num(r.unread_kb_start, '.0f')} -> {_num(r.unread_kb_end, '.0f')} | {lag} "
        f"| {r.error or ''} |"
    )


def _protocols(text: str) -> list[str]:
    protocols = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(protocols) - set(PROTOCOLS))
    if not protocols or unknown:
        raise argparse.ArgumentTypeError(f"protocols are among {', '.join(PROTOCOLS)}")
    return protocols


def _run_name(workers: int, protocol: str) -> str:
    return f"{workers}-{protocol}"


def _sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("sizes must be positive integers, comma-separated")
    return sizes


async def run(
    sizes: Sequence[int],
    options: Options,
    logs: Path | None,
    protocols: Sequence[str] = ("new",),
) -> list[SizeResult]:
    """Measure every size and protocol in turn; SIGTERM stops the run, and its processes,
    cleanly."""
    results: list[SizeResult] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_sigterm, nursery.cancel_scope)
        if logs is None:
            with tempfile.TemporaryDirectory(prefix="bench-fleet-") as scratch:
                await _run_sizes(sizes, protocols, options, Path(scratch), results)
        else:
            await _run_sizes(sizes, protocols, options, logs, results)
        nursery.cancel_scope.cancel()
    return results


async def _cancel_on_sigterm(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            print("SIGTERM: stopping", file=sys.stderr, flush=True)
            scope.cancel()
            return


async def _run_sizes(
    sizes: Sequence[int],
    protocols: Sequence[str],
    options: Options,
    logs: Path,
    results: list[SizeResult],
) -> None:
    for workers in sizes:
        for protocol in protocols:
            result = await measure_size(workers, options, logs, protocol)
            results.append(result)
            if result.error:
                tail = _log_tail(logs, _run_name(workers, protocol))
                print(f"{workers} workers: {result.error}{tail}", file=sys.stderr, flush=True)
            print(table_row(result), flush=True)


def _log_tail(logs: Path, run_name: str) -> str:
    lines: list[str] = []
    for name in (f"simulator-{run_name}.log", f"frontend-{run_name}.log"):
        path = logs / name
        if path.exists():
            text = path.read_text(errors="replace").strip().splitlines()[-5:]
            lines += [f"  {name}: {line}" for line in text]
    return ("\n" + "\n".join(lines)) if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_SIZES), help="workers")
    parser.add_argument("--seconds", type=float, default=10.0, help="steady window per size")
    parser.add_argument("--flips", type=int, default=5, help="busy/free flip pairs per size")
    parser.add_argument("--ranks", type=int, default=4, help="data-parallel ranks per worker")
    parser.add_argument("--rate", type=float, default=20.0, help="load changes per rank per s")
    parser.add_argument(
        "--protocols",
        type=_protocols,
        default=["new"],
        help=f"what the simulated workers speak, comma-separated among {', '.join(PROTOCOLS)}",
    )
    parser.add_argument(
        "--frontend-arg",
        action="append",
        default=[],
        help="one more argument for the frontend (repeat; e.g. --frontend-arg=--event-budget=6000)",
    )
    parser.add_argument(
        "--simulator",
        choices=sorted(SIMULATORS),
        default="lean",
        help="lean: bench/lean_sim.py, one cheap loop; workers: bench/fleet_sim.py, real workers",
    )
    parser.add_argument(
        "--workers-per-sim",
        type=int,
        default=None,
        help="workers per simulator process (default: 8192 lean, 1024 workers)",
    )
    parser.add_argument("--start-timeout", type=float, default=120.0, help="process start bound")
    parser.add_argument("--up-timeout", type=float, default=180.0, help="all-workers-up bound")
    parser.add_argument("--flip-timeout", type=float, default=30.0, help="bound of one flip")
    parser.add_argument("--settle", type=float, default=0.5, help="pause after each flip (s)")
    parser.add_argument("--warmup", type=float, default=2.0, help="load before the window (s)")
    parser.add_argument(
        "--startup-under-load",
        action="store_true",
        help="change loads while the frontend connects (default: only heartbeats until all up)",
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=0,
        help="lean simulator: KV events, each rank's tick storing a chain of this many blocks "
        "and evicting the oldest once full (0: none); the offered column adds '+ kv E (M)'",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--logs", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args()
    if args.kv_blocks and args.simulator != "lean":
        parser.error("--kv-blocks needs --simulator lean")
    _pin(0, SIM_CPU)
    _raise_fd_limit()
    options = Options(
        seconds=args.seconds,
        flips=args.flips,
        ranks=args.ranks,
        rate=args.rate,
        workers_per_sim=args.workers_per_sim or WORKERS_PER_SIM[args.simulator],
        start_timeout=args.start_timeout,
        up_timeout=args.up_timeout,
        flip_timeout=args.flip_timeout,
        settle=args.settle,
        warmup=args.warmup,
        startup_under_load=args.startup_under_load,
        frontend_args=tuple(args.frontend_arg),
        simulator=args.simulator,
        kv_blocks=max(args.kv_blocks, 0),
    )
    print(
        f"simulator {options.simulator} ({SIMULATORS[options.simulator].name}); "
        f"frontend on CPU {FRONTEND_CPU}, simulators and probes on CPU {SIM_CPU}; "
        f"{options.seconds:.0f} s window, {options.flips} flip pairs per size",
        flush=True,
    )
    print(HEADER)
    print("|" + "---|" * HEADER.count(" |"), flush=True)
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    results = trio.run(run, args.sizes, options, args.logs, args.protocols)
    if args.json is not None:
        args.json.write_text(json.dumps([r.summary() for r in results], indent=2) + "\n")


if __name__ == "__main__":
    main()
