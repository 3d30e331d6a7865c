"""The ``openai`` engine and its HTTP client, against a real fake upstream on loopback.

Request validation is tested without sockets; then streams, errors, broken and cancelled
streams, timeouts and the connection pool against the fake upstream of ``fake_upstream.py``.
The limits the engine reads from its upstream are tested in ``test_upstream_limits.py``, the
engine behind a worker and a frontend in ``test_upstream_through_the_shim.py``; the sans-IO
parts of the other modules of the package have test files of their own beside this one.
"""

from __future__ import annotations

import base64
import socket
import struct
from contextlib import aclosing
from typing import Any

import h11
import msgspec
import pytest
import trio
from fake_upstream import (
    CHAT,
    FALLBACK,
    TIMEOUT,
    Exchange,
    FakeUpstream,
    assert_idle,
    chat_chunk,
    collect,
    make_engine,
    usage_chunk,
)
from fake_upstream import (
    upstream_fixture as upstream_fixture,
)

from shim_common._client_text import QUOTE_CHARS, shorten
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress.engines._base import (
    FIRST_OUTPUT,
    EngineInputError,
    EngineOutput,
)
from worker_ingress.engines.upstream._client import (
    Origin,
    UpstreamClient,
    UpstreamConnectionError,
)
from worker_ingress.engines.upstream._engine import (
    OpenAIUpstreamEngine,
    UpstreamError,
    _error_message,
    create,
)

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


LONG = "why " * 200


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (msgspec.json.encode({"error": {"message": LONG}}), LONG),
        (msgspec.json.encode({"error": LONG}), LONG),
        (msgspec.json.encode({"object": "error", "message": LONG}), LONG),
        (msgspec.json.encode({"detail": LONG}), LONG),
        (msgspec.json.encode({"other": LONG}), msgspec.json.encode({"other": LONG}).decode()),
        (f"  {LONG}  ".encode(), LONG.strip()),
        (b"", "(empty body)"),
    ],
)
def test_an_upstream_error_is_quoted_by_the_one_rule_whatever_its_shape(
    body: bytes, message: str
) -> None:
    quoted = _error_message(body)
    assert quoted == shorten(message)
    assert len(quoted) < QUOTE_CHARS + 30


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
