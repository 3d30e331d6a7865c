"""One HTTP/1.1 connection of the server: its parser, its two tasks and the loop of cycles.

llhttp (the C parser of Node.js, through ``httptools``) parses requests, strictly: none of its
lenient flags is set. :class:`RequestParser` turns its callbacks into a queue of events (a head,
pieces of body, the end, or a refusal) and adds the rules llhttp leaves to its user: the head
limit, one ``Host`` (needed for HTTP/1.1), ``chunked`` as the only transfer coding (llhttp
itself refuses ``Content-Length`` beside ``Transfer-Encoding``, and obs-folded lines). Responses
are written here by hand: a status line, the headers (validated once and cached), and a
fixed-length or chunked body. :class:`Connection` moves bytes between a
:class:`trio.abc.Stream` and the parser, owns the tasks and enforces the limits. It is the only
code of the server that parses or writes HTTP: the handler's ``HTTPRequest`` and
``HTTPResponder`` (:mod:`shim_common._http_exchange`) reach it through the narrow
:class:`~shim_common._http_exchange.HTTPChannel` interface, which it implements, and hold no
protocol state of their own.

Rules of one connection (a loop of request/response cycles):

1. Reading a request head is bounded in time and size. The first head must arrive within
   ``header_timeout`` of the accept; between requests the connection may sit idle for
   ``keepalive_timeout``, and once the next request's first bytes are in, its head must complete
   within ``header_timeout``. A head (request line and header lines) longer than
   ``max_head_bytes`` is answered 431, whether it arrives whole or in pieces; a malformed one
   400, a transfer coding other than ``chunked`` 501; then the connection is closed. A request
   carrying both ``Content-Length`` and ``Transfer-Encoding`` (any spelling; an obs-folded header
   line is malformed too) is refused 400 and the connection closed, so no second request is ever
   read out of bytes that two framings disagree on. An absolute-form target
   (``GET http://host/path``) is served as its path.
2. The body is read only when the handler asks (``HTTPRequest.read_body``). That is when
   ``100 Continue`` is sent to a client that waits for it, after the ``Content-Length`` has been
   checked against ``max_body_bytes``; a chunked body is counted as it arrives. Over the cap:
   :class:`BodyTooLarge`, answered 413 unless the handler answers itself. Each piece of the body
   must arrive within ``body_timeout`` and the whole body within ``body_total_timeout`` of the
   head, else :class:`RequestTimeout` (408).
3. A reader task owns every read for the life of the connection: it feeds the parser and so
   notices EOF at any time. EOF or a broken socket means the client left: the reader cancels the
   connection's main task, so a handler that writes nothing for a while (a long prefill) is
   cancelled all the same, its ``finally:`` blocks run, and the connection closes without a
   response. The reader runs ahead of what the main task took from the parser by at most
   ``pipeline_buffer_bytes`` (the bytes of a pipelined next request, or of a body the handler
   has not asked for yet); then it stops reading, TCP flow control holds the client back, and
   a disconnect is noticed at the next write instead.
4. A handler answers exactly once: ``HTTPResponder.send`` (one complete response with
   ``Content-Length``, head and body in a single ``send_all``) or ``start_stream`` /
   ``send_chunk`` / ``end_stream`` (chunked, for server-sent events; an HTTP/1.0 client gets the
   body unframed and the connection closed after it). A response may go out while the request
   body is still unread (an early 529 decides without it). When the body is declared with a
   ``Content-Length`` of at most ``discard_body_bytes`` and the client is not waiting for
   ``100 Continue``, the server reads and drops the body after the response and keeps the
   connection (a shed client keeps its connection, so shedding stays cheap); otherwise the
   response carries ``Connection: close`` and the connection closes after it, since the next
   request cannot be found before the unread body is.
5. One bad peer or one failing handler never takes the server down. A handler exception is
   passed to ``on_error`` (to be counted) and logged, answered 500 when nothing was sent yet, and
   that connection is closed; a stream that had begun is cut short so the client sees it
   incomplete. A handler that returns without answering gets 500 too; one that returns with a
   stream still open has the stream ended for it. Invalid response headers raise
   :class:`~shim_common._http_exchange.InvalidResponse` before anything is written.
6. Keep-alive: when both sides of a cycle are done and neither said ``Connection: close``
   (an HTTP/1.0 client always does, in effect), the next cycle starts; otherwise the connection
   closes gracefully (send EOF, drain the client's last bytes for a moment, close), so a client
   still writing a body it was refused reads the answer instead of a TCP reset. An ``Upgrade``
   header is ignored (the server switches no protocol; RFC 9110 7.8); a ``CONNECT`` is answered
   as any other request and the connection closed after it.
7. A write that makes no progress for ``send_timeout`` (a client that stopped reading a stream)
   drops the connection: the handler is cancelled as if the client had left (its ``finally:``
   blocks run, a worker request is cancelled) and ``on_send_stall`` counts it. A large write
   goes out in pieces of ``send_piece_bytes``, each with its own deadline, so a client that
   reads slowly but steadily is kept. The same timer task as rule 1 watches this deadline.
8. While a connection waits for a request it has received nothing of (the first one, or the
   next on a keep-alive connection), it is listed in the server's :class:`IdleConnections`; a
   server out of file descriptors closes the longest idle of them first
   (:mod:`shim_common._httpserver`).
"""

