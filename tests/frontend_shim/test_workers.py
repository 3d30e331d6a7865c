"""The frontend's worker links and pool against real loopback sessions: a real
:class:`worker_ingress._server.Worker` (or, for protocol faults, a small fake) on 127.0.0.1 with
port 0, every test under ``trio.fail_after``.

The pure parts have files of their own: the request table and the per-request buffer
(test_request_plane.py), worker URLs and name resolution (test_discovery.py), the backoff
(tests/shim_common/test_net.py).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import hashlib
import random
import struct
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import pytest
import trio
import trio.testing
import trio_websocket

from frontend_shim._links import LinkSettings, WorkerLink
from frontend_shim._pool import WorkerPool
from shim_common import wire
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress._server import Worker, WorkerAddress
from worker_ingress._watch import ChangeSignal
from worker_ingress.engines._base import EngineOutput, PreparedRequest
from worker_ingress.engines._instant import InstantEngine, create

# Fast timings for loopback tests; the keepalive is far longer than any loopback round trip.
FAST = LinkSettings(
    connect_timeout=2.0,
    disconnect_timeout=0.1,
    keepalive_interval=0.2,
    keepalive_timeout=2.0,
    backoff_initial=0.02,
    backoff_cap=0.2,
)

# ----------------------------------------------------------------------------- loopback


class RecordingListener:
    """A FleetListener that records calls and lets a test wait for a condition."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.configs: list[wire.RuntimeConfig] = []
        self.events: list[wire.WorkerEvent] = []
        self.changed = ChangeSignal()
        self.busy_thresholds: wire.BusyThresholds | None = None

    def worker_up(self, key: str, config: wire.RuntimeConfig, now: float) -> None:
        self.calls.append(("up", key))
        self.configs.append(config)
        self.changed.bump()

    def worker_events(self, key: str, events: Sequence[wire.WorkerEvent], now: float) -> None:
        self.events.extend(events)
        self.changed.bump()

    def worker_lagging(self, key: str, lagging: bool, now: float) -> None:
        self.calls.append(("lagging" if lagging else "caught up", key))
        self.changed.bump()

    def worker_down(self, key: str, now: float) -> None:
        self.calls.append(("down", key))
        self.changed.bump()

    def thresholds(self, model: str) -> wire.BusyThresholds | None:
        return self.busy_thresholds

    def count(self, what: str) -> int:
        return sum(1 for call, _ in self.calls if call == what)

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Wait (the caller bounds the time) until ``condition()`` holds."""
        version = self.changed.version
        while not condition():
            version = await self.changed.wait_past(version)


async def poll_until(condition: Callable[[], bool], *, attempts: int = 500) -> None:
    """Check ``condition`` every 10 ms, at most ``attempts`` times (the caller bounds time)."""
    for _ in range(attempts):
        if condition():
            return
        await trio.sleep(0.01)
    raise AssertionError("condition never held")


class HoldingEngine(InstantEngine):
    """The instant engine, except a body with ``"hold": true`` streams one chunk then waits."""

    def __init__(self) -> None:
        super().__init__(create(_settings()).config)

    def prepare(self, endpoint: wire.Endpoint, body: dict[str, Any]) -> PreparedRequest:
        prepared = super().prepare(endpoint, body)
        if body.get("hold"):
            return PreparedRequest(
                endpoint=endpoint,
                prompt_tokens=prepared.prompt_tokens,
                max_tokens=prepared.max_tokens,
                payload="hold",
            )
        return prepared

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        if request.payload == "hold":
            yield EngineOutput(text="first", tokens=1)
            await trio.sleep_forever()
        async for output in super().generate(request):
            yield output


def _settings(**overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = {
        "port": 0,
        "system_port": 0,
        "worker_id": "w-test",
        "heartbeat_interval": 0.05,
        "mocker": MockerSettings(num_gpu_blocks=64),
    }
    values.update(overrides)
    return WorkerSettings(**values)


async def start_worker(
    nursery: trio.Nursery, **overrides: Any
) -> tuple[Worker, WorkerAddress, trio.CancelScope]:
    """Start a real worker; cancelling the returned scope kills it without a drain."""
    worker = Worker(_settings(**overrides), HoldingEngine())
    scope = trio.CancelScope()

    async def serve(*, task_status: trio.TaskStatus[WorkerAddress]) -> None:
        with scope:
            await worker.serve(task_status=task_status)

    address = await nursery.start(serve)
    return worker, address, scope


async def start_link(
    nursery: trio.Nursery, key: str, settings: LinkSettings = FAST
) -> tuple[WorkerLink, RecordingListener]:
    listener = RecordingListener()
    link = WorkerLink(key, listener, settings, rng=random.Random(1))
    await nursery.start(link.run)
    return link, listener


PROMPT = {"prompt": "one two three", "max_tokens": 5}


async def test_hello_config_and_events_reach_the_listener(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        _, address, _ = await start_worker(nursery, engine_request_limit=4)
        link, listener = await start_link(nursery, address.ws_url)
        await link.wait_connected()
        assert link.connected
        assert listener.calls == [("up", address.ws_url)]
        assert link.config is not None
        assert link.config.worker_id == "w-test"
        assert link.config.engine_request_limit == 4
        assert link.config.kv_total_blocks == 64
        await listener.wait_until(
            lambda: any(isinstance(e, wire.Heartbeat) for e in listener.events)
        )


async def test_a_request_streams_end_to_end(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        _, address, _ = await start_worker(nursery)
        link, _ = await start_link(nursery, address.ws_url)
        await link.wait_connected()
        async with link.request("completions", PROMPT) as stream:
            first = await stream.first()
            assert isinstance(first, wire.Started)
            assert first.prompt_tokens == 3
            replies = [reply async for reply in stream]
        chunks = [r for r in replies if isinstance(r, wire.Chunk)]
        assert sum(c.tokens for c in chunks) == 5
        assert chunks[-1].finish_reason == "length"
        end = replies[-1]
        assert isinstance(end, wire.End)
        assert (end.request_id, end.prompt_tokens, end.completion_tokens) == (
            stream.request_id,
            3,
            5,
        )
        assert end.ended_seq is not None
        assert link.open_requests == 0


async def test_many_concurrent_requests_share_one_connection(nursery: trio.Nursery) -> None:
    totals: list[int] = []

    async def one(link: WorkerLink, index: int) -> None:
        body = {"prompt": "x " * (index + 1), "max_tokens": index % 7 + 1}
        async with link.request("completions", body) as stream:
            assert isinstance(await stream.first(), wire.Started)
            replies = [reply async for reply in stream]
        end = replies[-1]
        assert isinstance(end, wire.End)
        assert end.prompt_tokens == index + 1
        assert sum(r.tokens for r in replies if isinstance(r, wire.Chunk)) == index % 7 + 1
        totals.append(end.completion_tokens)

    with trio.fail_after(20):
        _, address, _ = await start_worker(nursery)
        link, _ = await start_link(nursery, address.ws_url)
        await link.wait_connected()
        async with trio.open_nursery() as clients:
            for index in range(100):
                clients.start_soon(one, link, index)
        assert sorted(totals) == sorted(i % 7 + 1 for i in range(100))
        assert link.stats.sessions == 1


async def test_a_full_worker_rejects_and_a_leaving_client_frees_its_place(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(10):
        worker, address, _ = await start_worker(
            nursery, engine_request_limit=1, request_queue_limit=2
        )
        link, _ = await start_link(nursery, address.ws_url)
        await link.wait_connected()
        hold = {"prompt": "a", "hold": True}
        async with (
            link.request("completions", hold) as running,
            link.request("completions", hold) as queued_1,
            link.request("completions", hold) as queued_2,
        ):
            assert isinstance(await running.first(), wire.Started)
            await poll_until(lambda: worker.gate.queued == 2)
            async with link.request("completions", hold) as extra:
                rejected = await extra.first()
            assert rejected == wire.Rejected(
                request_id=extra.request_id, reason=wire.RejectReason.OVERLOADED
            )
            assert (worker.gate.running, worker.gate.queued) == (1, 2)
            del queued_1, queued_2
        # Leaving sent Cancel for the running one and both queued ones.
        await poll_until(lambda: (worker.gate.running, worker.gate.queued) == (0, 0))
        assert link.connected


async def test_a_cancelled_consumer_cancels_its_request(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        worker, address, _ = await start_worker(nursery, engine_request_limit=2)
        link, _ = await start_link(nursery, address.ws_url)
        await link.wait_connected()
        with trio.move_on_after(0.2):
            async with link.request("completions", {"prompt": "a", "hold": True}) as stream:
                assert isinstance(await stream.first(), wire.Started)
                async for _ in stream:
                    pass
        await poll_until(lambda: worker.gate.running == 0)
        assert link.open_requests == 0


async def test_a_killed_worker_fails_its_requests_and_comes_back(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        _, address, kill = await start_worker(nursery)
        port = int(address.ws_url.rsplit(":", 1)[1])
        link, listener = await start_link(nursery, address.ws_url)
        await link.wait_connected()
        async with link.request("completions", {"prompt": "a", "hold": True}) as stream:
            assert isinstance(await stream.first(), wire.Started)
            kill.cancel()
            with trio.fail_after(3):  # promptly, not after a keepalive timeout
                replies = [reply async for reply in stream]
        assert isinstance(replies[-1], wire.Failed)
        assert replies[-1].kind == "unavailable"
        await listener.wait_until(lambda: listener.count("down") == 1)
        assert not link.connected
        async with link.request("completions", PROMPT) as stream:
            assert isinstance(await stream.first(), wire.Failed)

        # The worker comes back on the same port: the link reconnects by itself.
        await start_worker(nursery, port=port, worker_id="w-again")
        await listener.wait_until(lambda: listener.count("up") == 2)
        assert listener.configs[-1].worker_id == "w-again"
        async with link.request("completions", PROMPT) as stream:
            assert isinstance(await stream.first(), wire.Started)
            assert isinstance([r async for r in stream][-1], wire.End)
        assert link.stats.requests_failed_by_disconnect == 1


async def test_an_unreachable_worker_is_retried_quietly(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        # A port that was just free: connections are refused.
        listener_socket = trio.socket.socket()
        await listener_socket.bind(("127.0.0.1", 0))
        port = listener_socket.getsockname()[1]
        listener_socket.close()
        link, listener = await start_link(nursery, f"ws://127.0.0.1:{port}")
        await poll_until(lambda: link.stats.connect_failures >= 3)
        assert listener.calls == []
        async with link.request("completions", PROMPT) as stream:
            first = await stream.first()
        assert isinstance(first, wire.Failed)
        assert first.kind == "unavailable"


# A fake worker for protocol faults the real one never commits.


async def serve_fake(
    nursery: trio.Nursery,
    on_request_plane: Callable[[trio_websocket.WebSocketConnection], Any],
) -> int:
    hello = wire.encode(
        wire.Hello(
            protocol_version=wire.PROTOCOL_VERSION,
            config=Worker(_settings(), HoldingEngine()).hello.config,
        )
    )

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        try:
            await ws.send_message(hello)
            if request.path == "/v1/requests":
                await on_request_plane(ws)
            else:
                while True:
                    await ws.get_message()
        except trio_websocket.ConnectionClosed:
            pass

    server = await nursery.start(trio_websocket.serve_websocket, handler, "127.0.0.1", 0, None)
    return int(server.port)


async def test_an_undecodable_message_ends_the_session_and_is_counted(
    nursery: trio.Nursery,
) -> None:
    async def garbage_after_generate(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.get_message()
        await ws.send_message(b"\xc1 not msgpack")
        await ws.get_message()

    with trio.fail_after(10):
        port = await serve_fake(nursery, garbage_after_generate)
        link, listener = await start_link(nursery, f"ws://127.0.0.1:{port}")
        await link.wait_connected()
        async with link.request("completions", PROMPT) as stream:
            first = await stream.first()
        assert isinstance(first, wire.Failed)
        assert first.kind == "unavailable"
        assert link.stats.protocol_errors == 1
        await listener.wait_until(lambda: listener.count("up") == 2)  # reconnected


async def test_a_wrong_protocol_version_is_refused(nursery: trio.Nursery) -> None:
    config = Worker(_settings(), HoldingEngine()).hello.config

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.send_message(wire.encode(wire.Hello(protocol_version=99, config=config)))
        with contextlib.suppress(trio_websocket.ConnectionClosed):
            await ws.get_message()

    with trio.fail_after(10):
        server = await nursery.start(trio_websocket.serve_websocket, handler, "127.0.0.1", 0, None)
        link, listener = await start_link(nursery, f"ws://127.0.0.1:{server.port}")
        await poll_until(lambda: link.stats.connect_failures >= 2)
        assert listener.calls == []


async def test_a_worker_whose_heartbeats_stop_is_dropped(nursery: trio.Nursery) -> None:
    """The event plane has no ping of its own: silence past 3 heartbeats ends the session."""

    async def answer_pings_only(ws: trio_websocket.WebSocketConnection) -> None:
        while True:  # the request plane stays healthy (pongs are automatic)
            await ws.get_message()

    settings = dataclasses.replace(
        FAST, keepalive_timeout=0.3, backoff_initial=5.0, backoff_cap=5.0
    )
    with trio.fail_after(10):
        # The fake's event plane sends its hello (heartbeat interval 0.05 s), then nothing.
        port = await serve_fake(nursery, answer_pings_only)
        link, listener = await start_link(nursery, f"ws://127.0.0.1:{port}", settings)
        await link.wait_connected()
        await listener.wait_until(lambda: listener.count("down") == 1)
        assert link.stats.keepalive_timeouts == 1


def _accept_key(key: bytes) -> bytes:
    digest = hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()
    return base64.b64encode(digest)


async def test_a_silent_worker_is_dropped_by_the_keepalive(nursery: trio.Nursery) -> None:
    """A peer that completes the handshake and the hello, then never answers a ping."""
    hello = wire.encode(
        wire.Hello(
            protocol_version=wire.PROTOCOL_VERSION,
            config=Worker(_settings(), HoldingEngine()).hello.config,
        )
    )

    async def mute_peer(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(4096)
            if not data:
                return
            head += data
        key = next(
            line.split(b":", 1)[1].strip()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")
        )
        await stream.send_all(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + _accept_key(key) + b"\r\n\r\n"
        )
        await stream.send_all(b"\x82\x7e" + struct.pack("!H", len(hello)) + hello)
        with trio.move_on_after(30):
            while await stream.receive_some(4096):
                pass  # read and ignore everything: pings go unanswered

    settings = LinkSettings(
        connect_timeout=2.0,
        disconnect_timeout=0.2,
        keepalive_interval=0.05,
        keepalive_timeout=0.3,
        backoff_initial=5.0,
        backoff_cap=5.0,
    )
    with trio.fail_after(10):
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, mute_peer, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        link, listener = await start_link(nursery, f"ws://127.0.0.1:{port}", settings)
        await link.wait_connected()
        await listener.wait_until(lambda: listener.count("down") == 1)
        assert link.stats.keepalive_timeouts >= 1
        nursery.cancel_scope.cancel()


# ----------------------------------------------------------------------------- the pool


async def test_a_host_name_becomes_one_link_per_address(nursery: trio.Nursery) -> None:
    async def resolver(host: str, port: int) -> list[str]:
        assert host == "workers.test"
        return ["127.0.0.1", "127.0.0.2"]

    with trio.fail_after(10):
        _, first, _ = await start_worker(nursery, worker_id="w-first")
        port = int(first.ws_url.rsplit(":", 1)[1])
        try:
            await start_worker(nursery, worker_id="w-second", host="127.0.0.2", port=port)
        except OSError as exc:
            pytest.skip(f"127.0.0.2 is not a local address here: {exc}")
        pool = WorkerPool([f"ws://workers.test:{port}"], settings=FAST, resolver=resolver)
        listener = RecordingListener()
        await nursery.start(pool.run, listener)
        keys = {f"ws://127.0.0.1:{port}", f"ws://127.0.0.2:{port}"}
        assert set(pool.links) == keys
        for key in keys:
            link = pool.links[key]
            await link.wait_connected()
            async with link.request("completions", PROMPT) as stream:
                assert isinstance(await stream.first(), wire.Started)
        # Each address reached its own worker.
        await listener.wait_until(lambda: listener.count("up") == 2)
        assert {key for call, key in listener.calls if call == "up"} == keys
        assert sorted(config.worker_id for config in listener.configs) == ["w-first", "w-second"]
        assert pool.link("ws://192.0.2.1:1") is None
        nursery.cancel_scope.cancel()


async def test_re_resolution_adds_and_stops_links(nursery: trio.Nursery) -> None:
    answers: list[list[str] | OSError] = [
        ["127.0.0.1"],
        OSError("lookup failed"),  # keeps what the name had
        ["127.0.0.1", "127.0.0.2"],
        ["127.0.0.2"],
    ]
    lookups = ChangeSignal()

    async def resolver(host: str, port: int) -> list[str]:
        assert host == "workers.test"
        answer = answers[min(lookups.version, len(answers) - 1)]
        lookups.bump()
        if isinstance(answer, OSError):
            raise answer
        return list(answer)

    with trio.fail_after(10):
        _, address, _ = await start_worker(nursery)
        port = int(address.ws_url.rsplit(":", 1)[1])
        pool = WorkerPool(
            [f"ws://workers.test:{port}"], settings=FAST, resolve_interval=0.05, resolver=resolver
        )
        listener = RecordingListener()
        await nursery.start(pool.run, listener)
        first_key = f"ws://127.0.0.1:{port}"
        assert set(pool.links) == {first_key}
        first = pool.links[first_key]
        await first.wait_connected()
        await lookups.wait_past(2)
        await poll_until(lambda: set(pool.links) == {f"ws://127.0.0.2:{port}"})
        # The removed link ended its session and told the listener.
        await listener.wait_until(lambda: ("down", first_key) in listener.calls)
        assert not first.connected
        nursery.cancel_scope.cancel()
