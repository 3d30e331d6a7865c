"""Frontend benchmark: shedding rate, completion rate and the latency the frontend adds.

Run: ``python bench/bench_frontend.py [--seconds 5] [--connections 64]`` (needs ``wrk``).

Processes (servers pinned to core 0, wrk to core 1 with ``taskset`` when there are 2+ cores):

- a mocker worker holding one long request, behind frontend B whose decode threshold is 0.0:
  the fleet is busy, so every completion B gets is answered 529 before its body is read;
- an instant-engine worker (zero work per token) behind frontend A with no thresholds.

Figures, all measured in this one run, side by side:

1. 529 answers/s from B, answered from the request head (the small body is dropped unparsed and
   the connection kept), against B's own ``GET /live`` rate on keep-alive connections.
2. completions/s through A and the instant worker, against ``GET /live`` on the worker's own
   system port (the same HTTP server, no routing and no request plane): an upper bound.
3. Latency on one connection: median and p99 of a completion through A, against ``GET /live``
   on A; the difference is what routing and the request plane add.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

SERVER_CPU = "0"
LOAD_CPU = "1"
POST_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"mock-model","prompt":"one two","max_tokens":1}'
"""


def _pinned(cpu: str, args: list[str]) -> list[str]:
    if (os.cpu_count() or 1) >= 2 and shutil.which("taskset"):
        return ["taskset", "-c", cpu, *args]
    return args


