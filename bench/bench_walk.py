"""The walk of one streamed completion, measured: which modules it touches, and what a token costs.

One worker (the mocker) and one frontend run in this process, in one Trio loop, on loopback. A
chat completion with ``"stream": true``, ``x-dynamo-priority: 2`` and ``x-dynamo-tenant: acme``
is sent once to warm every path up, then with ``max_tokens`` 1 and with ``max_tokens`` 21, each
``--rounds`` times, under a profiler that counts the Python calls into each module of the three
product packages (all tasks: the request's, the planes' senders and readers, and the event plane
following the load the request moved). The report:

- the modules touched by a one-token completion, by package;
- per module, the calls one more token costs: the median over the rounds of
  ``(calls at 21 tokens - calls at 1 token) / 20``.

Calls, not time: a profiler's overhead would swamp the figures it measured. What a call costs is
in ``bench/bench_planes.py`` and ``bench/bench_http.py``.

Usage::

    python -m bench.bench_walk --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import types
import urllib.parse
from pathlib import Path
from typing import Any, Final

import trio

from frontend_shim._app import run_frontend
from frontend_shim._cli import parse_args as frontend_args
from worker_ingress._cli import parse_args as worker_args
from worker_ingress._config import WorkerSettings
from worker_ingress._server import run_worker
from worker_ingress.engines._loader import load_engine

PACKAGES: Final = ("frontend_shim", "worker_ingress", "shim_common")
MODEL: Final = "mock-model"
_ROOT: Final = str(Path(__file__).resolve().parent.parent) + "/"

_calls: collections.Counter[str] = collections.Counter()
_module_of: dict[str, str | None] = {}


def _module(path: str) -> str | None:
    """``package/module`` of a product file, or ``None`` for anything else."""
    known = _module_of.get(path, "")
    if known != "":
        return known
    name: str | None = None
    if path.startswith(_ROOT) and path.endswith(".py"):
        relative = path[len(_ROOT) : -3]
        if relative.split("/", 1)[0] in PACKAGES:
            name = relative
    _module_of[path] = name
    return name


def _profile(frame: types.FrameType, event: str, arg: object) -> None:
    if event == "call":
        name = _module(frame.f_code.co_filename)
        if name is not None:
            _calls[name] += 1


async def _completion(port: int, max_tokens: int) -> bytes:
    """One streamed chat completion with priority and tenant headers; the whole reply."""
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello there " * 8}],
        }
    ).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"x-dynamo-priority: 2\r\nx-dynamo-tenant: acme\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    )
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(head + body)
    pieces = []
    for _ in range(10_000):
        piece = await stream.receive_some(65536)
        if not piece:
            break
        pieces.append(piece)
    await stream.aclose()
    return b"".join(pieces)


async def _profiled(port: int, max_tokens: int) -> collections.Counter[str]:
    await trio.sleep(0.3)  # the publish of the previous request's end is over
    _calls.clear()
    sys.setprofile(_profile)
    try:
        reply = await _completion(port, max_tokens)
        await trio.sleep(0.2)  # the events this request moved are published and applied
    finally:
        sys.setprofile(None)
    if b" 200 " not in reply.split(b"\r\n", 1)[0]:
        raise SystemExit(f"the completion failed: {reply[:300]!r}")
    return collections.Counter(_calls)


async def _measure(rounds: int, speedup: float) -> dict[str, Any]:
    worker, _ = worker_args(
        [
            *("--engine", "mocker", "--model", MODEL, "--host", "127.0.0.1"),
            *("--port", "0", "--system-port", "0", "--engine-request-limit", "4"),
            *("--speedup-ratio", str(speedup)),
        ]
    )
    with trio.fail_after(30 + 10 * rounds):
        return await _measure_in(worker, rounds)


async def _measure_in(worker: WorkerSettings, rounds: int) -> dict[str, Any]:
    async with trio.open_nursery() as nursery:
        address = await nursery.start(run_worker, worker, load_engine(worker))
        frontend, _ = frontend_args(
            ["--worker", address.ws_url, "--http-host", "127.0.0.1", "--http-port", "0"]
        )
        url = await nursery.start(run_frontend, frontend)
        port = urllib.parse.urlsplit(url).port
        assert port is not None
        for _ in range(200):  # until the link is up and the worker free
            if b" 200 " in (await _completion(port, 2)).split(b"\r\n", 1)[0]:
                break
            await trio.sleep(0.05)
        else:
            raise SystemExit("the frontend never routed to its worker")
        ones: list[collections.Counter[str]] = []
        extras: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(rounds):
            one = await _profiled(port, 1)
            many = await _profiled(port, 21)
            ones.append(one)
            for name in set(one) | set(many):
                extras[name].append((many[name] - one[name]) / 20)
        nursery.cancel_scope.cancel()
    touched = set().union(*ones)
    return {
        "touched": {p: sorted(m for m in touched if m.startswith(p + "/")) for p in PACKAGES},
        "per_token": {
            m: statistics.median(v + [0.0] * (rounds - len(v))) for m, v in extras.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3, help="pairs of completions measured")
    parser.add_argument(
        "--speedup-ratio",
        type=float,
        default=10.0,
        help="the mocker's; at 1000 tokens come faster than they are sent, and are merged",
    )
    args = parser.parse_args()
    report = trio.run(_measure, max(1, args.rounds), args.speedup_ratio)
    touched = report["touched"]
    print(f"modules touched by a one-token completion: {sum(len(m) for m in touched.values())}")
    for package, names in touched.items():
        print(f"  {package} ({len(names)}): " + " ".join(n.split("/", 1)[1] for n in names))
    print("calls one more token costs, per module (median of the rounds):")
    for name, extra in sorted(report["per_token"].items()):
        if extra >= 0.05:
            print(f"  {name:45s} {extra:5.1f}")


if __name__ == "__main__":
    main()
