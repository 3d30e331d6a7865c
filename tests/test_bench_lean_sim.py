"""Tests of ``bench/lean_sim.py`` (its pieces in ``bench/fleet/``): its wire pieces against the
real ones, and the whole simulator against the real frontend and the frontend's own websocket
client.

The end-to-end tests start real processes on loopback with port 0 (the simulator, and the
frontend); every check is one a broken simulator would fail: a wrong hello leaves the workers
unconnected, a wrong request plane gets no 200, missing or late load events never turn the
fleet busy (529) or free again, and counters that do not move fail the ``stats`` check.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from bench.bench_fleet import COMPLETION, FRONTEND_CPU, SIM_CPU
from bench.fleet import lean_frames, lean_workers
from bench.fleet.model import KV_TOTAL_BLOCKS, PROTOCOLS, Protocol
from bench.fleet_sim import Fleet as WorkerFleet
from bench.kit.children import Child
from bench.kit.http import Client
from frontend_shim._connection import PlaneClosed, PlaneConnection, open_plane
from frontend_shim._websocket import OP_BINARY, OP_PING, FrameReader, encode_frame
from shim_common import wire

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
SIM = ROOT / "bench" / "lean_sim.py"
WORKERS = 3


# ----------------------------------------------------------------------------- pieces


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_hello_is_the_real_workers_byte_for_byte(protocol: Protocol) -> None:
    real = WorkerFleet(1, 4, 20.0, "sim", True, protocol).workers[0].hello
    assert wire.encode(lean_workers.hello_of("sim-0", 4, protocol)) == wire.encode(real)


def test_client_frames_masked_fragmented_and_split_are_read_whole() -> None:
    parser = lean_frames.FrameParser()
    first = encode_frame(OP_BINARY, b"a" * 300)
    # A fragmented message: a first frame without FIN, then a final continuation.
    fragment = bytearray(encode_frame(OP_BINARY, b"hello "))
    fragment[0] &= 0x7F
    continuation = bytearray(encode_frame(0x0, b"world"))
    ping = encode_frame(OP_PING, b"p")
    data = first + bytes(fragment) + bytes(continuation) + ping
    # Split in two reads in the middle of a frame.
    out = parser.receive(data[:7]) + parser.receive(data[7:])
    assert out == [(OP_BINARY, b"a" * 300), (OP_BINARY, b"hello world"), (OP_PING, b"p")]


def test_an_unmasked_client_frame_is_a_protocol_error() -> None:
    with pytest.raises(lean_frames.FrameError) as caught:
        lean_frames.FrameParser().receive(lean_frames.server_frame(OP_BINARY, b"x"))
    assert caught.value.code == wire.CLOSE_PROTOCOL_ERROR


def test_server_frames_read_as_the_frontend_reads_them() -> None:
    reader = FrameReader(wire.MAX_MESSAGE_BYTES)
    payloads = [b"", b"s" * 125, b"m" * 126, b"l" * 70_000]
    data = b"".join(lean_frames.server_frame(OP_BINARY, payload) for payload in payloads)
    assert reader.receive(data) == [(OP_BINARY, payload) for payload in payloads]


def test_busy_from_follows_the_shared_rule() -> None:
    # 501 of 1,000 blocks is the first count over 0.5 (strict >).
    assert lean_workers.busy_from(wire.BusyThresholds(active_decode_blocks=0.5)) == 501
    # No check set: never busy.
    assert lean_workers.busy_from(wire.BusyThresholds()) == KV_TOTAL_BLOCKS + 1


# ----------------------------------------------------------------------------- processes


@contextlib.asynccontextmanager
async def _started(args: list[str], cpu: int, name: str) -> AsyncIterator[Child]:
    child = Child(args, name=name, cpu=cpu, control=True)
    await child.start()
    try:
        yield child
    finally:
        await child.stop()


async def _command(child: Child, line: str) -> str:
    """Send one control command; its answer line."""
    await child.send(line)
    return await child.readline()


@contextlib.asynccontextmanager
async def _simulator(
    protocol: str, workers: int = WORKERS, extra: list[str] | None = None
) -> AsyncIterator[tuple[Child, list[int]]]:
    args = [sys.executable, str(SIM), "--workers", str(workers), "--protocol", protocol]
    args += extra or []
    async with _started(args, SIM_CPU, "simulator") as sim:
        line = await sim.readline()
        match = re.fullmatch(rf"fleet-sim ready workers={workers} ports=([\d,]+)", line)
        assert match is not None, line
        yield sim, [int(port) for port in match[1].split(",")]


async def _until_status(client: Client, want: int, bound: float) -> bytes:
    """Send the cheap completion back to back until it is answered ``want``; its body."""
    with trio.fail_after(bound):
        while True:
            reply = await client.request("POST", "/v1/completions", COMPLETION)
            if reply.status == want:
                return bytes(reply.body)
            await trio.sleep(0.01)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_real_frontend_follows_the_lean_fleet(protocol: str) -> None:
    with trio.fail_after(90):
        async with _simulator(protocol) as (sim, ports):
            args = [
                sys.executable, "-m", "frontend_shim", "--router-mode", "kv",
                "--active-decode-blocks-threshold", "0.5", "--http-port", "0",
            ]  # fmt: skip
            for port in ports:
                args += ["--worker", f"ws://127.0.0.1:{port}"]
            async with _started(args, FRONTEND_CPU, "frontend") as frontend:
                client = Client((await frontend.ready())["http"])
                try:
                    await _check_the_fleet(sim, client, protocol)
                finally:
                    await client.aclose()


async def _check_the_fleet(sim: Child, client: Client, protocol: str) -> None:
    with trio.fail_after(30):
        while True:
            health = await client.request("GET", "/health")
            if health.status == 200 and health.json()["workers_connected"] == WORKERS:
                break
            await trio.sleep(0.05)
    # A real answer of a simulated worker: one token, through the router and the request plane.
    answer = json.loads(await _until_status(client, 200, 10))
    assert answer["choices"][0]["text"] == " tok"
    assert answer["usage"]["completion_tokens"] == 1
    stats0 = json.loads((await _command(sim, "stats")).removeprefix("stats "))
    assert stats0["subscribers"] == WORKERS
    # Busy: every rank over the threshold, so no worker may take the request.
    assert (await _command(sim, "busy")).startswith("ok busy ")
    await _until_status(client, 529, 10)
    assert (await _command(sim, "free")).startswith("ok free ")
    await _until_status(client, 200, 10)
    await trio.sleep(1.2)  # at least one heartbeat of every worker
    stats1 = json.loads((await _command(sim, "stats")).removeprefix("stats "))
    for key in ("generated", "load_events", "heartbeats", "batches"):
        assert stats1[key] > stats0[key], key
    # The loads change 20 times a second on every rank, not only on a flip (a flip is
    # 4 changes per worker): at least a quarter of that, whatever the machine's load.
    nominal = (stats1["monotonic"] - stats0["monotonic"]) * 20 * 4 * WORKERS
    assert stats1["generated"] - stats0["generated"] > nominal / 4
    metrics = bytes((await client.request("GET", "/metrics")).body)
    negotiated = re.search(rb"^dynamo_frontend_workers_event_interval_negotiated (\S+)$",
                           metrics, re.MULTILINE)  # fmt: skip
    assert negotiated is not None
    # Only a worker of the new protocol lists the publish interval.
    assert float(negotiated[1]) == (WORKERS if protocol == "new" else 0)


# ----------------------------------------------------------------------------- planes directly


@contextlib.asynccontextmanager
async def _plane(
    port: int, path: str, subprotocols: tuple[str, ...] = ()
) -> AsyncIterator[PlaneConnection]:
    """The frontend's own websocket client on one plane of a simulated worker."""
    plane = await open_plane(
        host="127.0.0.1",
        port=port,
        path=path,
        subprotocols=subprotocols,
        max_message_bytes=wire.MAX_MESSAGE_BYTES,
    )
    try:
        yield plane
    finally:
        await plane.aclose(1)


