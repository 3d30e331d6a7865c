"""What event-plane subscribers that never read cost a worker: its CPU and its completion latency.

Run: ``python bench/bench_subscribers.py [--idle 128,1000] [--clients 8] [--seconds 10]
[--trees a=.,b=PATH]``.

For each tree (a checkout of this repository; the worker process imports its code from there),
a mocker worker process pinned to CPU 0 serves completions to this process (pinned to CPU 1),
which keeps ``--clients`` completions running back to back on one request plane and times each
from its ``generate`` to its ``end``. The phases of a tree run in one worker: no other
connection, then for each count in ``--idle`` that many connections that upgrade to the event
plane and never read a byte (a worker with a subscriber cap refuses those over it).

Printed per tree and phase: the worker's open file descriptors (the connections it holds), its
CPU share at rest with the idle connections open, its CPU time per completion under load, the
completions done, and their latency p50 and p95; the ratios are against the same tree's first
phase. Other load on the machine moves every figure: compare the rows of one run, never absolute
times.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio
from trio_websocket import WebSocketConnection, open_websocket_url

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.children import Child
from bench.kit.proc import cpu_seconds, descriptors
from bench.kit.processes import clean_env, pin
from bench.kit.shim import worker_command
from bench.kit.stats import percentile
from bench.kit.table import Table
from shim_common import wire

#: Seconds after the idle subscribers connected before measuring, and of the measure at rest.
SETTLE_SECONDS = 5.0
IDLE_SECONDS = 3.0
BODY: dict[str, Any] = {"prompt": "one two three four five six seven eight", "max_tokens": 32}


def _worker(tree: str) -> Child:
    """A mocker worker of ``tree`` on CPU 0, run from the tree (``python -m`` puts the working
    directory first on the path); it gets 40 s to stop (its idle connections close first)."""
    args = worker_command(
        "--engine-request-limit", "64", "--speedup-ratio", "4", "--log-level", "error"
    )
    return Child(args, clean_env(tree), name="the worker", cpu=0, cwd=tree, grace=40.0)


async def _idle_subscriber(host: str, port: int, opened: trio.MemorySendChannel[None]) -> None:
    """Upgrade to the event plane, then never read (the socket stays open until cancelled)."""
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError:
        await opened.send(None)
        return
    async with stream:
        request = (
            f"GET {wire.EVENTS_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        )
        with contextlib.suppress(trio.BrokenResourceError):  # refused and closed already
            await stream.send_all(request.encode())
        await opened.send(None)
        await trio.sleep_forever()


async def _receive(ws: WebSocketConnection) -> wire.WorkerMessage:
    data = await ws.get_message()
    assert isinstance(data, bytes)
    return wire.decode_worker_message(data)


async def _completions(ws_url: str, clients: int, seconds: float, latencies: list[float]) -> None:
    """Run completions for ``seconds``; append the latency of each to ``latencies``."""
    async with open_websocket_url(
        ws_url + wire.REQUESTS_PATH, max_message_size=wire.MAX_MESSAGE_BYTES
    ) as ws:
        assert isinstance(await _receive(ws), wire.Hello)
        started: dict[int, float] = {}
        done: dict[int, trio.Event] = {}
        deadline = trio.current_time() + seconds
        # Clients stop at the deadline; the last one sends a request without a prompt, whose
        # answer (a failure, at once) tells the reader that every answer is in. Nothing is
        # cancelled inside trio-websocket's context manager (it re-raises cancellations).
        stopped = 0

        async def read() -> None:
            while True:
                message = await _receive(ws)
                items = message.messages if isinstance(message, wire.Batch) else [message]
                for item in items:
                    if isinstance(item, wire.Hello):
                        continue
                    if item.request_id == 0:
                        return
                    if isinstance(item, wire.End | wire.Failed | wire.Rejected):
                        latencies.append(time.perf_counter() - started.pop(item.request_id))
                        done.pop(item.request_id).set()

        async def client(first_id: int) -> None:
            nonlocal stopped
            request_id = first_id
            while trio.current_time() < deadline:
                request_id += clients
                done[request_id] = event = trio.Event()
                started[request_id] = time.perf_counter()
                await ws.send_message(
                    wire.encode(wire.Generate(request_id=request_id, endpoint="completions",
                                              body=BODY))
                )  # fmt: skip
                await event.wait()
            stopped += 1
            if stopped == clients:
                last = wire.Generate(request_id=0, endpoint="completions", body={})
                await ws.send_message(wire.encode(last))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            for number in range(clients):
                nursery.start_soon(client, number)


async def _phase(
    ws_url: str, pid: int, idle: int, clients: int, seconds: float
) -> tuple[int, float, float, int, float, float]:
    host, port = ws_url.removeprefix("ws://").rsplit(":", 1)
    latencies: list[float] = []
    async with trio.open_nursery() as nursery:
        opened_tx, opened_rx = trio.open_memory_channel[None](idle or 1)
        for _ in range(idle):
            nursery.start_soon(_idle_subscriber, host, int(port), opened_tx)
        for _ in range(idle):
            await opened_rx.receive()
        await trio.sleep(SETTLE_SECONDS)  # the handshakes done, the publisher settled
        held = descriptors(pid)
        cpu = cpu_seconds(pid)
        await trio.sleep(IDLE_SECONDS)
        idle_share = (cpu_seconds(pid) - cpu) / IDLE_SECONDS
        cpu = cpu_seconds(pid)
        await _completions(ws_url, clients, seconds, latencies)
        per_completion = (cpu_seconds(pid) - cpu) / max(len(latencies), 1)
        nursery.cancel_scope.cancel()
    return (
        held,
        idle_share,
        per_completion,
        len(latencies),
        statistics.median(latencies),
        percentile(latencies, 0.95),
    )


async def _tree(tree: str, idle: list[int], clients: int, seconds: float) -> list[tuple[Any, ...]]:
    worker = _worker(tree)
    await worker.start()
    try:
        with trio.fail_after(30):
            ws_url = (await worker.ready())["ws"]
        rows = []
        for count in (0, *idle):
            rows.append((count, *await _phase(ws_url, worker.pid, count, clients, seconds)))
            await trio.sleep(1.0)
        return rows
    finally:
        await worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--idle", default="128,1000", help="idle subscriber counts, comma-separated"
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--trees", default="this=.", help="label=path,... (a checkout each)")
    args = parser.parse_args()
    pin(1)
    table = Table(
        "tree", "idle subscribers", "worker fds", "worker CPU at rest", "CPU ms per completion",
        "completions", "p50 ms", "p95 ms", "p50 x", "p95 x",
    )  # fmt: skip
    print(table.head)
    for label, path in (item.split("=", 1) for item in args.trees.split(",")):
        tree = os.path.abspath(path)
        idle = [int(count) for count in args.idle.split(",")]
        rows = trio.run(_tree, tree, idle, args.clients, args.seconds)
        base = rows[0]
        for count, fds, rest, per_completion, done, p50, p95 in rows:
            row = table.row(
                label, count, fds, f"{rest:.0%}", f"{per_completion * 1000:.1f}", done,
                f"{p50 * 1000:.0f}", f"{p95 * 1000:.0f}", f"{p50 / base[5]:.2f}",
                f"{p95 / base[6]:.2f}",
            )  # fmt: skip
            print(row, flush=True)


if __name__ == "__main__":
    main()
