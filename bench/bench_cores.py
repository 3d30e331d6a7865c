"""The frontend on many cores beside NVIDIA Dynamo's: one-token chats, 529s and streamed tokens.

Run from the repository's root on a machine of 16 cores or more: ``python -m bench.bench_cores
[--processes 1,4] [--server-cpus 0-7] [--load-cpus 8-15] [--wrk-threads 8] [--workers 4]
[--connections 256] [--stream-connections 64] [--seconds 8] [--warm 2] [--dynamo-python PY]
[--json out.jsonl]`` (needs ``wrk``). On a 2-core machine it runs too (``--server-cpus 0
--load-cpus 1 --wrk-threads 1``), to check that it does.

Every system is started pinned to ``--server-cpus`` and loaded by wrk pinned to
``--load-cpus`` (``--wrk-threads`` threads; with several frontends on several ports, a thread
per port): Dynamo 1.6.1's frontend with ``--workers`` of its mockers, and ``frontend-shim
--local-workers W --processes N`` for each N of ``--processes``. Three cases, each system in
turn:

1. one-token chats, all workers sped up 10,000 times (``--connections``);
2. streamed chats of ``--stream-tokens`` tokens, same workers (``--stream-connections``);
3. every answer a 529: one worker slowed down (0.1) and held busy by one streamed chat, behind a
   decode threshold of 0.0 (``--connections``).

For each, after ``--warm`` seconds of load, ``--seconds`` measured: the rate, wrk's p50 and p99,
the answers by status, and the CPU of the frontend's processes and of the workers' (``/proc``,
before and after): cores used, and CPU per request. One line of JSON per measurement with
``--json``, and a table at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from bench.kit.dynamo import (
    DEFAULT_PYTHON,
    MODEL,
    PLANES,
    dynamo_env,
    dynamo_version,
    skipped,
    write_model_folder,
)
from bench.kit.http import kept_busy, post, wait_status
from bench.kit.proc import CLOCK_TICKS
from bench.kit.processes import clean_env, end_session, free_port
from bench.kit.table import Table

CHAT_PATH: Final = "/v1/chat/completions"


def chat(max_tokens: int, stream: bool = False) -> str:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
    }
    if stream:
        body.update(stream=True, ignore_eos=True)
    return json.dumps(body, separators=(",", ":"))


#: wrk's script: the body posted, answers counted by status, the percentiles printed.
LUA: Final = """
local body = os.getenv("WRK_BODY")
wrk.method = "POST"; wrk.body = body; wrk.headers["Content-Type"] = "application/json"
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) c200 = 0; c529 = 0; cother = 0 end
function response(status, headers, body)
  if status == 200 then c200 = c200 + 1 elseif status == 529 then c529 = c529 + 1
  else cother = cother + 1 end
end
function done(summary, latency, requests)
  local a, b, c = 0, 0, 0
  for _, t in ipairs(threads) do
    a = a + t:get("c200"); b = b + t:get("c529"); c = c + t:get("cother")
  end
  local errors = summary.errors
  io.write(string.format("STATUS %d %d %d %d\\n", a, b, c,
    errors.connect + errors.read + errors.write + errors.timeout))
  io.write(string.format("PCTL %d %d\\n", latency:percentile(50), latency:percentile(99)))
end
"""


def cpus(spec: str) -> set[int]:
    """The CPUs of a ``taskset``-style list (``0-7``, ``0,2,4``)."""
    found: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


class Processes:
    """Servers started pinned to a CPU set, each in a session of its own, stopped together."""

    def __init__(self, server_cpus: str, scratch: Path) -> None:
        self.cpus = cpus(server_cpus)
        self.scratch = scratch
        self.roots: dict[str, list[int]] = {"frontend": [], "workers": []}
        self._children: list[subprocess.Popen[bytes]] = []

    def start(self, role: str, name: str, args: list[str], env: dict[str, str]) -> None:
        log = open(self.scratch / f"{name}-{len(self._children)}.log", "wb")  # noqa: SIM115
        child = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, self.cpus),
        )
        self._children.append(child)
        self.roots[role].append(child.pid)

    def stop(self) -> None:
        for child in self._children:
            end_session(child.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5)


def _ticks() -> dict[int, tuple[int, int, str]]:
    """Every process's parent, CPU ticks and command line."""
    found: dict[int, tuple[int, int, str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), command)
    return found


