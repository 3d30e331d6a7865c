"""The measured event budget of a frontend serving HTTP: where it settles, at rest and under load.

Run: ``python bench/bench_event_budget.py [--trees old=PATH,new=.] [--workers 8]
[--clients 8] [--seconds 30] [--rounds 1]``.

For each tree (a checkout of this repository; its processes import their code from there), one
frontend with ``--local-workers`` mocker workers (no ``--event-budget``: the budget follows the
cost the frontend measures). First ``--seconds`` at rest, then as long with ``--clients``
clients sending completions back to back (each on a fresh connection). At the end of each
phase the frontend's ``/metrics`` give the budget in force and the cost per event message it
measured; its CPU share over the phase, and the event reads a second, are measured here.

Printed per tree and phase: the budget, the measured cost (us per message), the frontend's CPU
share, the reads a second and the completions a second. The machine's other load moves every
figure: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections import Counter
from typing import Any

import trio

READY = re.compile(rb"http=(\S+)")
BODY = json.dumps({"model": "mock-model", "prompt": "one two three four", "max_tokens": 8})


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _http(url: str, method: str, path: str, body: str = "") -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}"
    )
    try:
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(head.encode())
            answer = b""
            while chunk := await stream.receive_some(65536):
                answer += chunk
    except OSError:
        return 0, b""
    status = re.match(rb"HTTP/1\.1 (\d{3}) ", answer)
    return (int(status[1]), answer.split(b"\r\n\r\n", 1)[-1]) if status else (0, b"")


def _metric(text: bytes, name: str) -> float:
    match = re.search(rb"^" + name.encode() + rb" (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else float("nan")


async def _phase(url: str, pid: int, clients: int, seconds: float) -> dict[str, float]:
    statuses: Counter[int] = Counter()
    _, before = await _http(url, "GET", "/metrics")
    cpu = _cpu_seconds(pid)
    async with trio.open_nursery() as nursery:

        async def client() -> None:
            while True:
                status, _ = await _http(url, "POST", "/v1/completions", BODY)
                statuses[status] += 1

        for _ in range(clients):
            nursery.start_soon(client)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    share = (_cpu_seconds(pid) - cpu) / seconds
    _, after = await _http(url, "GET", "/metrics")
    batches = "dynamo_frontend_event_batches_total"
    return {
        "budget": _metric(after, "dynamo_frontend_event_budget_messages_per_second"),
        "cost_us": _metric(after, "dynamo_frontend_event_message_cost_seconds") * 1e6,
        "cpu": share,
        "batches_per_s": (_metric(after, batches) - _metric(before, batches)) / seconds,
        "ok_per_s": statuses[200] / seconds,
    }


async def _round(tree: str, args: argparse.Namespace) -> list[dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    env["PYTHONPATH"] = tree  # and run from it: `python -m` puts the working directory first
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "frontend_shim", "--http-port", "0", "--log-level", "error",
         "--local-workers", str(args.workers), "--speedup-ratio", "10",
         "--engine-request-limit", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=tree,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(60):
            while b"\n" not in line:
                line += await process.stdout.receive_some(4096)
            match = READY.search(line)
            assert match is not None, line
            url = match[1].decode()
            while True:
                status, body = await _http(url, "GET", "/health")
                if status == 200 and json.loads(body)["workers_connected"] == args.workers:
                    break
                await trio.sleep(0.1)
        return [
            await _phase(url, process.pid, 0, args.seconds),
            await _phase(url, process.pid, args.clients, args.seconds),
        ]
    finally:
        process.terminate()
        with trio.move_on_after(20):
            await process.wait()
        if process.returncode is None:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="this=.", help="label=path,... (a checkout each)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0, help="of each phase")
    parser.add_argument("--rounds", type=int, default=1, help="medians over this many")
    args = parser.parse_args()
    trees = [item.split("=", 1) for item in args.trees.split(",")]
    results: dict[str, list[list[dict[str, float]]]] = {label: [] for label, _ in trees}
    for _ in range(args.rounds):
        for label, path in trees:  # the trees in turn, so both see the same machine
            results[label].append(trio.run(_round, os.path.abspath(path), args))
    print(
        "| tree | phase | budget (msg/s) | measured us/msg | frontend CPU | event batches/s "
        "| completions/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, rounds in results.items():
        for index, phase in enumerate(("at rest", f"{args.clients} clients")):

            def median(key: str, index: int = index, rounds: Any = rounds) -> float:
                return float(statistics.median(r[index][key] for r in rounds))

            print(
                f"| {label} | {phase} | {median('budget'):.0f} | {median('cost_us'):.0f} "
                f"| {median('cpu'):.0%} | {median('batches_per_s'):.0f} "
                f"| {median('ok_per_s'):.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
