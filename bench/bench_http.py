"""The HTTP floor: our frontend's answers side by side with bare Trio servers on the same client.

Every server runs in its own process pinned to CPU 0; ``wrk`` (one thread, keep-alive
connections) runs pinned to CPU 1, so each figure is one core's worth of server
(``--processes N`` runs our frontends as N HTTP processes, their CPU summed over the
frontend's process tree: what several processes cost a request on one core). Rows, all
measured in this one run, the servers taking turns within each round, medians of ``--rounds``:

1. floor: a bare Trio keep-alive hello world parsing with httptools (llhttp, the parser our
   server uses), replies written by hand: no timeouts, no disconnect watcher, no limits;
2. floor: the same hello world on h11 (what our server was built on before llhttp);
3. ``frontend-shim`` ``GET /live``, on a frontend whose fleet is busy;
4. ``frontend-shim`` answering a completion 529 (the same busy frontend: a mocker slowed down
   50 times holds one long request, and the decode threshold is 0.0);
5. ``frontend-shim`` completion with ``max_tokens`` 1 through an instant-engine worker;
6. ``frontend-shim`` streamed completion of 64 tokens through the instant-engine worker.

For each row: requests/s, the core time per request (one core divided by the rate: the server's
CPU per request, the kernel's share of its system calls included, when it has the core to
itself), the CPU per request measured (user plus system time from ``/proc`` of the server's
processes over the run, divided by the requests answered: for the frontend's rows the frontend
and its worker, shown as their sum and the frontend's part; it stays near the true cost when
other programs take part of the core, which the core time does not), and the ratio to the
llhttp floor (the median of the rounds' ratios).
Then the ratios the HTTP layer is judged by: a 529 against ``/live``, ``/live`` against the
floor. The hypercorn row (hypercorn's Trio worker serving a raw ASGI hello world, the
off-the-shelf server this project would otherwise use) is measured when hypercorn is installed
(``pip install hypercorn``; not a dependency of the project).

Usage::

    python -m bench.bench_http                    # 64 connections, 5 s per figure, 3 rounds
    python -m bench.bench_http --seconds 3 --rounds 5 --connections 64
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Final

import h11
import httptools
import trio

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.http import kept_busy
from bench.kit.proc import tree_cpu_seconds
from bench.kit.processes import serve
from bench.kit.shim import shim
from bench.kit.table import Table
from bench.kit.wrk import SERVER_CPU, Wrk, need_wrk

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

HELLO_BODY: Final = b'{"message":"hello"}'
HELLO_RESPONSE: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 19\r\n\r\n" + HELLO_BODY
)
COMPLETION: Final = {"model": "mock-model", "prompt": "one two", "max_tokens": 1}
STREAMED: Final = {
    "model": "mock-model",
    "prompt": "one two",
    "max_tokens": 64,
    "stream": True,
}


def _ready(port: int) -> None:
    print(f"bench-http ready http=http://127.0.0.1:{port}", flush=True)


# -- the bare servers (each run in a child process) -------------------------------------------


async def serve_bare_llhttp() -> None:
    """Keep-alive hello world: httptools parses, the reply is one constant."""

    async def connection(stream: trio.SocketStream) -> None:
        class Ends:
            complete = 0

            def on_message_complete(self) -> None:
                self.complete += 1

        ends = Ends()
        parser = httptools.HttpRequestParser(ends)
        while True:
            try:
                data = await stream.receive_some(65536)
                if not data:
                    return
                parser.feed_data(data)
                if ends.complete:
                    await stream.send_all(HELLO_RESPONSE * ends.complete)
                    ends.complete = 0
            except (trio.BrokenResourceError, httptools.HttpParserError):
                return  # wrk resets its connections at the end of a run

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    _ready(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(connection, listeners)


async def serve_bare_h11() -> None:
    """Keep-alive hello world on h11."""

    async def connection(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return
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
    _ready(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(connection, listeners)


async def asgi_hello(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    """The hello world as a raw ASGI application: the least hypercorn can be asked to do."""
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
        _ready(int(binds[0].rsplit(":", 1)[1]))


BARE_SERVERS: Final = {
    "llhttp": serve_bare_llhttp,
    "h11": serve_bare_h11,
    "hypercorn": serve_hypercorn,
}


@contextlib.contextmanager
def bare_server(kind: str) -> Iterator[tuple[str, list[int]]]:
    """Start a bare server in a pinned child process; yield its URL and its pid."""
    with serve([sys.executable, __file__, "--serve", kind], cpu=SERVER_CPU) as server:
        yield server.addresses["http"], [server.pid]


# -- our frontend -------------------------------------------------------------------------


@contextlib.contextmanager
def frontends(
    processes: int = 1,
) -> Iterator[tuple[tuple[str, list[int]], tuple[str, list[int]]]]:
    """A busy frontend (every completion answered 529) and a fast one, each of ``processes``
    HTTP processes; yields each one's URL with the pids of the frontend and its worker (the
    frontend's pid stands for all its processes: CPU is read over its process tree)."""
    quiet = ["--log-level", "warning"]
    front = [*quiet, "--processes", str(processes)]
    long_body = json.dumps({**COMPLETION, "max_tokens": 100_000, "stream": True})
    with (
        shim(
            [*quiet, "--speedup-ratio", "0.02"],
            [*front, "--active-decode-blocks-threshold", "0.0"],
            cpu=SERVER_CPU,
        ) as busy,
        shim([*quiet, "--engine", "instant"], front, cpu=SERVER_CPU) as fast,
        # One long request makes the busy fleet busy (it holds KV blocks for the whole run).
        kept_busy(busy.url, "/v1/completions", long_body, "{}"),
    ):
        yield (
            (busy.url, [busy.frontend.pid, busy.worker.pid]),
            (fast.url, [fast.frontend.pid, fast.worker.pid]),
        )


