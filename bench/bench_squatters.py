"""Squatters on a worker's event plane from the frontends' own address: what their clients see.

Run: ``python bench/bench_squatters.py [--trees old=PATH,new=.] [--squatters 150]
[--frontends 3] [--seconds 30] [--after 10] [--clients 4] [--rounds 1]``.

For each tree (a checkout of this repository; its processes import their code from there), one
mocker worker and ``--frontends`` frontends linked to it, all on loopback and without a worker
token. ``--clients`` clients per frontend send completions back to back, each on a fresh
connection. After a quiet second, ``--squatters`` clients of the same address (loopback: the
frontends' own) connect to the worker's event plane, upgrade, never subscribe, stay a moment
(or until the worker puts them out) and come back, for ``--seconds``; then they stop and the
clients go on for ``--after`` seconds. A prober reads every frontend's ``/health`` every 50 ms
and counts the times a frontend lost its worker.

Printed per tree: the share of completions answered 200 during the attack and after it, the
503s, the times a frontend lost its worker (over all frontends), and the squatters' handshakes
answered 101. The machine's other load moves every figure: compare the rows of one run.
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

READY = re.compile(rb"\w+=(\S+)")
UPGRADE = (
    "GET /v1/events HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
    "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    "Sec-WebSocket-Version: 13\r\n\r\n"
)
BODY = json.dumps({"model": "mock-model", "prompt": "one two three four", "max_tokens": 4})
#: Seconds a squatter stays before it comes back, when the worker has not put it out first.
STAY_SECONDS = 0.2


async def _start(tree: str, args: list[str]) -> tuple[trio.Process, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    env["PYTHONPATH"] = tree  # and run from it: `python -m` puts the working directory first
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", *args, "--log-level", "error"],
        stdout=subprocess.PIPE, env=env, cwd=tree,
    )  # fmt: skip
    assert process.stdout is not None
    line = b""
    with trio.fail_after(30):
        while b"\n" not in line:
            line += await process.stdout.receive_some(4096)
    return process, [url.decode() for url in READY.findall(line)]


async def _http(url: str, method: str, path: str, body: str = "") -> tuple[int, bytes]:
    """One request on a fresh connection; ``(0, b"")`` when it failed."""
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


async def _squat(host: str, port: int, stop: trio.Event, counts: Counter[str]) -> None:
    upgrade = UPGRADE.format(host=host, port=port).encode()
    while not stop.is_set():
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            await trio.sleep(0.01)
            continue
        async with stream:
            try:
                await stream.send_all(upgrade)
                answer = await stream.receive_some(4096)
                counts["101" if answer.startswith(b"HTTP/1.1 101 ") else "refused"] += 1
                with trio.move_on_after(STAY_SECONDS):
                    while await stream.receive_some(65536):
                        pass
            except (trio.BrokenResourceError, OSError):
                pass


async def _client(url: str, phase: list[str], statuses: dict[str, Counter[int]]) -> None:
    while True:
        status, _ = await _http(url, "POST", "/v1/completions", BODY)
        statuses[phase[0]][status] += 1


async def _probe(url: str, losses: Counter[str], phase: list[str]) -> None:
    linked = True
    while True:
        status, body = await _http(url, "GET", "/health")
        now = status == 200 and json.loads(body).get("workers_connected") == 1
        if linked and not now:
            losses[phase[0]] += 1
        linked = now
        await trio.sleep(0.05)


async def _round(tree: str, args: argparse.Namespace) -> dict[str, Any]:
    worker, (ws, _system) = await _start(
        tree,
        ["worker_ingress", "--port", "0", "--system-port", "0", "--engine-request-limit", "32",
         "--speedup-ratio", "10"],
    )  # fmt: skip
    frontends: list[trio.Process] = []
    try:
        urls = []
        for _ in range(args.frontends):
            process, (url,) = await _start(
                tree, ["frontend_shim", "--http-port", "0", "--worker", ws]
            )
            frontends.append(process)
            urls.append(url)
        for url in urls:
            with trio.fail_after(30):
                while True:
                    status, body = await _http(url, "GET", "/health")
                    if status == 200 and json.loads(body).get("workers_connected") == 1:
                        break
                    await trio.sleep(0.05)
        host, port = ws.removeprefix("ws://").rsplit(":", 1)
        phase = ["before"]
        statuses: dict[str, Counter[int]] = {p: Counter() for p in ("before", "attack", "after")}
        losses: Counter[str] = Counter()
        squatters: Counter[str] = Counter()
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            for url in urls:
                nursery.start_soon(_probe, url, losses, phase)
                for _ in range(args.clients):
                    nursery.start_soon(_client, url, phase, statuses)
            await trio.sleep(1.0)
            phase[0] = "attack"
            async with trio.open_nursery() as flood:
                for _ in range(args.squatters):
                    flood.start_soon(_squat, host, int(port), stop, squatters)
                await trio.sleep(args.seconds)
                stop.set()
            phase[0] = "after"
            await trio.sleep(args.after)
            nursery.cancel_scope.cancel()
        return {"statuses": statuses, "losses": losses, "squatters": squatters}
    finally:
        for process in [*frontends, worker]:
            process.terminate()
        for process in [*frontends, worker]:
            with trio.move_on_after(10):
                await process.wait()
            if process.returncode is None:
                process.kill()


def _share(counts: Counter[int], status: int) -> float:
    total = sum(counts.values())
    return counts[status] / total if total else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="this=.", help="label=path,... (a checkout each)")
    parser.add_argument("--squatters", type=int, default=150)
    parser.add_argument("--frontends", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4, help="per frontend")
    parser.add_argument("--seconds", type=float, default=30.0, help="of the attack")
    parser.add_argument("--after", type=float, default=10.0, help="seconds measured after it")
    parser.add_argument("--rounds", type=int, default=1, help="medians over this many")
    args = parser.parse_args()
    trees = [item.split("=", 1) for item in args.trees.split(",")]
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in trees}
    for _ in range(args.rounds):
        for label, path in trees:  # the trees in turn, so both see the same machine
            results[label].append(trio.run(_round, os.path.abspath(path), args))
    print(
        "| tree | 200 during the attack | 503 during | 200 in the after | frontend losses "
        "of the worker | squatter handshakes answered 101 | completions |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, rounds in results.items():

        def median(f: Any, rounds: list[dict[str, Any]] = rounds) -> float:
            return float(statistics.median(f(r) for r in rounds))

        print(
            f"| {label} | {median(lambda r: _share(r['statuses']['attack'], 200)):.1%} "
            f"| {median(lambda r: _share(r['statuses']['attack'], 503)):.1%} "
            f"| {median(lambda r: _share(r['statuses']['after'], 200)):.1%} "
            f"| {median(lambda r: sum(r['losses'].values())):.0f} "
            f"| {median(lambda r: r['squatters']['101']):.0f} "
            f"| {median(lambda r: sum(sum(c.values()) for c in r['statuses'].values())):.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
