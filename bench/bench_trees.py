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
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.proc import cpu_seconds
from bench.kit.processes import clean_env
from bench.kit.shim import shim
from bench.kit.table import Table
from bench.kit.wrk import SERVER_CPU, Wrk, need_wrk

CHAT: Final = json.dumps(
    {"model": "mock-model", "messages": [{"role": "user", "content": "one two"}], "max_tokens": 1}
)
PATH: Final = "/v1/chat/completions"


@dataclass(frozen=True)
class Round:
    """One tree's figures in one round."""

    rate: float
    frontend_us: float
    worker_us: float
    one_p50_ms: float | None = None
    live_p50_ms: float | None = None


def _checked(figures: dict[str, float], url: str) -> dict[str, float]:
    if figures["non_2xx"]:
        raise RuntimeError(f"{url}: {figures['non_2xx']:.0f} non-2xx answers")
    return figures


def report(trees: Sequence[str], rounds: dict[str, list[Round]]) -> str:
    """The medians per tree, and each tree's median per-round rate ratio to the first tree."""
    first = rounds[trees[0]]
    table = Table(
        "tree",
        "requests/s",
        "frontend CPU per completion (us)",
        "worker CPU (us)",
        "one connection: completion p50 / GET /live p50 (ms)",
        "rate / first tree's",
    )
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
        table.add(
            tree,
            f"{statistics.median(m.rate for m in mine):,.0f}",
            f"{statistics.median(m.frontend_us for m in mine):.0f}",
            f"{statistics.median(m.worker_us for m in mine):.0f}",
            latency,
            f"{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})",
        )
    return str(table)


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
    need_wrk()
    trees = [os.path.abspath(tree) for tree in options.trees]
    engine = (
        ["--engine", "instant"]
        if options.engine == "instant"
        else ["--speedup-ratio", options.speedup_ratio]
    )
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        wrk = Wrk(options.seconds, options.connections, Path(scratch))
        systems: list[tuple[str, int, int, str]] = []
        quiet = ["--log-level", "warning"]
        for tree in trees:
            # Each tree's code, run from the tree: ``python -m`` puts the working directory
            # first on the import path, so from anywhere else it could import other code.
            ours = stack.enter_context(
                shim([*quiet, *engine], quiet, clean_env(tree), cpu=SERVER_CPU, cwd=tree)
            )
            wrk.run(ours.url + PATH, body=CHAT, connections=16, seconds=1)  # warm-up
            systems.append((tree, ours.worker.pid, ours.frontend.pid, ours.url))
        rounds: dict[str, list[Round]] = {tree: [] for tree in trees}
        for number in range(options.rounds):
            for tree, worker_pid, frontend_pid, url in systems[:: 1 if number % 2 == 0 else -1]:
                worker_cpu, frontend_cpu = cpu_seconds(worker_pid), cpu_seconds(frontend_pid)
                figures = _checked(wrk.run(url + PATH, body=CHAT), url)
                total = figures["requests"]
                worker_us = (cpu_seconds(worker_pid) - worker_cpu) / total * 1e6
                frontend_us = (cpu_seconds(frontend_pid) - frontend_cpu) / total * 1e6
                one = live = None
                if options.one:
                    one = _checked(wrk.run(url + PATH, body=CHAT, connections=1), url)["p50_ms"]
                    live = _checked(wrk.run(url + "/live", connections=1), url)["p50_ms"]
                rounds[tree].append(Round(figures["rps"], frontend_us, worker_us, one, live))
                print(f"round {number + 1}: {tree}: {figures['rps']:,.0f}/s", file=sys.stderr)
    print(
        f"wrk: {options.connections} connections, {options.seconds} s per figure,"
        f" {options.engine} engine, medians of {options.rounds} rounds"
    )
    print()
    print(report(trees, rounds))


if __name__ == "__main__":
    main()
