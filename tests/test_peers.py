"""Slow and half-dead peers: each is bounded in time, counted, and affects nothing else.

- an HTTP client that stops reading a stream (the frontend's send timeout; the worker's slot is
  not held by it at all);
- a worker that accepts the websocket and never says hello (the link's connect timeout);
- a worker that stops reading its socket (the link's watchdog judges the stuck write; the
  other links go on);
- a worker that sends part of a frame and stalls (event-plane silence);
- a frontend that sends part of a frame and stalls (the worker's keepalive ping).

Fake peers are hand-written on raw loopback sockets so that they can stop reading. Everything
runs in-process on 127.0.0.1 with port 0, under ``trio.fail_after``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import socket
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest
import trio
from client_frames import client_frames

from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from frontend_shim._event_budget import EventBudget
from frontend_shim._links import LinkSettings, WorkerLink
from frontend_shim._pacer import ReadPacer
from shim_common import wire
from worker_ingress._config import WorkerSettings
from worker_ingress._server import Worker, WorkerAddress
from worker_ingress.engines._base import EngineOutput, PreparedRequest
from worker_ingress.engines._instant import InstantEngine, create

TIMEOUT = 20.0
MODEL = "mock-model"
HEARTBEAT = 0.05


def worker_settings(**changes: Any) -> WorkerSettings:
    base = WorkerSettings(
        worker_id="w-real",
        host="127.0.0.1",
        port=0,
        system_port=0,
        heartbeat_interval=HEARTBEAT,
        drain_grace=1.0,
    )
    return dataclasses.replace(base, **changes)


class HeldEngine(InstantEngine):
    """Instant, except that a prompt ``hold`` streams one chunk and then waits forever."""

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(create(settings).config)

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        if request.prompt_tokens == 1 and request.max_tokens == 99:
            yield EngineOutput(text="first", tokens=1)
            await trio.sleep_forever()
        async for output in super().generate(request):
            yield output


@asynccontextmanager
async def running_worker(
    settings: WorkerSettings, engine: Any = None, **options: Any
) -> AsyncIterator[tuple[Worker, WorkerAddress]]:
    worker = Worker(settings, engine if engine is not None else create(settings), **options)
    async with trio.open_nursery() as nursery:
        address: WorkerAddress = await nursery.start(worker.serve)
        yield worker, address
        nursery.cancel_scope.cancel()


class Listener:
    """A fleet listener that counts ups and downs."""

    def __init__(self) -> None:
        self.ups = 0
        self.downs = 0

    def worker_up(self, key: str, config: wire.RuntimeConfig, now: float) -> None:
        self.ups += 1

    def worker_events(self, key: str, events: Sequence[wire.WorkerEvent], now: float) -> None:
        pass

    def worker_lagging(self, key: str, lagging: bool, now: float) -> None:
        pass

    def worker_down(self, key: str, now: float) -> None:
        self.downs += 1

    def thresholds(self, model: str) -> wire.BusyThresholds | None:
        return None


async def poll(condition: Callable[[], bool], what: str, *, tries: int = 1000) -> None:
    for _ in range(tries):
        if condition():
            return
        await trio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def serve_one_request(link: WorkerLink) -> None:
    """A request through a healthy link completes (the proof that nothing else is affected)."""
    async with link.request("completions", {"prompt": "a b", "max_tokens": 2}) as stream:
        assert isinstance(await stream.first(), wire.Started)
        replies = [reply async for reply in stream]
    assert isinstance(replies[-1], wire.End)


# ----------------------------------------------------------------------------- fake workers


def frame(payload: bytes) -> bytes:
    """An unmasked binary frame, as a server sends it."""
    size = len(payload)
    if size < 126:
        return bytes([0x82, size]) + payload
    if size < 1 << 16:
        return bytes([0x82, 126]) + struct.pack("!H", size) + payload
    return bytes([0x82, 127]) + struct.pack("!Q", size) + payload


def hello_frame() -> bytes:
    settings = worker_settings(worker_id="w-fake")
    config = Worker(settings, create(settings)).hello.config
    return frame(wire.encode(wire.Hello(protocol_version=wire.PROTOCOL_VERSION, config=config)))


def heartbeat_frame(seq: int) -> bytes:
    beat = wire.Heartbeat(seq=seq, ts=time.time(), loads=[], engine_requests=0, queued_requests=0)
    return frame(wire.encode(wire.EventBatch(events=[beat], sent=time.time())))


async def accept_upgrade(stream: trio.SocketStream) -> str | None:
    """Read an upgrade request and answer 101; returns its path (``None``: the peer left)."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = await stream.receive_some(4096)
        if not data:
            return None
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


