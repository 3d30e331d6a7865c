"""The request parser of the HTTP server (sans-IO): bytes in, request events out.

llhttp (the C parser of Node.js, through ``httptools``) parses requests, strictly: none of its
lenient flags is set. :class:`RequestParser` turns its callbacks into a queue of events (a
:class:`RequestHead`, pieces of body as ``bytes``, :data:`END`, or a :class:`ParseFailure`) and
adds the rules llhttp leaves to its user:

1. A head (request line and header lines) longer than ``max_head_bytes`` is refused 431,
   whether it arrives whole or in pieces, and so is a head of more than ``max_headers`` header
   lines (a line costs a callback, however short: the count bounds the CPU of a head as the
   size bounds its memory); chunk-size lines and trailers of a chunked body are bounded by the
   same size (400 past it), trailers by the same count (431).
2. A chunked body may come in at most ``max_body_chunks`` chunks, plus one for every
   ``bytes_per_extra_chunk`` bytes of it received: each chunk costs a callback, so a body in
   one-byte chunks would cost a hundred times what the same body costs whole. Past that, 400.
   The pieces of body one :meth:`RequestParser.feed` parses are delivered as one ``bytes``,
   however many chunks they came in, so what the body holds in memory is its size.
3. HTTP/1.1 needs exactly one ``Host``; a second is refused 400 at any version.
4. ``chunked`` is the only transfer coding (501 for any other). llhttp itself refuses
   ``Content-Length`` beside ``Transfer-Encoding`` and obs-folded lines (400).
5. An ``Upgrade`` header switches nothing (RFC 9110 7.8): the request is an ordinary one, its
   ``Content-Length`` body taken by hand where llhttp stops; a chunked body with ``Upgrade`` is
   refused 501, being rare enough not to parse by hand. A ``CONNECT`` ends the parse after its
   head: it is answered, then the connection ends.
6. After a refusal, or after a ``CONNECT``, nothing more is parsed.

The connection (:mod:`shim_common._http_connection`) feeds it and acts on the events.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import httptools

from shim_common._http_exchange import DEFAULT_LIMITS

__all__ = [
    "END",
    "EndOfRequest",
    "ParseFailure",
    "ParserEvent",
    "RequestHead",
    "RequestParser",
    "comma_tokens",
    "end_of_request",
]


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
    incomplete), body pieces by what is fed. The limits are those of
    :class:`~shim_common._http_exchange.HTTPLimits` of the same names.

    Attributes:
        events: the parsed events, oldest first.
    """

    def __init__(
        self,
        max_head_bytes: int,
        *,
        max_headers: int = DEFAULT_LIMITS.max_headers,
        max_body_chunks: int = DEFAULT_LIMITS.max_body_chunks,
        bytes_per_extra_chunk: int = DEFAULT_LIMITS.bytes_per_extra_chunk,
    ) -> None:
        self.events: deque[ParserEvent] = deque()
        self._max_head_bytes = max_head_bytes
        self._max_headers = max_headers
        self._max_body_chunks = max_body_chunks
        self._bytes_per_extra_chunk = bytes_per_extra_chunk
        self._parser = httptools.HttpRequestParser(self)
        self._done = False  # refused, or a CONNECT answered: nothing more is parsed
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
        # The current message's header (or trailer) lines so far, its chunks, and where its
        # body began in _body_seen.
        self._lines = 0
        self._chunks = 0
        self._body_begun_at = 0
        # Pieces of body parsed in the current feed, delivered as one event (rule 2).
        self._body_parts: list[bytes] = []
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
        if self._body_parts:
            self._flush_body()
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
        if self._body_parts:
            self._flush_body()
        self.events.append(ParseFailure(status, reason))

    def _flush_body(self) -> None:
        parts = self._body_parts
        self.events.append(parts[0] if len(parts) == 1 else b"".join(parts))
        self._body_parts = []

    # -- llhttp's callbacks (names fixed by httptools) -----------------------------------------

    def on_message_begin(self) -> None:
        self._messages_begun += 1
        self._in_message = self._in_head = True
        self._head_size = self._head_pieces = 0
        self._lines = self._chunks = 0
        self._body_begun_at = self._body_seen
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
        self._lines += 1
        if self._lines > self._max_headers:
            where = "request head" if self._in_head else "trailer section"
            raise _Refused(431, f"{where} over {self._max_headers} header lines")
        if self._in_head:
            # llhttp drops the whitespace before a value, not after it.
            self._headers.append((name.lower(), value.rstrip(b" \t")))
        # Else a trailer: counted (above, against the same limit), then dropped.

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._framing_bytes = 0
        self._lines = 0  # trailers are counted apart
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
                codings += comma_tokens(value)
            elif name == b"connection":
                connection += comma_tokens(value)
            elif name == b"expect":
                expect += comma_tokens(value)
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

    def on_chunk_header(self) -> None:
        self._chunks += 1
        received = self._body_seen - self._body_begun_at
        if self._chunks > self._max_body_chunks + received // self._bytes_per_extra_chunk:
            raise _Refused(
                400,
                f"chunked body in too many chunks: {self._chunks} for {received} bytes (at most "
                f"{self._max_body_chunks} and one per {self._bytes_per_extra_chunk} bytes)",
            )

    def on_body(self, body: bytes) -> None:
        self._body_seen += len(body)
        self._body_parts.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        if self._body_parts:
            self._flush_body()
        self.events.append(END)


def comma_tokens(value: bytes) -> list[bytes]:
    """The tokens of a comma-separated header value, lower-cased, empty ones left out."""
    return [token for part in value.lower().split(b",") if (token := part.strip(b" \t"))]


def end_of_request(events: deque[ParserEvent]) -> int:
    """Where the request whose head is ``events[0]`` ends in ``events``; ``-1`` when its end is
    not there yet or its body's framing broke first."""
    # Bounded by the events, which the reader's budget bounds.
    for index, event in enumerate(events):
        if event is END:
            return index
        if index and not isinstance(event, bytes):
            return -1
    return -1
