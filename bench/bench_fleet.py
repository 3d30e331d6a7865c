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
   the frontend's CPU share (``/proc``, over its process tree: its HTTP processes too with
   ``--frontend-arg=--processes=N``), its RSS, the simulators' CPU share, the bytes
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
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import IO, Final

import trio

if not __package__:
    # Run as ``python bench/bench_fleet.py``: the package ``bench`` is in the folder above, as it
    # is for ``python -m bench.bench_fleet``.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.fleet.control import Simulator, fleet_stats, flip_acks, flip_fleet
from bench.fleet.figures import HEADER, SizeResult, event_metrics, table_row
from bench.fleet.model import PROTOCOLS
from bench.kit.children import Child
from bench.kit.http import HTTP_ERRORS, Client
from bench.kit.proc import cpu_seconds, memory, tree_cpu_seconds, unread_bytes, wait_seconds
from bench.kit.processes import pin, raise_fd_limit

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
DEFAULT_SIZES: Final = "64,256,1024,2048,4096"
MIB: Final = 1 << 20

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


async def _wait_live(client: Client, deadline: float) -> bool:
    while trio.current_time() < deadline:
        with contextlib.suppress(*HTTP_ERRORS):
            if (await client.request("GET", "/live")).status == 200:
                return True
        await trio.sleep(0.005)
    return False


async def _connected(client: Client) -> int:
    reply = await client.request("GET", "/health")
    if reply.status != 200:
        return -1
    connected: int = json.loads(reply.body)["workers_connected"]
    return connected


async def _wait_connected(
    client: Client, want: int, began: float, deadline: float, curve: list[tuple[float, int]]
) -> bool:
    """Poll ``/health`` until ``want`` workers are connected; note the count every 0.5 s."""
    noted = -math.inf
    while trio.current_time() < deadline:
        with contextlib.suppress(*HTTP_ERRORS):
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
    code = await child.wait()
    if result.error is None:
        result.error = f"the {child.name} exited with code {code} ({result.phase})"
    stop.cancel()


async def _probe_live(client: Client, until: float, result: SizeResult) -> None:
    result.live_errors += await _probe(
        client, "GET", "/live", b"", until, LIVE_PERIOD, result.live_ms
    )


async def _probe_completions(client: Client, until: float, result: SizeResult) -> None:
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
    client: Client,
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
            status = (await client.request(method, target, body)).status
        except HTTP_ERRORS:
            status = 0
        if status == 200:
            latencies_ms.append((trio.current_time() - started) * 1000)
        else:
            errors += 1
        next_at = max(next_at + period, trio.current_time())
    return errors


async def _flip(
    sims: Sequence[Simulator], client: Client, mode: str, bound: float
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
                status = (await client.request("POST", "/v1/completions", COMPLETION)).status
            except HTTP_ERRORS:
                await trio.sleep(0.01)
                continue
            if status == want:
                elapsed = time.monotonic() - began
                break
    applied = await flip_acks(sims, mode)
    return elapsed, applied - began


async def _scrape(client: Client, result: SizeResult) -> tuple[float, float | None]:
    started = trio.current_time()
    body = (await client.request("GET", "/metrics")).body
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
_MEASURE_ERRORS: Final = (*HTTP_ERRORS, EOFError, RuntimeError)


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
        child = Child(args, name=f"simulator {shard}", cpu=SIM_CPU, log=log, control=True)
        children.append(child)
        await child.start()
        sims.append(Simulator(child))
    with trio.move_on_after(options.start_timeout):
        for sim in sims:
            await sim.ready()
    if any(not sim.ports for sim in sims):
        raise _Failed(f"simulators not ready within {options.start_timeout:.0f} s")
    return sims


async def _start_frontend(
    ports: Sequence[int], options: Options, log: IO[bytes], children: list[Child]
) -> tuple[Child, str]:
    args = [
        sys.executable, "-m", "frontend_shim", "--router-mode", "kv",
        "--active-decode-blocks-threshold", "0.5", "--http-port", "0",
        *options.frontend_args,
    ]  # fmt: skip
    for port in ports:
        args += ["--worker", f"ws://127.0.0.1:{port}"]
    frontend = Child(args, name="frontend", cpu=FRONTEND_CPU, log=log, control=True)
    children.append(frontend)
    await frontend.start()
    with trio.move_on_after(options.start_timeout):
        return frontend, (await frontend.ready())["http"]
    raise _Failed(f"no frontend ready line within {options.start_timeout:.0f} s")


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
            frontend, url = await _start_frontend(ports, options, frontend_log, children)
            result.ready_line_s = trio.current_time() - began
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_exits, list(children), result, nursery.cancel_scope)
                await _measure_frontend(sims, frontend, url, began, options, result)
                nursery.cancel_scope.cancel()


async def _measure_frontend(
    sims: Sequence[Simulator],
    frontend: Child,
    url: str,
    began: float,
    options: Options,
    result: SizeResult,
) -> None:
    workers = result.workers
    worker_ports = {worker_port for sim in sims for worker_port in sim.ports}
    pid = frontend.pid
    probe = Client(url)
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
    cpu0, wait0 = tree_cpu_seconds(pid), wait_seconds(pid)
    sim_pids = [sim.child.pid for sim in sims]
    sim_cpu0 = sum(cpu_seconds(sim_pid) for sim_pid in sim_pids)
    sim_wait0 = sum(wait_seconds(sim_pid) for sim_pid in sim_pids)
    result.unread_kb_start = unread_bytes(worker_ports) / 1024
    live = Client(url)
    completions = Client(url)
    async with trio.open_nursery() as probes:
        probes.start_soon(_probe_live, live, window_start + options.seconds, result)
        probes.start_soon(_probe_completions, completions, window_start + options.seconds, result)
    await live.aclose()
    await completions.aclose()
    result.unread_kb_end = unread_bytes(worker_ports) / 1024
    cpu1, wait1 = tree_cpu_seconds(pid), wait_seconds(pid)
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
    frontend_memory = memory(pid)
    result.frontend_rss_mb = frontend_memory.resident / MIB
    result.frontend_peak_rss_mb = frontend_memory.peak / MIB
    result.simulator_rss_mb = sum(memory(sim_pid).resident for sim_pid in sim_pids) / MIB
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
    with contextlib.suppress(*HTTP_ERRORS):
        result.connected_after = await _connected(probe)
    await probe.aclose()
    result.phase = "done"


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
    pin(SIM_CPU)
    raise_fd_limit()
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