async def heartbeats_forever(stream: trio.SocketStream) -> None:
    seq = 0
    while True:
        seq += 1
        await stream.send_all(heartbeat_frame(seq))
        await trio.sleep(HEARTBEAT)


Plane = Callable[[trio.SocketStream], Awaitable[None]]


async def serve_fake_worker(
    nursery: trio.Nursery,
    *,
    events: Plane,
    requests: Plane,
    receive_buffer: int | None = None,
) -> str:
    """A hand-made worker: the upgrade, then ``events`` or ``requests`` runs the plane."""

    async def handle(stream: trio.SocketStream) -> None:
        with trio.move_on_after(60):
            path = await accept_upgrade(stream)
            if path == wire.EVENTS_PATH:
                await events(stream)
            elif path == wire.REQUESTS_PATH:
                await requests(stream)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    if receive_buffer is not None:
        # Inherited by accepted sockets: the kernel holds little that this peer does not read.
        listeners[0].socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await nursery.start(trio.serve_listeners, handle, listeners)
    return f"ws://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def hello_then_heartbeats(stream: trio.SocketStream) -> None:
    await stream.send_all(hello_frame())
    await heartbeats_forever(stream)


async def hello_then_never_read(stream: trio.SocketStream) -> None:
    await stream.send_all(hello_frame())
    await trio.sleep_forever()


# ----------------------------------------------------------------------------- links


LINK = LinkSettings(
    connect_timeout=0.5,
    disconnect_timeout=0.1,
    keepalive_interval=0.2,
    keepalive_timeout=0.5,
    backoff_initial=0.05,
    backoff_cap=0.2,
)


@asynccontextmanager
async def links(
    *urls: str, settings: LinkSettings = LINK
) -> AsyncIterator[list[tuple[WorkerLink, Listener]]]:
    async with trio.open_nursery() as nursery:
        made = []
        for url in urls:
            listener = Listener()
            link = WorkerLink(url, listener, settings)
            await nursery.start(link.run)
            made.append((link, listener))
        yield made
        nursery.cancel_scope.cancel()


async def test_a_worker_that_never_says_hello_times_out_alone() -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    with trio.fail_after(TIMEOUT):
        async with (
            trio.open_nursery() as nursery,
            running_worker(worker_settings()) as (_, address),
        ):
            mute = await serve_fake_worker(nursery, events=silent, requests=silent)
            async with links(mute, address.ws_url) as [(stuck, _), (healthy, _)]:
                await healthy.wait_connected()
                started = trio.current_time()
                await poll(lambda: stuck.stats.connect_failures >= 2, "two timed-out attempts")
                # Each attempt ends at the connect timeout (0.5 s): an order of magnitude.
                assert trio.current_time() - started < 10 * LINK.connect_timeout
                assert not stuck.connected
                await serve_one_request(healthy)
            nursery.cancel_scope.cancel()


