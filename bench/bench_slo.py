"""SLO-aware admission: goodput at a TTFT objective, fixed N and the adaptive limit side by side.

Run from the repository's root: ``python -m bench.bench_slo [--seconds 30] [--loads 0.5,1,2,4]
[--objective 0.3] [--sweep 2,4,8,12,16,24,32,64] [--sweep-queues 2,8] [--plot slo.png]
[--json slo.json]`` (``--plot`` needs ``pip install -e '.[plot]'``). ``--mode e2e`` measures the
same table through real worker and frontend processes at the client instead
(:mod:`bench.slo.e2e`), e.g. ``--mode e2e --seconds 10 --loads 0.5,2 --sweep 8,16,32``.

What runs: the worker's own admission gate (:class:`worker_ingress._admission.AdmissionGate`)
in front of the mocker engine (:class:`worker_ingress.engines._mocker.MockerEngine`), in this
process, exactly as the request plane drives them (``reject_now``, then ``slot()``, the first
output reported to the lease). The mocker's step time grows with the tokens a step computes and
with the KV cache in use, and its chunked prefill makes the engine queue prefill when the step
budget is small (docs/mocker.md), so time to first token grows with the batch.

The clock: by default a Trio virtual clock (``MockClock(autojump_threshold=0)``): time moves only
when every task waits, so the simulated engine, the gate and the controller see exact times and
the figures do not depend on what else runs on the machine (a shared 2-core box). The mocker's
speedup ratio (``--speedup``, 2 by default, which puts the capacities near 160 completions a
second for ``short`` and 48 for ``long``) scales the modelled GPU. ``--clock real`` runs the same
in wall time instead (slower, and noisy on a shared machine: use it to check one load, e.g.
``--loads 2 --clock real``).

Two workloads: ``short``: 256-token prompts, 48 tokens out, a batch of 64 sequences and the
default 8,192-token step budget; ``long``: 1,024-token prompts, 16 out, a batch of 256 and a
1,024-token step budget, so one prompt fills a step and the engine queues prefill.

For each, in one run:

1. capacity: a closed loop of clients as many as the batch, with no gate limit, completions per
   second after a warm-up;
2. for each offered load (a multiple of that capacity), one seeded Poisson arrival sequence,
   played to every configuration: the usual setting (N = the engine's batch, Q = 64 for
   ``short``, 16 for ``long``), every fixed N of ``--sweep`` with every Q of ``--sweep-queues``
   (2 and 8), and the adaptive limit (``--ttft-slo``: N and Q of the usual setting, the
   objective S);
3. a load step for the adaptive limit: 4x the capacity, then 0.5x, and how long L takes to come
   back within 10% of where it settles at 0.5x.

Per configuration and load: goodput at the objective (completed requests whose time to first
token, arrival at the gate to first output, is <= S, per second), p50/p90/p99 time to first token
of the completed, the share refused, and the effective limit over time (median, min, max).
Requests that arrive during the warm-up are not counted. The best fixed N is the best of the fixed
configurations at each load (an oracle an operator does not have). The targets are checked at
the end as figures, not asserts: at every load, the adaptive limit's goodput at least 90% of the
best fixed configuration's; from 2x on, at least 3 times the usual setting's; at 0.5x, at most
1% refused; after the load step, L back within 10% of where it settles in under 10 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import random
import re
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Final, TypeVar

import trio
import trio.testing

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.children import started_logging
from bench.kit.stats import poisson_arrivals
from bench.slo.e2e import measure
from bench.slo.figures import (
    TABLE_HEAD,
    WORKLOADS,
    Config,
    Record,
    Row,
    Workload,
    best_fixed,
    check_targets,
    every,
    format_rows,
    recovery_seconds,
    summarize,
)
from worker_ingress._admission import AdmissionGate, Rejection
from worker_ingress._config import MockerSettings
from worker_ingress.engines import Engine
from worker_ingress.engines._mocker import MockerEngine

_T = TypeVar("_T")

#: What llama-server prints once it serves (its address).
LLAMA_READY: Final = re.compile(rb"listening on (http://127\.0\.0\.1:\d+)")
#: How often the effective limit is sampled for "L over time" (seconds).
LIMIT_SAMPLE_SECONDS: Final = 0.25
#: Share of the run at the start whose arrivals are not counted (the adaptive limit starts at N).
WARMUP_SHARE: Final = 0.2

# ----------------------------------------------------------------------------- running


#: Builds a fresh engine for one run (the mocker of a workload, or a client of an upstream).
EngineFactory = Callable[[], Engine]


def mocker_for(workload: Workload, speedup: float) -> EngineFactory:
    """The mocker shaped as the workload says, at the speedup ratio, without its prefix cache
    (every request of a workload has the same prompt: cached, it would cost no prefill)."""
    settings = MockerSettings(
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        speedup_ratio=speedup,
        enable_prefix_caching=False,
    )
    return functools.partial(MockerEngine, settings)


def _body(workload: Workload) -> dict[str, object]:
    prompt = " ".join(["word"] * workload.prompt_tokens)
    body: dict[str, object] = {"prompt": prompt, "max_tokens": workload.max_tokens}
    if workload.model is not None:
        # Greedy and without an early stop, so every request does the same work upstream.
        body |= {"model": workload.model, "temperature": 0, "ignore_eos": True}
    return body


async def _serve(
    gate: AdmissionGate, engine: Engine, workload: Workload, records: list[Record]
) -> None:
    """One request as the request plane serves it: shed fast, else wait for a slot, stream."""
    prepared = engine.prepare("completions", _body(workload))
    arrived = trio.current_time()
    if gate.reject_now() is not None:
        records.append(Record(arrived, math.nan, completed=False, refused=True))
        return
    ttft = math.nan
    try:
        async with (
            gate.slot(prompt_tokens=prepared.prompt_tokens) as lease,
            aclosing(engine.generate(prepared)) as outputs,
        ):
            async for _ in outputs:
                if math.isnan(ttft):
                    ttft = trio.current_time() - arrived
                    lease.first_output()
    except Rejection:
        records.append(Record(arrived, ttft, completed=False, refused=True))
        return
    records.append(Record(arrived, ttft, completed=True, refused=False))


async def _sample_limit(
    gate: AdmissionGate, limits: list[tuple[float, int]], origin: float
) -> None:
    while True:
        limits.append((trio.current_time() - origin, gate.effective_limit))
        await trio.sleep(LIMIT_SAMPLE_SECONDS)


async def play(
    workload: Workload,
    config: Config,
    arrivals: Sequence[float],
    *,
    make_engine: EngineFactory,
    drain: float,
) -> tuple[list[Record], list[tuple[float, int]]]:
    """Play one arrival sequence (offsets in seconds) to one configuration.

    Returns:
        Every request's record (arrival times relative to the start) and L over time.
    """
    engine = make_engine()
    gate = AdmissionGate(
        engine_slots=config.limit,
        queue_limit=config.queue,
        ttft_objective=config.objective,
    )
    records: list[Record] = []
    limits: list[tuple[float, int]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        origin = trio.current_time()
        nursery.start_soon(_sample_limit, gate, limits, origin)
        raw: list[Record] = []
        async with trio.open_nursery() as requests:
            for offset in arrivals:
                await trio.sleep_until(origin + offset)
                requests.start_soon(_serve, gate, engine, workload, raw)
            # Every admitted request ends within the cap's drain time; bound it anyway.
            requests.cancel_scope.deadline = trio.current_time() + drain
        nursery.cancel_scope.cancel()
    records = [dataclasses.replace(r, arrived=r.arrived - origin) for r in raw]
    return records, limits


async def capacity(workload: Workload, *, make_engine: EngineFactory, seconds: float) -> float:
    """Completions per second of a closed loop as many as the engine's batch, no gate limit."""
    engine = make_engine()
    prepared = engine.prepare("completions", _body(workload))
    done: list[float] = []

    async def client() -> None:
        while True:
            async with aclosing(engine.generate(prepared)) as outputs:
                async for _ in outputs:
                    pass
            done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        origin = trio.current_time()
        # The clients stop before the engine: an engine that stops first (the openai engine
        # closes its HTTP client) would fail a client's request mid-way instead of cancelling it.
        async with trio.open_nursery() as clients:
            for _ in range(workload.max_num_seqs):
                clients.start_soon(client)
            await trio.sleep(seconds)
            clients.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    warm = origin + seconds * WARMUP_SHARE
    return sum(1 for at in done if at >= warm) / (seconds * (1 - WARMUP_SHARE))


