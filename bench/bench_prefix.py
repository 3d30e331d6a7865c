"""Real traffic replayed through cache-aware routing: ours and NVIDIA Dynamo's, side by side.

Run from the repository's root::

    python -m bench.bench_prefix --trace PATH/conversation_trace.jsonl \\
        --trace-duration 300 --time-scale 0.5 --length-scale 0.03125 \\
        [--workers 4] [--repeats 1] [--dynamo-python .venv-dynamo/bin/python]

``--trace`` is required: the Mooncake conversation trace (``conversation_trace.jsonl`` of the
``kvcache-ai/Mooncake`` repository's FAST25 release, ``FAST25-release/traces/``) or the Azure LLM
inference trace 2023, conversation service (``data/AzureLLMInferenceTrace_conv.csv`` of
``Azure/AzurePublicDataset``).

A window of a trace (Mooncake: arrival times, lengths and 512-token block hashes; or Azure: times
and lengths) is scaled in time and length by ``examples/load_generator.py`` (a block of 512
tokens becomes ``512 x --length-scale`` words, so the trace's shared prefixes stay shared block
for block) and replayed, open loop at the trace's (scaled) arrival times, by that load generator
in a process of its own, against one frontend and ``--workers`` mockers, in each mode:

- ``round-robin``: the frontend ignores the caches;
- ``kv``: the frontend's cache-aware routing, the workers' prefix caches on;
- ``kv-nocache``: ``kv`` with ``--no-enable-prefix-caching`` on the workers (what the cache
  itself is worth);

and the same with Dynamo 1.6.1's frontend (``--router-mode kv`` and ``round-robin``) and its
mockers (one process each, prefix caching on), the same block size, number of blocks, speedup,
window and scale, as ``bench/bench_dynamo.py`` runs Dynamo (file discovery, TCP request plane,
ZMQ event plane, its tiny model folder: the prompts' words ``w0``...``w499`` are words of its
tokenizer). Without a Dynamo interpreter its rows are skipped and the report says why.

Each mocker gets ``--num-gpu-blocks`` blocks, by default enough for the caches of all the
workers together to hold a third (``--cache-share``) of the window's distinct blocks (and never
fewer than the largest request needs), so that where a prompt goes decides whether its prefix
is found.

Figures per system and mode (medians over ``--repeats``): hit rate at the client (the answers'
``usage.prompt_tokens_details.cached_tokens`` over their prompt tokens), TTFT p50/p90 (to the
first chunk), throughput (answers 200 per second), shed rate (529s), the share of requests each
worker started (from the workers' own counters), and each system's ``kv`` over its own
``round-robin``. The report starts with what an unbounded single cache would hit on the same
window (from the trace's block hashes, in arrival order) and the sizes chosen.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit import dynamo
from bench.kit.http import get, wait_connected, wait_status
from bench.kit.metrics import metric_sum
from bench.kit.processes import free_port, pinned, serve
from bench.kit.shim import frontend_command, worker_command
from bench.kit.table import Table, cell
from bench.kit.wrk import LOAD_CPU
from bench.prefix.window import (
    LOAD_GENERATOR,
    TRACE_WANTED,
    Plan,
    Window,
    load_generator,
    make_plan,
)

OURS: Final = "dynamo-shim"
MODES: Final = ("round-robin", "kv", "kv-nocache")
DYNAMO_MODES: Final = ("round-robin", "kv")
CHAT_PATH: Final = "/v1/chat/completions"
#: A chat of one word: the probe that a deployment answers before it is measured.
PROBE: Final = json.dumps(
    {"model": dynamo.MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 1}
)


# ----------------------------------------------------------------------------- deployments


@dataclasses.dataclass
class Fleet:
    """A running deployment: the frontend's URL and the workers' metrics URLs."""

    url: str
    worker_metrics: list[str]
    #: The counter of requests a worker started (one sample per worker's metrics page).
    counter: str


def started(fleet: Fleet) -> list[float]:
    """Requests each worker has started so far."""
    return [metric_sum(get(url, "")[1].decode(), fleet.counter) for url in fleet.worker_metrics]


@contextlib.contextmanager
def shim_fleet(
    mode: str, plan: Plan, speedup: float, frontend_args: Sequence[str] = ()
) -> Iterator[Fleet]:
    """Our frontend (with ``frontend_args`` added) and ``plan.workers`` mockers, in ``mode``."""
    worker = worker_command("--log-level", "warning", "--block-size", str(plan.block_tokens))
    worker += ["--num-gpu-blocks", str(plan.blocks_per_worker), "--speedup-ratio", f"{speedup:g}"]
    if mode == "kv-nocache":
        worker.append("--no-enable-prefix-caching")
    router = "kv" if mode.startswith("kv") else mode
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(serve(worker)).addresses for _ in range(plan.workers)]
        frontend = frontend_command(
            "--log-level", "warning", "--router-mode", router, *frontend_args
        )
        for addresses in workers:
            frontend += ["--worker", addresses["ws"]]
        http = stack.enter_context(serve(frontend)).addresses["http"]
        wait_connected(http, plan.workers)
        wait_status(http, CHAT_PATH, PROBE, 200, timeout=60)
        yield Fleet(
            http,
            [addresses["system"] + "/metrics" for addresses in workers],
            "dynamo_worker_started_request_total",
        )


@contextlib.contextmanager
def dynamo_fleet(
    python: str, mode: str, plan: Plan, speedup: float, scratch: Path, log: str
) -> Iterator[Fleet]:
    """Dynamo's frontend in ``mode`` and ``plan.workers`` mockers, one process each."""
    model = scratch / "model"
    dynamo.write_model_folder(model)  # its FILLER words include the prompts' w0...w499
    _allow_long_prompts(model)
    env = dynamo.dynamo_env(scratch / f"kv-{mode}-{time.monotonic_ns()}", log)
    mocker = [python, "-m", "dynamo.mocker", "--model-path", str(model)]
    mocker += ["--model-name", dynamo.MODEL]
    mocker += ["--block-size", str(plan.block_tokens)]
    mocker += ["--num-gpu-blocks-override", str(plan.blocks_per_worker)]
    mocker += ["--speedup-ratio", f"{speedup:g}", "--enable-prefix-caching", *dynamo.PLANES]
    metrics = []
    with contextlib.ExitStack() as stack:
        for index in range(plan.workers):
            port = _free_system_port()
            worker_env = {**env, "DYN_SYSTEM_ENABLED": "true", "DYN_SYSTEM_PORT": str(port)}
            log_file = scratch / f"dynamo-mocker-{mode}-{index}.log"
            stack.enter_context(serve(mocker, worker_env, log=log_file, ready=False, grace=15.0))
            metrics.append(f"http://127.0.0.1:{port}/metrics")
        port = free_port()
        frontend = [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1"]
        frontend += ["--http-port", str(port), "--router-mode", mode, *dynamo.PLANES]
        log_file = scratch / f"dynamo-frontend-{mode}.log"
        stack.enter_context(serve(frontend, env, log=log_file, ready=False, grace=15.0))
        url = f"http://127.0.0.1:{port}"
        wait_status(url, CHAT_PATH, PROBE, 200, timeout=180)
        fleet = Fleet(url, metrics, "dynamo_component_requests_total")
        _wait_dynamo_workers(fleet, plan.workers)
        yield fleet


def _free_system_port() -> int:
    """A free port below 32,768: Dynamo reads ``DYN_SYSTEM_PORT`` as a signed 16-bit number."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


def _allow_long_prompts(model: Path) -> None:
    """Raise the tiny model's context length: a scaled trace prompt can exceed 4,096 words."""
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        path = model / name
        content = json.loads(path.read_text())
        content[key] = 1 << 20
        path.write_text(json.dumps(content, indent=1) + "\n")


def _wait_dynamo_workers(fleet: Fleet, workers: int) -> None:
    """Wait until the frontend routes to every mocker (each has answered a probe)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if all(count > 0 for count in started(fleet)):
                return
        except OSError:
            pass
        wait_status(fleet.url, CHAT_PATH, PROBE, 200, timeout=30)
    raise RuntimeError(f"{fleet.url} did not route to all {workers} mockers")


# ----------------------------------------------------------------------------- one run


def replay(
    url: str, window: Window, span: float, scratch: Path, timeout: float, max_in_flight: int
) -> dict[str, Any]:
    """Run the load generator once against ``url`` and return its figures.

    Args:
        url: The frontend.
        window: What to replay.
        span: Replay seconds of the window (bounds the wait for the load generator).
        scratch: Where its figures are written.
        timeout: Seconds one request may take.
        max_in_flight: Requests out at once at most.
    """
    out = scratch / f"replay-{time.monotonic_ns()}.json"
    args = [sys.executable, str(LOAD_GENERATOR), "--url", url]
    args += ["--model", dynamo.MODEL, "--endpoint", "chat", *window.flags()]
    args += ["--timeout", f"{timeout:g}", "--max-in-flight", str(max_in_flight)]
    args += ["--json", str(out)]
    # The load generator bounds its own run; this bound only catches one that hangs.
    done = subprocess.run(
        pinned(LOAD_CPU, args),
        capture_output=True,
        text=True,
        cwd=LOAD_GENERATOR.parents[1],
        check=False,
        timeout=span + 2 * timeout + 120.0,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed:\n{done.stdout}\n{done.stderr}")
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def aiperf_trace(window: Window, path: Path) -> None:
    """Write the window as a Mooncake file for aiperf: arrivals scaled, lengths as they are.

    aiperf rebuilds each prompt from the hash ids in blocks of 512 of its tokenizer's tokens and
    scales no length, so only the time is scaled here. Only a Mooncake trace can be given.
    """
    trace = load_generator().read_trace(window.trace, "mooncake")
    chosen = load_generator().select_window(
        trace, start=window.start, duration=window.duration, count=window.requests
    )
    with path.open("w") as out:
        for request in chosen:
            row = {
                "timestamp": round(request.arrival * window.time_scale * 1000),
                "input_length": request.input_tokens,
                "output_length": request.output_tokens,
                "hash_ids": list(request.hash_ids),
            }
            out.write(json.dumps(row) + "\n")


def aiperf_tokenizer(scratch: Path) -> tuple[str, dict[str, str]]:
    """The tiny word-level tokenizer as an entry of a scratch model cache, and its environment.

    aiperf's prompt builders load the tokenizer in offline mode, where it reads only a model
    cache, not a folder: the folder of :func:`write_model_folder` is laid out as one.
    """
    revision = "0" * 40
    entry = scratch / "hub" / "models--local--words"
    dynamo.write_model_folder(entry / "snapshots" / revision)
    (entry / "refs").mkdir(parents=True, exist_ok=True)
    (entry / "refs" / "main").write_text(revision)
    return "local/words", {"HF_HUB_CACHE": str(scratch / "hub"), "HF_HUB_OFFLINE": "1"}


def replay_aiperf(
    aiperf: str, url: str, window: Window, span: float, scratch: Path
) -> dict[str, Any]:
    """Replay the window with NVIDIA's aiperf against ``url`` and read its per-request records.

    Returns:
        The figures of :func:`replay` that aiperf's records give (hit rate from their
        ``usage_prompt_cache_read_tokens`` over ``usage_prompt_tokens``, TTFT, throughput).
    """
    tag = time.monotonic_ns()
    trace = scratch / f"aiperf-window-{tag}.jsonl"
    aiperf_trace(window, trace)
    tokenizer, env = aiperf_tokenizer(scratch)
    artifacts = scratch / f"aiperf-{tag}"
    args = [aiperf, "profile", "--model", dynamo.MODEL, "--url", url, "--endpoint-type", "chat"]
    args += ["--streaming", "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace"]
    args += ["--tokenizer", tokenizer, "--fixed-schedule", "--ui-type", "none"]
    args += ["--artifact-dir", str(artifacts)]
    done = subprocess.run(
        pinned(LOAD_CPU, args),
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=False,
        timeout=span + 600.0,
    )
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    lines = (artifacts / "profile_export.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return aiperf_figures(records)


def aiperf_figures(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The figures of aiperf's per-request records (``profile_export.jsonl``)."""

    def value(record: Mapping[str, Any], name: str) -> float | None:
        metric = record.get("metrics", {}).get(name)
        return None if metric is None else float(metric["value"])

    ok = [r for r in records if not r.get("error")]
    ttfts = sorted(v / 1e3 for r in ok if (v := value(r, "time_to_first_token")) is not None)
    prompt = sum(value(r, "usage_prompt_tokens") or 0.0 for r in ok)
    cached = sum(value(r, "usage_prompt_cache_read_tokens") or 0.0 for r in ok)
    starts = [r["metadata"]["request_start_ns"] for r in records]
    ends = [r["metadata"]["request_end_ns"] for r in records]
    elapsed = (max(ends) - min(starts)) / 1e9 if records else 0.0
    shed = sum(1 for r in records if (r.get("error") or {}).get("code") == 529)

    # The load generator's percentile (nearest rank), so that both replays' figures compare.
    nearest_rank = load_generator().percentile

    def pick(share: float) -> float | None:
        return float(nearest_rank(ttfts, share)) if ttfts else None

    return {
        "sent": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "hit_rate": cached / prompt if prompt else None,
        "ttft_s": {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)},
        "throughput_rps": len(ok) / elapsed if elapsed > 0 else 0.0,
        "shed_rate": shed / len(records) if records else 0.0,
        "usage_missing": sum(1 for r in ok if value(r, "usage_prompt_tokens") is None),
    }


