"""HTTP to the upstream engine server: httpx with the few rules LLM serving needs on top.

httpx (on Trio through anyio) owns the protocol, the keep-alive pool and the timeouts. This module
adds:

1. Timeouts that fit a generation: a connect timeout, and a read timeout that bounds the silence
   between two reads, not the whole response (a generation may stream for minutes); no pool
   timeout (the admission gate already bounds what waits for a connection).
2. Cancellation reaches the upstream: leaving :meth:`UpstreamClient.stream` before the body ended
   closes the connection (shielded from the cancellation that caused it), so the engine server
   sees the disconnect and aborts the generation. A connection goes back to the pool only once its
   response was read to the end.
3. The keep-alive retry rule: a request that fails on a *reused* connection before the response
   head arrived (the server closed the idle connection as we sent on it) is sent once more. httpx
   retries only failed connects, and a POST to an engine is not idempotent, so nothing else is
   retried. Whether the connection was reused is read from httpcore's ``trace`` extension: a fresh
   one reports ``connection.connect_tcp``.
4. One exception type, :class:`UpstreamConnectionError`, for every transport failure, with a
   message that says what happened.

:class:`SSEDecoder` (server-sent events framing, sans-IO) is the other half of reading a streamed
response. It is kept rather than ``httpx-sse`` because it bounds the length of a line (httpx's
``aiter_lines`` does not, so a peer that never sends a newline would grow memory without end) and
because it reads bytes, so the body iterator can go on after ``[DONE]`` to let the connection be
reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from typing import Any, Final, cast

import httpx
import trio

from shim_common._net import base_url

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_KEEPALIVE_EXPIRY",
    "DEFAULT_READ_TIMEOUT",
    "Origin",
    "SSEDecoder",
    "UpstreamClient",
    "UpstreamConnectionError",
    "parse_base_url",
]

#: Seconds to open a TCP connection to the upstream.
DEFAULT_CONNECT_TIMEOUT: Final = 10.0
#: Seconds of silence allowed while waiting for response bytes (a long prefill writes nothing).
DEFAULT_READ_TIMEOUT: Final = 300.0
#: Seconds an idle keep-alive connection is kept; below uvicorn's default of 5 s (vLLM, SGLang).
DEFAULT_KEEPALIVE_EXPIRY: Final = 4.0
#: Seconds allowed to close a response whose body was not read to its end.
CLOSE_TIMEOUT: Final = 5.0
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
    def url(self) -> str:
        """The base URL, an IPv6 literal in brackets."""
        return base_url("http", self.host, self.port) + self.base_path

    def __str__(self) -> str:
        return self.url


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


class _Attempt:
    """What httpcore's trace tells about one attempt: did it open its own connection?"""

    def __init__(self, client: UpstreamClient) -> None:
        self._client = client
        self.fresh_connection = False

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            self.fresh_connection = True
            self._client.connections_opened += 1


