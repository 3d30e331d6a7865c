"""The lean simulator's websocket (RFC 6455, written by hand; ``lean_sim.py`` rule 1): the server's
frames, a parser of the client's masked frames that keeps the order of several frames per read,
and the answer to an upgrade request.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Final

from shim_common.wire import (
    CLOSE_PROTOCOL_ERROR,
    CLOSE_TOO_BIG,
    EVENTS_PATH,
    MAX_MESSAGE_BYTES,
    REQUESTS_PATH,
    SUBPROTOCOL_BATCH,
)

_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_HEAD16: Final = struct.Struct("!BBH")
_HEAD64: Final = struct.Struct("!BBQ")
OP_CONTINUATION: Final = 0x0
OP_TEXT: Final = 0x1
OP_BINARY: Final = 0x2
OP_CLOSE: Final = 0x8
OP_PING: Final = 0x9
OP_PONG: Final = 0xA
# ----------------------------------------------------------------------------- websocket framing


def server_frame(opcode: int, payload: bytes) -> bytes:
    """One final, unmasked frame from the server."""
    length = len(payload)
    if length < 126:
        return bytes((0x80 | opcode, length)) + payload
    if length < 1 << 16:
        return _HEAD16.pack(0x80 | opcode, 126, length) + payload
    return _HEAD64.pack(0x80 | opcode, 127, length) + payload


def close_frame(code: int, reason: str = "") -> bytes:
    """A close frame with a code and a reason of at most 123 bytes."""
    return server_frame(OP_CLOSE, code.to_bytes(2, "big") + reason.encode()[:123])


def unmask(data: bytes, key: bytes) -> bytes:
    """XOR ``data`` with the repeated 4-byte ``key`` (one big-integer operation)."""
    length = len(data)
    if not length:
        return b""
    repeated = (key * (length // 4 + 1))[:length]
    value = int.from_bytes(data, "little") ^ int.from_bytes(repeated, "little")
    return value.to_bytes(length, "little")


class FrameError(Exception):
    """The client broke the framing rules; ``code`` is the close code to send."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class FrameParser:
    """Client frames -> whole messages and control frames (sans-IO; rule 1)."""

    __slots__ = ("_buffer", "_fragment_opcode", "_fragments", "_fragments_size")

    def __init__(self) -> None:
        self._buffer = b""
        self._fragments: list[bytes] = []
        self._fragment_opcode = 0
        self._fragments_size = 0

    def receive(self, data: bytes) -> list[tuple[int, bytes]]:
        """Every complete message and control frame in what arrived so far, in order.

        Raises:
            FrameError: an unmasked frame, reserved bits, a bad opcode or sequence, or a
                message over the size cap.
        """
        buffer = self._buffer + data if self._buffer else data
        size = len(buffer)
        position = 0
        out: list[tuple[int, bytes]] = []
        while size - position >= 2:
            first = buffer[position]
            second = buffer[position + 1]
            if first & 0x70:
                raise FrameError(CLOSE_PROTOCOL_ERROR, "reserved bits set")
            if not second & 0x80:
                raise FrameError(CLOSE_PROTOCOL_ERROR, "an unmasked frame from the client")
            length = second & 0x7F
            head = 2
            if length == 126:
                if size - position < 4:
                    break
                length = int.from_bytes(buffer[position + 2 : position + 4], "big")
                head = 4
            elif length == 127:
                if size - position < 10:
                    break
                length = int.from_bytes(buffer[position + 2 : position + 10], "big")
                head = 10
            opcode = first & 0x0F
            if opcode < OP_CLOSE and self._fragments_size + length > MAX_MESSAGE_BYTES:
                raise FrameError(CLOSE_TOO_BIG, "message too big")
            end = position + head + 4 + length
            if end > size:
                break
            key = buffer[position + head : position + head + 4]
            payload = unmask(buffer[position + head + 4 : end], key)
            position = end
            self._frame(bool(first & 0x80), opcode, payload, out)
        self._buffer = buffer[position:]
        return out

    def _frame(self, fin: bool, opcode: int, payload: bytes, out: list[tuple[int, bytes]]) -> None:
        if opcode >= OP_CLOSE:
            if opcode not in (OP_CLOSE, OP_PING, OP_PONG) or not fin or len(payload) > 125:
                raise FrameError(CLOSE_PROTOCOL_ERROR, f"a bad control frame (opcode {opcode})")
            out.append((opcode, payload))
            return
        if opcode == OP_CONTINUATION:
            if not self._fragments:
                raise FrameError(CLOSE_PROTOCOL_ERROR, "a continuation with nothing to continue")
        elif opcode in (OP_BINARY, OP_TEXT):
            if self._fragments:
                raise FrameError(CLOSE_PROTOCOL_ERROR, "a new message inside a fragmented one")
            if fin:
                out.append((opcode, payload))
                return
            self._fragment_opcode = opcode
        else:
            raise FrameError(CLOSE_PROTOCOL_ERROR, f"an unknown opcode {opcode}")
        self._fragments.append(payload)
        self._fragments_size += len(payload)
        if fin:
            out.append((self._fragment_opcode, b"".join(self._fragments)))
            self._fragments = []
            self._fragments_size = 0


def handshake_answer(head: bytes) -> tuple[bytes, str | None, bool]:
    """The answer to an upgrade request head: ``(bytes, plane path or None, batching)``.

    ``None`` as the path means the answer is a refusal and the connection closes after it.
    """
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    key = headers.get("sec-websocket-key")
    if (
        len(parts) != 3
        or parts[0] != "GET"
        or headers.get("upgrade", "").lower() != "websocket"
        or key is None
    ):
        return refusal(400, b"not a websocket upgrade\n"), None, False
    path = parts[1]
    if path not in (EVENTS_PATH, REQUESTS_PATH):
        return refusal(404, b"unknown path; use /v1/events or /v1/requests\n"), None, False
    offered = [name.strip() for name in headers.get("sec-websocket-protocol", "").split(",")]
    batching = path == REQUESTS_PATH and SUBPROTOCOL_BATCH in offered
    accept = base64.b64encode(hashlib.sha1(key.encode("latin-1") + _GUID).digest()).decode()
    answer = [
        "HTTP/1.1 101 Switching Protocols",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Accept: {accept}",
        *([f"Sec-WebSocket-Protocol: {SUBPROTOCOL_BATCH}"] if batching else []),
    ]
    return ("\r\n".join(answer) + "\r\n\r\n").encode("latin-1"), path, batching


def refusal(status: int, body: bytes) -> bytes:
    reason = {400: "Bad Request", 404: "Not Found"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
