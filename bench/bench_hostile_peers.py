"""What a peer that claims to be a worker and then misbehaves costs a real frontend.

Run: ``python bench/bench_hostile_peers.py [--attacks ping,huge,bad] [--seconds 5] [--rounds 3]
[--trees a=.,b=PATH]``.

For each tree (a checkout of this repository; the frontend process imports its code from there)
and each attack, a frontend process (``--worker`` pointing at this process) links to a worker
played here: a valid hello on both planes, then on the event plane

- ``ping``: pings, 64 to a write, as fast as the frontend takes them;
- ``huge``: one 14 MiB event batch (under the protocol's 16 MiB cap) every 0.5 s;
- ``bad``: one message that does not decode, then nothing.

After a second, for ``--seconds``: the frontend's CPU share (``/proc/<pid>/stat``), the latency
of ``GET /live`` (one every 10 ms on a keep-alive connection, p50 and p99) and the event-plane
sessions the frontend opened (its redials). Rounds alternate the trees; the medians of the rounds
are printed. Other load on the machine moves every figure: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import os
import statistics
import struct
import sys
import time
from pathlib import Path

import trio

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.children import Child
from bench.kit.http import Client
from bench.kit.proc import cpu_seconds
from bench.kit.processes import clean_env
from bench.kit.shim import frontend_command
from bench.kit.stats import percentile
from bench.kit.table import Table
from shim_common import wire

HELLO = wire.encode(
    wire.Hello(
        protocol_version=wire.PROTOCOL_VERSION,
        config=wire.RuntimeConfig(
            worker_id="w-hostile",
            model="m",
            kv_total_blocks=100,
            block_size=16,
            max_num_batched_tokens=1000,
            max_num_seqs=8,
            data_parallel_size=1,
            engine_request_limit=None,
            request_queue_limit=40000,
            heartbeat_interval=1.0,
        ),
    )
)
#: The ``huge`` attack's batch: 14 MiB.
HUGE_BYTES = 14 << 20
#: Seconds the frontend runs before the measure starts.
SETTLE_SECONDS = 1.0


def frame(payload: bytes) -> bytes:
    """An unmasked binary frame, as a server sends it."""
    size = len(payload)
    if size < 126:
        return bytes([0x82, size]) + payload
    if size < 1 << 16:
        return bytes([0x82, 126]) + struct.pack("!H", size) + payload
    return bytes([0x82, 127]) + struct.pack("!Q", size) + payload


def huge_batch() -> bytes:
    beat = wire.Heartbeat(seq=1, ts=time.time(), loads=[], engine_requests=0, queued_requests=0)
    count = HUGE_BYTES // len(wire.encode(beat))
    return frame(wire.encode(wire.EventBatch(events=[beat] * count, sent=time.time())))


class HostileWorker:
    """The worker played here: both planes' upgrade and hello, then ``attack`` on the events."""

    def __init__(self, attack: str) -> None:
        self.attack = attack
        #: Event-plane sessions the frontend opened.
        self.sessions = 0
        self._huge = huge_batch() if attack == "huge" else b""

    async def handle(self, stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            try:
                path = await _accept_upgrade(stream)
                await stream.send_all(frame(HELLO))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_drain, stream)
                    if path == wire.EVENTS_PATH:
                        self.sessions += 1
                        await self._attack(stream)
                    await trio.sleep_forever()
            except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    async def _attack(self, stream: trio.SocketStream) -> None:
        if self.attack == "ping":
            pings = (bytes([0x89, 4]) + b"ping") * 64
            while True:
                await stream.send_all(pings)
                await trio.lowlevel.checkpoint()
        elif self.attack == "huge":
            while True:
                await stream.send_all(self._huge)
                await trio.sleep(0.5)
        elif self.attack == "bad":
            await stream.send_all(frame(b"\xc1"))  # a byte msgpack never uses


async def _accept_upgrade(stream: trio.SocketStream) -> str:
    head = b""
    while b"\r\n\r\n" not in head:
        data = await stream.receive_some(4096)
        if not data:
            raise trio.BrokenResourceError("the frontend left during the upgrade")
        head += data
    lines = head.split(b"\r\n")
    key = next(
        line.split(b":", 1)[1].strip()
        for line in lines
        if line.lower().startswith(b"sec-websocket-key:")
    )
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    await stream.send_all(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
    )
    return lines[0].split()[1].decode()


async def _drain(stream: trio.SocketStream) -> None:
    while await stream.receive_some(65536):
        pass


async def measure(tree: str, attack: str, seconds: float) -> tuple[float, float, float, int]:
    """One frontend of ``tree`` under ``attack``: (CPU share, /live p50 s, p99 s, sessions)."""
    worker = HostileWorker(attack)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, worker.handle, listeners)
        command = frontend_command("--worker", f"ws://127.0.0.1:{port}")
        # From the tree: ``-m`` puts the working directory first on the path.
        async with Child(command, clean_env(tree), cwd=tree, ready_within=60) as frontend:
            pid = frontend.pid
            await trio.sleep(SETTLE_SECONDS)
            cpu, start, sessions = cpu_seconds(pid), time.monotonic(), worker.sessions
            latencies: list[float] = []
            client = Client(frontend.addresses["http"])
            try:
                while time.monotonic() - start < seconds:
                    sent = time.perf_counter()
                    await client.request("GET", "/live")
                    latencies.append(time.perf_counter() - sent)
                    await trio.sleep(0.01)
            finally:
                client.close()
            share = (cpu_seconds(pid) - cpu) / (time.monotonic() - start)
            result = percentile(latencies, 0.5), percentile(latencies, 0.99)
        nursery.cancel_scope.cancel()
    return share, *result, worker.sessions - sessions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", default="ping,huge,bad", help="comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trees", default="this=.", help="label=path,... (a checkout each)")
    args = parser.parse_args()
    trees = [item.split("=", 1) for item in args.trees.split(",")]
    attacks = args.attacks.split(",")
    results: dict[tuple[str, str], list[tuple[float, float, float, int]]] = {}
    for _ in range(args.rounds):
        for attack in attacks:
            for label, path in trees:
                row = trio.run(measure, os.path.abspath(path), attack, args.seconds)
                results.setdefault((attack, label), []).append(row)
    print(f"medians of {args.rounds} rounds, {args.seconds:g} s each")
    table = Table(
        "attack", "tree", "frontend CPU", "/live p50 ms", "/live p99 ms", "event-plane sessions"
    )
    for (attack, label), rows in results.items():
        columns = zip(*rows, strict=True)
        share, p50, p99, sessions = (statistics.median(column) for column in columns)
        table.add(
            attack, label, f"{share:.0%}", f"{p50 * 1000:.1f}", f"{p99 * 1000:.1f}", f"{sessions:g}"
        )
    print(table)


if __name__ == "__main__":
    main()