def _replies(messages: list[bytes]) -> list[wire.WorkerMessage]:
    replies: list[wire.WorkerMessage] = []
    for data in messages:
        message = wire.decode_worker_message(data)
        replies.extend(message.messages if isinstance(message, wire.Batch) else [message])
    return replies


async def _read_until_closed(plane: PlaneConnection) -> None:
    for _ in range(10_000):
        await plane.messages()


async def test_a_long_request_is_cancelled_and_a_reused_id_closes_the_plane() -> None:
    with trio.fail_after(30):
        async with (
            _simulator("new", workers=1) as (_sim, [port]),
            _plane(port, wire.REQUESTS_PATH, (wire.SUBPROTOCOL_BATCH,)) as plane,
        ):
            assert plane.subprotocol == wire.SUBPROTOCOL_BATCH
            [hello] = _replies(await plane.messages())
            assert isinstance(hello, wire.Hello)
            body = {"model": "mock-model", "prompt": "a b c", "max_tokens": 10**7}
            await plane.send_message(
                wire.encode(wire.Generate(request_id=1, endpoint="completions", body=body))
            )
            seen: list[wire.WorkerMessage] = []
            while not any(isinstance(reply, wire.Chunk) for reply in seen):
                seen += _replies(await plane.messages())
            assert isinstance(seen[0], wire.Started)
            assert seen[0].prompt_tokens == 3
            await plane.send_message(wire.encode(wire.Cancel(request_id=1)))
            while not isinstance(seen[-1], wire.Failed | wire.End):
                seen += _replies(await plane.messages())
            final = seen[-1]
            assert isinstance(final, wire.Failed)
            assert final.kind == "cancelled"
            made = sum(reply.tokens for reply in seen if isinstance(reply, wire.Chunk))
            assert 0 < made < 10**7
            # A bad body: a clear error for that request, the plane goes on.
            await plane.send_message(
                wire.encode(wire.Generate(request_id=2, endpoint="completions", body={}))
            )
            [failed] = _replies(await plane.messages())
            assert isinstance(failed, wire.Failed)
            assert failed.kind == "bad_request"
            # Two requests with one id in flight: closed with 1008.
            generate = wire.encode(wire.Generate(request_id=3, endpoint="completions", body=body))
            await plane.send_messages([generate, generate])
            with pytest.raises(PlaneClosed) as closed:
                await _read_until_closed(plane)
            assert closed.value.code == wire.CLOSE_DUPLICATE_REQUEST_ID