async def test_a_worker_that_stops_reading_ends_its_session_and_blocks_no_other() -> None:
    body = {"prompt": "x " * 20_000, "max_tokens": 1}  # about 40 KB per Generate
    with trio.fail_after(TIMEOUT):
        async with (
            trio.open_nursery() as nursery,
            running_worker(worker_settings()) as (_, address),
        ):
            deaf = await serve_fake_worker(
                nursery,
                events=hello_then_heartbeats,
                requests=hello_then_never_read,
                receive_buffer=4096,
            )
            async with links(deaf, address.ws_url) as [(stuck, listener), (healthy, _)]:
                await stuck.wait_connected()
                await healthy.wait_connected()
                outcomes: list[object] = []

                async def send_one() -> None:
                    async with stuck.request("completions", body) as stream:
                        outcomes.append(await stream.first())

                async with trio.open_nursery() as senders:
                    for _ in range(40):  # far more than the socket buffers hold
                        senders.start_soon(send_one)
                    # While the stuck link's writes are blocked, the healthy one serves.
                    await poll(lambda: stuck.open_requests >= 10, "requests pile up")
                    await serve_one_request(healthy)
                    # The watchdog ends the session: every request of it fails, none hangs.
                    await poll(lambda: listener.downs >= 1, "the stuck session to end")
                assert stuck.stats.keepalive_timeouts >= 1
                assert len(outcomes) == 40
                assert all(isinstance(o, wire.Failed) and o.kind == "unavailable" for o in outcomes)
                await serve_one_request(healthy)
            nursery.cancel_scope.cancel()


