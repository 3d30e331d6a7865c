"""A raw HTTP/1.1 client and small handlers shared by the HTTP server's tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import h11
import trio
import trio.testing

from shim_common._httpserver import (
    DEFAULT_LIMITS,
    Handler,
    HTTPLimits,
    HTTPRequest,
    HTTPResponder,
    json_headers,
    serve_http,
)

MAX_READS = 1000  # bound on receive calls in one helper


@asynccontextmanager
async def running_server(
    handler: Handler,
    *,
    limits: HTTPLimits | None = None,
    on_error: Callable[[BaseException], None] | None = None,
) -> AsyncIterator[int]:
    """Serve ``handler`` on a loopback port for the duration of the block; yields the port."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_http(
                handler,
                "127.0.0.1",
                0,
                on_error=on_error,
                task_status=task_status,
                limits=limits or DEFAULT_LIMITS,
            )
        )
        yield port
        nursery.cancel_scope.cancel()


class Client:
    """A raw HTTP/1.1 client over one stream, using h11 to parse what the server sends."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    async def send_request(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
    ) -> None:
        all_headers = [("host", "127.0.0.1"), *(headers or [])]
        if body is not None:
            all_headers.append(("content-length", str(len(body))))
        data = self.conn.send(h11.Request(method=method, target=target, headers=all_headers))
        assert data is not None
        if body is not None:
            data += self.conn.send(h11.Data(data=body)) or b""
            data += self.conn.send(h11.EndOfMessage()) or b""
        await self.stream.send_all(data)

    async def next_event(self) -> h11.Event:
        for _ in range(MAX_READS):
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(bytes(await self.stream.receive_some(65536)))
                continue
            assert isinstance(event, h11.Event)
            return event
        raise AssertionError("no complete event")

    def expect_response_to(self, method: str = "GET") -> None:
        """Put the parser in step with a request that was written as raw bytes."""
        self.conn.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        self.conn.send(h11.EndOfMessage())

    async def request(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
    ) -> tuple[h11.Response, bytes]:
        await self.send_request(method, target, headers, body)
        if body is None:
            await self.stream.send_all(self.conn.send(h11.EndOfMessage()) or b"")
        response = await self.response_head_and_body()
        self.conn.start_next_cycle()
        return response

    async def response_head_and_body(self) -> tuple[h11.Response, bytes]:
        head: h11.Response | None = None
        body = b""
        for _ in range(MAX_READS):
            event = await self.next_event()
            if isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return head, body
        raise AssertionError("response did not end")


def header(response: h11.Response, name: bytes) -> bytes | None:
    for key, value in response.headers:
        if key == name:
            return value
    return None


async def read_until_eof(stream: trio.abc.ReceiveStream) -> bytes:
    data = b""
    for _ in range(MAX_READS):
        chunk = await stream.receive_some(65536)
        if not chunk:
            return data
        data += chunk
    raise AssertionError("no EOF")


async def echo(request: HTTPRequest, responder: HTTPResponder) -> None:
    """Answer with what was asked: method, path, query, a header and the body."""
    body = await request.read_body()
    answer = {
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "x-test": (request.header(b"x-test") or b"").decode(),
        "body": body.decode(),
    }
    await responder.send(200, json_headers(), json.dumps(answer).encode())


async def refuse(request: HTTPRequest, responder: HTTPResponder) -> None:
    """Answer 529 at once, never reading the body (the frontend's early shed)."""
    await responder.send(529, json_headers(), b"{}")


async def hello(request: HTTPRequest, responder: HTTPResponder) -> None:
    await responder.send(200, json_headers(), b'{"hello":true}')