async def _next_batch(plane: PlaneConnection) -> wire.EventBatch:
    [data] = await plane.messages()  # one batch per read: nothing else is sent meanwhile
    batch = wire.decode_event_message(data)
    assert isinstance(batch, wire.EventBatch)
    return batch


async def test_the_event_plane_honours_the_asked_interval_but_sends_edges_at_once() -> None:
    # No ticking (--rate 0): loads change only on a flip, so each batch is accounted for.
    args = ["--rate", "0"]
    with trio.fail_after(30):
        async with (
            _simulator("new", workers=1, extra=args) as (sim, [port]),
            _plane(port, wire.EVENTS_PATH) as plane,
        ):
            messages = await plane.messages()
            while len(messages) < 2:
                messages += await plane.messages()
            hello = wire.decode_event_message(messages[0])
            assert isinstance(hello, wire.Hello)
            assert hello.features == list(lean_workers.NEW_FEATURES)
            first = wire.decode_event_message(messages[1])
            assert isinstance(first, wire.EventBatch)
            [heartbeat] = first.events  # whole at once: the state of every rank
            assert isinstance(heartbeat, wire.Heartbeat)
            assert len(heartbeat.loads) == 4
            thresholds = wire.BusyThresholds(active_decode_blocks=0.5)
            subscribe = wire.Subscribe(thresholds=thresholds, publish_interval=30.0)
            await plane.send_message(wire.encode(subscribe))
            await plane.send_ping()  # answered, and the plane goes on
            # Free again is no edge: it waits out the 30 s asked, heartbeats too.
            assert (await _command(sim, "free")).startswith("ok free ")
            with trio.move_on_after(1.5) as quiet:
                await plane.messages()
            assert quiet.cancelled_caught
            # Busy is an edge: at once, with everything pending, latest wins, in seq order.
            last_seq = heartbeat.seq
            for mode in ("busy", "free"):
                assert (await _command(sim, mode)).startswith(f"ok {mode} ")
                with trio.fail_after(5):
                    batch = await _next_batch(plane)
                loads = [event for event in batch.events if isinstance(event, wire.LoadEvent)]
                assert sorted(event.load.dp_rank for event in loads) == [0, 1, 2, 3]
                assert all((event.load.kv_used_blocks > 500) == (mode == "busy") for event in loads)
                seqs = [event.seq for event in batch.events]
                assert seqs == sorted(seqs)
                assert seqs[0] > last_seq
                last_seq = seqs[-1]


