"""One request and its answer, as a handler sees them: :class:`HTTPRequest`, :class:`HTTPResponder`.

Also the server's limits (:class:`HTTPLimits`), the errors a handler may meet, and the helpers
for JSON answers. Handlers import all of this through :mod:`shim_common._httpserver`.

These objects hold no protocol state and write no bytes: each asks its connection, through the
narrow :class:`HTTPChannel` interface, to read the body, to respond, to start a stream, to send
data and to end it. The one implementation is :class:`shim_common._http_connection.Connection`,
the only code that drives the HTTP parser and serializer; this module does not import it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "DEFAULT_LIMITS",
    "AnswerAtOnce",
    "JSON_CONTENT_TYPE",
    "BodyTooLarge",
    "ClientDisconnected",
    "HTTPChannel",
    "HTTPLimits",
    "HTTPRequest",
    "HTTPResponder",
    "Handler",
    "InvalidResponse",
    "MalformedRequest",
    "RequestTimeout",
    "error_body",
    "header_value",
    "json_headers",
    "openai_error_type",
]


@dataclass(frozen=True, slots=True)
class HTTPLimits:
    """Bounds on what one connection may cost the server.

    Attributes:
        max_body_bytes: the largest request body accepted; larger bodies get 413.
        max_head_bytes: the largest request head (request line and header lines) accepted;
            a longer one gets 431, whether it arrives whole or in pieces. Trailers of a chunked
            body count against it too.
        header_timeout: seconds a client has to send a whole request head, counted from the
            accept for the first request and from its first byte for later ones.
        keepalive_timeout: seconds an idle keep-alive connection is kept between requests.
        body_timeout: seconds to wait for each piece of a request body before giving up (408).
        body_total_timeout: seconds from the end of the head for the whole body to arrive
            (408 past it), however steadily it dribbles in.
        receive_bytes: how much one ``receive_some`` call asks for.
        pipeline_buffer_bytes: how many bytes the connection's reader task reads ahead of what
            the handler took (a pipelined next request, a body not asked for yet) before it
            stops reading.
        linger_timeout: seconds to drain the client's bytes after our EOF when closing.
        linger_bytes: at most this many bytes are drained when closing.
        discard_body_bytes: a request body the handler did not read is read and dropped after
            the response, keeping the connection, when its declared length is at most this.
        send_timeout: seconds a write may make no progress (the client stopped reading)
            before the connection is dropped and its handler cancelled. Progress is measured
            per ``send_piece_bytes`` written.
        send_piece_bytes: a larger write is made in pieces of this size, each with its own
            ``send_timeout``, so a slow but reading client of a large response is not dropped.
        max_headers: the most header lines a request head may have (431 past it); trailers of
            a chunked body are counted apart against the same number.
        max_body_chunks: the chunks any chunked body may come in; it may have one more for
            every ``bytes_per_extra_chunk`` bytes of it received (400 past it).
        bytes_per_extra_chunk: see ``max_body_chunks``.
        min_body_rate: bytes per second; once ``min_body_rate_grace`` has passed since the
            head, a body that has arrived slower than this is an upload the server may close
            when it runs out of file descriptors, as it closes idle connections. (It is not
            refused otherwise: ``body_timeout`` and ``body_total_timeout`` bound it.)
        min_body_rate_grace: see ``min_body_rate``.
    """

    max_body_bytes: int = 16 * 1024 * 1024
    max_head_bytes: int = 16 * 1024
    header_timeout: float = 10.0
    keepalive_timeout: float = 75.0
    body_timeout: float = 60.0
    body_total_timeout: float = 120.0
    receive_bytes: int = 64 * 1024
    pipeline_buffer_bytes: int = 64 * 1024
    linger_timeout: float = 2.0
    linger_bytes: int = 1024 * 1024
    discard_body_bytes: int = 64 * 1024
    send_timeout: float = 60.0
    send_piece_bytes: int = 64 * 1024
    max_headers: int = 100
    max_body_chunks: int = 1024
    bytes_per_extra_chunk: int = 256
    min_body_rate: float = 240.0
    min_body_rate_grace: float = 5.0


DEFAULT_LIMITS = HTTPLimits()


class BodyTooLarge(Exception):
    """The request body is larger than ``HTTPLimits.max_body_bytes`` (the server answers 413)."""


class ClientDisconnected(Exception):
    """The client went away while the request was being read or answered."""


class RequestTimeout(Exception):
    """The client was too slow sending the request body (the server answers 408)."""


class MalformedRequest(Exception):
    """The request body's framing was invalid (the server answers ``status``, usually 400).

    Attributes:
        status: the status the server answers with.
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class InvalidResponse(ValueError):
    """A handler's response cannot be written: a header that is not valid HTTP, or a status
    outside 200-999. Raised before anything is sent, so the server can still answer 500."""


