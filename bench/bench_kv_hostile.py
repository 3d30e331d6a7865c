"""What a worker's KV events can cost a real frontend in ``--router-mode kv``.

Run: ``python bench/bench_kv_hostile.py [--attacks huge,tiny,asks,honest] [--seconds 10]
[--rounds 1] [--trees a=.,b=PATH]``.

For each tree (a checkout of this repository; the frontend and the worker import its code from
there) and each case, a frontend process follows two workers: a real mocker worker of the same
tree (model ``m``, the legitimate one) and one played here (model ``other``), whose hello lists
``kv-events`` (and ``kv-parts``) and which, once subscribed to, sends

- ``huge``: a hello claiming 262,144 blocks, then a 14 MB snapshot (1.5 million names) every 3 s;
- ``tiny``: the same claim, then a snapshot of 16 MiB of one-byte block names every 3 s;
- ``asks``: a snapshot, then an event out of sequence (a gap), again at once for every snapshot
  the frontend asks for: how often the frontend asks;
- ``honest``: a hello of 65,536 blocks and a snapshot of all of them every 3 s, as an honest
  worker's full cache goes: one message to a frontend that did not ask for parts, else parts of
  2,048 names, as fast as the protocol's byte rate allows.

After a second, for ``--seconds``: ``GET /live`` due every 10 ms over 8 keep-alive connections
(p50, p99, max, each counted from when it was due, so a stall counts every probe it delays),
one-token chat completions to the legitimate worker due every 20 ms (p99, counted the same way),
the frontend's CPU share and peak RSS (``VmHWM``), the snapshots the frontend asked the played
worker for, and the sessions it ended over the KV budget. Rounds alternate the trees; medians of
the rounds are printed. Other load on the machine moves every figure: compare the rows of one
run, and the last column, how late this process's own 10 ms timer fired (p99).

``--stall`` measures instead, in each tree's frontend code and on the thread's CPU clock (so other
load on the machine counts little), what an honest worker's full cache of 65,536 blocks costs
the frontend at once: decoding and applying it as one message, and, where the tree takes parts,
the longest part.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import os
import random
import statistics
import struct
import subprocess
import sys
import time
from typing import Any, Final

import httpx
import msgspec
import trio

from shim_common import wire

#: The protocol's pace of KV parts (bytes a second), when this tree has it.
PART_NAMES = getattr(wire, "KV_PART_NAMES", 2048)
PART_RATE = getattr(wire, "KV_BYTES_PER_SECOND", 256 * 1024)
SETTLE_SECONDS = 1.0
#: Keep-alive connections the ``/live`` probes share (a probe every 10 ms in all).
PROBERS = 8
EVERY = 3.0


def runtime(blocks: int) -> wire.RuntimeConfig:
    return wire.RuntimeConfig(
        worker_id="w-kv-played",
        model="other",
        kv_total_blocks=blocks,
        block_size=16,
        max_num_batched_tokens=8192,
        max_num_seqs=8,
        data_parallel_size=1,
        engine_request_limit=None,
        request_queue_limit=40000,
        heartbeat_interval=1.0,
    )


def hello(blocks: int) -> bytes:
    config = runtime(blocks)
    features = ["busy-edges", "publish-interval", "kv-events", "kv-parts"]
    return wire.encode(
        wire.Hello(protocol_version=wire.PROTOCOL_VERSION, config=config, features=features)
    )


def frame(payload: bytes) -> bytes:
    """An unmasked binary frame, as a server sends it."""
    size = len(payload)
    if size < 126:
        return bytes([0x82, size]) + payload
    if size < 1 << 16:
        return bytes([0x82, 126]) + struct.pack("!H", size) + payload
    return bytes([0x82, 127]) + struct.pack("!Q", size) + payload


def kv_message(events: list[dict[str, Any]]) -> bytes:
    return frame(msgspec.msgpack.encode({"type": "kv", "events": events}))


def snapshot(seq: int, names: Any, more: bool = False) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "kv-snapshot", "seq": seq, "ranks": [names]}
    if more:
        event["more"] = True
    return event


def heartbeat() -> bytes:
    beat = wire.Heartbeat(seq=1, ts=time.time(), loads=[], engine_requests=0, queued_requests=0)
    return frame(wire.encode(wire.EventBatch(events=[beat], sent=time.time())))


class LockedStream:
    """A stream two tasks write to (the heartbeats and the KV messages)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._lock = trio.Lock()

    async def send_all(self, data: bytes) -> None:
        async with self._lock:
            await self.stream.send_all(data)