from __future__ import annotations

import logging
import math
import re
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import Final

import httptools
import trio

from shim_common._http_exchange import (
    JSON_CONTENT_TYPE,
    BodyTooLarge,
    ClientDisconnected,
    Handler,
    HTTPLimits,
    HTTPRequest,
    HTTPResponder,
    InvalidResponse,
    MalformedRequest,
    RequestTimeout,
    error_body,
)

__all__ = [
    "END",
    "Connection",
    "EndOfRequest",
    "IdleConnections",
    "ParseFailure",
    "RequestHead",
    "RequestParser",
]

# The server's logger, whichever of its modules writes.
logger = logging.getLogger("shim_common._httpserver")


# -- parsing (sans-IO) ------------------------------------------------------------------------


class RequestHead:
    """A parsed request head, with what the connection needs of its framing.

    Attributes:
        method: e.g. ``b"GET"``.
        target: the request target as sent.
        headers: names lower-cased, values without surrounding whitespace, in the order received.
        http_version: e.g. ``b"1.1"``.
        keep_alive: whether the client allows another request after this one.
        expects_continue: whether the client waits for ``100 Continue`` (HTTP/1.1 only).
        content_length: the declared body length, or ``None``.
        chunked: whether the body is chunked (``Transfer-Encoding: chunked``).
        upgrade: whether the request is a ``CONNECT``, which asks for a tunnel: answered, then the
            connection ends. (An ``Upgrade`` header is ignored: the request is served as any.)
    """

    __slots__ = (
        "chunked",
        "content_length",
        "expects_continue",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "target",
        "upgrade",
    )

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        http_version: bytes,
        keep_alive: bool,
        expects_continue: bool,
        content_length: int | None,
        chunked: bool,
        upgrade: bool,
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.expects_continue = expects_continue
        self.content_length = content_length
        self.chunked = chunked
        self.upgrade = upgrade


class EndOfRequest:
    """The end of a request (its body, if any, is complete)."""

    __slots__ = ()


#: The one :class:`EndOfRequest` event.
END: Final = EndOfRequest()


class ParseFailure:
    """The bytes are not a request the server accepts; the parser takes nothing more.

    Attributes:
        status: the answer: 400 (malformed), 431 (head too large) or 501 (transfer coding).
        reason: what was wrong, for a human.
    """

    __slots__ = ("reason", "status")

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        self.reason = reason


ParserEvent = RequestHead | bytes | EndOfRequest | ParseFailure