def measure(
    fleet: Fleet,
    window: Window,
    plan: Plan,
    scratch: Path,
    timeout: float,
    max_in_flight: int,
    aiperf: str | None = None,
) -> dict[str, Any]:
    """One replay (by our load generator, or by ``aiperf`` when given) and the share of its
    requests each worker started."""
    before = started(fleet)
    if aiperf is None:
        figures = replay(fleet.url, window, plan.span, scratch, timeout, max_in_flight)
    else:
        figures = replay_aiperf(aiperf, fleet.url, window, plan.span, scratch)
    after = started(fleet)
    counts = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(counts)
    figures["worker_shares"] = [count / total if total else 0.0 for count in counts]
    return figures


# ----------------------------------------------------------------------------- the report


def median_run(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The figures of the report, each the median over ``runs``."""

    def median(get: Any) -> float | None:
        values = [v for v in (get(run) for run in runs) if v is not None]
        return statistics.median(values) if values else None

    shares = [sorted(run["worker_shares"], reverse=True) for run in runs]
    return {
        "hit_rate": median(lambda r: r["hit_rate"]),
        "ttft_p50": median(lambda r: r["ttft_s"]["p50"]),
        "ttft_p90": median(lambda r: r["ttft_s"]["p90"]),
        "throughput": median(lambda r: r["throughput_rps"]),
        "shed_rate": median(lambda r: r["shed_rate"]),
        "max_share": median(lambda r: max(r["worker_shares"], default=0.0)),
        "shares": [statistics.median(column) for column in zip(*shares, strict=True)],
        "usage_missing": median(lambda r: r["usage_missing"]),
        "runs": len(runs),
    }


def _ratio(top: float | None, bottom: float | None) -> str:
    if top is None or bottom is None or bottom == 0:
        return "-"
    return f"{top / bottom:.2f}"


def report(plan: Plan, results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """The figures as Markdown: the window, one row per system and mode, then the ratios.

    Args:
        plan: The window's figures and the sizes chosen.
        results: System -> mode -> what :func:`median_run` returned.
    """
    lines = [
        f"window: {plan.requests} requests over {plan.span:.1f} s of replay,"
        f" {plan.block_tokens} tokens a block, {plan.distinct_blocks} distinct blocks;"
        f" {plan.workers} workers x {plan.blocks_per_worker} blocks"
        f" ({plan.workers * plan.blocks_per_worker / max(1, plan.distinct_blocks):.0%}"
        " of the distinct blocks)",
        f"unbounded single cache: hit rate {plan.unbounded_hit_rate:.3f}; one LRU cache of all"
        f" {plan.workers * plan.blocks_per_worker} blocks: {plan.pooled_hit_rate:.3f}",
    ]
    rows = Table(
        "system", "mode", "hit rate", "TTFT p50 (ms)", "TTFT p90 (ms)", "throughput (req/s)",
        "shed", "busiest worker", "requests per worker",
    )  # fmt: skip
    for system, modes in results.items():
        for mode, row in modes.items():
            rows.add(
                system,
                mode,
                cell(row["hit_rate"], ".3f", missing="-"),
                cell(row["ttft_p50"], ".1f", scale=1e3, missing="-"),
                cell(row["ttft_p90"], ".1f", scale=1e3, missing="-"),
                cell(row["throughput"], ".2f", missing="-"),
                cell(row["shed_rate"], ".1%", missing="-"),
                cell(row["max_share"], ".0%", missing="-"),
                " / ".join(f"{share:.0%}" for share in row["shares"]),
            )
    ratios = Table(
        "system", "kv hit rate / round-robin's", "kv hit rate / unbounded",
        "kv TTFT p50 / round-robin's", "kv TTFT p50 / kv-nocache's",
        "kv throughput / round-robin's",
    )  # fmt: skip
    for system, modes in results.items():
        kv, rr = modes.get("kv"), modes.get("round-robin")
        if kv is None or rr is None:
            continue
        nocache = modes.get("kv-nocache")
        ratios.add(
            system,
            _ratio(kv["hit_rate"], rr["hit_rate"]),
            _ratio(kv["hit_rate"], plan.unbounded_hit_rate),
            _ratio(kv["ttft_p50"], rr["ttft_p50"]),
            _ratio(kv["ttft_p50"], nocache["ttft_p50"]) if nocache else "-",
            _ratio(kv["throughput"], rr["throughput"]),
        )
    return "\n".join([*lines, "", str(rows), "", str(ratios)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help=f"required: {TRACE_WANTED}",
    )
    parser.add_argument("--trace-start", type=float, default=0.0)
    parser.add_argument("--trace-duration", type=float, default=300.0)
    parser.add_argument("--trace-requests", type=int, default=None)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--length-scale", type=float, default=1.0 / 32)
    parser.add_argument("--output-scale", type=float, default=None)
    parser.add_argument("--workers", type=int, default=4, help="mockers (4 to 8)")
    parser.add_argument("--cache-share", type=float, default=1.0 / 3)
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="override the sizing")
    parser.add_argument("--speedup-ratio", type=float, default=1.0, help="the mockers'")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--max-in-flight", type=int, default=512)
    parser.add_argument("--modes", default=",".join(MODES), help="ours, comma-separated")
    parser.add_argument(
        "--frontend-args", default="", help="more flags for our frontend, space-separated"
    )
    parser.add_argument(
        "--dynamo-modes", default=",".join(DYNAMO_MODES), help="Dynamo's ('' for none)"
    )
    parser.add_argument(
        "--dynamo-python",
        default=str(dynamo.DEFAULT_PYTHON),
        help="an interpreter that can import dynamo.frontend and dynamo.mocker",
    )
    parser.add_argument("--dynamo-log", default="warn", help="DYN_LOG of the Dynamo processes")
    parser.add_argument(
        "--aiperf",
        default=None,
        help="replay with this aiperf executable instead of our load generator (Mooncake only;"
        " aiperf scales no length: give --length-scale 1 so the caches are sized for it)",
    )
    parser.add_argument("--logs", type=Path, default=None, help="keep logs and figures here")
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    options = parser.parse_args(argv)
    if options.trace is None:
        parser.error(f"--trace is required: {TRACE_WANTED}")
    if not options.trace.is_file():
        parser.error(f"--trace {options.trace}: no such file; wanted {TRACE_WANTED}")
    window = Window(
        options.trace,
        options.trace_start,
        options.trace_duration,
        options.trace_requests,
        options.time_scale,
        options.length_scale,
        options.output_scale,
    )
    generator = load_generator()
    plan = make_plan(
        generator, window, options.workers, options.cache_share, options.num_gpu_blocks
    )
    print(
        f"trace {options.trace.name}, window start {options.trace_start:g} s, duration"
        f" {options.trace_duration:g} s, time scale {options.time_scale:g}, length scale"
        f" {options.length_scale:g}, mocker speedup {options.speedup_ratio:g}",
        file=sys.stderr,
    )
    ours = [m for m in options.modes.split(",") if m]
    theirs = [m for m in options.dynamo_modes.split(",") if m]
    systems: list[tuple[str, str]] = [(OURS, mode) for mode in ours]
    version = dynamo.dynamo_version(options.dynamo_python) if theirs else None
    rival = f"Dynamo {version}"
    if theirs and version is None:
        print(dynamo.skipped(options.dynamo_python))
    elif theirs:
        systems += [(rival, mode) for mode in theirs]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = options.logs or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        for repeat in range(options.repeats):
            turn = repeat % len(systems)
            for system, mode in [*systems[turn:], *systems[:turn]]:
                print(f"repeat {repeat + 1}: {system} {mode}", file=sys.stderr)
                fleet: contextlib.AbstractContextManager[Fleet]
                if system == OURS:
                    fleet = shim_fleet(
                        mode, plan, options.speedup_ratio, options.frontend_args.split()
                    )
                else:
                    fleet = dynamo_fleet(
                        options.dynamo_python, mode, plan, options.speedup_ratio, scratch,
                        options.dynamo_log,
                    )  # fmt: skip
                with fleet as running:
                    figures = measure(
                        running, window, plan, scratch, options.timeout, options.max_in_flight,
                        options.aiperf,
                    )  # fmt: skip
                print(
                    json.dumps(
                        {
                            k: figures[k]
                            for k in (
                                "hit_rate",
                                "ttft_s",
                                "throughput_rps",
                                "shed_rate",
                                "worker_shares",
                            )
                        }
                    ),
                    file=sys.stderr,
                )
                runs.setdefault(system, {}).setdefault(mode, []).append(figures)
    if options.json is not None:
        options.json.write_text(
            json.dumps({"plan": dataclasses.asdict(plan), "runs": runs}, indent=1) + "\n"
        )
    results = {
        system: {mode: median_run(mode_runs) for mode, mode_runs in modes.items()}
        for system, modes in runs.items()
    }
    print(report(plan, results))


if __name__ == "__main__":
    main()