Handler = Callable[["HTTPRequest", "HTTPResponder"], Awaitable[None]]

#: A handler's answer to a request it can answer from the head alone, without its body and
#: without waiting (``GET /live``, a shed decided before the body): the whole response's bytes
#: (:func:`~shim_common._http_head_writer.complete_response`), or ``None`` to leave the request
#: to the :data:`Handler`. Called in the connection's reader task, once the whole request has
#: arrived; it must not block, and its answer keeps the connection open.
AnswerAtOnce = Callable[["HTTPRequest"], "bytes | None"]

JSON_CONTENT_TYPE = (b"content-type", b"application/json")


def header_value(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The value of the first header called ``name``, or ``None``: the one header reader.

    Names are compared as they are: ``name`` lower-case, as the server's parser and h11 (hence
    wsproto and trio-websocket) deliver every header name.
    """
    for header_name, value in headers:
        if header_name == name:
            return value
    return None


def json_headers(*extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """Response headers for a JSON body.

    Args:
        *extra: further headers to append, e.g. ``(b"retry-after", b"1")``.

    Returns:
        A fresh list with ``Content-Type: application/json`` first, then ``extra``.
    """
    return [JSON_CONTENT_TYPE, *extra]


def openai_error_type(status: int) -> str:
    """The OpenAI error type of an error answer with this status: the one map of both sides.

    ``server_error`` for a 5xx (what OpenAI answers), ``not_found_error`` for a 404,
    ``invalid_request_error`` for any other refusal.
    """
    if status >= 500:
        return "server_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error"


def error_body(message: str, status: int, error_type: str | None = None) -> bytes:
    """An error body in the OpenAI shape: ``{"error": {"message", "type", "code"}}``.

    Args:
        message: what went wrong, for a human.
        status: the HTTP status, repeated as ``code``.
        error_type: the OpenAI error type; by default :func:`openai_error_type` of ``status``.

    Returns:
        The JSON encoded body.
    """
    kind = openai_error_type(status) if error_type is None else error_type
    error = {"message": message, "type": kind, "code": status}
    return json.dumps({"error": error}, separators=(",", ":")).encode()


class HTTPChannel(Protocol):
    """What an exchange asks of the connection its request arrived on (one request at a time).

    The rules these calls follow (100-continue, the body cap, when a response closes the
    connection, one response per request) are those of :mod:`shim_common._http_connection` and
    :mod:`shim_common._http_cycle`.
    """

    @property
    def response_started(self) -> bool:
        """Whether the current request's status line has gone out."""

    @property
    def response_finished(self) -> bool:
        """Whether the current request's response is complete."""

    async def receive_body(self) -> bytes:
        """Read the current request's whole body (see :meth:`HTTPRequest.read_body`)."""

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send one complete response (see :meth:`HTTPResponder.send`)."""

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the head of a streamed response (see :meth:`HTTPResponder.start_stream`)."""

    async def send_data(self, data: bytes) -> None:
        """Send one piece of a streamed body (see :meth:`HTTPResponder.send_chunk`)."""

    async def end_stream(self) -> None:
        """End a streamed body (see :meth:`HTTPResponder.end_stream`)."""


