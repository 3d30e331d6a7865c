"""A small HTTP/1.1 client on Trio and h11, for talking to one upstream engine server.

It does what the ``openai`` engine needs and nothing more: plain ``http://`` to one origin,
keep-alive connections in a bounded pool, streamed response bodies, and timeouts that fit LLM
serving (a connect timeout, and a read timeout that bounds the silence between two reads, not the
whole response, because a generation may legitimately stream for minutes).

Rules of the pool:

1. At most ``max_connections`` requests are in flight at once; a further request waits for a
   place (the admission gate in front of the engine already bounds this, so the wait is rare).
2. A connection goes back to the idle pool only when both sides of h11 reached ``DONE``: the
   request was sent in full and the response body was read to its end. Anything else (an early
   exit, an exception, a cancellation, ``Connection: close``) closes the socket at once, so an
   upstream engine sees the disconnect and aborts the request it was generating.
3. Idle connections are kept newest first, at most ``max_idle_connections`` of them, and for at
   most ``keepalive_expiry`` seconds (below the 5 s idle timeout of uvicorn, which serves vLLM and
   SGLang). A connection that became readable while idle (the server closed it) is dropped.
4. A request that fails on a *reused* connection before a single byte of the response arrived is
   retried once on a fresh connection: the server closed the idle connection while we were picking
   it. Any other failure is reported, never retried (a POST to an engine is not idempotent).

The only I/O is ``trio.open_tcp_stream``, ``send_all`` and ``receive_some``; h11 owns the protocol.
:class:`SSEDecoder` (server-sent events framing) is sans-IO and lives here because it is the
other half of reading a streamed response.
"""

from __future__ import annotations

import contextlib
import dataclasses
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from typing import Final

import h11
import trio

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_KEEPALIVE_EXPIRY",
    "DEFAULT_READ_TIMEOUT",
    "HTTPClient",
    "Origin",
    "Response",
    "SSEDecoder",
    "UpstreamConnectionError",
    "parse_base_url",
]

#: Seconds to open a TCP connection to the upstream.
DEFAULT_CONNECT_TIMEOUT: Final = 10.0
#: Seconds of silence allowed while waiting for response bytes (a long prefill writes nothing).
DEFAULT_READ_TIMEOUT: Final = 300.0
#: Seconds an idle keep-alive connection is kept; below uvicorn's default of 5 s.
DEFAULT_KEEPALIVE_EXPIRY: Final = 4.0
#: Largest response head (status line and headers) accepted.
MAX_HEAD_BYTES: Final = 64 * 1024
_RECEIVE_SIZE: Final = 64 * 1024
#: Longest SSE line accepted; a longer one means a broken or hostile peer.
MAX_SSE_LINE_BYTES: Final = 4 * 1024 * 1024


class UpstreamConnectionError(Exception):
    """The upstream could not be reached, timed out, or broke the HTTP exchange."""


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where the upstream server listens and the path prefix its API lives under."""

    host: str
    port: int
    #: Prefix put before every request target, without a trailing slash ("" or "/engine").
    base_path: str = ""

    @property
    def host_header(self) -> str:
        """The ``Host`` header value."""
        return self.host if self.port == 80 else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"http://{self.host_header}{self.base_path}"


def parse_base_url(url: str) -> Origin:
    """Parse an upstream base URL such as ``http://127.0.0.1:8001`` or ``http://host:8001/v1``.

    A trailing ``/v1`` is removed, because request targets carry it (``/v1/chat/completions``)
    and the server's ``/metrics`` and ``/health`` live outside it.

    Args:
        url: The base URL as configured.

    Returns:
        The origin.

    Raises:
        ValueError: Not an ``http://`` URL with a host, or a bad port.
    """
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme != "http":
        raise ValueError(f"upstream URL {url!r}: only http:// is supported")
    if not parts.hostname:
        raise ValueError(f"upstream URL {url!r} has no host")
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ValueError(f"upstream URL {url!r}: {exc}") from exc
    if parts.query or parts.fragment:
        raise ValueError(f"upstream URL {url!r}: a base URL takes no query or fragment")
    base_path = parts.path.rstrip("/")
    if base_path.endswith("/v1"):
        base_path = base_path[: -len("/v1")]
    return Origin(host=parts.hostname, port=port, base_path=base_path)


class _Connection:
    """One TCP connection and its h11 state machine."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.idle_since = 0.0
        self.reused = False
        #: Bytes received in the current request/response cycle (retry rule 4 needs zero).
        self.bytes_received = 0

    def is_reusable(self) -> bool:
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    def looks_closed(self) -> bool:
        # An idle HTTP/1.1 connection has nothing to read: readable means EOF or garbage.
        return self.stream.socket.is_readable()