def run_async(clock: str, fn: Callable[[], Awaitable[_T]]) -> _T:
    """``trio.run`` of ``fn`` on the chosen clock (``virtual`` or ``real``)."""
    if clock == "virtual":
        return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))
    return trio.run(fn)


def configs_for(
    workload: Workload, sweep: Sequence[int], objective: float, queues: Sequence[int] = (2,)
) -> list[Config]:
    """The usual setting, the sweep (every N up to the batch with every Q of ``queues``) and the
    adaptive limit."""
    configs = [Config("usual", workload.usual_limit, workload.usual_queue)]
    configs += [Config("fixed", n, q) for q in queues for n in sweep if n <= workload.usual_limit]
    configs.append(Config("adaptive", workload.usual_limit, workload.usual_queue, objective))
    return configs


# ----------------------------------------------------------------------------- end to end


def e2e_records(raw: Sequence[Sequence[float]]) -> list[Record]:
    """The load generator's ``[sent, ttft, status]`` as records (a 529 or 503 is refused)."""
    return [
        Record(
            float(sent),
            float(ttft),
            completed=status == 200 and not math.isnan(ttft),
            refused=status in (503, 529),
        )
        for sent, ttft, status in raw
    ]


async def e2e_section(args: argparse.Namespace, chosen: Sequence[Workload]) -> None:
    """The table through real processes, TTFT at the client (module :mod:`bench.slo.e2e`)."""
    objective = args.objective
    warmup = args.seconds * WARMUP_SHARE
    loads = [float(v) for v in args.loads.split(",")]
    sweep = [int(v) for v in args.sweep.split(",") if v]
    print(
        f"bench_slo end to end: S = {objective * 1e3:.0f} ms at the client, speedup "
        f"{args.speedup:g}, {args.seconds:g} s per run ({warmup:g} s not counted); worker and "
        "frontend on CPU 0, the load generator on CPU 1"
    )
    for workload in chosen:
        shape = [
            "--speedup-ratio", str(args.speedup),
            "--max-num-seqs", str(workload.max_num_seqs),
            "--max-num-batched-tokens", str(workload.max_num_batched_tokens),
            "--no-enable-prefix-caching",  # one prompt for all: cached, it costs no prefill
        ]  # fmt: skip
        body = {
            "model": "mock-model",
            "prompt": " ".join(["word"] * workload.prompt_tokens),
            "max_tokens": workload.max_tokens,
            "stream": True,
        }
        probe = await measure(
            worker_flags=shape,
            queue=workload.usual_queue,
            body=body,
            clients=workload.max_num_seqs,
            seconds=args.seconds,
        )
        sent = [r for r in e2e_records(probe.records) if r.completed and r.arrived >= warmup]
        cap = len(sent) / (args.seconds - warmup)
        print(f"\n{workload.name}: {workload.describe()}; capacity {cap:.1f}/s (closed loop)")
        configs = configs_for(workload, sweep, objective, (2,))
        for load in loads:
            rng = random.Random(f"{args.seed}:{workload.name}:{load}")
            arrivals = poisson_arrivals(load * cap, args.seconds, rng)
            rows: dict[str, Row] = {}
            refusals: dict[str, tuple[float, float, float]] = {}
            for config in configs:
                flags = [*shape, "--engine-request-limit", str(config.limit)]
                if config.objective is not None:
                    flags += ["--ttft-slo", str(config.objective)]
                result = await measure(
                    worker_flags=flags, queue=config.queue, body=body, arrivals=arrivals
                )
                records = e2e_records(result.records)
                rows[config.label] = summarize(
                    records, objective=objective, start=warmup, end=args.seconds
                )
                refusals[config.label] = (result.marked, result.worker_refused, result.worker_slo)
            best = best_fixed(rows, configs)
            print(f"\n {load:g}x ({load * cap:.0f}/s offered, {len(arrivals)} requests)")
            print(TABLE_HEAD)
            for line in format_rows(rows, [c.label for c in configs], best.label):
                print(line)
            adaptive, usual = configs[-1], configs[0]
            ours = rows[adaptive.label]
            marked, refused, slo = refusals[adaptive.label]
            best_goodput = rows[best.label].goodput
            usual_goodput = rows[usual.label].goodput
            of_best = ours.goodput / best_goodput if best_goodput else math.inf
            of_usual = ours.goodput / usual_goodput if usual_goodput else math.inf
            print(
                f"  adaptive: {of_best:.2f} of the best fixed, {of_usual:.1f}x the usual; p90 "
                f"TTFT {ours.p90_ms:.0f} ms (S {objective * 1e3:.0f}); refused "
                f"{ours.refused:.1%}; frontend marked {marked:.0f} vs worker refusals "
                f"{refused:.0f} (slo {slo:.0f})"
            )


