"""Answers given at once by the connection's reader task (rule 10 of
:mod:`shim_common._http_connection`): what qualifies, the order of pipelined answers, one write
per batch, failures, and the time limits of a connection served this way.

The tests drive :func:`serve_connection` over in-memory streams, under the autojump clock where
they wait on timeouts.
"""

from __future__ import annotations

import functools

import trio
import trio.testing

from shim_common._httpserver import (
    HTTPLimits,
    HTTPRequest,
    HTTPResponder,
    complete_response,
    json_headers,
    serve_connection,
)

LIVE = complete_response(200, json_headers(), b'{"at":"once"}')
MAX_READS = 200


class Counted(trio.abc.Stream):
    """A stream that counts the writes made through it."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.writes = 0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes += 1
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Server:
    """A handler and an answer at once, each recording what it was given."""

    def __init__(self) -> None:
        self.handled: list[str] = []
        self.answered: list[str] = []
        self.errors: list[BaseException] = []

    def answer(self, request: HTTPRequest) -> bytes | None:
        if request.path == "/boom":
            raise ValueError("the answer failed")
        if request.path not in ("/live", "/shed"):
            return None
        self.answered.append(request.path)
        return LIVE

    async def handle(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        body = await request.read_body()
        self.handled.append(request.path)
        await responder.send(200, json_headers(), b'{"handled":"%s"}' % body)


async def responses(stream: trio.abc.Stream, count: int) -> list[bytes]:
    """Read ``count`` responses of status 200 with a ``Content-Length``; their bodies."""
    data = b""
    bodies: list[bytes] = []
    for _ in range(MAX_READS):
        while len(bodies) < count and b"\r\n\r\n" in data:
            head, _, rest = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 "), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(rest) < length:
                break
            bodies.append(rest[:length])
            data = rest[length:]
        if len(bodies) == count:
            assert data == b"", data
            return bodies
        received = await stream.receive_some(65536)
        assert received, "the connection closed"
        data += received
    raise AssertionError(f"{len(bodies)} responses, not {count}")


async def test_pipelined_answers_at_once_keep_their_order_beside_the_handler() -> None:
    server = Server()
    client_stream, server_stream = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: serve_connection(server_stream, server.handle, answer_at_once=server.answer)
            )
            await client_stream.send_all(
                b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n"
                b"POST /shed HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            bodies = await responses(client_stream, 4)
            nursery.cancel_scope.cancel()
    # What followed the request left to the handler was the main task's too, in order.
    assert bodies == [b'{"at":"once"}', b'{"at":"once"}', b'{"handled":"abc"}', b'{"handled":""}']
    assert server.answered == ["/live", "/shed"]
    assert server.handled == ["/echo", "/live"]


async def test_answers_that_arrived_together_leave_in_one_write() -> None:
    server = Server()
    client_stream, inner = trio.testing.memory_stream_pair()
    counted = Counted(inner)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: serve_connection(counted, server.handle, answer_at_once=server.answer)
            )
            await client_stream.send_all(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n" * 5)
            bodies = await responses(client_stream, 5)
            nursery.cancel_scope.cancel()
    assert bodies == [b'{"at":"once"}'] * 5
    assert counted.writes == 1
    assert server.handled == []


async def test_a_request_that_does_not_keep_the_connection_goes_to_the_handler() -> None:
    cases = [
        b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /live HTTP/1.0\r\n\r\n",
        b"HEAD /live HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /live HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",
    ]
    for raw in cases:
        server = Server()
        client_stream, server_stream = trio.testing.memory_stream_pair()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                serve = functools.partial(
                    serve_connection, server_stream, server.handle, answer_at_once=server.answer
                )
                nursery.start_soon(serve)
                await client_stream.send_all(raw)
                if b"Expect" in raw:
                    assert b"100 Continue" in await client_stream.receive_some(65536)
                    await client_stream.send_all(b"x")
                received = b""
                for _ in range(MAX_READS):
                    received += await client_stream.receive_some(65536)
                    if b"\r\n\r\n" in received:
                        break
                nursery.cancel_scope.cancel()
        assert server.answered == [], raw
        assert server.handled == ["/live"], raw


async def test_an_answer_that_fails_is_reported_and_the_handler_answers() -> None:
    server = Server()
    client_stream, server_stream = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: serve_connection(
                    server_stream,
                    server.handle,
                    on_error=server.errors.append,
                    answer_at_once=server.answer,
                )
            )
            await client_stream.send_all(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
            bodies = await responses(client_stream, 1)
            # The connection goes on, and answers at once again.
            await client_stream.send_all(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
            bodies += await responses(client_stream, 1)
            nursery.cancel_scope.cancel()
    assert bodies == [b'{"handled":""}', b'{"at":"once"}']
    assert server.handled == ["/boom"]
    assert [str(error) for error in server.errors] == ["the answer failed"]


async def test_a_connection_served_at_once_keeps_the_keepalive_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The first head is due header_timeout after the accept; served at once, later requests are
    # not cut by that deadline, and an idle connection closes after keepalive_timeout.
    server = Server()
    limits = HTTPLimits(header_timeout=1.0, keepalive_timeout=5.0)
    client_stream, server_stream = trio.testing.memory_stream_pair()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: serve_connection(
                    server_stream, server.handle, limits=limits, answer_at_once=server.answer
                )
            )
            for _ in range(4):
                await client_stream.send_all(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
                assert await responses(client_stream, 1) == [b'{"at":"once"}']
                await trio.sleep(3.0)  # past header_timeout, within keepalive_timeout
            started = trio.current_time()
            assert await client_stream.receive_some(65536) == b""  # closed once idle
            assert 1.0 <= trio.current_time() - started <= 2.5
            nursery.cancel_scope.cancel()
    assert server.answered == ["/live"] * 4
    assert server.handled == []