# -- the run ------------------------------------------------------------------------------

#: The rows, in order: (label, key).
ROWS: Final = [
    ("floor: bare Trio + httptools hello world", "llhttp"),
    ("floor: bare Trio + h11 hello world", "h11"),
    ("hypercorn (Trio) raw ASGI hello world", "hypercorn"),
    ("frontend-shim GET /live", "live"),
    ("frontend-shim completion answered 529", "shed"),
    ("frontend-shim completion, 1 token", "one_token"),
    ("frontend-shim streamed completion, 64 tokens", "streamed"),
]


def report(
    rates: dict[str, list[float]], cpu: dict[str, list[tuple[float, float]]] | None = None
) -> str:
    """The medians as a Markdown table, then the ratios the HTTP layer is judged by.

    A ratio is the median of its per-round ratios: the rows of one round ran back to back, so
    a neighbour's load on the machine weighs on both sides of it alike. ``cpu`` holds, per row
    and round, the CPU microseconds per request measured for all the row's processes and for
    the first of them (the frontend).
    """
    medians = {key: statistics.median(values) for key, values in rates.items() if values}
    floor = medians.get("llhttp")
    table = Table(
        "server",
        "requests/s",
        "core time per request (us)",
        "CPU per request measured (us), all (frontend)",
        "ratio to the llhttp floor",
        "runs",
    )
    for label, key in ROWS:
        if key not in medians:
            continue
        rate = medians[key]
        ratio = f"{_ratio(rates, key, 'llhttp'):.2f}" if floor else "n/a"
        runs = ", ".join(f"{value:,.0f}" for value in rates[key])
        measured = "-"
        if cpu and cpu.get(key):
            total = statistics.median(every for every, _ in cpu[key])
            first = statistics.median(part for _, part in cpu[key])
            measured = f"{total:.1f}" if key in BARE_SERVERS else f"{total:.1f} ({first:.1f})"
        table.add(label, f"{rate:,.0f}", f"{1e6 / rate:.1f}", measured, ratio, runs)
    lines = [str(table)]
    if "live" in medians and "shed" in medians:
        extra = statistics.median(
            1e6 / shed - 1e6 / live for shed, live in zip(rates["shed"], rates["live"], strict=True)
        )
        lines.append("")
        shed_ratio = _ratio(rates, "shed", "live")
        lines.append(f"529s / GET /live: {shed_ratio:.2f} ({extra:+.1f} us per 529)")
    if "live" in medians and floor:
        lines.append(f"GET /live / llhttp floor: {_ratio(rates, 'live', 'llhttp'):.2f}")
    return "\n".join(lines)


def _ratio(rates: dict[str, list[float]], top: str, bottom: str) -> float:
    return statistics.median(a / b for a, b in zip(rates[top], rates[bottom], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per figure")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the servers taking turns")
    parser.add_argument(
        "--processes", type=int, default=1, help="the frontends' --processes (HTTP processes)"
    )
    parser.add_argument("--serve", choices=sorted(BARE_SERVERS), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.serve:
        with contextlib.suppress(KeyboardInterrupt):
            trio.run(BARE_SERVERS[options.serve])
        return
    need_wrk()
    bare = ["llhttp", "h11"]
    if importlib.util.find_spec("hypercorn") is not None:
        bare.append("hypercorn")
    else:
        print("hypercorn is not installed (pip install hypercorn): its row is skipped")
    rates: dict[str, list[float]] = {key: [] for _, key in ROWS}
    cpu: dict[str, list[tuple[float, float]]] = {key: [] for _, key in ROWS}
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        wrk = Wrk(options.seconds, options.connections, Path(scratch))
        completion, streamed = json.dumps(COMPLETION), json.dumps(STREAMED)
        servers = {kind: stack.enter_context(bare_server(kind)) for kind in bare}
        (busy, busy_pids), (fast, fast_pids) = stack.enter_context(frontends(options.processes))
        figures = {
            **{kind: (url + "/", None, pids) for kind, (url, pids) in servers.items()},
            "live": (busy + "/live", None, busy_pids),
            "shed": (busy + "/v1/completions", completion, busy_pids),
            "one_token": (fast + "/v1/completions", completion, fast_pids),
            "streamed": (fast + "/v1/completions", streamed, fast_pids),
        }
        for url, body, _ in figures.values():
            wrk.run(url, body=body, seconds=1.0)  # warm-up
        for _ in range(options.rounds):
            for key, (url, body, pids) in figures.items():
                before = [tree_cpu_seconds(pid) for pid in pids]
                result = wrk.run(url, body=body)
                used = [
                    tree_cpu_seconds(pid) - start for pid, start in zip(pids, before, strict=True)
                ]
                expected_non_2xx = key == "shed"
                if (result["non_2xx"] > 0) != expected_non_2xx:
                    raise RuntimeError(f"{key}: {result['non_2xx']:.0f} non-2xx answers")
                rates[key].append(result["rps"])
                if result["requests"]:
                    per_request = 1e6 / result["requests"]
                    cpu[key].append((sum(used) * per_request, used[0] * per_request))
    print(
        f"wrk: 1 thread on CPU 1, {options.connections} keep-alive connections, "
        f"{options.seconds:.0f} s per figure; servers on CPU {SERVER_CPU}; "
        f"medians of {options.rounds} rounds"
    )
    print(report(rates, cpu))


if __name__ == "__main__":
    main()
