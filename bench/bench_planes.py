"""Request-plane throughput of a worker against a bare trio-websocket echo of the same frames.

Run: ``python bench/bench_planes.py [--seconds 2] [--rounds 3]``. Prints requests/s (medians over
rounds, scenarios interleaved within each round so drift hits them alike) and the ratios.

Scenarios, each served by a child process (pinned to CPU 0 when there are two; the load generator
pins itself to CPU 1):

- ``serve``: a worker with the zero-work engine (``max_tokens=1``: Started, Chunk, End per
  request), on 1 connection and on 8 connections.
- ``reject``: a worker whose engine never finishes, N=1 and Q=2 filled first, so every further
  request is rejected at once (one ``Rejected`` frame per request).
- ``echo3`` / ``echo1``: plain ``serve_websocket`` answering each message with byte-identical
  copies of those three (or one) frames, without decoding: the floor of the websocket stack.

The client keeps a window of requests in flight per connection (pipelining, as a frontend does).
These are figures, not a test: this machine is small and noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Final

import trio
from trio_websocket import (
    WebSocketConnection,
    WebSocketRequest,
    open_websocket_url,
    serve_websocket,
)

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.children import Child
from bench.kit.processes import pin
from shim_common import wire
from worker_ingress._config import WorkerSettings
from worker_ingress.engines._base import EngineOutput, PreparedRequest
from worker_ingress.engines._instant import InstantEngine, create

WINDOW: Final = 64
REQUEST_BODY: Final = {"prompt": "bench the planes", "max_tokens": 1}
HELD_REQUESTS: Final = 3  # N + Q of the reject scenario
SCENARIOS: Final = ("serve", "reject", "echo3", "echo1")


def _ready(url: str) -> None:
    print(f"bench-planes ready ws={url}", flush=True)


# ----------------------------------------------------------------------------- servers


class NeverEndingEngine(InstantEngine):
    """Holds every request forever (to fill the gate)."""

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        await trio.sleep_forever()
        yield EngineOutput()  # pragma: no cover


def _sample_frames() -> tuple[bytes, ...]:
    """The frames a worker sends for one served request, byte for byte."""
    return (
        wire.encode(wire.Started(request_id=123456, prompt_tokens=3)),
        wire.encode(wire.Chunk(request_id=123456, text=" tok", tokens=1, finish_reason="length")),
        wire.encode(wire.End(request_id=123456, prompt_tokens=3, completion_tokens=1)),
    )


def _sample_rejection() -> bytes:
    return wire.encode(wire.Rejected.of(123456, wire.RejectReason.OVERLOADED))


async def _serve_echo(replies: tuple[bytes, ...]) -> None:
    hello = wire.encode(wire.Hello(protocol_version=wire.PROTOCOL_VERSION, config=_config()))

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        try:
            await ws.send_message(hello)
            while True:
                await ws.get_message()
                for reply in replies:
                    await ws.send_message(reply)
        except Exception:  # the client leaving ends the connection
            return

    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
        _ready(f"ws://127.0.0.1:{server.port}")


def _config() -> wire.RuntimeConfig:
    return wire.RuntimeConfig(
        worker_id="bench",
        model="mock-model",
        kv_total_blocks=1,
        block_size=16,
        max_num_batched_tokens=1,
        max_num_seqs=1,
        data_parallel_size=1,
        engine_request_limit=None,
        request_queue_limit=1,
        heartbeat_interval=1.0,
    )


async def _serve_worker(scenario: str) -> None:
    from worker_ingress._server import Worker

    settings = WorkerSettings(worker_id="bench", port=0, system_port=0)
    if scenario == "reject":
        settings = dataclasses.replace(settings, engine_request_limit=1, request_queue_limit=2)
        engine: InstantEngine = NeverEndingEngine(create(settings).config)
    else:
        engine = create(settings)
    worker = Worker(settings, engine)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(worker.serve)
        _ready(address.ws_url)


def _serve(scenario: str) -> None:
    if scenario == "echo3":
        trio.run(_serve_echo, _sample_frames())
    elif scenario == "echo1":
        trio.run(_serve_echo, (_sample_rejection(),))
    else:
        trio.run(_serve_worker, scenario)


# ----------------------------------------------------------------------------- client


def _generate(request_id: int) -> bytes:
    return wire.encode(
        wire.Generate(request_id=request_id, endpoint="completions", body=REQUEST_BODY)
    )


async def _drive(ws: WebSocketConnection, frames_per_request: int, stop_at: float) -> int:
    """Keep WINDOW requests in flight until ``stop_at``; return the requests answered."""
    window = trio.Semaphore(WINDOW)
    answered = 0
    first_id = 1_000_000  # above the held requests' ids

    async def send_requests() -> None:
        for request_id in range(first_id, first_id + 10**9):
            await window.acquire()
            await ws.send_message(_generate(request_id))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_requests)
        frames = 0
        while trio.current_time() < stop_at:
            await ws.get_message()
            frames += 1
            if frames % frames_per_request == 0:
                answered += 1
                window.release()
        nursery.cancel_scope.cancel()
    return answered


async def _measure(url: str, connections: int, frames_per_request: int, seconds: float) -> float:
    answered: list[int] = []

    async def one(stop_at: float) -> None:
        async with open_websocket_url(url, message_queue_size=WINDOW * 4) as ws:
            await ws.get_message()  # hello
            answered.append(await _drive(ws, frames_per_request, stop_at))

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(connections):
            nursery.start_soon(one, start + seconds)
    return sum(answered) / (trio.current_time() - start)


async def _hold_gate_full(url: str, *, task_status: trio.TaskStatus[None]) -> None:
    """Occupy the N + Q places of the reject scenario with requests that never end."""
    async with open_websocket_url(url) as ws:
        await ws.get_message()  # hello
        for request_id in range(HELD_REQUESTS):
            await ws.send_message(_generate(request_id))
        await ws.get_message()  # Started of the first request
        await trio.sleep(0.2)  # the two others are queued by now
        task_status.started()
        await trio.sleep_forever()


async def _run(seconds: float, rounds: int) -> None:
    pin(1)
    results: dict[str, list[float]] = {}
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        for name in SCENARIOS:
            command = [sys.executable, __file__, "--serve", name]
            server = await stack.enter_async_context(Child(command, name=name, cpu=0))
            urls[name] = server.addresses["ws"] + wire.REQUESTS_PATH
        plan = [
            ("echo, 1 connection", "echo3", 1, 3),
            ("worker, 1 connection", "serve", 1, 3),
            ("echo, 8 connections", "echo3", 8, 3),
            ("worker, 8 connections", "serve", 8, 3),
            ("echo, 1 frame, 1 connection", "echo1", 1, 1),
            ("worker rejecting, 1 connection", "reject", 1, 1),
            ("echo, 1 frame, 8 connections", "echo1", 8, 1),
            ("worker rejecting, 8 connections", "reject", 8, 1),
        ]
        async with trio.open_nursery() as nursery:
            await nursery.start(_hold_gate_full, urls["reject"])
            for _ in range(rounds):
                for label, name, connections, frames in plan:
                    rate = await _measure(urls[name], connections, frames, seconds)
                    results.setdefault(label, []).append(rate)
            nursery.cancel_scope.cancel()
    medians = {label: statistics.median(rates) for label, rates in results.items()}
    print(f"requests/s, median of {rounds} rounds of {seconds:.1f} s, window {WINDOW}/connection")
    for label, rate in medians.items():
        print(f"  {label:34s} {rate:10,.0f}")
    print("ratios (target: serving >= 0.5 of echo, rejecting >= 0.8 of echo)")
    for worker_label, echo_label in [
        ("worker, 1 connection", "echo, 1 connection"),
        ("worker, 8 connections", "echo, 8 connections"),
        ("worker rejecting, 1 connection", "echo, 1 frame, 1 connection"),
        ("worker rejecting, 8 connections", "echo, 1 frame, 8 connections"),
    ]:
        print(f"  {worker_label:34s} {medians[worker_label] / medians[echo_label]:6.2f}")


def main() -> None:
    """Parse the arguments and run the benchmark (or one of its servers)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", choices=SCENARIOS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve)
    else:
        trio.run(_run, args.seconds, args.rounds)


if __name__ == "__main__":
    main()
