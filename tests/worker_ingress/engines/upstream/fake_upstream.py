"""A real fake upstream on loopback for the tests of the ``openai`` engine, and their helpers.

The fake upstream is a minimal trio + h11 server: each test gives it a handler that plays one
upstream behaviour (streams, errors, dies, hangs) and it records what it saw (bodies,
connections, disconnects). The ``upstream`` fixture serves it for one test; a test module
imports it as itself (``upstream_fixture as upstream_fixture``), which pytest then finds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import h11
import msgspec
import pytest
import trio

from worker_ingress.engines._base import (
    EngineConfig,
    EngineOutput,
)
from worker_ingress.engines.upstream._client import (
    Origin,
    UpstreamClient,
)
from worker_ingress.engines.upstream._engine import OpenAIUpstreamEngine

TIMEOUT = 10.0
FALLBACK = EngineConfig(
    kv_total_blocks=1000,
    block_size=4,
    max_num_batched_tokens=512,
    max_num_seqs=8,
    data_parallel_size=1,
)


# ------------------------------------------------------------------------------------------
# Fake upstream


class Exchange:
    """One request seen by the fake upstream and the means to answer it."""

    def __init__(
        self, stream: trio.SocketStream, conn: h11.Connection, request: h11.Request, body: bytes
    ) -> None:
        self.stream = stream
        self.conn = conn
        self.method = request.method.decode()
        self.target = request.target.decode()
        self.headers = {bytes(k).decode(): bytes(v).decode() for k, v in request.headers}
        self.body = body
        self.close_after = False

    @property
    def json(self) -> Any:
        return msgspec.json.decode(self.body)

    async def _send(self, event: h11.Event) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def send_json(self, status: int, payload: object) -> None:
        body = msgspec.json.encode(payload)
        await self.send_raw(status, body, b"application/json")

    async def send_raw(self, status: int, body: bytes, content_type: bytes = b"text/plain") -> None:
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await self._send(h11.Response(status_code=status, headers=headers))
        await self._send(h11.Data(data=body))
        await self._send(h11.EndOfMessage())

    async def start_sse(self) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await self._send(h11.Response(status_code=200, headers=headers))

    async def event(self, payload: object) -> None:
        data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
        await self._send(h11.Data(data=f"data: {data}\n\n".encode()))

    async def end_sse(self) -> None:
        await self.event("[DONE]")
        await self._send(h11.EndOfMessage())

    async def die(self) -> None:
        """Close the socket in the middle of a response."""
        await self.stream.aclose()

    async def wait_for_disconnect(self) -> None:
        """Read until the client closes (what an engine server does to abort a request)."""
        while await self.stream.receive_some(4096):
            pass


Handler = Callable[[Exchange], Awaitable[None]]


class FakeUpstream:
    """A tiny OpenAI-compatible server; ``routes`` maps ``METHOD /path`` to a handler."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.routes: dict[str, Handler] = {}
        self.seen: list[Exchange] = []
        self.connections = 0
        #: Clients whose idle connections are closed when the test ends.
        self.clients: list[UpstreamClient] = []
        self.disconnected = trio.Event()
        self.port = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._connection, listeners)
            task_status.started()

    @property
    def origin(self) -> Origin:
        return Origin(host=self.host, port=self.port)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = await self._read_request(stream, conn)
                if request is None:
                    return
                exchange = Exchange(stream, conn, request, body)
                self.seen.append(exchange)
                handler = self.routes.get(f"{exchange.method} {exchange.target}", _not_found)
                await handler(exchange)
                if exchange.close_after or conn.our_state is not h11.DONE:
                    return
                if conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            pass
        finally:
            self.disconnected.set()
            await trio.aclose_forcefully(stream)

    async def _read_request(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None, b""
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, body


async def _not_found(exchange: Exchange) -> None:
    await exchange.send_json(404, {"error": {"message": "not here", "type": "NotFound"}})


def make_engine(upstream: FakeUpstream, **kwargs: Any) -> OpenAIUpstreamEngine:
    engine = OpenAIUpstreamEngine(upstream.origin, FALLBACK, model="m", **kwargs)
    upstream.clients.append(engine.client)
    return engine


def chat_chunk(content: str | None, finish: str | None = None, index: int = 0) -> object:
    delta = {} if content is None else {"content": content}
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }


def usage_chunk(prompt: int, completion: int) -> object:
    return {
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
    }


async def collect(engine: OpenAIUpstreamEngine, prepared: Any) -> list[EngineOutput]:
    outputs: list[EngineOutput] = []
    async with aclosing(engine.generate(prepared)) as stream:
        async for output in stream:
            outputs.append(output)
    return outputs


def assert_idle(engine: OpenAIUpstreamEngine) -> None:
    (load,) = engine.load()
    assert (load.active_decode_blocks, load.active_prefill_tokens, load.kv_used_blocks) == (0, 0, 0)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "one two three four five"}]}


async def models_m(exchange: Exchange) -> None:
    """Answers ``GET /v1/models`` with the one model ``m``."""
    await exchange.send_json(200, {"object": "list", "data": [{"id": "m"}]})


@pytest.fixture(name="upstream")
async def upstream_fixture(nursery: trio.Nursery) -> AsyncIterator[FakeUpstream]:
    """A :class:`FakeUpstream` served on loopback for one test (import it as itself)."""
    server = FakeUpstream()
    await nursery.start(server.serve)
    yield server
    for client in server.clients:
        await client.aclose()