class _Refused(Exception):
    """Raised inside a parser callback to stop llhttp with a refusal of ours."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


# Per header line, what the callbacks do not see: ": " and CRLF.
_LINE_OVERHEAD: Final = 4


class RequestParser:
    """Bytes in, request events out (see the rules at the top of the module for what is refused).

    Feed it with :meth:`feed`; take events from :attr:`events` in order. After a
    :class:`ParseFailure`, or after a ``CONNECT`` (which asks for a tunnel), it ignores what it
    is fed. Memory is bounded: a head by ``max_head_bytes`` (plus one piece of input while it is
    incomplete), body pieces by what is fed.

    Attributes:
        events: the parsed events, oldest first.
    """

    def __init__(self, max_head_bytes: int) -> None:
        self.events: deque[ParserEvent] = deque()
        self._max_head_bytes = max_head_bytes
        self._parser = httptools.HttpRequestParser(self)
        self._done = False  # refused, or switched protocols: nothing more is parsed
        self._in_message = False
        self._in_head = False
        self._messages_begun = 0
        # The head so far as the callbacks saw it (exact once complete), and the pieces of input
        # fed wholly inside an incomplete head (exact for what the callbacks do not see yet).
        self._head_size = 0
        self._head_pieces = 0
        # Input fed since the last body byte inside a message's body: chunk sizes and
        # trailers, which nothing else bounds.
        self._framing_bytes = 0
        self._body_seen = 0
        self._target = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._last_head: RequestHead | None = None
        # Body bytes still due to a request that asked to upgrade (taken by hand, see
        # _after_upgrade_request).
        self._upgrade_body_left = 0

    @property
    def mid_request(self) -> bool:
        """Whether part of a request has been fed that has not been parsed into its end."""
        return self._in_message

    def feed(self, data: bytes | bytearray) -> None:
        """Parse ``data``, appending to :attr:`events` what it completes."""
        # Each pass parses the rest of the piece, or up to the end of a request that asked to
        # upgrade (llhttp stops there); bounded by the requests in one piece.
        while data and not self._done:
            if self._upgrade_body_left:
                data = self._take_upgrade_body(data)
                continue
            rest = self._feed_llhttp(data)
            if rest is None:
                return
            data = rest

    def _feed_llhttp(self, data: bytes | bytearray) -> bytes | bytearray | None:
        """Feed llhttp; the bytes after a request that asked to upgrade, else ``None``."""
        was_in_head = self._in_head
        begun_before = self._messages_begun
        body_before = self._body_seen
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            return self._after_upgrade_request(data[exc.args[0] :])
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            if isinstance(refusal, _Refused):
                self._fail(refusal.status, str(refusal))
            else:  # pragma: no cover - the callbacks raise only _Refused
                raise
            return None
        except httptools.HttpParserError as exc:
            self._fail(400, str(exc) or "malformed request")
            return None
        if self._in_head:
            if was_in_head and self._messages_begun == begun_before:
                self._head_pieces += len(data)  # all of it is part of one incomplete head
            if max(self._head_pieces, self._head_size) > self._max_head_bytes:
                self._fail(431, f"request head over {self._max_head_bytes} bytes")
        elif self._in_message:
            if self._body_seen != body_before:
                self._framing_bytes = 0
            else:
                self._framing_bytes += len(data)
                if self._framing_bytes > self._max_head_bytes:
                    self._fail(400, "chunk framing or trailers too large")
        return None

    def _after_upgrade_request(self, rest: bytes | bytearray) -> bytes | bytearray | None:
        """llhttp ended a request that asked to switch protocols right after its head.

        The server switches nothing (RFC 9110 7.8 lets it ignore ``Upgrade``), so the request
        is an ordinary one: its ``Content-Length`` body is taken here, and a fresh parser reads
        what follows. A ``CONNECT`` is answered and the connection ends (``upgrade`` is set on
        its head); a chunked body with ``Upgrade`` is refused (501), being rare enough not to
        parse by hand.
        """
        head = self._last_head
        assert head is not None
        assert self.events[-1] is END, "llhttp pauses only at the end of a request"
        if head.upgrade:
            self._done = True
            return None
        self._parser = httptools.HttpRequestParser(self)
        if head.chunked:
            self.events.pop()  # the body was never read: no end of it
            self._fail(501, "a chunked body with Upgrade is not supported")
            return None
        if head.content_length:
            self.events.pop()
            self._upgrade_body_left = head.content_length
            self._in_message = True
        return rest

    def _take_upgrade_body(self, data: bytes | bytearray) -> bytes | bytearray:
        taken = bytes(data[: self._upgrade_body_left])
        self._upgrade_body_left -= len(taken)
        self._body_seen += len(taken)
        self.events.append(taken)
        if not self._upgrade_body_left:
            self._in_message = False
            self.events.append(END)
        return data[len(taken) :]

    def _fail(self, status: int, reason: str) -> None:
        self._done = True
        self.events.append(ParseFailure(status, reason))

    # -- llhttp's callbacks (names fixed by httptools) -----------------------------------------

    def on_message_begin(self) -> None:
        self._messages_begun += 1
        self._in_message = self._in_head = True
        self._head_size = self._head_pieces = 0
        self._target = b""
        self._headers = []

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._head_size += len(url)
        if self._head_size > self._max_head_bytes:
            raise _Refused(431, f"request head over {self._max_head_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + _LINE_OVERHEAD
        if self._head_size > self._max_head_bytes:
            raise _Refused(431, f"request head over {self._max_head_bytes} bytes")
        if self._in_head:
            # llhttp drops the whitespace before a value, not after it.
            self._headers.append((name.lower(), value.rstrip(b" \t")))
        # Else a trailer: counted (above, against the same limit), then dropped.

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._framing_bytes = 0
        parser = self._parser
        version = parser.get_http_version().encode("ascii")
        hosts = 0
        content_length: int | None = None
        chunked = False
        codings: list[bytes] = []
        connection: list[bytes] = []
        expect: list[bytes] = []
        for name, value in self._headers:
            if name == b"host":
                hosts += 1
            elif name == b"content-length":
                # llhttp has checked the digits and refused a second Content-Length header.
                content_length = int(value)
            elif name == b"transfer-encoding":
                codings += _comma_tokens(value)
            elif name == b"connection":
                connection += _comma_tokens(value)
            elif name == b"expect":
                expect += _comma_tokens(value)
        at_least_1_1 = version >= b"1.1"
        if codings:
            if codings != [b"chunked"]:
                raise _Refused(501, "only the chunked transfer coding is supported")
            chunked = True
        if hosts > 1 or (at_least_1_1 and not hosts):
            raise _Refused(400, "one Host header is needed (HTTP/1.1), and more is refused")
        method = parser.get_method()
        head = RequestHead(
            method,
            self._target,
            self._headers,
            version,
            keep_alive=at_least_1_1 and b"close" not in connection,
            expects_continue=at_least_1_1 and b"100-continue" in expect,
            content_length=content_length,
            chunked=chunked,
            upgrade=method == b"CONNECT",
        )
        self._last_head = head
        self.events.append(head)

    def on_body(self, body: bytes) -> None:
        self._body_seen += len(body)
        self.events.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        self.events.append(END)


def _comma_tokens(value: bytes) -> list[bytes]:
    return [token for part in value.lower().split(b",") if (token := part.strip(b" \t"))]


# -- writing responses ------------------------------------------------------------------------

_REASONS: Final[dict[int, bytes]] = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}
_TOKEN: Final = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
# A field value: visible characters and obs-text, single spaces or tabs inside, none around.
_FIELD_VALUE: Final = re.compile(rb"(?:[\x21-\x7e\x80-\xff](?:[ \t]*[\x21-\x7e\x80-\xff])*)?")
# The framing headers the connection writes itself; a handler's own are dropped.
_FRAMING: Final = frozenset({b"content-length", b"transfer-encoding"})
# Header lines already validated, by header, with whether each says ``Connection: close``;
# bounded (short lines only, cleared when full), as some values vary per response.
_LINES: dict[tuple[bytes, bytes], tuple[bytes, bool]] = {}
_MAX_CACHED_LINES: Final = 1024
_MAX_CACHED_LINE_BYTES: Final = 256


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 200 <= status <= 999:
            raise InvalidResponse(f"status {status} is not a final three-digit status")
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))
        _STATUS_LINES[status] = line
    return line


def _header_lines(headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """The handler's headers as wire lines (framing headers left out), and whether they say
    ``Connection: close``.

    Raises:
        InvalidResponse: a name that is not a token, or a value with control characters.
    """
    lines = b""
    says_close = False
    for header in headers:
        cached = _LINES.get(header)
        if cached is None:
            cached = _header_line(header)
            if len(cached[0]) <= _MAX_CACHED_LINE_BYTES:
                if len(_LINES) >= _MAX_CACHED_LINES:
                    _LINES.clear()
                _LINES[header] = cached
        lines += cached[0]
        says_close = says_close or cached[1]
    return lines, says_close


def _header_line(header: tuple[bytes, bytes]) -> tuple[bytes, bool]:
    name, value = header
    if _TOKEN.fullmatch(name) is None or _FIELD_VALUE.fullmatch(value) is None:
        raise InvalidResponse(f"invalid response header {header!r}")
    lower = name.lower()
    if lower in _FRAMING:
        return b"", False
    closes = lower == b"connection" and b"close" in _comma_tokens(value)
    return lower + b": " + value + b"\r\n", closes


_CHUNKED_LINE: Final = b"transfer-encoding: chunked\r\n"
_CLOSE_LINE: Final = b"connection: close\r\n"
_LAST_CHUNK: Final = b"0\r\n\r\n"
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


# -- the connection ---------------------------------------------------------------------------


class IdleConnections:
    """The connections of a server that wait for a request with none of it received yet.

    When the process runs out of file descriptors, closing the longest idle of these frees
    descriptors at the least cost: no request is lost, and a keep-alive client opens a new
    connection when it needs one (RFC 9112 9.3 lets a server close an idle connection).
    """

    def __init__(self) -> None:
        # Insertion-ordered: the longest idle first.
        self._idle: dict[Connection, None] = {}

    def __len__(self) -> int:
        return len(self._idle)

    def add(self, connection: Connection) -> None:
        """Record that ``connection`` went idle."""
        self._idle[connection] = None

    def discard(self, connection: Connection) -> None:
        """Record that ``connection`` is busy again (or gone)."""
        self._idle.pop(connection, None)

    def close_oldest(self, count: int) -> int:
        """Close up to ``count`` of the longest idle connections; returns how many."""
        closed = 0
        while self._idle and closed < count:
            connection = next(iter(self._idle))
            del self._idle[connection]
            connection.close_idle()
            closed += 1
        return closed


class Connection:
    """The request/response cycles of one connection: see the rules at the top of the module.

    Two tasks share the connection. The reader task owns every read: it feeds the parser, wakes
    the main task, and notices EOF at any time (cancelling a running handler). It stops reading
    when ``pipeline_buffer_bytes`` were fed that the main task has not taken events for yet. The
    main task runs the cycles and does every write, the handler's included (through the
    :class:`~shim_common._http_exchange.HTTPChannel` methods, which act on the current request).

    Attributes:
        response_started: whether the current request's status line has gone out.
        response_finished: whether the current request's response is complete.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        handler: Handler,
        limits: HTTPLimits,
        on_error: Callable[[BaseException], None] | None,
        on_send_stall: Callable[[], None] | None = None,
        idle: IdleConnections | None = None,
    ) -> None:
        self._stream = stream
        self._idle = idle
        self._parser = RequestParser(limits.max_head_bytes)
        self._events = self._parser.events
        self._handler = handler
        self._limits = limits
        self._on_error = on_error
        self._on_send_stall = on_send_stall
        # When the write in progress is due (rule 7); infinite while none is in progress.
        self._send_deadline = math.inf
        # Set when the client is known to be gone (EOF, reset, or a failed write).
        self._client_gone = False
        self._eof = False
        # Bytes fed to the parser since the main task last found its events all taken (the
        # reader's budget).
        self._unconsumed = 0
        self._data_arrived = trio.lowlevel.ParkingLot()  # the main task waits here for bytes
        self._budget_freed = trio.lowlevel.ParkingLot()  # the reader waits here for budget
        self._discarding = False  # closing: the reader drops what it reads
        # The main task's scope, one for the connection's life (entering a fresh scope per
        # request costs more): the reader cancels it when the client leaves, the timer when a
        # request head is late.
        self._scope = trio.CancelScope()
        # When the awaited request head is due; infinite while no head is awaited. A plain float
        # that the timer task polls, because moving a cancel scope's deadline twice per request
        # costs several percent of the request rate.
        self._head_deadline = math.inf
        # The request being handled: its head, when it arrived, whether its unread body may be
        # dropped (rule 4), whether its end has been taken from the parser, whether the client
        # still waits for 100 Continue, and its response's state.
        self._request: RequestHead | None = None
        self._request_started = 0.0
        self._body_discardable = False
        self._request_done = False
        self._awaiting_continue = False
        self._keep_alive = True
        self.response_started = False
        self.response_finished = False

    # -- the handler's requests (the HTTPChannel interface) ------------------------------------

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send one complete response with ``Content-Length``, head and body in one write."""
        lines, says_close = _header_lines(headers)  # validates: bad headers leave nothing started
        head = _status_line(status) + lines + b"content-length: %d\r\n" % len(body)
        if says_close:
            self._keep_alive = False
        elif self._closes_after_response():
            head += _CLOSE_LINE
        self._claim_response()
        self.response_finished = True
        if body and not self._head_only():
            await self._send_all(head + b"\r\n" + body)
        else:
            await self._send_all(head + b"\r\n")

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the head of a chunked response (no chunking for an HTTP/1.0 client)."""
        lines, says_close = _header_lines(headers)  # validates: bad headers leave nothing started
        head = _status_line(status) + lines
        if self._chunked_response():
            head += _CHUNKED_LINE
        elif not self._head_only():
            self._keep_alive = False  # the body ends with the connection
        if says_close:
            self._keep_alive = False
        elif self._closes_after_response():
            head += _CLOSE_LINE
        self._claim_response()
        await self._send_all(head + b"\r\n")

    async def send_data(self, data: bytes) -> None:
        """Send one piece of a streamed body; empty data sends nothing."""
        if not self.response_started or self.response_finished:
            raise RuntimeError("send_chunk() outside a started stream")
        if not data or self._head_only():
            return
        if self._chunked_response():
            await self._send_all(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            await self._send_all(data)

    async def end_stream(self) -> None:
        """Send the end of a streamed body."""
        if not self.response_started or self.response_finished:
            raise RuntimeError("end_stream() outside a started stream")
        self.response_finished = True
        if self._chunked_response() and not self._head_only():
            await self._send_all(_LAST_CHUNK)

    def _claim_response(self) -> None:
        if self.response_started:
            raise RuntimeError("a response was already started for this request")
        self.response_started = True
        self._awaiting_continue = False

    def _head_only(self) -> bool:
        return self._request is not None and self._request.method == b"HEAD"

    def _chunked_response(self) -> bool:
        # An HTTP/1.0 client does not know chunking: its streamed body ends with the connection.
        return self._request is not None and self._request.http_version >= b"1.1"

    def _closes_after_response(self) -> bool:
        """Whether a response sent now must end the connection (rules 4 and 6)."""
        if not self._keep_alive:
            return True
        if not self._request_done and not self._body_discardable:
            self._keep_alive = False
            return True
        return False

    # -- moving bytes -------------------------------------------------------------------------

    async def _send_all(self, data: bytes) -> None:
        timeout = self._limits.send_timeout
        piece = self._limits.send_piece_bytes
        try:
            if len(data) <= piece:
                self._send_deadline = trio.current_time() + timeout
                await self._stream.send_all(data)
            else:
                view = memoryview(data)
                for start in range(0, len(data), piece):
                    self._send_deadline = trio.current_time() + timeout
                    await self._stream.send_all(view[start : start + piece])
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._client_gone = True
            raise ClientDisconnected("the client closed the connection") from exc
        finally:
            self._send_deadline = math.inf

    async def _read_forever(self) -> None:
        """The reader task: socket to parser, bounded, until EOF (or cancelled with the
        connection)."""
        limits = self._limits
        parser = self._parser
        drained = 0
        while True:
            if self._unconsumed >= limits.pipeline_buffer_bytes and not self._discarding:
                await self._budget_freed.park()
                continue
            try:
                received = await self._stream.receive_some(limits.receive_bytes)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                received = b""
            if not received:
                break
            if self._discarding:
                drained += len(received)
                if drained >= limits.linger_bytes:
                    break
                continue
            parser.feed(received)
            self._unconsumed += len(received)
            self._data_arrived.unpark_all()
        self._eof = True
        self._client_gone = True
        # The client left: stop whatever the main task does, a running handler included.
        self._scope.cancel()
        self._data_arrived.unpark_all()

    async def _wait_for_data(self) -> None:
        """Wait until the reader fed the parser more bytes (or saw EOF); every event is taken."""
        # The parser holds at most a partial head (bounded by max_head_bytes) or partial chunk
        # framing: what the reader fed before is consumed, so its budget renews.
        self._unconsumed = 0
        self._budget_freed.unpark_all()
        if not self._eof:
            await self._data_arrived.park()

    # -- the connection loop ------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_forever)
                nursery.start_soon(self._enforce_deadlines)
                with self._scope:
                    await self._run_cycles()
                nursery.cancel_scope.cancel()
        finally:
            if self._idle is not None:
                self._idle.discard(self)

    def close_idle(self) -> None:
        """End the connection now, as it waits for a request it has received nothing of."""
        self._scope.cancel()

    async def _run_cycles(self) -> None:
        first = True
        while True:
            request = await self._read_head(first)
            if request is None:
                return
            first = False
            keep_alive = await self._handle(request)
            if not keep_alive:
                return
            if self.response_finished and not self._request_done and self._body_discardable:
                keep_alive = await self._discard_body()
            if not (keep_alive and self._keep_alive and self._request_done):
                await self._close_gracefully()
                return

    async def _read_head(self, first: bool) -> RequestHead | None:
        """Wait for the next request head; ``None`` when the connection should just end."""
        limits = self._limits
        events = self._events
        idle = not first and not events and not self._parser.mid_request
        # Past this deadline the timer cancels the connection's main task: a client that idles
        # or dribbles is simply disconnected.
        self._head_deadline = trio.current_time() + (
            limits.keepalive_timeout if idle else limits.header_timeout
        )
        # Each pass either returns or waits for more bytes of a head the parser caps at
        # max_head_bytes, so the loop is bounded by that size (and by the deadline).
        while True:
            if events:
                event = events.popleft()
                if isinstance(event, RequestHead):
                    self._head_deadline = math.inf
                    return event
                if isinstance(event, ParseFailure):
                    await self._answer_protocol_error(event)
                return None  # pragma: no cover - a head always comes first
            if self._eof:
                return None  # a clean close between requests, or a partial head at EOF
            if self._idle is None or events or self._parser.mid_request:
                await self._wait_for_data()
            else:
                # Nothing of a request yet: closable when the process runs out of descriptors.
                self._idle.add(self)
                try:
                    await self._wait_for_data()
                finally:
                    self._idle.discard(self)
            if idle:
                idle = False
                self._head_deadline = trio.current_time() + limits.header_timeout

    async def _enforce_deadlines(self) -> None:
        """The timer task: cancel the main task once an awaited request head (rule 1) or a
        write in progress (rule 7) is overdue.

        It wakes at the earlier recorded deadline, or after the shortest timeout while none is
        recorded (a deadline set meanwhile is then noticed at most that late), so it costs
        nothing per request and one wake-up per timeout period.
        """
        limits = self._limits
        poll = min(limits.header_timeout, limits.keepalive_timeout, limits.send_timeout)
        while True:
            now = trio.current_time()
            if self._head_deadline <= now:
                self._scope.cancel()
                return
            if self._send_deadline <= now:
                self._client_gone = True
                logger.info("dropping a client that read nothing for %s s", limits.send_timeout)
                if self._on_send_stall is not None:
                    self._on_send_stall()
                self._scope.cancel()
                return
            await trio.sleep_until(min(self._head_deadline, self._send_deadline, now + poll))

    async def _answer_protocol_error(self, failure: ParseFailure) -> None:
        if self._client_gone:
            return
        try:
            await self._send_error(failure.status, f"malformed request: {failure.reason}")
        except ClientDisconnected:
            return
        await self._close_gracefully()

    async def _send_error(self, status: int, message: str) -> None:
        error_type = "server_error" if status >= 500 else "invalid_request_error"
        body = error_body(message, status, error_type)
        content_type = b"%s: %s\r\n" % JSON_CONTENT_TYPE
        head = _status_line(status) + content_type + b"content-length: %d\r\n" % len(body)
        self.response_started = self.response_finished = True
        self._keep_alive = False
        await self._send_all(head + _CLOSE_LINE + b"\r\n" + body)

    async def _handle(self, head: RequestHead) -> bool:
        """Run the handler for one request; ``True`` when the connection may go on."""
        events = self._events
        # A request without a body ends right after its head, in the same piece of input.
        self._request_done = bool(events) and events[0] is END
        if self._request_done:
            events.popleft()
        self._request = head
        self._request_started = trio.current_time()
        self._awaiting_continue = head.expects_continue
        self._keep_alive = head.keep_alive and not head.upgrade
        self.response_started = self.response_finished = False
        declared = head.content_length
        # Only a plain Content-Length body (a request with both framings never gets here).
        self._body_discardable = (
            declared is not None
            and declared <= min(self._limits.discard_body_bytes, self._limits.max_body_bytes)
            and not head.expects_continue
        )
        request = HTTPRequest(self, head.method, head.target, head.headers, head.http_version)
        failure: Exception | None = None
        if self._eof:
            return False  # the client left before its request could start
        try:
            # The reader cancels this when the client leaves (see _read_forever).
            await self._handler(request, HTTPResponder(self))
        except Exception as exc:
            failure = exc

        if self._client_gone:
            return False
        if failure is not None:
            return await self._after_failure(failure)
        if not self.response_started:
            error = RuntimeError(f"handler returned without a response to {request.path}")
            self.report(error)
            await self._send_error_and_close(500, "internal error")
            return False
        if not self.response_finished:
            await self.end_stream()
        return True

    async def _after_failure(self, failure: Exception) -> bool:
        if isinstance(failure, ClientDisconnected):
            return False
        if isinstance(failure, BodyTooLarge):
            status, message = 413, f"request body too large (limit {self._limits.max_body_bytes})"
        elif isinstance(failure, RequestTimeout):
            status, message = 408, "request body timed out"
        elif isinstance(failure, MalformedRequest):
            status, message = failure.status, f"malformed request: {failure}"
        else:
            self.report(failure)
            status, message = 500, "internal error"
        if self.response_started:
            # Cut the response short: without the final chunk the client sees it incomplete.
            return False
        await self._send_error_and_close(status, message)
        return False

    async def _send_error_and_close(self, status: int, message: str) -> None:
        if self.response_started:
            return  # the response has begun: nothing else can be sent in its place
        try:
            await self._send_error(status, message)
        except ClientDisconnected:
            return
        await self._close_gracefully()

    def report(self, error: BaseException) -> None:
        """Log an unexpected exception and pass it to ``on_error`` (rule 5)."""
        logger.error("HTTP handler failed", exc_info=error)
        if self._on_error is not None:
            try:
                self._on_error(error)
            except Exception:
                logger.exception("on_error callback failed")

    # -- reading the body and watching for disconnects -----------------------------------------

    async def receive_body(self) -> bytes:
        """Read the current request's whole body (rule 2)."""
        head = self._request
        assert head is not None, "a body is read only while a request is handled"
        if self._request_done:
            return b""
        limits = self._limits
        declared = head.content_length
        if declared is not None and declared > limits.max_body_bytes:
            raise BodyTooLarge(f"declared body of {declared} bytes")
        if self._awaiting_continue:
            self._awaiting_continue = False
            await self._send_all(_CONTINUE)
        events = self._events
        whole_body_due = self._request_started + limits.body_total_timeout
        parts: list[bytes] = []
        size = 0
        # Every pass consumes at least one byte of a body capped at max_body_bytes, or ends,
        # or waits within the deadlines.
        while True:
            if events:
                event = events.popleft()
                if event is END:
                    self._request_done = True
                    return b"".join(parts)
                if isinstance(event, bytes):
                    size += len(event)
                    if size > limits.max_body_bytes:
                        raise BodyTooLarge(f"body over {limits.max_body_bytes} bytes")
                    parts.append(event)
                    continue
                assert isinstance(event, ParseFailure), event
                raise MalformedRequest(event.reason, event.status)
            if self._eof:
                raise ClientDisconnected("the client left during the request body")
            piece_due = trio.current_time() + limits.body_timeout
            with trio.move_on_at(min(piece_due, whole_body_due)) as scope:
                await self._wait_for_data()
            if scope.cancelled_caught:
                if piece_due <= whole_body_due:
                    raise RequestTimeout(f"no body data for {limits.body_timeout} s")
                raise RequestTimeout(f"body not complete in {limits.body_total_timeout} s")

    async def _discard_body(self) -> bool:
        """Read and drop the rest of a small declared body; ``True`` when the cycle completed.

        The body of an early response usually came in with the head, so this rarely waits; when
        it must, the wait is bounded by ``body_timeout``.
        """
        events = self._events
        dropped = 0
        # Bounded: each pass consumes body bytes (at most discard_body_bytes) or ends.
        while True:
            if events:
                event = events.popleft()
                if event is END:
                    self._request_done = True
                    return True
                if isinstance(event, bytes):
                    dropped += len(event)
                    if dropped > self._limits.discard_body_bytes:
                        return False
                    continue
                return False  # the framing broke mid-body: just close
            if self._eof:
                return False
            with trio.move_on_after(self._limits.body_timeout) as scope:
                await self._wait_for_data()
            if scope.cancelled_caught:
                return False

    async def _close_gracefully(self) -> None:
        """Half-close, let the reader drain what the client still sends (bounded), then close.

        Closing a socket with unread bytes makes the kernel send a reset, which can destroy the
        response before the client reads it; draining until the client's EOF avoids that.
        """
        self._discarding = True
        self._budget_freed.unpark_all()
        stream = self._stream
        if isinstance(stream, trio.abc.HalfCloseableStream):
            try:
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
        with trio.move_on_after(self._limits.linger_timeout):
            # The reader wakes this task only at EOF (or after linger_bytes): one pass or two.
            while not self._eof:
                await self._data_arrived.park()
