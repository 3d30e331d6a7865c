"""A client's half-close (rule 3 of :mod:`shim_common._http_connection`, rule 7 of
:mod:`shim_common._http_cycle`, :mod:`shim_common._http_half_close`): what was received whole is
answered, in order; a close both ways, a reset or an EOF mid-request is still a departure.

The tests talk to a server on a loopback socket with raw bytes.
"""

from __future__ import annotations

import functools
import json
import struct

import pytest
import trio
from http_test_client import echo, read_until_eof, running_server

from shim_common._httpserver import (
    ClientDisconnected,
    HTTPRequest,
    HTTPResponder,
    complete_response,
    json_headers,
    serve_http,
)


async def _slow_answer(request: HTTPRequest, responder: HTTPResponder) -> None:
    body = await request.read_body()
    await trio.sleep(0.2)  # a prefill: nothing written meanwhile
    await responder.send(200, json_headers(), body)


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
async def test_a_complete_post_then_a_half_close_gets_its_answer(version: bytes) -> None:
    # Before, the reader took the client's FIN for a departure and cancelled the handler: no
    # answer at all. Now the request, all in, runs to its answer; an HTTP/1.1 client is sent
    # one 100 Continue first (the probe a client that closed both ways answers with a reset).
    with trio.fail_after(10):
        async with running_server(_slow_answer) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    b"POST / HTTP/%b\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello" % version
                )
                await stream.send_eof()
                raw = await read_until_eof(stream)
    assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 " if version == b"1.1"
                          else b"HTTP/1.1 200 ")  # fmt: skip
    assert raw.endswith(b"\r\n\r\nhello")


@pytest.mark.parametrize("at_once", [False, True], ids=["handler", "answered-at-once"])
async def test_pipelined_requests_then_a_half_close_are_all_answered_in_order(
    at_once: bool,
) -> None:
    # Before, of 1,000 pipelined GETs followed by a half-close, 936 were dropped silently.
    count = 1000

    def answer(request: HTTPRequest) -> bytes:
        body = json.dumps({"path": request.path}).encode()
        return complete_response(200, json_headers(), body)

    with trio.fail_after(20):
        async with trio.open_nursery() as server:
            port = await server.start(
                functools.partial(
                    serve_http, echo, "127.0.0.1", 0, answer_at_once=answer if at_once else None
                )
            )
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                raw_requests = b"".join(
                    b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(count)
                )
                async with trio.open_nursery() as nursery:
                    received: list[bytes] = []

                    async def read() -> None:
                        received.append(await read_until_eof(stream))

                    nursery.start_soon(read)
                    await stream.send_all(raw_requests)
                    await stream.send_eof()
            server.cancel_scope.cancel()
    raw = received[0]
    statuses = raw.count(b"HTTP/1.1 200 ")
    assert statuses == count
    paths = [json.loads(part.split(b"\r\n\r\n", 1)[1])["path"] for part in
             raw.split(b"HTTP/1.1 200 ")[1:]]  # fmt: skip
    assert paths == [f"/{i}" for i in range(count)]


async def test_a_half_close_in_the_middle_of_a_body_is_a_departure() -> None:
    outcome: list[str] = []
    done = trio.Event()

    async def reader(request: HTTPRequest, responder: HTTPResponder) -> None:
        try:
            await request.read_body()
            outcome.append("body")  # pragma: no cover - the body never completes
        except ClientDisconnected:
            outcome.append("disconnected")
        finally:
            done.set()

    with trio.fail_after(10):
        async with running_server(reader) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nabc")
                await stream.send_eof()
                assert await read_until_eof(stream) == b""
            await done.wait()
    assert outcome in ([], ["disconnected"])


@pytest.mark.parametrize("close", ["fin", "reset"])
async def test_a_client_that_closes_during_a_silent_handler_still_frees_it(close: str) -> None:
    # A close both ways (FIN) reads as a half-close at first: the probe's reset tells them
    # apart, so the handler is cancelled within a round trip, not at its first write.
    started = trio.Event()
    cleaned_up = trio.Event()

    async def silent(request: HTTPRequest, responder: HTTPResponder) -> None:
        await request.read_body()
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cleaned_up.set()

    with trio.fail_after(10):
        async with running_server(silent) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            await started.wait()
            if close == "reset":
                linger = struct.pack("ii", 1, 0)
                stream.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, linger)
            await stream.aclose()
            await cleaned_up.wait()
