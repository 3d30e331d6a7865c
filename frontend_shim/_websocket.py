"""A lean websocket client codec (RFC 6455, sans-IO): the frontend's side of a worker's planes.

The worker serves with trio-websocket, which is built on wsproto. On the frontend, one process
follows every worker of a fleet, so the cost of one small message is what bounds the fleet it
can follow; wsproto's frame parser costs about ten times a minimal one (see docs/decisions.md).
This module does only what a client of our planes needs, and does it on whole buffers:

Rules:

1. Handshake: :func:`handshake_request` builds the upgrade request (with any extra headers, a
   bearer token say, and the subprotocols offered); :class:`HandshakeReader` reads the answer
   with h11 and checks that a chosen subprotocol was one offered. ``101`` with the right
   ``Sec-WebSocket-Accept`` opens the connection, and the bytes after the head are the first
   frames. Any other status is :class:`HandshakeRejected` with the status and a bounded part of
   the body, so a 401 or a 404 reads as what it is.
2. Frames from the server must be unmasked and have no reserved bits (no extension is ever
   negotiated); anything else is a :class:`WebSocketProtocolError` (close 1002).
3. :meth:`FrameReader.receive` takes whatever bytes arrived and returns every complete message
   and control frame in them, in order: ``(OP_BINARY, payload)``, ``(OP_TEXT, payload)``,
   ``(OP_PING, payload)``, ``(OP_PONG, payload)``, ``(OP_CLOSE, payload)``. A fragmented message
   is returned once, whole. A partial frame waits for more bytes.
4. Size cap: a data frame whose header declares more than ``max_message_bytes`` (counting the
   fragments before it, and the headers of its continuation frames) raises
   :class:`MessageTooBig` (close 1009) before its payload is read, so a peer cannot make the
   reader buffer more than the cap. Control frames are at most 125 bytes and never fragmented.
5. Frames to the server are masked with a fresh random key (:func:`encode_frame`), taken from
   the operating system's random bytes, read for many keys at once.
6. Frames per message: a message may come in at most :data:`~shim_common.wire.MESSAGE_FRAMES`
   frames plus one per :data:`~shim_common.wire.MESSAGE_FRAME_BYTES` bytes of it received
   before (the bound the HTTP server puts on a body's chunks); the frame past it is a
   :class:`WebSocketProtocolError` from its header. Each fragment is held until the message
   ends, so endless empty fragments, under every size cap, would otherwise grow the reader
   without bound.
7. First message: with ``pause_after_first``, the reader stops at the end of the first data
   message (a plane's hello, read under a small cap): what came after it in the same call is
   held unparsed, and so is anything given to it later, until :meth:`FrameReader.limit` sets the
   cap of the messages after it and gives those bytes back (the caller does so as soon as it has
   accepted the first message, before it reads again). A peer thus cannot make the reader hold
   more than the small cap, plus one read, before what it announced about itself is checked.
8. The bytes of an incomplete frame are held in one buffer that grows in place: a frame dribbled
   a byte per read costs its size, not an object per read.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Sequence
from typing import Final

import h11

from shim_common._client_text import CLOSE_REASON_BYTES, cut_utf8
from shim_common._http_exchange import header_value
from shim_common.wire import MESSAGE_FRAME_BYTES, MESSAGE_FRAMES

__all__ = [
    "OP_BINARY",
    "OP_CLOSE",
    "OP_CONTINUATION",
    "OP_PING",
    "OP_PONG",
    "OP_TEXT",
    "FrameReader",
    "HandshakeError",
    "HandshakeReader",
    "HandshakeRejected",
    "MessageTooBig",
    "WebSocketProtocolError",
    "close_payload",
    "encode_frame",
    "handshake_request",
    "parse_close",
]

OP_CONTINUATION: Final = 0x0
OP_TEXT: Final = 0x1
OP_BINARY: Final = 0x2
OP_CLOSE: Final = 0x8
OP_PING: Final = 0x9
OP_PONG: Final = 0xA

_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
#: Most of a rejected handshake's body kept for the error message.
_REJECTION_BODY_BYTES: Final = 1024
#: Largest response head a worker may send during the handshake.
_MAX_HEAD_BYTES: Final = 16 * 1024


class WebSocketProtocolError(Exception):
    """The server broke the websocket framing rules (close code 1002)."""


class MessageTooBig(WebSocketProtocolError):
    """A message over the size cap (close code 1009)."""


class HandshakeError(Exception):
    """The upgrade failed for a reason other than a clear refusal."""


class HandshakeRejected(HandshakeError):
    """The server answered the upgrade with an HTTP status other than 101.

    Attributes:
        status: The HTTP status code.
        body: At most 1 KiB of the response body.
    """

    def __init__(self, status: int, body: bytes) -> None:
        text = body.decode("utf-8", "replace").strip()
        super().__init__(f"HTTP {status}" + (f": {text}" if text else ""))
        self.status = status
        self.body = body


def handshake_request(
    host: str,
    target: str,
    headers: Sequence[tuple[str, str]] = (),
    subprotocols: Sequence[str] = (),
) -> tuple[bytes, bytes]:
    """The bytes of an upgrade request, and the key they carry.

    Args:
        host: The ``Host`` header value (``host:port``, an IPv6 literal in brackets).
        target: The path, e.g. ``/v1/events``.
        headers: Extra headers, e.g. ``[("Authorization", "Bearer ...")]``.
        subprotocols: Subprotocols offered, in order of preference.

    Returns:
        ``(request bytes, Sec-WebSocket-Key)``; give the key to :class:`HandshakeReader`.
    """
    key = base64.b64encode(os.urandom(16))
    lines = [
        f"GET {target} HTTP/1.1",
        f"Host: {host}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key.decode()}",
        "Sec-WebSocket-Version: 13",
        *([f"Sec-WebSocket-Protocol: {', '.join(subprotocols)}"] if subprotocols else []),
        *(f"{name}: {value}" for name, value in headers),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), key


class HandshakeReader:
    """Reads the server's answer to :func:`handshake_request` (sans-IO).

    Feed bytes to :meth:`receive` until it returns the bytes that follow the head (possibly
    empty): the connection is then open. It raises :class:`HandshakeRejected` for a status
    other than 101 (once the body, or 1 KiB of it, has arrived), :class:`HandshakeError` for an
    answer that is not a valid upgrade.
    """

    def __init__(self, key: bytes, subprotocols: Sequence[str] = ()) -> None:
        self._accept = base64.b64encode(hashlib.sha1(key + _GUID).digest())
        self._offered = {name.encode() for name in subprotocols}
        #: The subprotocol the server chose (``None``: none), once the upgrade succeeded.
        self.subprotocol: str | None = None
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD_BYTES)
        # h11 must see the request to know what it reads; its bytes are not used.
        self._conn.send(
            h11.Request(
                method="GET",
                target="/",
                headers=[("Host", "x"), ("Connection", "Upgrade"), ("Upgrade", "websocket")],
            )
        )
        self._conn.send(h11.EndOfMessage())
        self._status: int | None = None
        self._body = bytearray()

    def receive(self, data: bytes) -> bytes | None:
        """Take bytes from the server.

        Args:
            data: What arrived; ``b""`` means the server closed the connection.

        Returns:
            ``None`` while the answer is incomplete; once the upgrade succeeded, the bytes
            that followed the head (the first frames).

        Raises:
            HandshakeRejected: a status other than 101.
            HandshakeError: a malformed answer, a wrong accept key, or an early close.
        """
        try:
            self._conn.receive_data(data)
            while True:
                event = self._conn.next_event()
                if event is h11.NEED_DATA:
                    if not data:
                        raise HandshakeError("the server closed during the handshake")
                    return None
                if event is h11.PAUSED:
                    break
                if isinstance(event, h11.InformationalResponse):
                    if event.status_code == 101:
                        self._check_upgrade(event.headers)
                        continue
                elif isinstance(event, h11.Response):
                    self._status = event.status_code
                elif isinstance(event, h11.Data):
                    self._body += event.data
                    if len(self._body) >= _REJECTION_BODY_BYTES:
                        break
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
        except h11.RemoteProtocolError as exc:
            if not data and self._status is None:
                raise HandshakeError("the server closed before answering the upgrade") from exc
            raise HandshakeError(f"not an HTTP answer: {exc}") from exc
        if self._status is not None:
            raise HandshakeRejected(self._status, bytes(self._body[:_REJECTION_BODY_BYTES]))
        data_after, _closed = self._conn.trailing_data
        return bytes(data_after)

    def _check_upgrade(self, headers: Sequence[tuple[bytes, bytes]]) -> None:
        if (header_value(headers, b"upgrade") or b"").lower() != b"websocket":
            raise HandshakeError("101 without Upgrade: websocket")
        if header_value(headers, b"sec-websocket-accept") != self._accept:
            raise HandshakeError("wrong Sec-WebSocket-Accept")
        if header_value(headers, b"sec-websocket-extensions") is not None:
            raise HandshakeError("the server chose an extension none was offered")
        chosen = header_value(headers, b"sec-websocket-protocol")
        if chosen is not None:
            if chosen not in self._offered:
                raise HandshakeError(f"the server chose a subprotocol not offered: {chosen!r}")
            self.subprotocol = chosen.decode()


#: Masking keys read from the operating system at once.
_MASK_KEYS_READ: Final = 1024


class _MaskKeys:
    """Fresh 4-byte masking keys from ``os.urandom``, read :data:`_MASK_KEYS_READ` keys at a time:
    a frame costs no system call of its own (a request's ``Generate`` paid one ``getrandom``)."""

    __slots__ = ("_at", "_pool")

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def next(self) -> bytes:
        at = self._at
        if at >= len(self._pool):
            self._pool = os.urandom(4 * _MASK_KEYS_READ)
            at = 0
        self._at = at + 4
        return self._pool[at : at + 4]


_mask_keys = _MaskKeys()


def encode_frame(opcode: int, payload: bytes = b"") -> bytes:
    """One final, masked frame from the client (rule 5)."""
    length = len(payload)
    if length < 126:
        head = bytes((0x80 | opcode, 0x80 | length))
    elif length < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + length.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + length.to_bytes(8, "big")
    key = _mask_keys.next()
    if not length:
        return head + key
    # XOR with the repeated key as one big-integer operation: linear, and fast in CPython.
    repeated = (key * (length // 4 + 1))[:length]
    masked = (int.from_bytes(payload, "little") ^ int.from_bytes(repeated, "little")).to_bytes(
        length, "little"
    )
    return head + key + masked


def close_payload(code: int, reason: str = "") -> bytes:
    """The payload of a close frame: the code and a reason of at most 123 bytes, cut at a
    character boundary (a cut through a character would be invalid UTF-8, which the peer must
    fail the connection for)."""
    return code.to_bytes(2, "big") + cut_utf8(reason, CLOSE_REASON_BYTES).encode("utf-8")


def parse_close(payload: bytes) -> tuple[int, str]:
    """``(code, reason)`` of a close frame's payload (1005, "" when it has none)."""
    if len(payload) < 2:
        return 1005, ""
    return int.from_bytes(payload[:2], "big"), payload[2:].decode("utf-8", "replace")


class FrameReader:
    """Turns bytes from the server into messages and control frames (rules 2-4, 6-8).

    Args:
        max_message_bytes: The largest message accepted (rule 4), until :meth:`limit`.
        pause_after_first: Stop after the first message until :meth:`limit` (rule 7).
    """

    __slots__ = (
        "_first",
        "_fragment_opcode",
        "_fragments",
        "_fragments_size",
        "_frames",
        "_max",
        "_needed",
        "_paused",
        "_pending",
    )

    def __init__(self, max_message_bytes: int, *, pause_after_first: bool = False) -> None:
        self._max = max_message_bytes
        self._first = pause_after_first
        self._paused = False
        # The bytes of an incomplete frame (or, paused, everything after the first message), as
        # they arrived, in one buffer that grows in place and is read once it holds enough for
        # the frame (``_needed`` bytes). Joining at every read would copy a large message once
        # per read, quadratic in its size (the receive-buffer trap h11 fixed too); a list of
        # the reads would cost an object per read, 40 times a frame dribbled a byte at a time.
        self._pending = bytearray()
        self._needed = 0
        self._fragments: list[bytes] = []
        self._fragment_opcode = 0
        # The message's size so far (its fragments and their continuation headers) and frames.
        self._fragments_size = 0
        self._frames = 0

    def limit(self, max_message_bytes: int) -> bytes:
        """Accept messages of at most ``max_message_bytes`` from now on (rules 4 and 7).

        Returns:
            The bytes held unparsed (a frame under way, or what followed the first message),
            given back and forgotten here: the caller passes them to :meth:`receive` first.
        """
        self._max = max_message_bytes
        self._first = self._paused = False
        held = bytes(self._pending)
        self._pending = bytearray()
        self._needed = 0
        return held

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held for the next call."""
        return len(self._pending)

    def receive(self, data: bytes) -> list[tuple[int, bytes]]:
        """Every complete message and control frame in what arrived so far, in order.

        Raises:
            WebSocketProtocolError: a masked frame, reserved bits, a bad opcode or sequence, a
                message in too many frames.
            MessageTooBig: a message over the cap.
        """
        pending = self._pending
        if pending or self._paused:
            pending += data
            if self._paused or len(pending) < self._needed:
                return []  # the frame is still incomplete (or paused: rule 7)
            buffer = bytes(pending)
            self._pending = bytearray()
        else:
            buffer = data
        out: list[tuple[int, bytes]] = []
        size = len(buffer)
        position = 0
        needed = 2  # what the incomplete frame at the end needs, from its first byte
        while size - position >= 2:
            first = buffer[position]
            length = buffer[position + 1]
            if length & 0x80 or first & 0x70:
                raise WebSocketProtocolError("a masked frame or reserved bits from the server")
            length &= 0x7F
            head = 2
            if length == 126:
                if size - position < 4:
                    needed = 4
                    break
                length = int.from_bytes(buffer[position + 2 : position + 4], "big")
                head = 4
            elif length == 127:
                if size - position < 10:
                    needed = 10
                    break
                length = int.from_bytes(buffer[position + 2 : position + 10], "big")
                head = 10
            opcode = first & 0x0F
            if opcode < OP_CLOSE and (
                opcode == OP_CONTINUATION or self._fragments_size + length > self._max
            ):
                self._check_bounds(opcode, head, length)
            end = position + head + length
            if end > size:
                needed = head + length
                break
            payload = buffer[position + head : end]
            position = end
            if first & 0x80 and opcode in (OP_BINARY, OP_TEXT) and not self._frames:
                out.append((opcode, payload))  # the common case: one whole message
            elif not self._frame(first & 0x80, opcode, head, payload, out):
                continue
            if self._first and opcode < OP_CLOSE:
                self._paused = True  # rule 7: nothing more is parsed until limit()
                break
        if position < size:
            # At most one read's worth: what came after the last complete frame.
            self._pending += memoryview(buffer)[position:]
            self._needed = needed
        return out

    def _check_bounds(self, opcode: int, head: int, length: int) -> None:
        """Rules 4 and 6 for the header of a data frame, before its payload is read."""
        so_far = self._fragments_size
        if opcode == OP_CONTINUATION:
            bound = MESSAGE_FRAMES + so_far // MESSAGE_FRAME_BYTES
            if self._frames >= bound:
                raise WebSocketProtocolError(
                    f"more than {bound} frames in one message of {so_far} bytes so far "
                    f"({MESSAGE_FRAMES} and one per {MESSAGE_FRAME_BYTES} bytes accepted)"
                )
            length += head
        if so_far + length > self._max:
            raise MessageTooBig(f"a message over {self._max} bytes")

    def _frame(
        self, fin: int, opcode: int, head: int, payload: bytes, out: list[tuple[int, bytes]]
    ) -> bool:
        """Take a control frame or a fragment; True when it was a control frame or ended a
        message (which is then in ``out``)."""
        if opcode >= OP_CLOSE:
            if opcode not in (OP_CLOSE, OP_PING, OP_PONG) or not fin or len(payload) > 125:
                raise WebSocketProtocolError(f"a bad control frame (opcode {opcode})")
            out.append((opcode, payload))
            return True
        if opcode == OP_CONTINUATION:
            if not self._frames:
                raise WebSocketProtocolError("a continuation frame with nothing to continue")
            # Its header counts toward the message's size (rule 4), as its payload does.
            self._fragments_size += head + len(payload)
        elif opcode in (OP_BINARY, OP_TEXT):
            if self._frames:
                raise WebSocketProtocolError("a new message inside a fragmented one")
            self._fragment_opcode = opcode
            self._fragments_size = len(payload)
        else:
            raise WebSocketProtocolError(f"an unknown opcode {opcode}")
        self._fragments.append(payload)
        self._frames += 1
        if not fin:
            return False
        out.append((self._fragment_opcode, b"".join(self._fragments)))
        self._fragments = []
        self._fragments_size = 0
        self._frames = 0
        return True