async def test_a_worker_that_sends_half_a_frame_and_stalls_is_dropped() -> None:
    async def half_a_frame(stream: trio.SocketStream) -> None:
        await stream.send_all(hello_frame())
        for seq in range(1, 4):
            await stream.send_all(heartbeat_frame(seq))
            await trio.sleep(HEARTBEAT)
        whole = heartbeat_frame(4)
        await stream.send_all(whole[: len(whole) // 2])
        await trio.sleep_forever()

    async def answer_pings(stream: trio.SocketStream) -> None:
        await stream.send_all(hello_frame())
        await trio.sleep_forever()  # never pinged within the test: the event plane decides

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await serve_fake_worker(nursery, events=half_a_frame, requests=answer_pings)
            settings = dataclasses.replace(
                LINK, keepalive_interval=60.0, backoff_initial=5.0, backoff_cap=5.0
            )
            async with links(url, settings=settings) as [(link, listener)]:
                await link.wait_connected()
                started = trio.current_time()
                await poll(lambda: listener.downs == 1, "the session to end")
                assert trio.current_time() - started < 10 * settings.keepalive_timeout
                assert link.stats.keepalive_timeouts == 1
            nursery.cancel_scope.cancel()


# ----------------------------------------------------------------------------- the worker side


def client_frame(payload: bytes) -> bytes:
    """A masked binary frame, as a client sends it (mask of zeros: the payload is as is)."""
    size = len(payload)
    if size < 126:
        return bytes([0x82, 0x80 | size]) + b"\0\0\0\0" + payload
    return bytes([0x82, 0x80 | 126]) + struct.pack("!H", size) + b"\0\0\0\0" + payload


async def test_a_frontend_that_sends_half_a_frame_and_stalls_frees_its_slot() -> None:
    settings = worker_settings(engine_request_limit=1, request_queue_limit=2)
    engine = HeldEngine(settings)
    with trio.fail_after(TIMEOUT):
        # This client never answers a ping: the keepalive must give it long enough to get its
        # first request running on a busy machine before it drops the client.
        async with running_worker(
            settings, engine, ping_interval=1.0, ping_timeout=1.0, close_timeout=0.2
        ) as (worker, address):
            host, port = address.ws_url.removeprefix("ws://").rsplit(":", 1)
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(
                    b"GET /v1/requests HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    b"Sec-WebSocket-Version: 13\r\n\r\n"
                )
                # A client sends frames only once the upgrade is answered (RFC 6455, 4.1).
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive_some(4096)
                assert answer.startswith(b"HTTP/1.1 101")
                generate = wire.Generate(
                    request_id=1, endpoint="completions", body={"prompt": "x", "max_tokens": 99}
                )
                await stream.send_all(client_frame(wire.encode(generate)))
                await poll(lambda: worker.gate.running == 1, "the request to hold its slot")
                second = client_frame(wire.encode(msgspec.structs.replace(generate, request_id=2)))
                await stream.send_all(second[: len(second) // 2])
                # No more bytes, no pong: the worker's keepalive drops the peer.
                await poll(lambda: worker.gate.in_flight == 0, "the slot to be freed")
            errors = worker.metrics.registry.get_sample_value(
                "dynamo_worker_connection_errors_total"
            )
            assert errors is not None
            assert errors >= 1


# ----------------------------------------------------------------------------- the HTTP side


@asynccontextmanager
async def frontend(
    workers: Sequence[WorkerSettings], **options: Any
) -> AsyncIterator[tuple[str, list[Worker]]]:
    async with trio.open_nursery() as nursery:
        started: list[Worker] = []
        urls: list[str] = []
        for settings in workers:
            worker = Worker(settings, create(settings))
            address: WorkerAddress = await nursery.start(worker.serve)
            started.append(worker)
            urls.append(address.ws_url)
        frontend_settings = FrontendSettings(http_port=0, workers=tuple(urls), **options)
        async with trio.open_nursery() as frontend_nursery:
            url: str = await frontend_nursery.start(run_frontend, frontend_settings)
            async with httpx.AsyncClient() as client:
                for _ in range(500):
                    if (await client.get(url + "/health")).json()["workers_connected"] == len(urls):
                        break
                    await trio.sleep(0.02)
            yield url, started
            frontend_nursery.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


async def test_a_client_that_stops_reading_holds_no_slot_and_is_dropped() -> None:
    """The worker's slot is bounded by the engine alone: the frontend reads every reply into
    the request's buffer (merging text), so a slow client never slows the worker. The client's
    connection is bounded by the frontend's send timeout."""
    body = {"model": MODEL, "prompt": "a b", "max_tokens": 60_000, "stream": True}
    with trio.fail_after(TIMEOUT):
        async with frontend(
            [worker_settings(engine_request_limit=1, request_queue_limit=2)],
            http_send_timeout=1.0,
        ) as (url, [worker]):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            await sock.connect((host, int(port)))
            stream = trio.SocketStream(sock)
            async with stream:
                payload = json.dumps(body).encode()
                await stream.send_all(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(payload) + payload
                )
                # The engine finishes and the slot is back while the client reads nothing.
                await poll(lambda: worker.gate.state.started_total == 1, "the start")
                await poll(lambda: worker.gate.in_flight == 0, "the slot to be freed")
                async with httpx.AsyncClient() as client:
                    # Meanwhile others are served.
                    other = await client.post(
                        url + "/v1/completions",
                        json={"model": MODEL, "prompt": "a", "max_tokens": 2},
                    )
                    assert other.status_code == 200
                    for _ in range(500):
                        metrics = (await client.get(url + "/metrics")).text
                        if metric(metrics, "dynamo_frontend_http_send_stalls_total") >= 1:
                            break
                        await trio.sleep(0.02)
                assert metric(metrics, "dynamo_frontend_http_send_stalls_total") == 1
                assert metric(metrics, "dynamo_frontend_inflight_requests") == 0
                # The frontend closed the connection: what is left to read ends.
                with trio.fail_after(5):
                    while await stream.receive_some(1 << 20):
                        pass


@pytest.mark.parametrize("stream", [False, True])
async def test_the_send_timeout_leaves_slow_but_reading_clients_alone(stream: bool) -> None:
    body = {"model": MODEL, "prompt": "a b", "max_tokens": 3000, "stream": stream}
    with trio.fail_after(TIMEOUT):
        async with (
            frontend([worker_settings()], http_send_timeout=1.0) as (url, _),
            httpx.AsyncClient() as client,
            client.stream("POST", url + "/v1/completions", json=body) as reply,
        ):
            assert reply.status_code == 200
            received = 0
            async for chunk in reply.aiter_raw(4096):
                received += len(chunk)
                await trio.sleep(0.002)
            assert received > 0
            metrics = (await client.get(url + "/metrics")).text
            assert metric(metrics, "dynamo_frontend_http_send_stalls_total") == 0


# ----------------------------------------------------------------------------- the event budget


def v1_heartbeat_frame(seq: int) -> bytes:
    """A version-1 worker's batch: no ``sent`` stamp (the link falls back to the event's ts)."""
    beat = wire.Heartbeat(seq=seq, ts=time.time(), loads=[], engine_requests=0, queued_requests=0)
    return frame(wire.encode(wire.EventBatch(events=[beat])))


class SeqListener(Listener):
    """Notes the batches handed over and the newest ``seq`` seen."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0
        self.newest = 0

    def worker_events(self, key: str, events: Sequence[wire.WorkerEvent], now: float) -> None:
        self.batches += 1
        self.newest = max([self.newest, *(event.seq for event in events)])


async def record_everything(stream: trio.SocketStream, into: bytearray) -> None:
    """What the frontend writes on a hand-made worker's plane, until it closes."""
    while data := await stream.receive_some(4096):
        into.extend(data)


async def budget_link(
    nursery: trio.Nursery,
    events: Plane,
    budget: EventBudget,
    *,
    in_place: bool = True,
    requests: Plane = hello_then_never_read,
) -> tuple[WorkerLink, SeqListener]:
    """A link, up on return, to a hand-made worker whose event plane ``events`` serves, read at
    ``budget`` by the pool's pacer in place (``in_place``) or by the link's task.

    The fake request plane (``requests``) answers no ping: the link's keepalive is off for the
    test.
    """
    url = await serve_fake_worker(nursery, events=events, requests=requests)
    pacer = None
    if in_place:
        pacer = ReadPacer()
        await nursery.start(pacer.run)
    listener = SeqListener()
    quiet = dataclasses.replace(LINK, keepalive_interval=30.0, keepalive_timeout=30.0)
    link = WorkerLink(url, listener, quiet, budget=budget, pacer=pacer)
    await nursery.start(link.run)
    await poll(lambda: link.connected, "the link to come up")
    return link, listener


@pytest.mark.parametrize("in_place", [False, True], ids=["task-reads", "reads-in-place"])
async def test_an_old_worker_is_read_at_the_budget_interval_latest_wins(in_place: bool) -> None:
    # A version-1 worker: no features in its hello, a batch every 5 ms whatever anyone asks. The
    # new frontend sends it nothing and reads it at the budget's interval, keeping the latest:
    # its link's task reads (no pacer), or the pool's pacer reads the socket in place.
    sent = 0
    received = bytearray()

    async def old_worker_events(stream: trio.SocketStream) -> None:
        nonlocal sent
        async with trio.open_nursery() as nursery:
            nursery.start_soon(record_everything, stream, received)
            await stream.send_all(hello_frame())
            while True:
                sent += 1
                await stream.send_all(v1_heartbeat_frame(sent))
                await trio.sleep(0.005)

    budget = EventBudget(10)
    budget.resize(2)  # two links: one read every 0.2 s each
    assert budget.interval == pytest.approx(0.2)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            link, listener = await budget_link(
                nursery, old_worker_events, budget, in_place=in_place
            )
            assert link.paced
            assert not link.negotiated
            await poll(lambda: sent > 20, "the worker to send")
            start_batches, start = listener.batches, trio.current_time()
            await trio.sleep(1.0)
            reads = listener.batches - start_batches
            elapsed = trio.current_time() - start
            # About one read per 0.2 s (the worker sent about 200 batches meanwhile) ...
            assert 1 <= reads <= elapsed / 0.2 + 2
            # ... and each applies the newest state the read found, not a backlog.
            assert sent - listener.newest <= 0.2 / 0.005 * 3
            assert link.stats.event_batches > reads  # everything read was decoded
            nursery.cancel_scope.cancel()
    assert received == b""  # no subscribe for a worker that does not list the feature


async def test_reads_in_place_answer_the_workers_pings_and_end_on_its_close() -> None:
    # A paced link's task sleeps while the pacer reads for it: the pongs the worker's pings are
    # owed, and the reply to its close, must still go out, and the close must end the session.
    received = bytearray()
    pings = 3

    async def pinging_worker_events(stream: trio.SocketStream) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(record_everything, stream, received)
            await stream.send_all(hello_frame())
            for seq in range(1, pings + 1):
                await stream.send_all(bytes([0x89, 2]) + b"p%d" % seq + v1_heartbeat_frame(seq))
                await trio.sleep(0.1)
            await poll(lambda: client_opcodes(received).count(0xA) == pings, "the pongs")
            await stream.send_all(bytes([0x88, 2]) + (1001).to_bytes(2, "big"))
            await poll(lambda: 0x8 in client_opcodes(received), "the close reply")
            nursery.cancel_scope.cancel()

    budget = EventBudget(20)
    budget.resize(2)  # one read every 0.1 s
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            _, listener = await budget_link(nursery, pinging_worker_events, budget)
            await poll(lambda: listener.downs >= 1, "the close to end the session", tries=500)
            assert listener.newest == pings  # every heartbeat before the close was applied
            nursery.cancel_scope.cancel()
    pongs = [payload for opcode, payload in client_frames(received) if opcode == 0xA]
    assert pongs == [b"p1", b"p2", b"p3"]


REFUSALS = {
    "rejected": wire.Rejected(request_id=1, reason=wire.RejectReason.OVERLOADED),
    "draining": wire.Failed(request_id=1, kind="unavailable", message="worker draining"),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
async def test_a_refusal_reaches_its_request_after_the_events_sent_before_it(refusal: str) -> None:
    # Read once a second. The worker sends a heartbeat, then refuses the request on the other
    # plane: the refusal is handed over only after the heartbeat is applied (read out of turn),
    # whoever waits for it, and the pacing goes on as before (one read a second, not two).
    to_send: trio.MemorySendChannel[int]
    to_send, to_worker = trio.open_memory_channel[int](10)

    async def old_worker_events(stream: trio.SocketStream) -> None:
        await stream.send_all(hello_frame())
        async for seq in to_worker:
            await stream.send_all(v1_heartbeat_frame(seq))

    async def refusing_requests(stream: trio.SocketStream) -> None:
        await stream.send_all(hello_frame())
        assert await stream.receive_some(65536)  # the Generate of request 1
        await stream.send_all(frame(wire.encode(REFUSALS[refusal])))
        await trio.sleep_forever()

    budget = EventBudget(1)
    budget.resize(1)  # one read a second
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            link, listener = await budget_link(
                nursery, old_worker_events, budget, requests=refusing_requests
            )
            await trio.sleep(0.2)  # the first read (at once) is behind us
            await to_send.send(1)
            await trio.sleep(0.05)  # in the socket, not read: the next read is a second away
            assert listener.newest == 0
            async with link.request("completions", {"prompt": "x"}) as stream:
                first = await stream.first()
                assert first == REFUSALS[refusal]
                assert listener.newest == 1  # applied before the refusal was handed over
            reads = link.stats.event_reads
            await trio.sleep(2.1)
            assert link.stats.event_reads - reads <= 3  # still about one a second
            nursery.cancel_scope.cancel()


def client_opcodes(data: bytes | bytearray) -> list[int]:
    return [opcode for opcode, _ in client_frames(data)]


@pytest.mark.parametrize("in_place", [False, True], ids=["task-reads", "watched"])
async def test_a_new_worker_is_asked_for_the_budget_interval(in_place: bool) -> None:
    # The real worker sends a heartbeat every 50 ms and lists the publish-interval feature: the
    # link asks for 0.3 s and gets about three batches a second, read by the link's task (no
    # pacer) or by the pacer watching the socket.
    settings = worker_settings(load_publish_interval=0.01)
    budget = EventBudget(10)
    budget.resize(3)
    with trio.fail_after(TIMEOUT):
        async with running_worker(settings) as (worker, address):
            hello = worker.hello
            assert wire.FEATURE_PUBLISH_INTERVAL in hello.features
            async with trio.open_nursery() as nursery:
                pacer = None
                if in_place:
                    pacer = ReadPacer()
                    await nursery.start(pacer.run)
                listener = SeqListener()
                link = WorkerLink(address.ws_url, listener, LINK, budget=budget, pacer=pacer)
                await nursery.start(link.run)
                await poll(lambda: link.connected, "the link to come up")
                assert link.negotiated
                assert not link.paced
                await trio.sleep(0.4)  # the subscribe is read; one batch under the old interval
                start_batches = listener.batches
                await trio.sleep(1.2)
                batches = listener.batches - start_batches
                # 24 heartbeats were produced; at 0.3 s apart at most 5 batches went out.
                assert 2 <= batches <= 5
                # Each read took one batch (read as it came, not paced).
                assert link.stats.event_reads <= link.stats.event_batches + 2
                await serve_one_request(link)
                nursery.cancel_scope.cancel()


async def test_an_old_frontend_gets_the_workers_own_interval() -> None:
    # A frontend of the fleet work's protocol: it sends the subscribe it knows (thresholds only,
    # no publish_interval) and then reads; the new worker keeps its own interval for it.
    settings = worker_settings(load_publish_interval=0.01)
    with trio.fail_after(TIMEOUT):
        async with running_worker(settings) as (_worker, address):
            host, port = address.ws_url.removeprefix("ws://").rsplit(":", 1)
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(
                    b"GET /v1/events HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    b"Sec-WebSocket-Version: 13\r\n\r\n"
                )
                buffer = b""
                while b"\r\n\r\n" not in buffer:
                    buffer += await stream.receive_some(4096)
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                assert head.startswith(b"HTTP/1.1 101")
                old_subscribe = msgspec.msgpack.encode(
                    {"type": "subscribe", "thresholds": {"active_decode_blocks": 0.5}}
                )
                await stream.send_all(client_frame(old_subscribe))
                messages: list[bytes] = []
                start = trio.current_time()
                while trio.current_time() - start < 1.0:
                    buffer += await stream.receive_some(65536)
                    while (parsed := _server_message(buffer)) is not None:
                        message, buffer = parsed
                        messages.append(message)
    hello = wire.decode_event_message(messages[0])
    assert isinstance(hello, wire.Hello)
    batches = [wire.decode_event_message(message) for message in messages[1:]]
    assert all(isinstance(batch, wire.EventBatch) for batch in batches)
    # Heartbeats every 50 ms, each sent at once under the worker's own 10 ms interval.
    assert len(batches) >= 10


def _server_message(buffer: bytes) -> tuple[bytes, bytes] | None:
    """One unmasked binary frame off the front of ``buffer`` (``None``: not all there yet)."""
    if len(buffer) < 2:
        return None
    size, offset = buffer[1] & 0x7F, 2
    if size == 126:
        if len(buffer) < 4:
            return None
        size, offset = struct.unpack("!H", buffer[2:4])[0], 4
    elif size == 127:
        if len(buffer) < 10:
            return None
        size, offset = struct.unpack("!Q", buffer[2:10])[0], 10
    if len(buffer) < offset + size:
        return None
    assert buffer[0] == 0x82
    return buffer[offset : offset + size], buffer[offset + size :]
