"""Two or more source trees side by side: one-token completions through frontend and worker.

Made to tell a regression from noise on a shared machine: every tree gets its own worker and
frontend (started with ``PYTHONPATH`` pointing at the tree, all pinned to CPU 0), all are up at
once, and the rounds take turns between the trees (the order reversed every other round), so a
burst of someone else's load falls on every tree alike. wrk (one thread, CPU 1) sends chat
completions with ``max_tokens`` 1.

Per tree and round: requests/s on ``--connections`` keep-alive connections, the CPU time the
frontend and the worker spent per completion (from ``/proc``: user + system, read around the
wrk run), and with ``--one`` the p50 of a completion and of ``GET /live`` on one connection.
The report gives medians of the rounds, and per tree the median of its per-round rate ratio to
the first tree.

Usage::

    mkdir old && git archive <commit> | tar -x -C old
    python -m bench.bench_trees old . --rounds 5 --seconds 3 --one
    python -m bench.bench_trees old . --engine instant      # the zero-work engine
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from bench.bench_frontend import LOAD_CPU, _pinned, _server, _wait_connected

CHAT: Final = json.dumps(
    {"model": "mock-model", "messages": [{"role": "user", "content": "one two"}], "max_tokens": 1}
)


@dataclass(frozen=True)
class Round:
    """One tree's figures in one round."""

    rate: float
    frontend_us: float
    worker_us: float
    one_p50_ms: float | None = None
    live_p50_ms: float | None = None


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _process(args: list[str], tree: str) -> Iterator[tuple[int, list[str]]]:
    """Start a server of ``tree``, yield its pid and the URLs of its ready line, stop it."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
    env["PYTHONPATH"] = tree
    # Run from the tree: ``python -m`` puts the working directory first on the import path, so
    # from anywhere else (a checkout of another tree above all) it could import other code.
    with _server(args, env, cwd=tree) as started:
        yield started


def _wrk(url: str, lua: str | None, connections: int, seconds: int) -> tuple[float, float, float]:
    """Run wrk; return requests/s, requests, p50 in milliseconds."""
    args = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency"]
    if lua is not None:
        args += ["-s", lua]
    output = subprocess.run(
        _pinned(LOAD_CPU, [*args, url]), capture_output=True, text=True, check=True
    ).stdout
    if re.search(r"Non-2xx or 3xx responses: (\d+)", output):
        raise RuntimeError(f"{url}: non-2xx answers:\n{output}")
    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    total = re.search(r"(\d+) requests in", output)
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)\b", output)
    if rate is None or total is None or p50 is None:
        raise RuntimeError(f"unexpected wrk output:\n{output}")
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[p50[2]]
    return float(rate[1]), float(total[1]), float(p50[1]) * scale


def report(trees: Sequence[str], rounds: dict[str, list[Round]]) -> str:
    """The medians per tree, and each tree's median per-round rate ratio to the first tree."""
    first = rounds[trees[0]]
    lines = [
        "| tree | requests/s | frontend CPU per completion (us) | worker CPU (us)"
        " | one connection: completion p50 / GET /live p50 (ms) | rate / first tree's |",
        "|---|---|---|---|---|---|",
    ]
    for tree in trees:
        mine = rounds[tree]
        ratios = [m.rate / f.rate for m, f in zip(mine, first, strict=True)]
        one = [m.one_p50_ms for m in mine if m.one_p50_ms is not None]
        live = [m.live_p50_ms for m in mine if m.live_p50_ms is not None]
        latency = (
            f"{statistics.median(one):.2f} / {statistics.median(live):.2f}"
            if one and live
            else "n/a"
        )
        lines.append(
            f"| {tree} | {statistics.median(m.rate for m in mine):,.0f}"
            f" | {statistics.median(m.frontend_us for m in mine):.0f}"
            f" | {statistics.median(m.worker_us for m in mine):.0f}"
            f" | {latency} | {statistics.median(ratios):.2f}"
            f" ({', '.join(f'{r:.2f}' for r in ratios)}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="source trees (the first is the reference)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--engine", choices=("mocker", "instant"), default="mocker")
    parser.add_argument("--speedup-ratio", default="100", help="the mocker's")
    parser.add_argument("--one", action="store_true", help="also the one-connection p50s")
    options = parser.parse_args()
    if not shutil.which("wrk"):
        sys.exit("wrk is needed (apt-get install -y wrk)")
    trees = [os.path.abspath(tree) for tree in options.trees]
    engine = (
        ["--engine", "instant"]
        if options.engine == "instant"
        else ["--speedup-ratio", options.speedup_ratio]
    )
    path = "/v1/chat/completions"
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        lua = os.path.join(scratch, "chat.lua")
        with open(lua, "w") as script:
            script.write(
                'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                f"wrk.body = {json.dumps(CHAT)}\n"
            )
        systems: list[tuple[str, int, int, str]] = []
        for tree in trees:
            python = sys.executable
            worker = [python, "-m", "worker_ingress", "--port", "0", "--system-port", "0"]
            worker += ["--log-level", "warning", *engine]
            worker_pid, (worker_url, _) = stack.enter_context(_process(worker, tree))
            frontend = [python, "-m", "frontend_shim", "--http-port", "0"]
            frontend += ["--log-level", "warning", "--worker", worker_url]
            frontend_pid, (url,) = stack.enter_context(_process(frontend, tree))
            _wait_connected(url)
            _wrk(url + path, lua, 16, 1)  # warm-up
            systems.append((tree, worker_pid, frontend_pid, url))
        rounds: dict[str, list[Round]] = {tree: [] for tree in trees}
        for number in range(options.rounds):
            for tree, worker_pid, frontend_pid, url in systems[:: 1 if number % 2 == 0 else -1]:
                worker_cpu, frontend_cpu = _cpu_seconds(worker_pid), _cpu_seconds(frontend_pid)
                rate, total, _ = _wrk(url + path, lua, options.connections, options.seconds)
                worker_us = (_cpu_seconds(worker_pid) - worker_cpu) / total * 1e6
                frontend_us = (_cpu_seconds(frontend_pid) - frontend_cpu) / total * 1e6
                one = live = None
                if options.one:
                    one = _wrk(url + path, lua, 1, options.seconds)[2]
                    live = _wrk(url + "/live", None, 1, options.seconds)[2]
                rounds[tree].append(Round(rate, frontend_us, worker_us, one, live))
                print(f"round {number + 1}: {tree}: {rate:,.0f}/s", file=sys.stderr)
    print(
        f"wrk: {options.connections} connections, {options.seconds} s per figure,"
        f" {options.engine} engine, medians of {options.rounds} rounds"
    )
    print()
    print(report(trees, rounds))


if __name__ == "__main__":
    main()