@contextlib.contextmanager
def _server(
    args: list[str], env: dict[str, str], cwd: str | None = None
) -> Iterator[tuple[int, list[str]]]:
    """Start a server pinned to ``SERVER_CPU``, yield its pid and the URLs of its ready line,
    stop it.

    Each server runs in a session of its own, as the Dynamo processes of
    ``bench/bench_dynamo.py`` do: with the kernel's autogroup scheduling (Linux's default), CPU
    time is shared between sessions first, so servers left in this script's session would
    share one session's share of a core that other programs also use, and lose to servers that
    each have their own.
    """
    process = subprocess.Popen(
        _pinned(SERVER_CPU, args),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=cwd,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if " ready " not in line:
            raise RuntimeError(f"no ready line from {args[:3]}: {line!r}")
        yield process.pid, re.findall(r"\w+=(\S+)", line)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _process(args: list[str], env: dict[str, str]) -> Iterator[list[str]]:
    """Start a server, yield the URLs of its ready line, stop it."""
    with _server(args, env) as (_, urls):
        yield urls


def _wait_connected(url: str) -> None:
    for _ in range(500):
        with urllib.request.urlopen(url + "/health", timeout=5) as reply:
            if json.load(reply)["workers_connected"] >= 1:
                return
        time.sleep(0.02)
    raise RuntimeError(f"{url} never connected to its worker")


@contextlib.contextmanager
def _made_busy(url: str, body: str) -> Iterator[None]:
    """Hold one long streamed completion (``body``) on the frontend at ``url``, whose threshold
    makes a worker busy as soon as it holds any KV block, until it answers 529; keep it so for
    the block."""
    holder = subprocess.Popen(
        ["curl", "-sN", "-o", os.devnull, "-H", "Content-Type: application/json",
         "-d", body, url + "/v1/completions"]
    )  # fmt: skip
    try:
        for _ in range(300):
            probe = subprocess.run(
                ["curl", "-s", "-o", os.devnull, "-w", "%{http_code}", "-d", "{}",
                 url + "/v1/completions"],
                capture_output=True, text=True, check=False,
            ).stdout  # fmt: skip
            if probe == "529":
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("the busy fleet never became busy")
        yield
    finally:
        holder.terminate()
        holder.wait()


def cpu_seconds(root: int) -> float:
    """User plus system CPU seconds of ``root`` and every live process below it."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime
    tree = {root}
    grew = True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        grew = bool(below)
        tree |= below
    return sum(ticks.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


class Wrk:
    """Runs wrk on the load core and parses its summary."""

    def __init__(self, seconds: float, connections: int, lua: str) -> None:
        self.seconds = seconds
        self.connections = connections
        self.lua = lua

    def run(
        self, url: str, *, post: bool = False, connections: int | None = None
    ) -> dict[str, float]:
        args = [
            "wrk",
            "-t1",
            f"-c{connections or self.connections}",
            f"-d{max(1, round(self.seconds))}s",
        ]
        args += ["--latency"]
        if post:
            args += ["-s", self.lua]
        output = subprocess.run(
            _pinned(LOAD_CPU, [*args, url]), capture_output=True, text=True, check=True
        ).stdout
        figures: dict[str, float] = {
            "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", output)[1]),  # type: ignore[index]
        }
        non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
        total = re.search(r"(\d+) requests in", output)
        figures["requests"] = float(total[1]) if total else 0.0
        figures["non_2xx"] = float(non_2xx[1]) if non_2xx else 0.0
        for label, key in (("50%", "p50_ms"), ("99%", "p99_ms")):
            match = re.search(rf"{re.escape(label)}\s+([\d.]+)(us|ms|s)\b", output)
            if match:
                scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[match[2]]
                figures[key] = float(match[1]) * scale
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=64)
    options = parser.parse_args()
    if not shutil.which("wrk"):
        sys.exit("wrk is needed (apt-get install -y wrk)")
    env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
    python = sys.executable
    worker = [python, "-m", "worker_ingress", "--port", "0", "--system-port", "0"]
    frontend = [python, "-m", "frontend_shim", "--http-port", "0", "--log-level", "warning"]
    with tempfile.TemporaryDirectory() as scratch:
        lua = os.path.join(scratch, "post.lua")
        with open(lua, "w") as script:
            script.write(POST_LUA)
        wrk = Wrk(options.seconds, options.connections, lua)
        with (
            _process([*worker, "--speedup-ratio", "0.02"], env) as (mock_ws, _),
            _process([*worker, "--engine", "instant"], env) as (
                instant_ws,
                instant_system,
            ),
            _process(
                [*frontend, "--worker", mock_ws, "--active-decode-blocks-threshold", "0.0"], env
            ) as (busy_url,),
            _process([*frontend, "--worker", instant_ws], env) as (free_url,),
        ):
            _wait_connected(busy_url)
            _wait_connected(free_url)
            # One long request makes the busy fleet busy (it holds KV blocks for minutes).
            long_body = '{"model":"mock-model","prompt":"a b c","max_tokens":2000,"stream":true}'
            with _made_busy(busy_url, long_body):
                live_busy = wrk.run(busy_url + "/live")
                shed = wrk.run(busy_url + "/v1/completions", post=True)
            through = wrk.run(free_url + "/v1/completions", post=True)
            direct = wrk.run(instant_system + "/live")
            one_completion = wrk.run(free_url + "/v1/completions", post=True, connections=1)
            one_live = wrk.run(free_url + "/live", connections=1)
    print(f"wrk: {options.connections} connections, {options.seconds:.0f} s per figure")
    print(f"busy fleet: GET /live (keep-alive)       {live_busy['rps']:10.0f} /s")
    print(
        f"busy fleet: 529 answers (keep-alive)     {shed['rps']:10.0f} /s"
        f"   ratio to /live {shed['rps'] / live_busy['rps']:.2f}"
        f"   ({shed['non_2xx']:.0f} of {shed['requests']:.0f} were non-2xx)"
    )
    print(f"completions through frontend + worker    {through['rps']:10.0f} /s")
    print(
        f"worker system port GET /live (direct)    {direct['rps']:10.0f} /s"
        f"   ratio {through['rps'] / direct['rps']:.2f}"
    )
    added_p50 = one_completion["p50_ms"] - one_live["p50_ms"]
    added_p99 = one_completion["p99_ms"] - one_live["p99_ms"]
    print(
        f"one connection: completion p50 {one_completion['p50_ms']:.2f} ms"
        f" p99 {one_completion['p99_ms']:.2f} ms; /live p50 {one_live['p50_ms']:.2f} ms"
        f" p99 {one_live['p99_ms']:.2f} ms; added p50 {added_p50:.2f} ms p99 {added_p99:.2f} ms"
    )


if __name__ == "__main__":
    main()
