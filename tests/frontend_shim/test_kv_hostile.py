"""A worker's KV events against the frontend's bounds (frontend_shim._links rules 7 and 8,
frontend_shim._kv_budget, frontend_shim._worker_hello), with the worker played by the test.

The played worker speaks the protocol's framing and hello, records what the frontend writes on
each session's event plane (its subscriptions, its close frame), and then does what the test
says: parts too fast for the budget, a gap after every snapshot, a snapshot of 14 MB. Loopback
only, under fail_after.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import httpx
import pytest
import trio
from test_kv_link import client_messages
from test_peers import accept_upgrade, frame, poll
from worker_configs import runtime_config

from frontend_shim import _kv_feed
from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from frontend_shim._fleet_bridge import FleetBridge
from frontend_shim._kv_budget import BURST_BYTES, CLOSE_OVER_BUDGET, KvBudget
from frontend_shim._kv_index import KvIndex
from frontend_shim._links import LinkSettings, WorkerLink
from frontend_shim._load import Fleet
from shim_common import wire

TIMEOUT = 30.0
KV_LINK = LinkSettings(
    connect_timeout=2.0,
    disconnect_timeout=0.5,
    keepalive_interval=30.0,
    keepalive_timeout=30.0,
    backoff_initial=0.05,
    backoff_cap=0.2,
    kv_events=True,
)
PARTS = [wire.FEATURE_PUBLISH_INTERVAL, wire.FEATURE_KV_EVENTS, wire.FEATURE_KV_PARTS]


class Session:
    """One session of the played worker: what the frontend wrote on its event plane."""

    def __init__(self) -> None:
        self.written = bytearray()

    def messages(self) -> list[bytes]:
        return client_messages(self.written)

    def subscribes(self) -> list[wire.Subscribe]:
        return [wire.decode_subscriber_message(m) for m in self.messages()]

    def close_frame(self) -> tuple[int, str] | None:
        """The code and reason of the close frame the frontend sent, if any."""
        data = self.written
        position = 0
        while position + 2 <= len(data):
            opcode, length = data[position] & 0x0F, data[position + 1] & 0x7F
            offset = 2
            if length == 126:
                length, offset = int.from_bytes(data[position + 2 : position + 4], "big"), 4
            elif length == 127:
                length, offset = int.from_bytes(data[position + 2 : position + 10], "big"), 10
            start = position + offset + 4
            if start + length > len(data):
                return None
            mask = data[start - 4 : start]
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(data[start : start + length]))
            if opcode == 8:
                return int.from_bytes(payload[:2], "big"), payload[2:].decode()
            position = start + length
        return None


Behaviour = Callable[["PlayedWorker", trio.SocketStream, Session], Awaitable[None]]


class PlayedWorker:
    """Both planes of a worker with the hello given; on each session's event plane, heartbeats
    and ``behaviour`` once the frontend subscribed to KV events."""

    def __init__(self, features: Sequence[str], blocks: int, behaviour: Behaviour) -> None:
        config = runtime_config(worker_id="w-kv", kv_total_blocks=blocks, heartbeat_interval=0.2)
        self.hello = frame(
            wire.encode(
                wire.Hello(
                    protocol_version=wire.PROTOCOL_VERSION, config=config, features=[*features]
                )
            )
        )
        self.behaviour = behaviour
        self.sessions: list[Session] = []

    async def serve(self, nursery: trio.Nursery) -> str:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(trio.serve_listeners, self._handle, listeners)
        return f"ws://127.0.0.1:{listeners[0].socket.getsockname()[1]}"

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            await self._serve(stream)
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the frontend ended the session

    async def _serve(self, stream: trio.SocketStream) -> None:
        path = await accept_upgrade(stream)
        if path is None:
            return
        await stream.send_all(self.hello)
        if path != wire.EVENTS_PATH:
            while await stream.receive_some(65536):
                pass
            return
        session = Session()
        self.sessions.append(session)
        lock = trio.Lock()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_record, stream, session)
            nursery.start_soon(_heartbeats, stream, lock)
            await poll(lambda: any(s.kv_events for s in session.subscribes()), "a subscription")
            async with lock:
                await self.behaviour(self, stream, session)
            await trio.sleep_forever()


async def _record(stream: trio.SocketStream, session: Session) -> None:
    while data := await stream.receive_some(65536):
        session.written.extend(data)


async def _heartbeats(stream: trio.SocketStream, lock: trio.Lock) -> None:
    seq = 0
    while True:
        seq += 1
        now = time.time()
        beat = wire.Heartbeat(seq=seq, ts=now, loads=[], engine_requests=0, queued_requests=0)
        message = frame(wire.encode(wire.EventBatch(events=[beat], sent=now)))
        async with lock:
            await stream.send_all(message)
        await trio.sleep(0.05)


def kv_frame(*events: wire.KvEvent) -> bytes:
    return frame(wire.encode(wire.KvBatch(events=list(events))))


async def parts_too_fast(worker: PlayedWorker, stream: trio.SocketStream, session: Session) -> None:
    # Valid parts of 2,048 of the widest names, as fast as the socket takes them: a snapshot
    # that never ends, over the byte budget within a few of its bursts.
    names = [2**63 - n for n in range(wire.KV_PART_NAMES)]
    part = kv_frame(wire.KvSnapshot(seq=1, ranks=[names], more=True))
    for _ in range(4 * BURST_BYTES // len(part)):
        await stream.send_all(part)
        await trio.lowlevel.checkpoint()


@contextlib.asynccontextmanager
async def linked(worker: PlayedWorker) -> AsyncIterator[tuple[WorkerLink, KvIndex]]:
    index = KvIndex()
    links: dict[str, WorkerLink] = {}
    bridge = FleetBridge(Fleet(), on_change=lambda: None, links=links, kv_index=index)
    async with trio.open_nursery() as nursery:
        url = await worker.serve(nursery)
        link = WorkerLink(url, bridge, KV_LINK)
        links[url] = link
        await nursery.start(link.run)
        yield link, index
        nursery.cancel_scope.cancel()


async def test_a_worker_past_its_kv_budget_is_closed_with_1008_counted_and_not_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = PlayedWorker(PARTS, 1 << 16, parts_too_fast)
    caplog.set_level(logging.INFO, logger="frontend_shim")
    with trio.fail_after(TIMEOUT):
        async with linked(worker) as (link, index):
            await poll(lambda: link.stats.kv_budget_closes == 1, "the close over budget")
            await poll(lambda: len(worker.sessions) >= 2 and link.connected, "the next session")
            await trio.sleep(0.3)
            # The next session asks for no KV events: routed on the router's guesses.
            assert not link.kv_events
            assert all(not s.kv_events for s in worker.sessions[1].subscribes())
            kept = index.worker("w-kv")
            assert kept is not None
            assert not kept.events
    first = worker.sessions[0]
    assert first.subscribes()[0].kv_parts
    closed = first.close_frame()
    assert closed is not None
    code, reason = closed
    assert code == CLOSE_OVER_BUDGET
    assert "KV events past 256 KiB a second" in reason
    assert "closing its session (1008)" in caplog.text
    # The budget's worth was read before the close, and far less than what was sent.
    assert link.stats.kv_budget_closes == 1


async def gap_after_every_snapshot(
    worker: PlayedWorker, stream: trio.SocketStream, session: Session
) -> None:
    # A snapshot, then an event out of sequence; again for every snapshot the frontend asks
    # for (before, the frontend asked about 80 times a second, each a fresh snapshot).
    def asked_more_than(count: int) -> Callable[[], bool]:
        return lambda: sum(s.kv_snapshot for s in session.subscribes()) > count

    for answered in range(1000):
        seq = 1 + 3 * answered
        gap = wire.KvRemoved(seq=seq + 2, dp_rank=0, blocks=[1])
        await stream.send_all(kv_frame(wire.KvSnapshot(seq=seq, ranks=[[1, 2, 3]]), gap))
        await poll(asked_more_than(answered), "an ask", tries=5000)



async def test_a_worker_making_gaps_is_asked_for_a_snapshot_at_most_once_a_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_kv_feed, "SNAPSHOT_RETRY", 0.5)
    worker = PlayedWorker([wire.FEATURE_KV_EVENTS], 100, gap_after_every_snapshot)
    with trio.fail_after(TIMEOUT):
        async with linked(worker) as (link, _):
            await poll(lambda: link.stats.kv_snapshots_asked >= 1, "the first ask")
            await trio.sleep(1.6)
            asked = link.stats.kv_snapshots_asked
    assert 2 <= asked <= 5  # one at once, then one every 0.5 s


async def whole_snapshot(worker: PlayedWorker, stream: trio.SocketStream, session: Session) -> None:
    await stream.send_all(kv_frame(wire.KvSnapshot(seq=1, ranks=[[1, 2, 3]])))


async def test_an_older_worker_whose_whole_cache_would_not_fit_a_message_is_not_asked() -> None:
    # Before, a worker listing kv-events with a cache of 65,536 blocks was allowed 4 MiB
    # messages; an older worker sends its whole cache in one, so it is not asked at all.
    asked: list[bool] = []

    async def record_ask(worker: PlayedWorker, stream: trio.SocketStream, s: Session) -> None:
        asked.append(True)

    features = [wire.FEATURE_PUBLISH_INTERVAL, wire.FEATURE_KV_EVENTS]
    worker = PlayedWorker(features, 1 << 16, record_ask)
    with trio.fail_after(TIMEOUT):
        async with linked(worker) as (link, index):
            await poll(lambda: link.connected and bool(worker.sessions), "the link")
            await poll(lambda: bool(worker.sessions[0].subscribes()), "a subscribe")
            assert not link.kv_events
            kept = index.worker("w-kv")
            assert kept is not None
            assert not kept.events
    assert not any(s.kv_events for s in worker.sessions[0].subscribes())
    assert not asked


async def parts_in_time(worker: PlayedWorker, stream: trio.SocketStream, session: Session) -> None:
    await stream.send_all(kv_frame(wire.KvSnapshot(seq=4, ranks=[[1, 2]], more=True)))
    await trio.sleep(0.2)
    await stream.send_all(kv_frame(wire.KvSnapshot(seq=4, ranks=[[3]])))
    await stream.send_all(kv_frame(wire.KvStored(seq=5, dp_rank=0, parent=3, blocks=[4])))


async def test_a_worker_of_parts_is_asked_for_parts_and_each_snapshot_is_put_in_use_whole() -> None:
    worker = PlayedWorker(PARTS, 1 << 20, parts_in_time)
    with trio.fail_after(TIMEOUT):
        async with linked(worker) as (link, index):
            await poll(lambda: index.stats.snapshot_parts == 1, "the first part")
            assert index.depth("w-kv", 0, [1], 0.0) == 0  # not in use before its last part
            await poll(lambda: index.depth("w-kv", 0, [1, 2, 3, 4], 0.0) == 4, "the rest")
            assert link.kv_events
            assert link.kv_parts
            assert link.stats.kv_budget_closes == 0
    assert worker.sessions[0].subscribes()[0].kv_parts


async def huge_snapshot(worker: PlayedWorker, stream: trio.SocketStream, session: Session) -> None:
    # A hello claiming 262,144 blocks once earned 16 MiB messages in kv mode: the header of a
    # 14 MiB snapshot must end the session before its payload is read.
    size = 14 << 20
    await stream.send_all(bytes([0x82, 127]) + struct.pack("!Q", size))
    with contextlib.suppress(trio.BrokenResourceError):
        for _ in range(size >> 16):
            await stream.send_all(b"\x00" * (1 << 16))
        raise AssertionError("the frontend read all 14 MiB")


@pytest.mark.parametrize("attack", ["huge-snapshot", "parts-too-fast"])
async def test_a_kv_mode_frontend_serves_on_and_counts_a_worker_over_its_kv_bounds(
    attack: str, caplog: pytest.LogCaptureFixture
) -> None:
    behaviour = huge_snapshot if attack == "huge-snapshot" else parts_too_fast
    worker = PlayedWorker(PARTS, 1 << 18, behaviour)
    caplog.set_level(logging.INFO, logger="frontend_shim")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await worker.serve(nursery)
            settings = FrontendSettings(http_port=0, workers=(url,), router_mode="kv")
            base: str = await nursery.start(run_frontend, settings)
            async with httpx.AsyncClient(base_url=base) as client:
                for _ in range(300):
                    assert (await client.get("/live")).status_code == 200
                    if attack == "huge-snapshot" and "a message over" in caplog.text:
                        break
                    if attack == "parts-too-fast" and "closing its session (1008)" in caplog.text:
                        break
                    await trio.sleep(0.02)
                metrics = (await client.get("/metrics")).text
            nursery.cancel_scope.cancel()
    if attack == "huge-snapshot":
        assert "a message over" in caplog.text
    else:
        assert "dynamo_frontend_worker_kv_budget_closes_total 1.0" in metrics
    assert "dynamo_frontend_kv_index_snapshot_parts_total" in metrics


def test_the_budget_lets_the_protocols_rate_through_and_closes_past_either_bucket() -> None:
    budget = KvBudget(100.0)
    # A worker at the protocol's byte rate, in parts of 19 KB, for a minute: never over.
    now = 100.0
    for _ in range(60 * wire.KV_BYTES_PER_SECOND // 19_000):
        now += 19_000 / wire.KV_BYTES_PER_SECOND
        assert budget.charge(now=now, size=19_000, cpu=0.001) is None
    # Twice the rate: over once the burst is spent.
    over = None
    for step in range(1000):
        over = budget.charge(now=now + step * 0.01, size=2 * wire.KV_BYTES_PER_SECOND // 100, cpu=0)
        if over is not None:
            break
    assert over is not None
    assert "KiB a second" in over
    # CPU: a tenth of a core past a twentieth, from a fresh budget.
    budget = KvBudget(0.0)
    results = [budget.charge(now=step * 0.1, size=0, cpu=0.01) for step in range(1, 200)]
    assert any(result is not None and "of a core" in result for result in results)