class HTTPRequest:
    """One request head, and the means to read its body.

    Attributes:
        method: the request method, e.g. ``"GET"``.
        path: the request target without the query, e.g. ``"/v1/chat/completions"``; for an
            absolute-form target (``http://host/health``) its path (``/health``).
        query: the query string without ``?``; ``""`` when absent.
        http_version: ``"1.1"`` or ``"1.0"``.
    """

    __slots__ = ("_body", "_connection", "_headers", "http_version", "method", "path", "query")

    def __init__(
        self,
        connection: HTTPChannel,
        method: bytes,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        http_version: bytes,
    ) -> None:
        """Wrap a parsed head.

        Args:
            connection: the connection the request arrived on.
            method: the request method, as sent.
            target: the request target (visible ASCII, validated by the parser).
            headers: the headers, names lower-cased, in the order received.
            http_version: e.g. ``b"1.1"``.
        """
        self._connection = connection
        self._headers = headers
        self._body: bytes | None = None
        self.method = method.decode("ascii")
        if target[:1] != b"/" and b"://" in target:
            target = _origin_form(target)
        path, _, query = target.partition(b"?")
        # The parser admits only visible ASCII in a target; latin-1 never fails on bytes.
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
        self.http_version = http_version.decode("ascii")

    @property
    def headers(self) -> Sequence[tuple[bytes, bytes]]:
        """The request headers, names lower-cased, in the order received (the parser's own
        list, not a copy: read it, do not change it)."""
        return self._headers

    def header(self, name: bytes) -> bytes | None:
        """The value of the first header called ``name`` (lower-case), or ``None``."""
        return header_value(self._headers, name)

    async def read_body(self) -> bytes:
        """Read the whole request body (once; later calls return the same bytes).

        Sends ``100 Continue`` first when the client waits for it and the declared length fits.

        Returns:
            The body; ``b""`` for a request without one.

        Raises:
            BodyTooLarge: the body is over ``HTTPLimits.max_body_bytes`` (declared or counted).
            ClientDisconnected: the client left before the body was complete.
            RequestTimeout: a piece of the body took longer than ``HTTPLimits.body_timeout``, or
                the whole body took longer than ``HTTPLimits.body_total_timeout``.
            MalformedRequest: the body framing was invalid (the server answers 400).
        """
        if self._body is None:
            self._body = await self._connection.receive_body()
        return self._body


def _origin_form(target: bytes) -> bytes:
    # An absolute-form target (RFC 9112 3.2.2: a server must accept it) routes by its path and
    # query; the authority is dropped, as the Host header already names it.
    after_scheme = target.partition(b"://")[2]
    ends = [i for i in (after_scheme.find(b"/"), after_scheme.find(b"?")) if i >= 0]
    if not ends:
        return b"/"
    rest = after_scheme[min(ends) :]
    return rest if rest[:1] == b"/" else b"/" + rest


class HTTPResponder:
    """How a handler answers its request: exactly one response, complete or streamed.

    The connection keeps the response's state and refuses a second response, a chunk outside a
    stream and the like with ``RuntimeError``.
    """

    __slots__ = ("_connection",)

    def __init__(self, connection: HTTPChannel) -> None:
        self._connection = connection

    @property
    def started(self) -> bool:
        """Whether a status line has gone out."""
        return self._connection.response_started

    @property
    def finished(self) -> bool:
        """Whether the response is complete."""
        return self._connection.response_finished

    async def send(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send a complete response with ``Content-Length``, head and body in one write.

        Args:
            status: the HTTP status code.
            headers: response headers, without ``Content-Length`` (added here).
            body: the whole body (left out in answer to ``HEAD``).

        Raises:
            RuntimeError: a response was already started.
            ClientDisconnected: the client is gone.
        """
        await self._connection.respond(status, headers, body)

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the head of a streamed (chunked) response; the body follows in chunks.

        Args:
            status: the HTTP status code.
            headers: response headers, without ``Content-Length`` (that would stop chunking).

        Raises:
            RuntimeError: a response was already started.
            ClientDisconnected: the client is gone.
        """
        await self._connection.start_stream(status, headers)

    async def send_chunk(self, data: bytes) -> None:
        """Send one piece of a streamed body (empty data sends nothing).

        Blocks while the client is slow to read: backpressure reaches the caller.

        Raises:
            RuntimeError: no stream was started, or it has ended.
            ClientDisconnected: the client is gone.
        """
        await self._connection.send_data(data)

    async def end_stream(self) -> None:
        """End a streamed body (the terminating chunk).

        Raises:
            RuntimeError: no stream was started, or it has ended.
            ClientDisconnected: the client is gone.
        """
        await self._connection.end_stream()
