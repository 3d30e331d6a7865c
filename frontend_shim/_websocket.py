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
   fragments before it) raises :class:`MessageTooBig` (close 1009) before its payload is read,
   so a peer cannot make the reader buffer more than the cap. Control frames are at most 125
   bytes and never fragmented.
5. Frames to the server are masked with a fresh random key (:func:`encode_frame`), taken from
   the operating system's random bytes, read for many keys at once.
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
    """Turns bytes from the server into messages and control frames (rules 2-4).

    Args:
        max_message_bytes: The largest message accepted (rule 4).
    """

    __slots__ = (
        "_fragment_opcode",
        "_fragments",
        "_fragments_size",
        "_held",
        "_max",
        "_needed",
        "_pending",
    )

    def __init__(self, max_message_bytes: int) -> None:
        self._max = max_message_bytes
        # The bytes of an incomplete frame, as they arrived: joined once, when they are enough
        # for the frame (``_needed`` bytes), never copied piece by piece. Joining at every read
        # would copy a large message once per read, quadratic in its size (the receive-buffer
        # trap h11 fixed too).
        self._pending: list[bytes] = []
        self._held = 0
        self._needed = 0
        self._fragments: list[bytes] = []
        self._fragment_opcode = 0
        self._fragments_size = 0

    def limit(self, max_message_bytes: int) -> None:
        """Accept messages of at most ``max_message_bytes`` from now on (rule 4), the frame
        under way included: its header, held with it, is read again at the next call."""
        self._max = max_message_bytes
        self._needed = 0

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held for the next call."""
        return self._held

    def receive(self, data: bytes) -> list[tuple[int, bytes]]:
        """Every complete message and control frame in what arrived so far, in order.

        Raises:
            WebSocketProtocolError: a masked frame, reserved bits, a bad opcode or sequence.
            MessageTooBig: a message over the cap.
        """
        if self._pending:
            self._pending.append(data)
            self._held += len(data)
            if self._held < self._needed:
                return []  # the frame is still incomplete: nothing is copied
            buffer = b"".join(self._pending)
            self._pending = []
            self._held = 0
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
            if opcode < OP_CLOSE and self._fragments_size + length > self._max:
                raise MessageTooBig(f"a message over {self._max} bytes")
            end = position + head + length
            if end > size:
                needed = head + length
                break
            payload = buffer[position + head : end]
            position = end
            if first & 0x80 and opcode in (OP_BINARY, OP_TEXT) and not self._fragments:
                out.append((opcode, payload))  # the common case: one whole message
            else:
                self._frame(first & 0x80, opcode, payload, out)
        if position < size:
            # At most one read's worth: what came after the last complete frame.
            self._pending = [buffer[position:]]
            self._held = size - position
            self._needed = needed
        return out

    def _frame(self, fin: int, opcode: int, payload: bytes, out: list[tuple[int, bytes]]) -> None:
        if opcode >= OP_CLOSE:
            if opcode not in (OP_CLOSE, OP_PING, OP_PONG) or not fin or len(payload) > 125:
                raise WebSocketProtocolError(f"a bad control frame (opcode {opcode})")
            out.append((opcode, payload))
            return
        if opcode == OP_CONTINUATION:
            if not self._fragments:
                raise WebSocketProtocolError("a continuation frame with nothing to continue")
        elif opcode in (OP_BINARY, OP_TEXT):
            if self._fragments:
                raise WebSocketProtocolError("a new message inside a fragmented one")
            self._fragment_opcode = opcode
        else:
            raise WebSocketProtocolError(f"an unknown opcode {opcode}")
        self._fragments.append(payload)
        self._fragments_size += len(payload)
        if fin:
            out.append((self._fragment_opcode, b"".join(self._fragments)))
            self._fragments = []
            self._fragments_size = 0
