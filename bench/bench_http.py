"""Requests per second of our HTTP server, side by side with a bare h11 loop and hypercorn.

Each server runs in its own process (pinned to the first core when the machine has two or more),
answering ``GET /`` with a small JSON body over keep-alive connections. The load comes from ``wrk``
when it is on PATH (pinned to the second core), else from a Python client process holding many
keep-alive connections (pinned to the second core too). The bare loop is the floor of trio + h11
with none of the server's duties (no timeouts, no disconnect watcher, no error handling); the
ratio shows what those duties cost. The hypercorn row is hypercorn's Trio worker serving a raw
ASGI hello-world (no framework on top): the off-the-shelf server this project would otherwise
use. It is measured when hypercorn is importable (``pip install hypercorn``; it is not a
dependency of the project) and skipped otherwise.

Usage::

    python bench/bench_http.py                   # every server, 64 connections, 5 s each
    python bench/bench_http.py --duration 10 --connections 16 --client python
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import h11
import trio

from shim_common._httpserver import HTTPRequest, HTTPResponder, json_headers, serve_http

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

HELLO_BODY = b'{"message":"hello"}'
REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


# -- servers (run in a child process) ---------------------------------------------------------


async def hello(request: HTTPRequest, responder: HTTPResponder) -> None:
    await responder.send(200, json_headers(), HELLO_BODY)


async def serve_ours() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, hello, "127.0.0.1", 0)
        print(port, flush=True)


async def serve_bare() -> None:
    async def connection(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return  # wrk resets its connections at the end of a run
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                continue
            if isinstance(event, h11.EndOfMessage):
                headers = [(b"content-type", b"application/json"), (b"content-length", b"19")]
                out = conn.send(h11.Response(status_code=200, headers=headers, reason=b"OK"))
                out = (out or b"") + (conn.send(h11.Data(data=HELLO_BODY)) or b"")
                out += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(out)
                conn.start_next_cycle()
                continue
            return

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(connection, listeners)


async def asgi_hello(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    """The hello-world as a raw ASGI application: the least hypercorn can be asked to do."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", b"19")]
    await send(
        {"type": "http.response.start", "status": 200, "headers": headers, "trailers": False}
    )
    await send({"type": "http.response.body", "body": HELLO_BODY, "more_body": False})


async def serve_hypercorn() -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            lambda task_status: serve(asgi_hello, config, task_status=task_status)
        )
        print(binds[0].rsplit(":", 1)[1], flush=True)


def hypercorn_installed() -> bool:
    return importlib.util.find_spec("hypercorn") is not None


SERVERS = {"ours": serve_ours, "bare": serve_bare, "hypercorn": serve_hypercorn}


# -- the Python load generator (run in a child process) ---------------------------------------


async def python_load(port: int, connections: int, duration: float) -> int:
    """Keep-alive load, one request in flight per connection; returns responses received."""
    response_size = await _probe_response_size(port)
    done = 0
    deadline = trio.current_time() + duration

    async def one_connection() -> None:
        nonlocal done
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            while trio.current_time() < deadline:
                await stream.send_all(REQUEST)
                remaining = response_size
                while remaining > 0:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    remaining -= len(data)
                done += 1

    async with trio.open_nursery() as nursery:
        for _ in range(connections):
            nursery.start_soon(one_connection)
    return done


async def _probe_response_size(port: int) -> int:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(REQUEST)
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/", headers=[("Host", "127.0.0.1")]))
        conn.send(h11.EndOfMessage())
        raw = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                raw += data
                conn.receive_data(data)
            elif isinstance(event, h11.EndOfMessage):
                return len(raw)


# -- orchestration ----------------------------------------------------------------------------


def _pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {core})


def _start_server(kind: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, port


def _measure(port: int, client: str, connections: int, duration: float) -> float:
    if client == "wrk":
        cmd = [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(duration))}s",
            f"http://127.0.0.1:{port}/",
        ]
        if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
            cmd = ["taskset", "-c", "1", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        match = re.search(r"Requests/sec:\s+([\d.]+)", out)
        assert match, out
        return float(match.group(1))
    out = subprocess.run(
        [sys.executable, __file__, "--load", str(port), str(connections), str(duration)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per server")
    parser.add_argument("--client", choices=["auto", "wrk", "python"], default="auto")
    parser.add_argument("--serve", choices=sorted(SERVERS), help=argparse.SUPPRESS)
    parser.add_argument("--load", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve:
        _pin(0)
        with contextlib.suppress(KeyboardInterrupt):
            trio.run(SERVERS[args.serve])
        return
    if args.load:
        _pin(1)
        port, connections, duration = int(args.load[0]), int(args.load[1]), float(args.load[2])
        started = time.perf_counter()
        done = trio.run(python_load, port, connections, duration)
        print(done / (time.perf_counter() - started))
        return

    client = args.client
    if client == "auto":
        client = "wrk" if shutil.which("wrk") else "python"
    kinds = ["ours", "bare"]
    if hypercorn_installed():
        kinds.append("hypercorn")
    else:
        print("hypercorn is not installed (pip install hypercorn): its row is skipped")
    servers = {kind: _start_server(kind) for kind in kinds}
    results: dict[str, list[float]] = {kind: [] for kind in servers}
    try:
        for _, port in servers.values():
            _measure(port, client, args.connections, 1.0)  # warm-up
        for _ in range(args.rounds):
            for kind, (_, port) in servers.items():
                results[kind].append(_measure(port, client, args.connections, args.duration))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=10)

    print(f"client={client} connections={args.connections} duration={args.duration}s")
    medians = {kind: statistics.median(values) for kind, values in results.items()}
    for kind, values in results.items():
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{kind:>9}: median {medians[kind]:,.0f} req/s  (runs: {runs})")
    print(f"ratio ours/bare: {medians['ours'] / medians['bare']:.2f}")
    if "hypercorn" in medians:
        print(f"ratio ours/hypercorn: {medians['ours'] / medians['hypercorn']:.2f}")


if __name__ == "__main__":
    main()
