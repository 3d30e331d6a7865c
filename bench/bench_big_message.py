"""How long one large request-plane message stalls a worker's other connections.

Run: ``python bench/bench_big_message.py [--trees old=PATH,new=.] [--size 7700000]
[--kinds words,string,ids] [--rounds 3]``.

For each tree (a checkout of this repository; the worker process imports its code from there)
and each kind of message, a mocker worker process serves a probe: one request-plane client that
sends one-token completions back to back and times each. After a second, a raw client sends one
``generate`` of about ``--size`` bytes (a frame with a zero mask, written in one go, so the
sender costs nothing to measure): ``words``, a prompt of one-letter words (the most tokens per
byte); ``string``, one word as long as the message; ``ids``, a prompt of token ids. The probe
goes on for two more seconds.

Printed per tree and kind: the probe's median round trip before the message, its longest round
trip after it (how long the other connections stalled), and how long the large message took to
be answered. Medians over the rounds. Other load on the machine moves every figure: compare
the rows of one run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

import trio
from trio_websocket import open_websocket_url

from shim_common import wire

READY = re.compile(rb"ws=(\S+) system=(\S+)")
PROBE = {"prompt": "a b", "max_tokens": 1}


def _body(kind: str, size: int) -> dict[str, Any]:
    if kind == "words":
        return {"prompt": "a " * (size // 2), "max_tokens": 1}
    if kind == "string":
        return {"prompt": "x" * size, "max_tokens": 1}
    return {"prompt": list(range(size // 5)), "max_tokens": 1}  # ids: about 5 bytes each


def _client_frame(payload: bytes) -> bytes:
    """One masked binary frame (a zero mask: the payload goes as it is)."""
    return bytes([0x82, 0x80 | 127]) + struct.pack("!Q", len(payload)) + b"\0\0\0\0" + payload


def _final(message: wire.WorkerMessage) -> bool:
    items = message.messages if isinstance(message, wire.Batch) else [message]
    return any(isinstance(item, wire.End | wire.Failed | wire.Rejected) for item in items)


async def _start_worker(tree: str) -> tuple[trio.Process, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    env["PYTHONPATH"] = tree  # and run from it: `python -m` puts the working directory first
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "worker_ingress", "--port", "0", "--system-port", "0",
         "--speedup-ratio", "100", "--log-level", "error"],
        stdout=subprocess.PIPE, env=env, cwd=tree,
    )  # fmt: skip
    assert process.stdout is not None
    line = b""
    with trio.fail_after(30):
        while b"\n" not in line:
            line += await process.stdout.receive_some(4096)
    match = READY.search(line)
    assert match is not None, line
    return process, match[1].decode()


async def _big(ws_url: str, frame: bytes) -> float:
    """Send the large message on a raw connection; seconds until its answer."""
    host, port = ws_url.removeprefix("ws://").rsplit(":", 1)
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(
            f"GET {wire.REQUESTS_PATH} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        received = await stream.receive_some(65536)  # the 101, and maybe the hello
        start = time.perf_counter()
        await stream.send_all(frame)
        while received.count(b"\x82") < 2:  # the hello's frame, then the answer's
            received += await stream.receive_some(65536)
        return time.perf_counter() - start


async def _round(tree: str, kind: str, size: int) -> tuple[float, float, float]:
    process, ws_url = await _start_worker(tree)
    frame = _client_frame(
        wire.encode(wire.Generate(request_id=1, endpoint="completions", body=_body(kind, size)))
    )
    try:
        before: list[float] = []
        after: list[float] = []
        phase = [before]
        async with open_websocket_url(
            ws_url + wire.REQUESTS_PATH, max_message_size=wire.MAX_MESSAGE_BYTES
        ) as ws:
            await ws.get_message()

            async def probe() -> None:
                request_id = 0
                while True:
                    request_id += 1
                    start = time.perf_counter()
                    generate = wire.Generate(request_id=request_id, endpoint="completions",
                                             body=PROBE)  # fmt: skip
                    await ws.send_message(wire.encode(generate))
                    while True:
                        data = await ws.get_message()
                        assert isinstance(data, bytes)
                        if _final(wire.decode_worker_message(data)):
                            break
                    phase[0].append(time.perf_counter() - start)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(probe)
                await trio.sleep(1.0)
                phase[0] = after
                answered = await _big(ws_url, frame)
                await trio.sleep(2.0)
                nursery.cancel_scope.cancel()
        return statistics.median(before), max(after), answered
    finally:
        process.terminate()
        with trio.move_on_after(10):
            await process.wait()
        if process.returncode is None:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="this=.", help="label=path,... (a checkout each)")
    parser.add_argument("--size", type=int, default=7_700_000, help="bytes of the message")
    parser.add_argument("--kinds", default="words,string,ids")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = [item.split("=", 1) for item in args.trees.split(",")]
    kinds = args.kinds.split(",")
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        for kind in kinds:
            for label, path in trees:  # the trees in turn, so both see the same machine
                row = trio.run(_round, os.path.abspath(path), kind, args.size)
                results.setdefault((label, kind), []).append(row)
    print("| tree | message | probe p50 before, ms | longest probe after, ms | answered in, ms |")
    print("|---|---|---|---|---|")
    for (label, kind), rows in results.items():
        columns = zip(*rows, strict=True)
        p50, stall, answered = (statistics.median(column) * 1000 for column in columns)
        print(f"| {label} | {kind} | {p50:.1f} | {stall:.0f} | {answered:.0f} |", flush=True)


if __name__ == "__main__":
    main()