# ----------------------------------------------------------------------------- llama.cpp


async def llama_section(args: argparse.Namespace) -> None:
    """The same comparison at one load behind a real ``llama-server`` (on the CPU, real time).

    The server runs ``--llama-slots`` slots on one thread (pinned to CPU 0 when ``taskset`` is
    there); the gate and the ``openai`` engine run in this process. The usual setting is N = the
    server's slots with Q = 16; the sweep is N = 1, 2, 4, ... up to the slots with Q = 2.
    """
    from worker_ingress._config import WorkerSettings
    from worker_ingress.engines.upstream._engine import create

    slots = args.llama_slots
    workload = Workload(
        name="llama",
        prompt_tokens=args.llama_prompt_words,
        max_tokens=args.llama_max_tokens,
        max_num_seqs=slots,
        max_num_batched_tokens=2048,
        usual_queue=16,
        model="tiny",
    )
    server = [args.llama_server, "-m", args.llama_model, "--alias", "tiny", "--host"]
    server += ["127.0.0.1", "--port", "0", "-np", str(slots), "-c", str(slots * 4096), "-t", "1"]
    log = Path(tempfile.mkdtemp()) / "llama-server.log"
    async with started_logging(server, log, LLAMA_READY, cpu=0, name="llama-server") as (_, ready):
        url = ready[1].decode()

        def engine_with(limit: int) -> EngineFactory:
            settings = WorkerSettings(
                worker_id="bench",
                model="tiny",
                engine="openai",
                upstream_url=url,
                engine_request_limit=limit,
            )
            return functools.partial(create, settings)

        cap = await capacity(workload, make_engine=engine_with(slots), seconds=15.0)
        objective = args.llama_objective
        load = args.llama_load
        print(
            f"\nllama: llama-server ({slots} slots, 1 thread, the suite's tiny model), "
            f"{workload.prompt_tokens}-word prompts, {workload.max_tokens} out; capacity "
            f"{cap:.1f}/s (closed loop); {load:g}x offered; S = {objective * 1e3:.0f} ms"
        )
        sweep = [n for n in (1, 2, 4, 8, 16, 32) if n < slots]
        configs = [Config("usual", slots, 16)]
        configs += [Config("fixed", n, 2) for n in [*sweep, slots]]
        configs.append(Config("adaptive", slots, 16, objective))
        arrivals = poisson_arrivals(load * cap, args.llama_seconds, random.Random(args.seed))
        rows: dict[str, Row] = {}
        for config in configs:
            records, limits = await play(
                workload,
                config,
                arrivals,
                make_engine=engine_with(config.limit),
                drain=4 * objective + 60.0,
            )
            rows[config.label] = summarize(
                records,
                objective=objective,
                start=args.llama_seconds * WARMUP_SHARE,
                end=args.llama_seconds,
                limits=limits,
            )
        best = best_fixed(rows, configs)
        print(TABLE_HEAD)
        for line in format_rows(rows, [c.label for c in configs], best.label):
            print(line)
        ours, usual = rows[configs[-1].label], rows[configs[0].label]
        share = ours.goodput / rows[best.label].goodput if rows[best.label].goodput else math.inf
        ratio = ours.goodput / usual.goodput if usual.goodput else math.inf
        print(f"  adaptive: {share:.0%} of the best fixed, {ratio:.1f}x the usual")