def role_seconds(roots: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of the frontend's processes and of the workers': every process below
    a root, a ``worker_ingress`` process counted as a worker whoever started it."""
    processes = _ticks()
    seconds = {"frontend": 0.0, "workers": 0.0}
    for role, pids in roots.items():
        tree = set(pids)
        grew = True
        while grew:
            below = {pid for pid, (parent, _, _) in processes.items() if parent in tree} - tree
            grew = bool(below)
            tree |= below
        for pid in tree:
            if pid in processes:
                _, ticks, command = processes[pid]
                kind = "workers" if "worker_ingress" in command else role
                seconds[kind] += ticks / CLOCK_TICKS
    return seconds


def run_wrk(
    url: str, body: str, connections: int, seconds: float, threads: int, load_cpus: str,
    script: Path,
) -> dict[str, float]:  # fmt: skip
    args = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
            "--latency", "-s", str(script), url]  # fmt: skip
    output = subprocess.run(
        ["taskset", "-c", load_cpus, *args],
        env=dict(os.environ, WRK_BODY=body),
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout
    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    status = re.search(r"STATUS (\d+) (\d+) (\d+) (\d+)", output)
    pctl = re.search(r"PCTL (\d+) (\d+)", output)
    if rate is None or status is None or pctl is None:
        raise RuntimeError(f"unexpected wrk output:\n{output}")
    return {
        "rps": float(rate[1]),
        "ok": float(status[1]),
        "529": float(status[2]),
        "other": float(status[3]) + float(status[4]),
        "p50_ms": int(pctl[1]) / 1000,
        "p99_ms": int(pctl[2]) / 1000,
    }


class Bench:
    """One run: every system, every case (see the module docstring)."""

    def __init__(self, options: argparse.Namespace, scratch: Path) -> None:
        self.o = options
        self.scratch = scratch
        self.script = scratch / "count.lua"
        self.script.write_text(LUA)
        self.model = scratch / "model"
        write_model_folder(self.model)
        self.rows: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def ours(self, processes: int, workers: int, speedup: str, extra: list[str]) -> Iterator[
        tuple[str, Processes]
    ]:  # fmt: skip
        port = free_port()
        running = Processes(self.o.server_cpus, self.scratch)
        args = [sys.executable, "-m", "frontend_shim", "--http-port", str(port),
                "--local-workers", str(workers), "--speedup-ratio", speedup,
                "--processes", str(processes), "--log-level", "warning", *extra]  # fmt: skip
        try:
            running.start("frontend", f"shim-{processes}", args, clean_env())
            url = f"http://127.0.0.1:{port}"
            wait_status(url, CHAT_PATH, chat(1), 200, timeout=90)
            yield url, running
        finally:
            running.stop()

    @contextlib.contextmanager
    def theirs(self, workers: int, speedup: str, extra: list[str]) -> Iterator[
        tuple[str, Processes]
    ]:  # fmt: skip
        port = free_port()
        running = Processes(self.o.server_cpus, self.scratch)
        kv = Path(tempfile.mkdtemp(dir=self.scratch))
        env = dynamo_env(kv, "warn")
        python = self.o.dynamo_python
        try:
            running.start("frontend", "dynamo-frontend", [python, "-m", "dynamo.frontend",
                          "--http-host", "127.0.0.1", "--http-port", str(port), *PLANES, *extra],
                          env)  # fmt: skip
            for _ in range(workers):
                running.start("workers", "dynamo-mocker", [python, "-m", "dynamo.mocker",
                              "--model-path", str(self.model), "--model-name", MODEL, *PLANES,
                              "--speedup-ratio", speedup], env)  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            wait_status(url, CHAT_PATH, chat(1), 200, timeout=180)
            time.sleep(2.0)  # every mocker registered
            yield url, running
        finally:
            running.stop()

    def measure(self, system: str, case: str, url: str, running: Processes, body: str,
                connections: int, tokens: int = 1) -> None:  # fmt: skip
        o = self.o
        run_wrk(url + CHAT_PATH, body, connections, o.warm, o.wrk_threads, o.load_cpus,
                self.script)  # fmt: skip
        before = role_seconds(running.roots)
        started = time.monotonic()
        figures = run_wrk(url + CHAT_PATH, body, connections, o.seconds, o.wrk_threads,
                          o.load_cpus, self.script)  # fmt: skip
        wall = time.monotonic() - started
        after = role_seconds(running.roots)
        answered = max(1.0, figures["ok"] + figures["529"] + figures["other"])
        row: dict[str, Any] = {"system": system, "case": case, "connections": connections,
                               **figures}  # fmt: skip
        for role in ("frontend", "workers"):
            used = after[role] - before[role]
            row[f"{role}_cores"] = round(used / wall, 3)
            row[f"{role}_us_per_request"] = round(used / answered * 1e6, 1)
        if tokens > 1:
            row["tokens_per_s"] = round(figures["rps"] * tokens)
        self.rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        if o.json is not None:
            with open(o.json, "a") as out:
                out.write(json.dumps(row) + "\n")

    def system(self, name: str, start: Any) -> None:
        o = self.o
        with start(o.workers, "10000", []) as (url, running):
            self.measure(name, "one-token chats", url, running, chat(1), o.connections)
            self.measure(name, f"streamed {o.stream_tokens} tokens", url, running,
                         chat(o.stream_tokens, stream=True), o.stream_connections,
                         o.stream_tokens)  # fmt: skip
        busy = start(1, "0.1", ["--active-decode-blocks-threshold", "0.0"])
        with busy as (url, running), kept_busy(url, CHAT_PATH, chat(3000, True), chat(1)):
            status = post(url, CHAT_PATH, chat(1))
            if status != 529:
                print(f"{name}: the busy deployment answered {status}", file=sys.stderr)
            self.measure(name, "529s", url, running, chat(1), o.connections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,4", help="comma-separated --processes values")
    parser.add_argument("--server-cpus", default="0-7")
    parser.add_argument("--load-cpus", default="8-15")
    parser.add_argument("--wrk-threads", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--stream-connections", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warm", type=float, default=2.0)
    parser.add_argument("--dynamo-python", default=str(DEFAULT_PYTHON))
    parser.add_argument("--no-dynamo", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    o = parser.parse_args()
    version = None if o.no_dynamo else dynamo_version(o.dynamo_python)
    if version is None and not o.no_dynamo:
        print(skipped(o.dynamo_python))
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(o, Path(tmp))
        if version is not None:
            bench.system(f"Dynamo {version}", bench.theirs)
        for count in (int(n) for n in o.processes.split(",")):
            bench.system(
                f"--processes {count}",
                lambda w, s, e, count=count: bench.ours(count, w, s, e),
            )
    print(f"servers on CPUs {o.server_cpus}, wrk on {o.load_cpus} ({o.wrk_threads} threads);"
          f" {o.warm:g} s warm-up, {o.seconds:g} s measured")  # fmt: skip
    print()
    out = Table("system", "case", "rate/s (tokens/s)", "p50 ms", "p99 ms", "unexpected answers",
                "frontend cores", "frontend us/request", "worker cores")  # fmt: skip
    for r in bench.rows:
        unexpected = r["ok"] + r["other"] if r["case"] == "529s" else r["529"] + r["other"]
        out.add(r["system"], r["case"], f"{r.get('tokens_per_s', r['rps']):,.0f}",
                f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{unexpected:.0f}",
                f"{r['frontend_cores']:.2f}", f"{r['frontend_us_per_request']:.0f}",
                f"{r['workers_cores']:.2f}")  # fmt: skip
    print(out)


if __name__ == "__main__":
    main()