class PlayedWorker:
    """Both planes' upgrade and hello; on the event plane, ``case`` once subscribed."""

    def __init__(self, case: str) -> None:
        self.case = case
        self.asks = 0
        rng = random.Random(1)
        self.blocks = 65536 if case == "honest" else 1 << 18
        if case == "huge":
            self.names: Any = [rng.getrandbits(63) for _ in range(14_000_000 // 9)]
        elif case == "tiny":
            count = (16 << 20) - 64  # a msgpack array of that many one-byte integers
            self.names = msgspec.Raw(b"\xdd" + struct.pack("!I", count) + b"\x01" * count)
        else:
            self.names = [rng.getrandbits(63) for _ in range(self.blocks)]
        self._whole = kv_message([snapshot(1, self.names)]) if case != "asks" else b""

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            await self._serve(stream)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the frontend closed the session

    async def _serve(self, stream: trio.SocketStream) -> None:
        path = await _accept_upgrade(stream)
        await stream.send_all(frame(hello(self.blocks)))
        if path != wire.EVENTS_PATH:
            while await stream.receive_some(65536):
                pass
            return
        send, receive = trio.open_memory_channel[wire.Subscribe](64)
        locked = LockedStream(stream)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_read_subscribes, stream, send)
            nursery.start_soon(_beat, locked)
            first = await receive.receive()
            while not first.kv_events:
                first = await receive.receive()
            parts = bool(getattr(first, "kv_parts", False))
            if self.case == "asks":
                await self._asks(locked, receive)
            while True:
                await self._snapshot(locked, parts)
                await trio.sleep(EVERY)

    async def _snapshot(self, stream: LockedStream, parts: bool) -> None:
        if self.case != "honest" or not parts:
            await stream.send_all(self._whole)
            return
        names = self.names
        for start in range(0, len(names), PART_NAMES):
            more = start + PART_NAMES < len(names)
            message = kv_message([snapshot(1, names[start : start + PART_NAMES], more)])
            await stream.send_all(message)
            await trio.sleep(len(message) / PART_RATE)

    async def _asks(
        self, stream: LockedStream, receive: trio.MemoryReceiveChannel[wire.Subscribe]
    ) -> None:
        seq = 1
        while True:
            gap = {"type": "kv-removed", "seq": seq + 2, "dp_rank": 0, "blocks": [1]}
            await stream.send_all(kv_message([snapshot(seq, [1, 2, 3]), gap]))
            seq += 3
            subscribe = await receive.receive()
            while not subscribe.kv_snapshot:
                subscribe = await receive.receive()
            self.asks += 1


async def _beat(stream: LockedStream) -> None:
    while True:
        await stream.send_all(heartbeat())
        await trio.sleep(0.5)


async def _read_subscribes(
    stream: trio.SocketStream, send: trio.MemorySendChannel[wire.Subscribe]
) -> None:
    buffer = bytearray()
    while data := await stream.receive_some(65536):
        buffer += data
        while len(buffer) >= 6:
            length, offset = buffer[1] & 0x7F, 2
            if length == 126:
                length, offset = struct.unpack("!H", buffer[2:4])[0], 4
            elif length == 127:
                length, offset = struct.unpack("!Q", buffer[2:10])[0], 10
            if len(buffer) < offset + 4 + length:
                break
            mask = buffer[offset : offset + 4]
            masked = buffer[offset + 4 : offset + 4 + length]
            body = bytes(b ^ mask[i % 4] for i, b in enumerate(masked))
            opcode = buffer[0] & 0x0F
            del buffer[: offset + 4 + length]
            if opcode == 2:
                with contextlib.suppress(msgspec.DecodeError):
                    await send.send(wire.decode_subscriber_message(body))


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


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _start(command: list[str], tree: str, ready: bytes) -> tuple[trio.Process, str]:
    process = await trio.lowlevel.open_process(
        command,
        cwd=tree,  # ``-m`` puts the working directory first on the path
        env={**os.environ, "PYTHONPATH": tree},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    printed = b""
    with trio.fail_after(60):
        while ready not in printed:
            printed += await process.stdout.receive_some(4096)
    return process, printed.split(ready)[1].split()[0].decode()


def _p(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] if ordered else 0.0


async def play(case: str) -> None:
    """Play the worker of ``case`` (in a process of its own, so that what it costs to send is not
    counted in the probes' latency): print its port, then how many snapshots it was asked for,
    every 0.1 s."""
    played = PlayedWorker(case)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, played.handle, listeners)
        print(f"played port={listeners[0].socket.getsockname()[1]}", flush=True)
        while True:
            print(f"asks={played.asks}", flush=True)
            await trio.sleep(0.1)


SELF: Final = os.path.abspath(__file__)


async def measure(tree: str, case: str, seconds: float) -> dict[str, float]:
    """One frontend of ``tree`` under ``case``: its figures, by name."""
    processes: list[trio.Process] = []
    async with trio.open_nursery() as nursery:
        try:
            player = await trio.lowlevel.open_process(
                [sys.executable, SELF, "--play", case],
                stdout=subprocess.PIPE,
            )
            processes.append(player)
            assert player.stdout is not None
            said = b""
            with trio.fail_after(120):
                while b"played port=" not in said:
                    said += await player.stdout.receive_some(4096)
            port = int(said.split(b"played port=")[1].split()[0])
            asked = [0]

            async def read_asks() -> None:
                assert player.stdout is not None
                partial = b""
                while data := await player.stdout.receive_some(4096):
                    *lines, partial = (partial + data).split(b"\n")
                    for line in lines:
                        if line.startswith(b"asks="):
                            asked[0] = int(line[5:])

            nursery.start_soon(read_asks)
            worker, ws_url = await _start(
                [sys.executable, "-m", "worker_ingress", "--port", "0", "--system-port", "0",
                 "--model", "m", "--speedup-ratio", "100"],
                tree,
                b"worker-ingress ready ws=",
            )
            processes.append(worker)
            frontend, url = await _start(
                [sys.executable, "-m", "frontend_shim", "--http-port", "0", "--router-mode",
                 "kv", "--worker", ws_url, "--worker", f"ws://127.0.0.1:{port}"],
                tree,
                b"ready http=",
            )
            processes.append(frontend)
            await trio.sleep(SETTLE_SECONDS)
            cpu, start, asks = _cpu_seconds(frontend.pid), time.monotonic(), asked[0]
            live: list[float] = []
            chats: list[float] = []
            own: list[float] = []  # how late this process itself wakes (it must not be the limit)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

            async def completions(client: httpx.AsyncClient, offset: float) -> None:
                # Two of these: a completion due every 40 ms, each counted from when it was due.
                due = trio.current_time() + offset
                while True:
                    await trio.sleep_until(due)
                    with contextlib.suppress(httpx.HTTPError):
                        await client.post("/v1/chat/completions", json=body)
                    chats.append(trio.current_time() - due)
                    due += 0.04

            async def watch_self() -> None:
                while True:
                    due = trio.current_time() + 0.01
                    await trio.sleep_until(due)
                    own.append(trio.current_time() - due)

            host, port_text = url.removeprefix("http://").split(":")

            async def prober(offset: float, began: float) -> None:
                # One keep-alive connection; a probe due every PROBERS x 10 ms. One that is due
                # while the last is unanswered goes when it is answered, and every probe counts
                # from when it was due, so a stall delays each probe that falls in it.
                stream = await trio.open_tcp_stream(host, int(port_text))
                request = b"GET /live HTTP/1.1\r\nHost: bench\r\n\r\n"
                due = began + offset
                async with stream:
                    while due - began < seconds:
                        await trio.sleep_until(due)
                        await stream.send_all(request)
                        answer = b""
                        while not answer.endswith(b"\r\n\r\n") and b"\r\n\r\n" not in answer:
                            answer += await stream.receive_some(4096)
                        head, _, body = answer.partition(b"\r\n\r\n")
                        length = int(head.lower().split(b"content-length:")[1].split()[0])
                        while len(body) < length:
                            body += await stream.receive_some(4096)
                        live.append(trio.current_time() - due)
                        due += PROBERS * 0.01

            async with (
                httpx.AsyncClient(base_url=url, timeout=30) as client,
                trio.open_nursery() as load,
            ):
                load.start_soon(completions, client, 0.0)
                load.start_soon(completions, client, 0.02)
                load.start_soon(watch_self)
                began = trio.current_time()
                async with trio.open_nursery() as probes:
                    for number in range(PROBERS):
                        probes.start_soon(prober, number * 0.01, began)
                load.cancel_scope.cancel()
            elapsed = time.monotonic() - start
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                metrics = (await client.get("/metrics")).text
            closes = [
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("dynamo_frontend_worker_kv_budget_closes_total")
            ]
            return {
                "closes": sum(closes),
                "cpu": (_cpu_seconds(frontend.pid) - cpu) / elapsed,
                "live_p50": _p(live, 0.5) * 1000,
                "live_p99": _p(live, 0.99) * 1000,
                "live_max": max(live) * 1000,
                "chat_p99": _p(chats, 0.99) * 1000,
                "rss": _peak_rss_mb(frontend.pid),
                "asks": (asked[0] - asks) / elapsed,
                "own_p99": _p(own, 0.99) * 1000,
            }
        finally:
            for process in processes:
                process.terminate()
                with trio.move_on_after(10):
                    await process.wait()
                process.kill()
            nursery.cancel_scope.cancel()


def stall() -> tuple[float, float, float]:
    """(ms to decode and apply 65,536 names in one message, median and longest ms of a part; 0
    without parts), in the frontend code this process imports."""
    from frontend_shim._kv_index import KvIndex

    rng = random.Random(1)
    names = [rng.getrandbits(63) for _ in range(65536)]
    config = runtime(65536)
    parts = "more" in wire.KvSnapshot.__struct_fields__
    costs: dict[str, list[float]] = {"whole": [], "part": []}
    for _ in range(5):
        for kind in ("whole", "part") if parts else ("whole",):
            index = KvIndex()
            index.add_worker(config, 0.0, events=True)
            size = len(names) if kind == "whole" else PART_NAMES
            for start in range(0, len(names), size):
                more = start + size < len(names)
                event = snapshot(1, names[start : start + size], more)
                data = msgspec.msgpack.encode({"type": "kv", "events": [event]})
                began = time.thread_time()
                batch = wire.decode_event_message(data)
                assert isinstance(batch, wire.KvBatch)
                index.apply(config.worker_id, batch.events, 0.0)
                costs[kind].append(time.thread_time() - began)
    part = costs["part"] or [0.0]
    whole = statistics.median(costs["whole"])
    return whole * 1000, statistics.median(part) * 1000, max(part) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--play", help=argparse.SUPPRESS)
    parser.add_argument("--stall", action="store_true", help="the sans-IO cost, see above")
    parser.add_argument("--stall-one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--attacks", default="huge,tiny,asks,honest", help="comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--trees", default="this=.", help="label=path,... (a checkout each)")
    args = parser.parse_args()
    if args.play:
        trio.run(play, args.play)
        return
    if args.stall_one:
        print(*stall())
        return
    trees = [item.split("=", 1) for item in args.trees.split(",")]
    if args.stall:
        print("| tree | 65,536 names in one message, ms | a part of 2,048, median / most, ms |")
        print("|---|---|---|")
        for label, path in trees:
            tree = os.path.abspath(path)
            whole, part, most = subprocess.run(
                [sys.executable, SELF, "--stall-one"],
                env={**os.environ, "PYTHONPATH": tree},
                cwd=tree,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            print(f"| {label} | {float(whole):.1f} | {float(part):.2f} / {float(most):.2f} |")
        return
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for case in args.attacks.split(","):
            for label, path in trees:
                row = trio.run(measure, os.path.abspath(path), case, args.seconds)
                results.setdefault((case, label), []).append(row)
    print(f"medians of {args.rounds} rounds, {args.seconds:g} s each")
    print(
        "| case | tree | frontend CPU | /live p50 / p99 / max ms | completions p99 ms "
        "| peak RSS MB | snapshots asked /s | KV budget closes | bench's own lag p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (case, label), rows in results.items():
        m = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        print(
            f"| {case} | {label} | {m['cpu']:.0%} | {m['live_p50']:.1f} / {m['live_p99']:.1f} / "
            f"{m['live_max']:.0f} | {m['chat_p99']:.1f} | {m['rss']:.0f} | {m['asks']:.1f} "
            f"| {m['closes']:g} | {m['own_p99']:.1f} |"
        )


if __name__ == "__main__":
    main()