# ----------------------------------------------------------------------------- the command


def _plot(path: str, report: dict[str, object]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install -e '.[plot]'", file=sys.stderr)
        return
    workloads: dict[str, dict[str, object]] = report["workloads"]  # type: ignore[assignment]
    figure, axes = plt.subplots(3, len(workloads), figsize=(6 * len(workloads), 12), squeeze=False)
    for column, (name, data) in enumerate(workloads.items()):
        loads = data["loads"]
        series: dict[str, dict[str, list[float]]] = data["series"]  # type: ignore[assignment]
        for label, values in series.items():
            axes[0][column].plot(loads, values["goodput"], marker="o", label=label)
            axes[1][column].plot(loads, values["p90_ms"], marker="o", label=label)
        axes[0][column].set_title(f"{name}: goodput at the objective")
        axes[0][column].set_xlabel("offered load (x capacity)")
        axes[0][column].set_ylabel("requests/s with TTFT <= S")
        axes[0][column].legend(fontsize="small")
        axes[1][column].set_title(f"{name}: p90 TTFT of the completed")
        axes[1][column].set_xlabel("offered load (x capacity)")
        axes[1][column].set_ylabel("ms")
        axes[1][column].set_yscale("log")
        axes[1][column].axhline(report["objective"] * 1e3, color="grey", linestyle=":")  # type: ignore[operator]
        step: list[list[float]] = data["step_limits"]  # type: ignore[assignment]
        axes[2][column].plot([at for at, _ in step], [value for _, value in step])
        axes[2][column].axvline(data["drop_at"], color="grey", linestyle=":")
        axes[2][column].set_title(f"{name}: L over time, 4x then 0.5x")
        axes[2][column].set_xlabel("s")
        axes[2][column].set_ylabel("effective limit L")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"plot written to {path}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="arrival window per run")
    parser.add_argument("--loads", default="0.5,1,2,4", help="multiples of the capacity")
    parser.add_argument("--objective", type=float, default=0.3, help="S, seconds")
    parser.add_argument("--sweep", default="2,4,8,12,16,24,32,64", help="fixed N of the sweep")
    parser.add_argument("--sweep-queues", default="2,8", help="Q of the sweep's fixed N")
    parser.add_argument("--workloads", default="short,long")
    parser.add_argument("--speedup", type=float, default=2.0, help="the mocker's speedup ratio")
    parser.add_argument("--clock", choices=("virtual", "real"), default="virtual")
    parser.add_argument(
        "--mode", choices=("gate", "e2e"), default="gate", help="e2e: real processes"
    )
    parser.add_argument("--seed", default="bench_slo")
    parser.add_argument("--step-seconds", type=float, default=30.0, help="each half of the step")
    parser.add_argument("--plot", metavar="FILE", help="draw the figures into a PNG")
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--llama-server", metavar="BIN", help="also run behind llama-server")
    parser.add_argument("--llama-model", metavar="GGUF", help="its model (tests/tiny_gguf.py)")
    parser.add_argument("--llama-slots", type=int, default=8)
    parser.add_argument("--llama-prompt-words", type=int, default=512)
    parser.add_argument("--llama-max-tokens", type=int, default=32)
    parser.add_argument("--llama-objective", type=float, default=0.25, help="S there, seconds")
    parser.add_argument("--llama-load", type=float, default=2.0, help="multiple of capacity")
    parser.add_argument("--llama-seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    loads = [float(v) for v in args.loads.split(",")]
    sweep = [int(v) for v in args.sweep.split(",") if v]
    queues = [int(v) for v in args.sweep_queues.split(",") if v]
    chosen = [w for w in WORKLOADS if w.name in args.workloads.split(",")]
    objective = args.objective
    drain = 4 * objective + 60.0
    warmup = args.seconds * WARMUP_SHARE
    if args.mode == "e2e":
        trio.run(e2e_section, args, chosen)
        return

    print(
        f"bench_slo: objective S = {objective * 1e3:.0f} ms, speedup {args.speedup:g}, "
        f"{args.clock} clock, {args.seconds:g} s per run ({warmup:g} s warm-up not counted)"
    )
    results: dict[tuple[str, float], dict[str, Row]] = {}
    configs: dict[str, list[Config]] = {}
    recoveries: dict[str, tuple[float, float]] = {}
    report: dict[str, object] = {"objective": objective, "workloads": {}}
    for workload in chosen:
        cap = run_async(
            args.clock,
            functools.partial(
                capacity, workload, make_engine=mocker_for(workload, args.speedup), seconds=20.0
            ),
        )
        configs[workload.name] = configs_for(workload, sweep, objective, queues)
        print(f"\n{workload.name}: {workload.describe()}; capacity {cap:.1f}/s (closed loop)")
        series: dict[str, dict[str, list[float]]] = {}
        for load in loads:
            rng = random.Random(f"{args.seed}:{workload.name}:{load}")
            arrivals = poisson_arrivals(load * cap, args.seconds, rng)
            rows: dict[str, Row] = {}
            for config in configs[workload.name]:
                played = run_async(
                    args.clock,
                    functools.partial(
                        play,
                        workload,
                        config,
                        arrivals,
                        make_engine=mocker_for(workload, args.speedup),
                        drain=drain,
                    ),
                )
                records, limits = played
                rows[config.label] = summarize(
                    records, objective=objective, start=warmup, end=args.seconds, limits=limits
                )
            results[(workload.name, load)] = rows
            best = best_fixed(rows, configs[workload.name])
            print(f"\n {load:g}x ({load * cap:.0f}/s offered, {len(arrivals)} requests)")
            print(TABLE_HEAD)
            order = [c.label for c in configs[workload.name]]
            for line in format_rows(rows, order, best.label):
                print(line)
            for kind, config in (
                ("usual", configs[workload.name][0]),
                ("best fixed", best),
                ("adaptive", configs[workload.name][-1]),
            ):
                entry = series.setdefault(kind, {"goodput": [], "p90_ms": []})
                entry["goodput"].append(rows[config.label].goodput)
                entry["p90_ms"].append(rows[config.label].p90_ms)

        # The load step: 4x, then 0.5x; L over time.
        rng = random.Random(f"{args.seed}:{workload.name}:step")
        high = poisson_arrivals(4 * cap, args.step_seconds, rng)
        low = poisson_arrivals(0.5 * cap, args.step_seconds, rng)
        arrivals = high + [args.step_seconds + offset for offset in low]
        adaptive = configs[workload.name][-1]
        played = run_async(
            args.clock,
            functools.partial(
                play,
                workload,
                adaptive,
                arrivals,
                make_engine=mocker_for(workload, args.speedup),
                drain=drain,
            ),
        )
        _, step_limits = played
        steady, seconds = recovery_seconds(
            step_limits, drop_at=args.step_seconds, end=2 * args.step_seconds
        )
        recoveries[workload.name] = (steady, seconds)
        at_high = [v for at, v in step_limits if args.step_seconds / 2 <= at < args.step_seconds]
        print(
            f"\n load step 4x -> 0.5x at {args.step_seconds:g} s: L median "
            f"{statistics.median(at_high):.0f} at 4x, steady {steady:g} at 0.5x, back within "
            f"10% after {seconds:.1f} s"
        )
        print("  L over time (every 2 s): " + " ".join(str(v) for v in every(step_limits, 2.0)))
        report["workloads"][workload.name] = {  # type: ignore[index]
            "capacity": cap,
            "loads": loads,
            "series": series,
            "rows": {
                f"{load:g}": {label: dataclasses.asdict(row) for label, row in rows.items()}
                for (name, load), rows in results.items()
                if name == workload.name
            },
            "step_limits": step_limits,
            "drop_at": args.step_seconds,
            "recovery": {"steady": steady, "seconds": seconds},
        }

    print("\ntargets:")
    for verdict in check_targets(results, configs, recoveries):
        print(f"  [{'met' if verdict.met else 'MISSED'}] {verdict.target}: {verdict.figure}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=float))
    if args.plot and chosen:
        _plot(args.plot, report)
    if args.llama_server:
        if not args.llama_model:
            parser.error("--llama-server needs --llama-model")
        trio.run(llama_section, args)


if __name__ == "__main__":
    main()