class Response:
    """A response whose body is read in pieces with :meth:`receive_some`.

    Attributes:
        status: The HTTP status code.
        headers: The response headers, names lower-cased.
    """

    def __init__(
        self,
        connection: _Connection,
        status: int,
        headers: list[tuple[bytes, bytes]],
        read_timeout: float,
    ) -> None:
        self._connection = connection
        self._read_timeout = read_timeout
        self.status = status
        self.headers = headers
        self.complete = False

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header, or ``None``.

        Args:
            name: Lower-case header name.

        Returns:
            The value.
        """
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def receive_some(self) -> bytes:
        """Read the next piece of the body.

        Returns:
            Body bytes; ``b""`` once the body has ended.

        Raises:
            UpstreamConnectionError: The connection broke or went silent for too long.
        """
        if self.complete:
            return b""
        while True:
            event = await _next_event(self._connection, self._read_timeout)
            if isinstance(event, h11.Data):
                if event.data:
                    return bytes(event.data)
                continue
            if isinstance(event, h11.EndOfMessage):
                self.complete = True
                return b""
            raise UpstreamConnectionError(f"unexpected HTTP event in a body: {event!r}")

    async def read(self, max_bytes: int) -> bytes:
        """Read the whole body.

        Args:
            max_bytes: Largest body accepted.

        Returns:
            The body.

        Raises:
            UpstreamConnectionError: The body is larger than ``max_bytes`` or the connection broke.
        """
        pieces: list[bytes] = []
        size = 0
        while piece := await self.receive_some():
            size += len(piece)
            if size > max_bytes:
                raise UpstreamConnectionError(f"response body over {max_bytes} bytes")
            pieces.append(piece)
        return b"".join(pieces)


async def _next_event(connection: _Connection, read_timeout: float) -> h11.Event:
    """Next h11 event, reading from the socket as needed; protocol and I/O errors unified."""
    while True:
        try:
            event = connection.h11.next_event()
        except h11.RemoteProtocolError as exc:
            raise UpstreamConnectionError(f"upstream broke HTTP/1.1: {exc}") from exc
        if event is h11.NEED_DATA:
            try:
                with trio.fail_after(read_timeout):
                    data = await connection.stream.receive_some(_RECEIVE_SIZE)
            except trio.TooSlowError as exc:
                raise UpstreamConnectionError(
                    f"upstream sent nothing for {read_timeout:g} s"
                ) from exc
            except (trio.BrokenResourceError, OSError) as exc:
                raise UpstreamConnectionError(f"upstream connection lost: {exc}") from exc
            connection.bytes_received += len(data)
            try:
                connection.h11.receive_data(data)
            except h11.RemoteProtocolError as exc:  # pragma: no cover - h11 raises in next_event
                raise UpstreamConnectionError(f"upstream broke HTTP/1.1: {exc}") from exc
            continue
        if event is h11.PAUSED:  # pragma: no cover - a client never pauses before DONE
            raise UpstreamConnectionError("HTTP connection paused unexpectedly")
        if isinstance(event, h11.ConnectionClosed):
            raise UpstreamConnectionError("upstream closed the connection mid-response")
        assert isinstance(event, h11.Event)
        return event


class _NoResponseBytes(UpstreamConnectionError):
    """Failed before any byte of the response: the retry rule 4 applies on a reused connection."""


class HTTPClient:
    """A keep-alive connection pool to one upstream origin (the rules are in the module docstring).

    Args:
        origin: Where the upstream listens.
        max_connections: Most requests in flight at once.
        max_idle_connections: Most idle connections kept for reuse.
        connect_timeout: Seconds to open a connection.
        read_timeout: Seconds of silence allowed while reading a response.
        keepalive_expiry: Seconds an idle connection stays reusable.
    """

    def __init__(
        self,
        origin: Origin,
        *,
        max_connections: int = 64,
        max_idle_connections: int | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        keepalive_expiry: float = DEFAULT_KEEPALIVE_EXPIRY,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.origin = origin
        self._slots = trio.Semaphore(max_connections)
        self._max_idle = (
            min(max_connections, 256) if max_idle_connections is None else (max_idle_connections)
        )
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._keepalive_expiry = keepalive_expiry
        self._idle: list[_Connection] = []
        #: Connections opened so far (for tests and logs: reuse shows as a small number).
        self.connections_opened = 0

    @property
    def idle_connections(self) -> int:
        """How many connections wait in the pool for reuse."""
        return len(self._idle)

    def close_idle(self) -> None:
        """Close every idle connection at once (in-flight ones close when their request ends).

        Synchronous, so it also works from a ``finally`` block of a cancelled task.
        """
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.stream.socket.close()

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        target: str,
        *,
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
    ) -> AsyncIterator[Response]:
        """Send a request and yield its response once the head has arrived.

        The body is read by the caller with :meth:`Response.receive_some`. Leaving the block
        before the body has ended closes the connection, which tells the upstream to stop.

        Args:
            method: ``GET``, ``POST``...
            target: The path under the origin's base path, e.g. ``/v1/completions``.
            body: The request body (sent with ``Content-Length``).
            headers: Extra request headers.

        Yields:
            The response.

        Raises:
            UpstreamConnectionError: Connecting, sending or reading the head failed.
        """
        async with self._slots:
            connection, response = await self._send_with_retry(method, target, body, headers)
            try:
                yield response
            except BaseException:
                await trio.aclose_forcefully(connection.stream)
                raise
            await self._release(connection)

    async def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
        max_body_bytes: int = 16 * 1024 * 1024,
    ) -> tuple[int, bytes]:
        """Send a request and read the whole response.

        Args:
            method: ``GET``, ``POST``...
            target: The path under the origin's base path.
            body: The request body.
            headers: Extra request headers.
            max_body_bytes: Largest response body accepted.

        Returns:
            The status and the body.

        Raises:
            UpstreamConnectionError: The exchange failed or the body is too large.
        """
        async with self.stream(method, target, body=body, headers=headers) as response:
            return response.status, await response.read(max_body_bytes)

    async def _send_with_retry(
        self, method: str, target: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> tuple[_Connection, Response]:
        connection = await self._acquire()
        try:
            return connection, await self._send(connection, method, target, body, headers)
        except _NoResponseBytes:
            await trio.aclose_forcefully(connection.stream)
            if not connection.reused:
                raise
        except BaseException:
            await trio.aclose_forcefully(connection.stream)
            raise
        # Rule 4: the server dropped the idle connection under us; one fresh attempt.
        connection = await self._connect()
        try:
            return connection, await self._send(connection, method, target, body, headers)
        except BaseException:
            await trio.aclose_forcefully(connection.stream)
            raise

    async def _acquire(self) -> _Connection:
        now = trio.current_time()
        while self._idle:
            connection = self._idle.pop()
            if now - connection.idle_since <= self._keepalive_expiry and not (
                connection.looks_closed()
            ):
                connection.reused = True
                return connection
            await trio.aclose_forcefully(connection.stream)
        return await self._connect()

    async def _connect(self) -> _Connection:
        try:
            with trio.fail_after(self._connect_timeout):
                stream = await trio.open_tcp_stream(self.origin.host, self.origin.port)
        except trio.TooSlowError as exc:
            raise UpstreamConnectionError(
                f"connecting to {self.origin} timed out after {self._connect_timeout:g} s"
            ) from exc
        except OSError as exc:
            raise UpstreamConnectionError(f"cannot connect to {self.origin}: {exc}") from exc
        self.connections_opened += 1
        return _Connection(stream)

    async def _send(
        self,
        connection: _Connection,
        method: str,
        target: str,
        body: bytes,
        headers: Sequence[tuple[str, str]],
    ) -> Response:
        request_headers = [
            ("Host", self.origin.host_header),
            ("Content-Length", str(len(body))),
            *headers,
        ]
        conn = connection.h11
        data = conn.send(
            h11.Request(
                method=method, target=self.origin.base_path + target, headers=request_headers
            )
        )
        if body:
            data = (data or b"") + (conn.send(h11.Data(data=body)) or b"")
        data = (data or b"") + (conn.send(h11.EndOfMessage()) or b"")
        try:
            await connection.stream.send_all(data)
        except (trio.BrokenResourceError, OSError) as exc:
            raise _NoResponseBytes(f"sending to {self.origin} failed: {exc}") from exc
        while True:
            try:
                event = await _next_event(connection, self._read_timeout)
            except UpstreamConnectionError as exc:
                if connection.bytes_received == 0:
                    raise _NoResponseBytes(str(exc)) from exc
                raise
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                return Response(
                    connection,
                    event.status_code,
                    [(bytes(name), bytes(value)) for name, value in event.headers],
                    self._read_timeout,
                )
            raise UpstreamConnectionError(f"unexpected HTTP event before a response: {event!r}")

    async def _release(self, connection: _Connection) -> None:
        if not connection.is_reusable() or len(self._idle) >= self._max_idle:
            await trio.aclose_forcefully(connection.stream)
            return
        connection.h11.start_next_cycle()
        connection.bytes_received = 0
        connection.idle_since = trio.current_time()
        self._idle.append(connection)


class SSEDecoder:
    """Server-sent events framing, sans-IO: bytes in, the ``data`` of each event out.

    Only what OpenAI-compatible servers use is kept: ``data:`` fields (several in one event are
    joined with newlines); comments, ``event:``, ``id:`` and ``retry:`` are ignored. Lines may
    end with LF, CRLF or CR. A line longer than ``max_line_bytes`` is an error, so a peer that
    never sends a newline cannot grow the buffer without bound.

    Args:
        max_line_bytes: Longest line accepted.
    """

    def __init__(self, max_line_bytes: int = MAX_SSE_LINE_BYTES) -> None:
        self._max_line_bytes = max_line_bytes
        self._buffer = bytearray()
        self._data: list[str] = []
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[str]:
        """Add bytes and return the data of every event they complete.

        Args:
            chunk: Bytes of the stream, cut anywhere.

        Returns:
            The ``data`` of each completed event, in order.

        Raises:
            ValueError: A line is too long or is not UTF-8.
        """
        if not chunk:
            return []  # keeps a pending CR: its LF may still come in the next chunk
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF of a CRLF cut between two chunks
        self._pending_cr = False
        self._buffer += chunk
        events: list[str] = []
        start = 0
        buffer = self._buffer
        # Next LF and CR at or after ``start``; -1 once there is none left. Each is searched again
        # only when passed, so a chunk of many LF-only lines is scanned once, not once per line.
        lf = buffer.find(b"\n")
        cr = buffer.find(b"\r")
        while True:
            if 0 <= lf < start:
                lf = buffer.find(b"\n", start)
            if 0 <= cr < start:
                cr = buffer.find(b"\r", start)
            if lf < 0 and cr < 0:
                break
            if cr < 0 or (0 <= lf < cr):
                end, next_start = lf, lf + 1
            elif cr + 1 < len(buffer):
                end, next_start = cr, cr + (2 if buffer[cr + 1] == 0x0A else 1)
            else:
                end, next_start = cr, cr + 1
                self._pending_cr = True
            self._line(bytes(buffer[start:end]), events)
            start = next_start
        del buffer[:start]
        if len(buffer) > self._max_line_bytes:
            raise ValueError(f"server-sent event line over {self._max_line_bytes} bytes")
        return events

    def _line(self, raw: bytes, events: list[str]) -> None:
        if not raw:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"server-sent event line is not UTF-8: {exc}") from exc
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)

    def close(self) -> list[str]:
        """End of stream: return the data of an event left without its blank line, if any.

        Returns:
            Zero or one event data.
        """
        events: list[str] = []
        if self._buffer:
            self._line(bytes(self._buffer), events)
            self._buffer.clear()
        self._line(b"", events)
        return events
