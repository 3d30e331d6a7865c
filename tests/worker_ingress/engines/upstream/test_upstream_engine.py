"""The ``openai`` engine and its HTTP client, against a real fake upstream on loopback.

The fake upstream is a minimal trio + h11 server in this file: each test gives it a handler that
plays one upstream behaviour (streams, errors, dies, hangs) and it records what it saw (bodies,
connections, disconnects). Request validation is tested without sockets; the sans-IO parts of the
other modules of the package have test files of their own beside this one.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import h11
import httpx
import msgspec
import pytest
import trio
from trio_websocket import open_websocket_url

from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from shim_common import wire
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress._server import Worker
from worker_ingress.engines._base import (
    FIRST_OUTPUT,
    EngineConfig,
    EngineInputError,
    EngineOutput,
)
from worker_ingress.engines.upstream._client import (
    Origin,
    UpstreamClient,
    UpstreamConnectionError,
)
from worker_ingress.engines.upstream._engine import OpenAIUpstreamEngine, UpstreamError, create

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


@pytest.fixture
async def upstream(nursery: trio.Nursery) -> AsyncIterator[FakeUpstream]:
    server = FakeUpstream()
    await nursery.start(server.serve)
    yield server
    for client in server.clients:
        await client.aclose()


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


# ------------------------------------------------------------------------------------------
# Sans-IO: prepare and create


def test_prepare_forces_streaming_with_usage() -> None:
    engine = OpenAIUpstreamEngine(Origin("127.0.0.1", 1), FALLBACK, model="m")
    body = {**CHAT, "stream": False, "stream_options": {"other": 1}, "max_tokens": 7}
    prepared = engine.prepare("chat_completions", body)
    assert (prepared.prompt_tokens, prepared.max_tokens) == (5, 7)
    sent = msgspec.json.decode(prepared.payload.body)
    assert sent["stream"] is True
    assert sent["stream_options"] == {"other": 1, "include_usage": True}
    assert body["stream"] is False  # the caller's body is left alone
    completion = engine.prepare("completions", {"model": "m", "prompt": [[1, 2, 3], "a b"]})
    assert completion.prompt_tokens == 5
    embedding = engine.prepare("embeddings", {"model": "m", "input": ["a b", "c"]})
    assert embedding.prompt_tokens == 3
    assert "stream" not in msgspec.json.decode(embedding.payload.body)


@pytest.mark.parametrize(
    ("endpoint", "body", "message"),
    [
        ("chat_completions", {"messages": []}, "messages"),
        ("chat_completions", {"messages": "hi"}, "messages"),
        ("chat_completions", {"messages": ["hi"]}, r"messages\[0\] must be an object"),
        ("completions", {}, "prompt"),
        ("completions", {"prompt": 3}, "prompt"),
        ("embeddings", {}, "input"),
        ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
        ("completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ("completions", {"prompt": "x", "extra": object()}, "JSON"),
    ],
)
def test_prepare_refuses(endpoint: Any, body: dict[str, Any], message: str) -> None:
    engine = OpenAIUpstreamEngine(Origin("127.0.0.1", 1), FALLBACK, model="m")
    with pytest.raises(EngineInputError, match=message):
        engine.prepare(endpoint, body)


def test_create_reads_settings() -> None:
    settings = WorkerSettings(
        worker_id="w",
        engine="openai",
        upstream_url="http://127.0.0.1:8001/v1",
        mocker=MockerSettings(num_gpu_blocks=100, data_parallel_size=2),
    )
    engine = create(settings)
    assert engine.config.kv_total_blocks == 200
    assert engine.config.data_parallel_size == 1
    with pytest.raises(ValueError, match="upstream-url"):
        create(WorkerSettings(worker_id="w", engine="openai"))


# ------------------------------------------------------------------------------------------
# Against the fake upstream


async def test_streaming_chat(upstream: FakeUpstream) -> None:
    async def chat(exchange: Exchange) -> None:
        await exchange.start_sse()
        await exchange.event(chat_chunk(None))  # the role-only first chunk
        for word in (" one", " two"):
            await exchange.event(chat_chunk(word))
        await exchange.event(chat_chunk(" three", finish="stop"))
        await exchange.event(usage_chunk(5, 4))  # one more token than deltas: a merged delta
        await exchange.end_sse()

    upstream.routes["POST /v1/chat/completions"] = chat
    engine = make_engine(upstream)
    versions_before = engine.load_changed.version
    with trio.fail_after(TIMEOUT):
        for _ in range(2):
            outputs = await collect(engine, engine.prepare("chat_completions", CHAT))
            # The role-only first chunk is the first output (it frees a waiting place), sent
            # as the marker the worker does not forward.
            assert outputs[0] is FIRST_OUTPUT
            outputs = outputs[1:]
            assert "".join(output.text for output in outputs) == " one two three"
            assert [output.finish_reason for output in outputs] == [None, None, "stop"]
            assert sum(output.tokens for output in outputs) == 4
            assert_idle(engine)
    sent = upstream.seen[-1].json
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == CHAT["messages"]
    assert engine.load_changed.version > versions_before
    # Keep-alive: the second request reused the first connection.
    assert (engine.client.connections_opened, upstream.connections) == (1, 1)


async def test_streaming_completions(upstream: FakeUpstream) -> None:
    async def completions(exchange: Exchange) -> None:
        await exchange.start_sse()
        for index, piece in enumerate(("a", "b", "c")):
            finish = "length" if index == 2 else None
            chunk = {"choices": [{"index": 0, "text": piece, "finish_reason": finish}]}
            await exchange.event(chunk)
        await exchange.end_sse()

    upstream.routes["POST /v1/completions"] = completions
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT):
        prepared = engine.prepare("completions", {"model": "m", "prompt": "x y", "max_tokens": 3})
        outputs = await collect(engine, prepared)
    assert [(o.text, o.tokens, o.finish_reason) for o in outputs] == [
        ("a", 1, None),
        ("b", 1, None),
        ("c", 1, "length"),
    ]
    assert_idle(engine)


async def test_embeddings(upstream: FakeUpstream) -> None:
    packed = base64.b64encode(struct.pack("<2f", 0.5, -1.0)).decode()

    async def embeddings(exchange: Exchange) -> None:
        inputs = exchange.json["input"]
        if exchange.json.get("encoding_format") == "base64":
            data = [{"embedding": packed, "index": i} for i in range(len(inputs))]
        else:
            data = [{"embedding": [float(i), 1.0], "index": i} for i in reversed(range(2))]
        await exchange.send_json(200, {"object": "list", "data": data, "usage": {}})

    upstream.routes["POST /v1/embeddings"] = embeddings
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT):
        outputs = await collect(engine, engine.prepare("embeddings", {"input": ["a", "b"]}))
        assert [(o.index, o.embedding) for o in outputs] == [(0, [0.0, 1.0]), (1, [1.0, 1.0])]
        body = {"input": ["a"], "encoding_format": "base64"}
        outputs = await collect(engine, engine.prepare("embeddings", body))
        assert [o.embedding for o in outputs] == [[0.5, -1.0]]
    assert_idle(engine)


async def test_upstream_4xx_is_input_error(upstream: FakeUpstream) -> None:
    async def refuse(exchange: Exchange) -> None:
        message = "This model's maximum context length is 4096 tokens."
        await exchange.send_json(400, {"object": "error", "message": message, "code": 400})

    upstream.routes["POST /v1/chat/completions"] = refuse
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT), pytest.raises(EngineInputError, match="maximum context"):
        await collect(engine, engine.prepare("chat_completions", CHAT))
    assert_idle(engine)


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_upstream_overload_and_5xx_are_failures(upstream: FakeUpstream, status: int) -> None:
    async def fail(exchange: Exchange) -> None:
        await exchange.send_json(status, {"error": {"message": "engine sad"}})

    upstream.routes["POST /v1/chat/completions"] = fail
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT), pytest.raises(UpstreamError, match=f"{status}: engine sad"):
        await collect(engine, engine.prepare("chat_completions", CHAT))
    assert_idle(engine)


async def test_upstream_dies_mid_stream(upstream: FakeUpstream) -> None:
    async def die(exchange: Exchange) -> None:
        await exchange.start_sse()
        await exchange.event(chat_chunk("partial"))
        await exchange.die()

    upstream.routes["POST /v1/chat/completions"] = die
    engine = make_engine(upstream)
    outputs: list[EngineOutput] = []

    async def consume() -> None:
        async with aclosing(engine.generate(engine.prepare("chat_completions", CHAT))) as stream:
            async for output in stream:
                outputs.append(output)

    with trio.fail_after(TIMEOUT), pytest.raises(UpstreamError, match=r"connection lost|closed"):
        await consume()
    assert [output.text for output in outputs] == ["partial"]
    assert_idle(engine)


@pytest.mark.parametrize(
    ("ending", "message"),
    [
        ("truncated", "before finishing"),
        ("error_event", "failed mid-stream: out of memory"),
        ("garbage", "bad stream chunk"),
    ],
)
async def test_broken_streams(upstream: FakeUpstream, ending: str, message: str) -> None:
    async def broken(exchange: Exchange) -> None:
        await exchange.start_sse()
        await exchange.event(chat_chunk("partial"))
        if ending == "error_event":
            await exchange.event({"error": {"message": "out of memory", "code": 500}})
        elif ending == "garbage":
            await exchange.event("{not json")
        await exchange._send(h11.EndOfMessage())

    upstream.routes["POST /v1/chat/completions"] = broken
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT), pytest.raises(UpstreamError, match=message):
        await collect(engine, engine.prepare("chat_completions", CHAT))
    assert_idle(engine)


async def test_closing_the_generator_closes_the_upstream_connection(
    upstream: FakeUpstream,
) -> None:
    async def endless(exchange: Exchange) -> None:
        await exchange.start_sse()
        await exchange.event(chat_chunk("first"))
        await exchange.wait_for_disconnect()

    upstream.routes["POST /v1/chat/completions"] = endless
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT):
        async with aclosing(engine.generate(engine.prepare("chat_completions", CHAT))) as stream:
            first = await anext(stream)
            assert first.text == "first"
            (load,) = engine.load()
            assert (load.active_prefill_tokens, load.active_decode_blocks) == (0, 2)
        await upstream.disconnected.wait()
    assert_idle(engine)


async def test_cancellation_during_prefill_closes_the_connection(upstream: FakeUpstream) -> None:
    async def silent(exchange: Exchange) -> None:
        await exchange.wait_for_disconnect()  # a long prefill: no head, no bytes

    upstream.routes["POST /v1/chat/completions"] = silent
    engine = make_engine(upstream)

    async def consume() -> None:
        await collect(engine, engine.prepare("chat_completions", CHAT))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            for _ in range(1000):  # until the upstream has the request
                if upstream.seen:
                    break
                await trio.sleep(0.001)
            (load,) = engine.load()
            assert (load.active_prefill_tokens, load.active_decode_blocks) == (5, 2)
            nursery.cancel_scope.cancel()
        await upstream.disconnected.wait()
    assert_idle(engine)


async def test_read_timeout_is_a_failure(upstream: FakeUpstream) -> None:
    async def silent(exchange: Exchange) -> None:
        await exchange.wait_for_disconnect()

    upstream.routes["POST /v1/chat/completions"] = silent
    engine = make_engine(upstream, read_timeout=0.05)
    with trio.fail_after(TIMEOUT), pytest.raises(UpstreamError, match="sent nothing"):
        await collect(engine, engine.prepare("chat_completions", CHAT))
    assert_idle(engine)


async def test_stale_pooled_connection_is_not_used(upstream: FakeUpstream) -> None:
    async def once(exchange: Exchange) -> None:
        await exchange.send_json(200, {"data": []})
        exchange.close_after = True  # closes after answering, without saying Connection: close

    upstream.routes["GET /v1/models"] = once
    client = UpstreamClient(upstream.origin)
    with trio.fail_after(TIMEOUT):
        for _ in range(3):
            assert await client.request("GET", "/v1/models") == (200, b'{"data":[]}')
            await upstream.disconnected.wait()
            upstream.disconnected = trio.Event()
    await client.aclose()
    assert client.connections_opened == 3


async def test_connect_failure_is_an_upstream_error() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = OpenAIUpstreamEngine(Origin("127.0.0.1", port), FALLBACK, model="m")
    with trio.fail_after(TIMEOUT), pytest.raises(UpstreamError, match="cannot connect"):
        await collect(engine, engine.prepare("chat_completions", CHAT))
    assert_idle(engine)


async def test_run_waits_for_the_upstream_then_reads_its_limits_and_usage(
    upstream: FakeUpstream,
) -> None:
    probes = 0
    usage = [0.25]

    async def models(exchange: Exchange) -> None:
        nonlocal probes
        probes += 1
        if probes < 3:
            await exchange.send_json(503, {"error": "loading"})
        else:
            await exchange.send_json(200, {"object": "list", "data": [{"id": "m"}]})

    async def metrics(exchange: Exchange) -> None:
        text = (
            'vllm:cache_config_info{block_size="8",num_gpu_blocks="400"} 1.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage[0]}\n'
        )
        await exchange.send_raw(200, text.encode())

    upstream.routes["GET /v1/models"] = models
    upstream.routes["GET /metrics"] = metrics
    engine = make_engine(upstream, metrics_poll_interval=0.01)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            assert probes == 3
            assert (engine.config.kv_total_blocks, engine.config.block_size) == (400, 8)
            (load,) = engine.load()
            assert (load.kv_used_blocks, load.active_decode_blocks) == (100, 100)
            usage[0] = 0.0
            while engine.load()[0].kv_used_blocks != 0:
                await engine.load_changed.wait_past(engine.load_changed.version)
            nursery.cancel_scope.cancel()
    assert_idle(engine)


async def test_run_without_metrics_keeps_the_fallback(upstream: FakeUpstream) -> None:
    async def models(exchange: Exchange) -> None:
        await exchange.send_json(200, {"object": "list", "data": [{"id": "other"}]})

    upstream.routes["GET /v1/models"] = models
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            nursery.cancel_scope.cancel()
    assert engine.config == FALLBACK
    probed = [f"{exchange.method} {exchange.target}" for exchange in upstream.seen]
    assert probed == ["GET /v1/models", "GET /metrics", "GET /get_server_info", "GET /props"]


async def test_absurd_limits_from_the_upstream_fall_back_to_the_flags(
    upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    # A count past 2**53 could not go into the worker's hello (msgpack carries 64 bits at most).
    async def server_info(exchange: Exchange) -> None:
        info = {"max_total_num_tokens": 10**40, "page_size": 1, "max_running_requests": 4}
        await exchange.send_json(200, info)

    upstream.routes["GET /v1/models"] = _models_m
    upstream.routes["GET /get_server_info"] = server_info
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            nursery.cancel_scope.cancel()
    assert engine.config.kv_total_blocks == FALLBACK.kv_total_blocks
    assert engine.config.max_num_seqs == 4  # the sane values are still taken
    assert any("kv_total_blocks" in r.getMessage() for r in caplog.records)


async def test_config_read_before_run_stays_fixed(
    upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    async def models(exchange: Exchange) -> None:
        await exchange.send_json(200, {"object": "list", "data": [{"id": "m"}]})

    async def metrics(exchange: Exchange) -> None:
        text = (
            'vllm:cache_config_info{block_size="8",num_gpu_blocks="400"} 1.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        )
        await exchange.send_raw(200, text.encode())

    upstream.routes["GET /v1/models"] = models
    upstream.routes["GET /metrics"] = metrics
    engine = make_engine(upstream, metrics_poll_interval=3600)
    announced = engine.config  # what a worker puts in its hello before starting the engine
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            nursery.cancel_scope.cancel()
    assert engine.config == announced == FALLBACK
    # The usage fraction is scaled to the announced total, so the decode ratio stays right.
    assert engine.load()[0].kv_used_blocks == 250
    assert "--num-gpu-blocks 400 --block-size 8" in caplog.text


@pytest.mark.parametrize("request_limit", [None, 2, 8])
async def test_llamacpp_limits_load_and_request_limit(
    upstream: FakeUpstream, caplog: pytest.LogCaptureFixture, request_limit: int | None
) -> None:
    processing = [True]

    async def props(exchange: Exchange) -> None:
        settings = {"n_ctx": 1024, "params": {}}
        await exchange.send_json(200, {"total_slots": 2, "default_generation_settings": settings})

    async def slots(exchange: Exchange) -> None:
        held = {"is_processing": processing[0], "n_prompt_tokens": 30}
        await exchange.send_json(200, [{"id": 0, **held}, {"id": 1, "is_processing": False}])

    upstream.routes["GET /v1/models"] = _models_m
    upstream.routes["GET /props"] = props
    upstream.routes["GET /slots"] = slots
    engine = make_engine(upstream, metrics_poll_interval=0.01, request_limit=request_limit)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            # 2 slots of 1024 tokens in blocks of 4; 30 tokens held in one slot.
            assert (engine.config.kv_total_blocks, engine.config.max_num_seqs) == (512, 2)
            assert engine.load()[0].kv_used_blocks == 8
            processing[0] = False
            while engine.load()[0].kv_used_blocks != 0:
                await engine.load_changed.wait_past(engine.load_changed.version)
            nursery.cancel_scope.cancel()
    warned = [r.getMessage() for r in caplog.records if "--engine-request-limit" in r.getMessage()]
    if request_limit == 2:
        assert warned == []
    else:
        assert len(warned) == 1
        assert "runs at" in warned[0]
        assert "set --engine-request-limit 2" in warned[0]


async def test_reused_connection_dropped_under_us_is_retried_once(upstream: FakeUpstream) -> None:
    calls = 0

    async def flaky(exchange: Exchange) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            await exchange.die()  # the idle timeout fired just as the request went out
            return
        await exchange.send_json(200, {"call": calls})

    upstream.routes["POST /x"] = flaky
    client = UpstreamClient(upstream.origin)
    upstream.clients.append(client)
    with trio.fail_after(TIMEOUT):
        assert await client.request("POST", "/x") == (200, b'{"call":1}')
        assert await client.request("POST", "/x") == (200, b'{"call":3}')
    assert client.connections_opened == 2


async def test_fresh_connection_dropped_is_not_retried(upstream: FakeUpstream) -> None:
    async def drop(exchange: Exchange) -> None:
        await exchange.die()

    upstream.routes["POST /x"] = drop
    client = UpstreamClient(upstream.origin)
    upstream.clients.append(client)
    with trio.fail_after(TIMEOUT), pytest.raises(UpstreamConnectionError):
        await client.request("POST", "/x")
    assert (client.connections_opened, len(upstream.seen)) == (1, 1)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


async def test_ipv6_upstream_gets_a_bracketed_host_header(nursery: trio.Nursery) -> None:
    if not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    upstream = FakeUpstream(host="::1")
    await nursery.start(upstream.serve)

    async def models(exchange: Exchange) -> None:
        await exchange.send_json(200, {"object": "list", "data": [{"id": "m"}]})

    upstream.routes["GET /v1/models"] = models
    engine = create(
        WorkerSettings(worker_id="w", engine="openai", upstream_url=f"http://[::1]:{upstream.port}")
    )
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as inner:
            await inner.start(engine.run)
            inner.cancel_scope.cancel()
    assert upstream.seen[0].headers["host"] == f"[::1]:{upstream.port}"


# ------------------------------------------------------------------------------------------
# Through a worker and a frontend (in-process): several choices stay several choices


async def _models_m(exchange: Exchange) -> None:
    await exchange.send_json(200, {"object": "list", "data": [{"id": "m"}]})


async def _two_choices(exchange: Exchange) -> None:
    """An upstream answering ``n: 2``: the deltas of both choices interleave, as vLLM sends them."""
    chat = exchange.target.endswith("/chat/completions")

    def piece(index: int, text: str | None, finish: str | None = None) -> object:
        if chat:
            return chat_chunk(text, finish, index)
        return {"choices": [{"index": index, "text": text or "", "finish_reason": finish}]}

    assert exchange.json["n"] == 2
    await exchange.start_sse()
    for first, second in (("alpha", "gamma"), (" beta", " delta")):
        await exchange.event(piece(0, first))
        await exchange.event(piece(1, second))
    await exchange.event(piece(1, None, "length"))
    await exchange.event(piece(0, None, "stop"))
    await exchange.event(usage_chunk(3, 4))
    await exchange.end_sse()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_reach_the_client_apart(
    upstream: FakeUpstream, path: str, stream: bool
) -> None:
    upstream.routes["GET /v1/models"] = _models_m
    upstream.routes["POST /v1/chat/completions"] = _two_choices
    upstream.routes["POST /v1/completions"] = _two_choices
    settings = WorkerSettings(worker_id="w", host="127.0.0.1", port=0, system_port=0, model="m")
    engine = make_engine(upstream)
    body: dict[str, Any] = {"model": "m", "n": 2, "stream": stream, "max_tokens": 2}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(Worker(settings, engine).serve)
            frontend = FrontendSettings(http_port=0, workers=(address.ws_url,))
            url = await nursery.start(run_frontend, frontend)
            async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
                for _ in range(500):  # until the frontend has the worker
                    if (await client.get("/health")).json()["workers_connected"] == 1:
                        break
                    await trio.sleep(0.01)
                if stream:
                    async with client.stream("POST", path, json=body) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            for choice in json.loads(line[len("data: ") :])["choices"]:
                                text = choice["delta"]["content"] if "delta" in choice else ""
                                text = text or choice.get("text") or ""
                                texts[choice["index"]] = texts.get(choice["index"], "") + text
                                if choice["finish_reason"]:
                                    finishes[choice["index"]] = choice["finish_reason"]
                else:
                    response = await client.post(path, json=body)
                    assert response.status_code == 200, response.text
                    answer = response.json()
                    assert [choice["index"] for choice in answer["choices"]] == [0, 1]
                    assert answer["usage"]["completion_tokens"] == 4
                    for choice in answer["choices"]:
                        message = choice.get("message")
                        texts[choice["index"]] = message["content"] if message else choice["text"]
                        finishes[choice["index"]] = choice["finish_reason"]
            nursery.cancel_scope.cancel()
    assert texts == {0: "alpha beta", 1: "gamma delta"}
    assert finishes == {0: "stop", 1: "length"}


async def test_the_first_upstream_chunk_gives_the_waiting_place_back(
    upstream: FakeUpstream,
) -> None:
    # N = 2 slots but W = 1: the second request waits while the first one has no output yet,
    # and starts as soon as the upstream's first chunk (role-only, no text) arrives.
    send_role = trio.Event()
    release = trio.Event()

    async def chat(exchange: Exchange) -> None:
        await exchange.start_sse()
        await send_role.wait()
        await exchange.event(chat_chunk(None))  # the role-only first chunk
        await release.wait()
        await exchange.event(chat_chunk(" hi", finish="stop"))
        await exchange.end_sse()

    upstream.routes["GET /v1/models"] = _models_m
    upstream.routes["POST /v1/chat/completions"] = chat
    settings = WorkerSettings(
        worker_id="w",
        host="127.0.0.1",
        port=0,
        system_port=0,
        model="m",
        engine_request_limit=2,
        engine_request_waiting_limit=1,
    )
    worker = Worker(settings, make_engine(upstream))
    gate = worker.gate

    async def until(condition: Callable[[], bool]) -> None:
        for _ in range(500):
            if condition():
                return
            await trio.sleep(0.01)
        raise AssertionError("the gate never got there")

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(worker.serve)
            async with open_websocket_url(address.ws_url + wire.REQUESTS_PATH) as ws:
                await ws.get_message()  # the hello
                for request_id in (1, 2):
                    generate = wire.Generate(
                        request_id=request_id, endpoint="chat_completions", body=CHAT
                    )
                    await ws.send_message(wire.encode(generate))
                await until(lambda: (gate.running, gate.waiting, gate.queued) == (1, 1, 1))
                send_role.set()
                await until(lambda: gate.running == 2)
                await until(lambda: gate.waiting == 0)
                release.set()
                ended: set[int] = set()
                while ended != {1, 2}:
                    message = await ws.get_message()
                    assert isinstance(message, bytes)
                    reply = wire.decode_worker_message(message)
                    assert not isinstance(reply, wire.Chunk) or reply.text  # no empty chunk
                    if isinstance(reply, wire.End):
                        ended.add(reply.request_id)
            nursery.cancel_scope.cancel()
    assert gate.state.admitted_queue_total == 1


@pytest.mark.parametrize(
    ("tail", "cached"),
    [
        # vLLM (with --enable-prompt-tokens-details) and newer llama.cpp: OpenAI's field.
        (
            {
                "usage": {
                    "prompt_tokens": 9,
                    "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": 8},
                }
            },
            8,
        ),
        # llama.cpp's own count, beside a usage that does not say.
        ({"usage": {"prompt_tokens": 9, "completion_tokens": 1}, "timings": {"cache_n": 5}}, 5),
        # An upstream that says nothing: 0.
        ({"usage": {"prompt_tokens": 9, "completion_tokens": 1}}, 0),
        (
            {
                "usage": {
                    "prompt_tokens": 9,
                    "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": None},
                }
            },
            0,
        ),
    ],
)
async def test_the_upstreams_cached_tokens_are_passed_on_and_counted(
    upstream: FakeUpstream, tail: dict[str, Any], cached: int
) -> None:
    async def chat(exchange: Exchange) -> None:
        await exchange.start_sse()
        await exchange.event(chat_chunk(" one", finish="length"))
        await exchange.event({"choices": [], **tail})
        await exchange.end_sse()

    upstream.routes["POST /v1/chat/completions"] = chat
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT):
        outputs = await collect(engine, engine.prepare("chat_completions", CHAT))
    assert outputs[-1].finish_reason == "length"
    assert outputs[-1].cached_tokens == cached
    (stats,) = engine.prefix_cache_stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (9, cached)