async def test_kv_events_a_snapshot_then_every_event_in_order_and_a_fresh_snapshot() -> None:
    # Rule 6: ticks store chains of 4 blocks and evict the oldest once a rank holds its 1,000.
    args = ["--rate", "200", "--ranks", "2", "--kv-blocks", "4"]
    with trio.fail_after(60):
        async with (
            _simulator("new", workers=1, extra=args) as (sim, [port]),
            _plane(port, wire.EVENTS_PATH) as plane,
        ):
            hello = wire.decode_event_message((await plane.messages())[0])
            assert isinstance(hello, wire.Hello)
            assert wire.FEATURE_KV_EVENTS in hello.features
            ask = wire.Subscribe(thresholds=wire.BusyThresholds(), kv_events=True)
            await plane.send_message(wire.encode(ask))
            cached: dict[int, set[int]] = {}
            seq: int | None = None
            snapshots: list[wire.KvSnapshot] = []
            evictions = 0
            asked = False
            for _ in range(10_000):
                for data in await plane.messages():
                    message = wire.decode_event_message(data)
                    if not isinstance(message, wire.KvBatch):
                        continue
                    for event in message.events:
                        if isinstance(event, wire.KvSnapshot):
                            snapshots.append(event)
                            cached = {r: set(names) for r, names in enumerate(event.ranks)}
                            seq = event.seq
                            continue
                        assert seq is not None, "an event before the first snapshot"
                        assert event.seq == seq + 1, "a gap or a reordering"
                        seq = event.seq
                        if isinstance(event, wire.KvStored):
                            assert not cached[event.dp_rank] & set(event.blocks)
                            cached[event.dp_rank].update(event.blocks)
                        elif isinstance(event, wire.KvRemoved):
                            assert set(event.blocks) <= cached[event.dp_rank]
                            cached[event.dp_rank].difference_update(event.blocks)
                            evictions += 1
                    assert all(len(names) <= KV_TOTAL_BLOCKS for names in cached.values())
                if evictions and not asked:
                    fresh = wire.Subscribe(
                        thresholds=ask.thresholds, kv_events=True, kv_snapshot=True
                    )
                    await plane.send_message(wire.encode(fresh))
                    asked = True
                if len(snapshots) == 2 and seq is not None and seq > snapshots[1].seq + 10:
                    break
            assert len(snapshots) == 2
            # The fresh snapshot is the full cache of each rank, and events went on from it.
            assert [len(names) for names in snapshots[1].ranks] == [KV_TOTAL_BLOCKS] * 2
            assert seq is not None
            assert seq > snapshots[1].seq
            assert all(len(names) == KV_TOTAL_BLOCKS for names in cached.values())
            stats = json.loads((await _command(sim, "stats")).partition(" ")[2])
            assert stats["kv_snapshots"] == 2
            assert stats["kv_events"] >= seq - snapshots[1].seq