class UpstreamClient:
    """A keep-alive connection pool to one upstream (the rules are in the module docstring).

    Args:
        origin: Where the upstream listens.
        max_connections: Most requests in flight at once; more wait for a place.
        connect_timeout: Seconds to open a connection.
        read_timeout: Seconds of silence allowed while reading a response.
        keepalive_expiry: Seconds an idle connection stays reusable.
    """

    def __init__(
        self,
        origin: Origin,
        *,
        max_connections: int = 64,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        keepalive_expiry: float = DEFAULT_KEEPALIVE_EXPIRY,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.origin = origin
        self._read_timeout = read_timeout
        self._http = httpx.AsyncClient(
            base_url=origin.url,
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=min(max_connections, 256),
                keepalive_expiry=keepalive_expiry,
            ),
            timeout=httpx.Timeout(
                connect=connect_timeout, read=read_timeout, write=read_timeout, pool=None
            ),
            # The upstream is named by the operator: no proxy from the environment, no redirect,
            # and no compression (it would hold back the tokens of a stream).
            trust_env=False,
            follow_redirects=False,
            verify=False,  # plain http:// only: no need to load a CA bundle per client
            headers={"Accept-Encoding": "identity"},
        )
        #: Connections opened so far (for tests and logs: reuse shows as a small number).
        self.connections_opened = 0

    async def aclose(self) -> None:
        """Close every connection; the client is unusable afterwards. Works when cancelled."""
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
            await self._http.aclose()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except httpx.ConnectTimeout as exc:
            raise UpstreamConnectionError(f"connecting to {self.origin} timed out") from exc
        except httpx.ConnectError as exc:
            raise UpstreamConnectionError(f"cannot connect to {self.origin}: {exc}") from exc
        except httpx.ReadTimeout as exc:
            raise UpstreamConnectionError(
                f"upstream sent nothing for {self._read_timeout:g} s"
            ) from exc
        except httpx.HTTPError as exc:
            raise UpstreamConnectionError(
                f"upstream connection lost: {exc or type(exc).__name__}"
            ) from exc

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        target: str,
        *,
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
    ) -> AsyncIterator[httpx.Response]:
        """Send a request and yield its response once the head has arrived.

        Read the body with :meth:`iter_body` or :meth:`read`. Leaving the block before the body
        has ended closes the connection, which tells the upstream to stop.

        Args:
            method: ``GET``, ``POST``...
            target: The path under the origin's base path, e.g. ``/v1/completions``.
            body: The request body.
            headers: Extra request headers.

        Yields:
            The response.

        Raises:
            UpstreamConnectionError: Connecting, sending or reading the head failed.
        """
        response = await self._send(method, target, body, headers)
        try:
            yield response
        finally:
            # Shielded: closing is what tells the upstream to stop, cancelled or not.
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                await response.aclose()

    async def _send(
        self, method: str, target: str, body: bytes, headers: Sequence[tuple[str, str]]
    ) -> httpx.Response:
        for retry in (False, True):
            attempt = _Attempt(self)
            request = self._http.build_request(
                method, target, content=body, headers=list(headers), extensions={"trace": attempt}
            )
            try:
                with self._errors():
                    return await self._http.send(request, stream=True)
            except UpstreamConnectionError as exc:
                dropped = isinstance(
                    exc.__cause__, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError
                )
                if retry or attempt.fresh_connection or not dropped:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def iter_body(self, response: httpx.Response) -> AsyncGenerator[bytes, None]:
        """The body of a response in pieces as they arrive.

        Args:
            response: From :meth:`stream`.

        Yields:
            Body bytes.

        Raises:
            UpstreamConnectionError: The connection broke or went silent for too long.
        """
        with self._errors():
            # httpx types it as an iterator; it is an async generator, closed here at once.
            pieces = cast(AsyncGenerator[bytes, None], response.aiter_bytes())
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    if piece:
                        yield piece

    async def read(self, response: httpx.Response, max_bytes: int) -> bytes:
        """Read the whole body of a response.

        Args:
            response: From :meth:`stream`.
            max_bytes: Largest body accepted.

        Returns:
            The body.

        Raises:
            UpstreamConnectionError: The body is larger than ``max_bytes`` or the connection broke.
        """
        pieces: list[bytes] = []
        size = 0
        async with contextlib.aclosing(self.iter_body(response)) as body:
            async for piece in body:
                size += len(piece)
                if size > max_bytes:
                    raise UpstreamConnectionError(f"response body over {max_bytes} bytes")
                pieces.append(piece)
        return b"".join(pieces)

    async def request(
        self, method: str, target: str, *, max_body_bytes: int = 16 * 1024 * 1024
    ) -> tuple[int, bytes]:
        """Send a request without a body and read the whole response.

        Args:
            method: ``GET``, ``POST``...
            target: The path under the origin's base path.
            max_body_bytes: Largest response body accepted.

        Returns:
            The status and the body.

        Raises:
            UpstreamConnectionError: The exchange failed or the body is too large.
        """
        async with self.stream(method, target) as response:
            return response.status_code, await self.read(response, max_body_bytes)


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
