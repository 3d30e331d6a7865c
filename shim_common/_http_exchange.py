"""One request and its answer, as a handler sees them: :class:`HTTPRequest`, :class:`HTTPResponder`.

Also the server's limits (:class:`HTTPLimits`), the errors a handler may meet, and the helpers
for JSON answers. The connection these objects work on is
:class:`shim_common._http_connection.Connection`; handlers import all of this through
:mod:`shim_common._httpserver`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING

import h11

if TYPE_CHECKING:
    from shim_common._http_connection import Connection

__all__ = [
    "DEFAULT_LIMITS",
    "JSON_CONTENT_TYPE",
    "BodyTooLarge",
    "ClientDisconnected",
    "HTTPLimits",
    "HTTPRequest",
    "HTTPResponder",
    "Handler",
    "RequestTimeout",
    "error_body",
    "h11_bytes",
    "json_headers",
    "response_head",
]


@dataclass(frozen=True, slots=True)
class HTTPLimits:
    """Bounds on what one connection may cost the server.

    Attributes:
        max_body_bytes: the largest request body accepted; larger bodies get 413.
        max_head_bytes: the largest incomplete request head h11 buffers (its
            ``max_incomplete_event_size``); a head still incomplete past it gets 431. h11 checks
            only incomplete heads, so one that arrives whole in a single read may be up to
            ``receive_bytes`` long.
        header_timeout: seconds a client has to send a whole request head, counted from the
            accept for the first request and from its first byte for later ones.
        keepalive_timeout: seconds an idle keep-alive connection is kept between requests.
        body_timeout: seconds to wait for each piece of a request body before giving up (408).
        receive_bytes: how much one ``receive_some`` call asks for.
        pipeline_buffer_bytes: how many bytes of a pipelined next request the disconnect watcher
            reads and keeps while a handler runs, before it stops reading.
        linger_timeout: seconds to drain the client's bytes after our EOF when closing.
        linger_bytes: at most this many bytes are drained when closing.
        discard_body_bytes: a request body the handler did not read is read and dropped after
            the response, keeping the connection, when its declared length is at most this.
        send_timeout: seconds a write may make no progress (the client stopped reading)
            before the connection is dropped and its handler cancelled. Progress is measured
            per ``send_piece_bytes`` written.
        send_piece_bytes: a larger write is made in pieces of this size, each with its own
            ``send_timeout``, so a slow but reading client of a large response is not dropped.
    """

    max_body_bytes: int = 16 * 1024 * 1024
    max_head_bytes: int = 16 * 1024
    header_timeout: float = 10.0
    keepalive_timeout: float = 75.0
    body_timeout: float = 60.0
    receive_bytes: int = 64 * 1024
    pipeline_buffer_bytes: int = 64 * 1024
    linger_timeout: float = 2.0
    linger_bytes: int = 1024 * 1024
    discard_body_bytes: int = 64 * 1024
    send_timeout: float = 60.0
    send_piece_bytes: int = 64 * 1024


DEFAULT_LIMITS = HTTPLimits()


class BodyTooLarge(Exception):
    """The request body is larger than ``HTTPLimits.max_body_bytes`` (the server answers 413)."""


class ClientDisconnected(Exception):
    """The client went away while the request was being read or answered."""


class RequestTimeout(Exception):
    """The client was too slow sending the request body (the server answers 408)."""


Handler = Callable[["HTTPRequest", "HTTPResponder"], Awaitable[None]]

JSON_CONTENT_TYPE = (b"content-type", b"application/json")
_REASONS: dict[int, bytes] = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}


def json_headers(*extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """Response headers for a JSON body.

    Args:
        *extra: further headers to append, e.g. ``(b"retry-after", b"1")``.

    Returns:
        A fresh list with ``Content-Type: application/json`` first, then ``extra``.
    """
    return [JSON_CONTENT_TYPE, *extra]


def error_body(message: str, status: int, error_type: str = "invalid_request_error") -> bytes:
    """An error body in the OpenAI shape: ``{"error": {"message", "type", "code"}}``.

    Args:
        message: what went wrong, for a human.
        status: the HTTP status, repeated as ``code``.
        error_type: the OpenAI error type.

    Returns:
        The JSON encoded body.
    """
    error = {"message": message, "type": error_type, "code": status}
    return json.dumps({"error": error}, separators=(",", ":")).encode()


class HTTPRequest:
    """One request head, and the means to read its body.

    Attributes:
        method: the request method, e.g. ``"GET"``.
        path: the request target without the query, e.g. ``"/v1/chat/completions"``.
        query: the query string without ``?``; ``""`` when absent.
        http_version: ``"1.1"`` or ``"1.0"``.
    """

    __slots__ = ("_body", "_connection", "_h11_request", "http_version", "method", "path", "query")

    def __init__(self, connection: Connection, request: h11.Request) -> None:
        self._connection = connection
        self._h11_request = request
        self._body: bytes | None = None
        self.method = request.method.decode("ascii")
        path, _, query = request.target.partition(b"?")
        # The target was validated by h11 as visible ASCII; latin-1 never fails on bytes.
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
        self.http_version = request.http_version.decode("ascii")

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """The request headers, names lower-cased, in the order received."""
        return list(self._h11_request.headers)

    def header(self, name: bytes) -> bytes | None:
        """The value of the first header called ``name`` (lower-case), or ``None``."""
        for header_name, value in self._h11_request.headers:
            if header_name == name:
                return value
        return None

    async def read_body(self) -> bytes:
        """Read the whole request body (once; later calls return the same bytes).

        Sends ``100 Continue`` first when the client waits for it and the declared length fits.

        Returns:
            The body; ``b""`` for a request without one.

        Raises:
            BodyTooLarge: the body is over ``HTTPLimits.max_body_bytes`` (declared or counted).
            ClientDisconnected: the client left before the body was complete.
            RequestTimeout: a piece of the body took longer than ``HTTPLimits.body_timeout``.
            h11.RemoteProtocolError: the body framing was invalid (the server answers 400).
        """
        if self._body is None:
            self._body = await self._connection.read_body(self._h11_request)
        return self._body


class HTTPResponder:
    """How a handler answers its request: exactly one response, complete or streamed.

    Attributes:
        started: whether a status line has gone out.
        finished: whether the response is complete.
    """

    __slots__ = ("_connection", "_head_request", "finished", "started")

    def __init__(self, connection: Connection, head_request: bool) -> None:
        self._connection = connection
        self._head_request = head_request
        self.started = False
        self.finished = False

    async def send(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send a complete response with ``Content-Length``, head and body in one write.

        Args:
            status: the HTTP status code.
            headers: response headers, without ``Content-Length`` (added here).
            body: the whole body.

        Raises:
            RuntimeError: a response was already started.
            ClientDisconnected: the client is gone.
        """
        conn = self._connection
        all_headers = [*headers, (b"content-length", b"%d" % len(body))]
        if conn.closes_after_response() and not _says_close(headers):
            all_headers.append((b"connection", b"close"))
        head = response_head(status, all_headers)  # validates: bad headers leave nothing started
        self._claim()
        h = conn.h11
        data = h11_bytes(h.send(head))
        if body and not self._head_request:
            data += h11_bytes(h.send(h11.Data(data=body)))
        data += h11_bytes(h.send(h11.EndOfMessage()))
        self.finished = True
        await conn.send_all(data)

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the head of a streamed (chunked) response; the body follows in chunks.

        Args:
            status: the HTTP status code.
            headers: response headers, without ``Content-Length`` (that would stop chunking).

        Raises:
            RuntimeError: a response was already started.
            ClientDisconnected: the client is gone.
        """
        conn = self._connection
        if conn.closes_after_response() and not _says_close(headers):
            headers = [*headers, (b"connection", b"close")]
        head = response_head(status, headers)  # validates: bad headers leave nothing started
        self._claim()
        await conn.send_all(h11_bytes(conn.h11.send(head)))

    async def send_chunk(self, data: bytes) -> None:
        """Send one piece of a streamed body (empty data sends nothing).

        Blocks while the client is slow to read: backpressure reaches the caller.

        Raises:
            RuntimeError: no stream was started, or it has ended.
            ClientDisconnected: the client is gone.
        """
        if not self.started or self.finished:
            raise RuntimeError("send_chunk() outside a started stream")
        if data and not self._head_request:
            await self._connection.send_all(
                h11_bytes(self._connection.h11.send(h11.Data(data=data)))
            )

    async def end_stream(self) -> None:
        """End a streamed body (the terminating chunk).

        Raises:
            RuntimeError: no stream was started, or it has ended.
            ClientDisconnected: the client is gone.
        """
        if not self.started or self.finished:
            raise RuntimeError("end_stream() outside a started stream")
        self.finished = True
        await self._connection.send_all(h11_bytes(self._connection.h11.send(h11.EndOfMessage())))

    def _claim(self) -> None:
        if self.started:
            raise RuntimeError("a response was already started for this request")
        self.started = True


def _says_close(headers: list[tuple[bytes, bytes]]) -> bool:
    return (b"connection", b"close") in headers


def response_head(status: int, headers: list[tuple[bytes, bytes]]) -> h11.Response:
    return h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b""))


def h11_bytes(data: bytes | None) -> bytes:
    # h11 returns None only for ConnectionClosed, which the server never sends.
    assert data is not None
    return data
