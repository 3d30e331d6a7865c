"""Fuzzed input: whatever bytes or JSON a client sends, the answer is an error, never a crash.

Each property runs the real parser on generated input; the bar is "a clear error and nothing
else lost": the HTTP server answers with a status line or closes, and reports no handler error;
the frontend's body checks raise only :class:`BadRequest`; the wire decoders raise only
``msgspec.DecodeError``.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgspec
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_shim._admin import parse_threshold_update
from frontend_shim._request_body import BadRequest, parse_completion_body
from shim_common import wire
from shim_common._httpserver import HTTPLimits, HTTPRequest, HTTPResponder, serve_connection

# Pieces of HTTP that make generated input reach deep into the parser, not stop at byte 1.
_FRAGMENTS = [
    b"GET / HTTP/1.1\r\n",
    b"POST /v1/completions HTTP/1.1\r\n",
    b"Host: x\r\n",
    b"Content-Length: 5\r\n",
    b"Content-Length: -1\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Expect: 100-continue\r\n",
    b"Connection: close\r\n",
    b"\r\n",
    b"5\r\nhello\r\n0\r\n\r\n",
    b"zz\r\n",
    b'{"model":"m"}',
    b"\x00\xff",
    b" ",
    b":",
]
_http_input = st.lists(
    st.one_of(st.sampled_from(_FRAGMENTS), st.binary(max_size=40)), max_size=12
).map(b"".join)


async def _echo_body(request: HTTPRequest, responder: HTTPResponder) -> None:
    body = await request.read_body()
    await responder.send(200, [(b"content-type", b"text/plain")], body[:16])


async def _serve_bytes(data: bytes) -> tuple[bytes, list[BaseException]]:
    errors: list[BaseException] = []
    client, server = trio.testing.memory_stream_pair()
    limits = HTTPLimits(max_body_bytes=64, header_timeout=1.0, body_timeout=1.0)
    received = bytearray()
    with trio.fail_after(30):  # virtual time: the autojump clock skips the timeouts
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: serve_connection(server, _echo_body, limits=limits, on_error=errors.append)
            )
            await client.send_all(data)
            await client.send_eof()
            # Bounded: the server closes at the latest after its header timeout.
            while chunk := await client.receive_some(65536):
                received += chunk
                if len(received) > 1_000_000:
                    raise AssertionError("the server answered without bound")
    return bytes(received), errors


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_http_input)
def test_the_http_server_answers_or_closes_on_any_bytes(data: bytes) -> None:
    received, errors = trio.run(
        _serve_bytes, data, clock=trio.testing.MockClock(autojump_threshold=0)
    )
    assert errors == []  # a bad client is never a server error
    if received:
        assert received.startswith(b"HTTP/1.1 ")


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
    | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
_bodies = st.one_of(
    _json,
    st.fixed_dictionaries(
        {"model": _json},
        optional={
            "stream": _json,
            "messages": _json,
            "prompt": _json,
            "active_decode_blocks_threshold": _json,
            "active_prefill_tokens_threshold": _json,
            "active_prefill_tokens_threshold_frac": _json,
        },
    ),
)


def _encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@given(st.one_of(_bodies.map(_encode), st.binary(max_size=64)))
def test_completion_bodies_are_accepted_or_refused_with_400(raw: bytes) -> None:
    for endpoint in ("chat_completions", "completions", "embeddings"):
        try:
            body = parse_completion_body(raw, endpoint)
        except BadRequest as refused:
            status = refused.status
        else:
            status = 200
            assert isinstance(body["model"], str)
        assert status in (200, 400)


@given(st.one_of(_bodies.map(_encode), st.binary(max_size=64)))
def test_threshold_updates_are_accepted_or_refused_with_400_or_422(raw: bytes) -> None:
    try:
        model, update = parse_threshold_update(raw)
    except BadRequest as refused:
        status = refused.status
    else:
        status = 200
        assert isinstance(model, str)
        assert update.active_decode_blocks is None or 0.0 <= update.active_decode_blocks <= 1.0
    assert status in (200, 400, 422)


@given(st.binary(max_size=128) | _bodies.map(lambda v: msgspec.msgpack.encode(v)))
def test_wire_decoders_raise_only_decode_errors(data: bytes) -> None:
    for decode in (
        wire.decode_client_message,
        wire.decode_worker_message,
        wire.decode_event_message,
    ):
        with contextlib.suppress(msgspec.DecodeError):
            decode(data)
