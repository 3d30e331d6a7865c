"""The worker's bound on the frames of one websocket message, in front of trio-websocket.

trio-websocket (over wsproto) bounds a message by its payload alone, and holds a part for every
frame of a message until the message ends: a client that opens a message and continues it with
empty, non-final fragments forever stays under the size cap, sends no control frame, and grows
the worker's memory for as long as it likes. The library has no bound on frames, so this module
puts one in front of it, on the bytes a client sends.

Rules:

1. The stream of every accepted connection is wrapped (:class:`FrameBoundListener`), and what the
   client sends is looked at before the library reads it: the opening request with h11, as
   wsproto reads it, then each frame's header (a payload is skipped, never copied or unmasked).
   Bytes pass through unchanged otherwise. What follows the request reaches the library only
   once it has answered the request (its first write): wsproto drops what it is given between
   the two, so the frames the library reads begin exactly where the count begins (a client
   sends frames only once it has its answer anyway).
2. A data message may come in at most :data:`~shim_common.wire.MESSAGE_FRAMES` frames plus one
   per :data:`~shim_common.wire.MESSAGE_FRAME_BYTES` bytes of it received before (the bound the
   frontend's reader puts on a worker's messages; the HTTP server bounds a body's chunks the
   same way). The frame past the bound never reaches the library: in its place the wrapper
   hands it a close frame from the client, code 1002 (a protocol error) with the reason, which
   the library answers as any close (its own close frame, 1002 and the reason, goes to the
   client). Nothing the client sends after it is read: the library's next read closes the
   connection and reads its end (the library has answered the close by then; a client that
   passed the bound before its handshake was even answered sees the connection end without
   one). The breach is reported (``on_breach``: counted, logged).
3. A request the library will refuse (not HTTP, not an upgrade) is not looked at further: the
   library closes that connection before any frame counts.
4. Pings are bounded too: the library answers each with a pong the worker writes, so a client
   that floods them has the worker spend a core on pongs. :data:`PING_BURST` at once, then
   :data:`PINGS_PER_SECOND` (a frontend pings a plane once per keepalive interval at most, 15 s
   by default; ten a second leaves room for short test intervals, and a pong costs the worker
   tens of microseconds, so the bound holds pongs to a sliver of a core); the ping past the
   bound is a breach as in rule 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import h11
import trio

from shim_common._client_text import CLOSE_REASON_BYTES, cut_utf8
from shim_common._control_rate import ControlFrameRate
from shim_common._net import host_for_url
from shim_common.wire import CLOSE_PROTOCOL_ERROR, MESSAGE_FRAME_BYTES, MESSAGE_FRAMES

__all__ = [
    "PINGS_PER_SECOND",
    "PING_BURST",
    "FrameBoundListener",
    "FrameBoundStream",
    "FrameCounter",
]

#: Pings a client may send at once (rule 4) ...
PING_BURST: Final = 32
#: ... and a second after that.
PINGS_PER_SECOND: Final = 10.0


class FrameCounter:
    """Rules 1-4 on the bytes one client sends (sans-IO).

    Args:
        now: The time the connection was accepted (the ping bucket counts from it).

    Attributes:
        breach: Why the client was cut off (rule 2), once it was; ``None`` before.
    """

    __slots__ = (
        "_frames",
        "_handshake",
        "_header",
        "_pings",
        "_size",
        "_skip",
        "breach",
        "ignored",
    )

    def __init__(self, now: float) -> None:
        # The opening request, read as wsproto reads it.
        self._handshake = h11.Connection(h11.SERVER)
        #: Whether the library refuses the request, so nothing is counted (rule 3).
        self.ignored = False
        # The header of a frame split between reads (at most 14 bytes), and the payload bytes of
        # the current frame still to come.
        self._header = bytearray()
        self._skip = 0
        # The frames of the data message under way (0: none) and its payload bytes so far.
        self._frames = 0
        self._size = 0
        # Starts full (rule 4).
        self._pings = ControlFrameRate(PINGS_PER_SECOND, PING_BURST, now)
        self.breach: str | None = None

    def request(self, data: bytes | bytearray) -> int | None:
        """Take what the client sent before its request was whole.

        Returns:
            Where in ``data`` the request ends, once it does (what follows is frames);
            ``None`` while it does not, or when the library refuses it (:attr:`ignored`).
        """
        handshake = self._handshake
        handshake.receive_data(bytes(data))
        try:
            while True:
                event = handshake.next_event()
                if event is h11.NEED_DATA:
                    return None
                if event is h11.PAUSED:
                    break
                if isinstance(event, h11.ConnectionClosed):
                    self.ignored = True
                    return None
        except h11.RemoteProtocolError:
            self.ignored = True  # rule 3: the library refuses it too
            return None
        return len(data) - len(handshake.trailing_data[0])

    def frames(self, data: bytes | bytearray, now: float) -> int | None:
        """Take the next frames' bytes, arriving at ``now`` (after any breach, nothing more may
        be given).

        Returns:
            Where in ``data`` the frame past the bound begins (rules 2 and 4), or ``None``.
        """
        size = len(data)
        position = 0
        header = self._header
        while position < size:
            if self._skip:
                step = min(self._skip, size - position)
                self._skip -= step
                position += step
                continue
            if not header:
                # The first byte of a frame says what it is: rules 2 and 4, before it is read.
                first = data[position]
                opcode = first & 0x0F
                if opcode < 0x8:
                    if opcode:
                        self._frames = self._size = 0  # a new message
                    elif self._frames >= MESSAGE_FRAMES + self._size // MESSAGE_FRAME_BYTES:
                        self.breach = (
                            f"more than {self._frames} frames in one message of {self._size} "
                            f"bytes ({MESSAGE_FRAMES} and one per {MESSAGE_FRAME_BYTES} "
                            "bytes accepted)"
                        )
                        return position
                    self._frames += 1
                elif opcode == 0x9 and not self._pings.allow(1, now):
                    self.breach = f"pings past {self._pings.bound}"
                    return position
                if size - position >= 14:
                    # The whole header is here (the usual case): read it in place.
                    length, head = _header_fields(data[position + 1 : position + 10])
                    position += head
                    self._frame_begins(first, length)
                    continue
            # A header split between reads: gather it, at most 14 bytes.
            header.append(data[position])
            position += 1
            if len(header) >= 2 and len(header) == _header_fields(header[1:10])[1]:
                self._frame_begins(header[0], _header_fields(header[1:10])[0])
                header.clear()
        return None

    def _frame_begins(self, first: int, length: int) -> None:
        """The header of a frame carrying ``length`` bytes has been read."""
        self._skip = length
        if first & 0x0F < 0x8:
            self._size += length
            if first & 0x80:
                self._frames = self._size = 0  # the message ends with this frame


def _header_fields(after_first: bytes | bytearray) -> tuple[int, int]:
    """``(payload length, header size)`` of a frame from the bytes after its first (the length
    is 0 while the extended length is not all there yet)."""
    second = after_first[0]
    length = second & 0x7F
    head = 2 + (4 if second & 0x80 else 0)
    if length == 126:
        return int.from_bytes(after_first[1:3], "big"), head + 2
    if length == 127:
        return int.from_bytes(after_first[1:9], "big"), head + 8
    return length, head


def _close_from_client(reason: str) -> bytes:
    """A close frame as a client sends it (masked, with a key of zeros): code 1002 and the
    reason, cut to what a control frame holds."""
    text = cut_utf8(reason, CLOSE_REASON_BYTES).encode("utf-8")
    payload = CLOSE_PROTOCOL_ERROR.to_bytes(2, "big") + text
    return bytes([0x88, 0x80 | len(payload)]) + bytes(4) + payload


class FrameBoundStream(trio.abc.Stream):
    """A connection's stream as the websocket library sees it (rules 1-3).

    Args:
        stream: The accepted stream (TCP, or TLS over it).
        on_breach: Called with the stream and the reason when the client passes the bound.

    Attributes:
        peer_host: The client's address (its IP address, as the socket names it).
    """

    def __init__(
        self, stream: trio.abc.Stream, on_breach: Callable[[FrameBoundStream, str], None]
    ) -> None:
        self._stream = stream
        self._on_breach = on_breach
        self._counter = FrameCounter(trio.current_time())
        # Whether the request is whole, what followed it in its read, and whether the library
        # has answered it (rule 1).
        self._requested = False
        self._held = b""
        self._answered = trio.Event()
        self.peer_host, self._peer = _peer(stream)

    def __repr__(self) -> str:
        return self._peer

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        counter = self._counter
        if counter.breach is not None:
            # Rule 2: the library has read and answered the close; the connection ends here.
            await trio.aclose_forcefully(self._stream)
            return b""
        if self._requested:
            await self._answered.wait()  # rule 1
            data, self._held = self._held or await self._stream.receive_some(max_bytes), b""
        else:
            data = await self._stream.receive_some(max_bytes)
            if not data or counter.ignored:
                return data
            end = counter.request(data)
            if end is None:
                return data
            self._requested = True
            if end < len(data):
                self._held = bytes(data[end:])
            if end:
                return data[:end]
            return await self.receive_some(max_bytes)
        if not data or counter.ignored:
            return data
        cut = counter.frames(data, trio.current_time())
        if cut is None:
            return data
        assert counter.breach is not None
        self._on_breach(self, counter.breach)
        return bytes(data[:cut]) + _close_from_client(counter.breach)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._answered.set()
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


def _peer(stream: trio.abc.Stream) -> tuple[str, str]:
    """The client's address, and the text that names the connection in the log."""
    inner = stream
    while not isinstance(inner, trio.SocketStream):
        transport = getattr(inner, "transport_stream", None)
        if not isinstance(transport, trio.abc.Stream):
            return repr(stream), repr(stream)
        inner = transport
    try:
        host, port, *_ = inner.socket.getpeername()
    except OSError:
        return repr(stream), repr(stream)
    named = f"{host_for_url(host)}:{port}"
    return str(host), named if inner is stream else repr(stream)


class FrameBoundListener(trio.abc.Listener[trio.abc.Stream]):
    """Wraps a listener: each accepted stream is a :class:`FrameBoundStream`.

    Args:
        listener: The listener underneath (TCP, or TLS over TCP).
        on_breach: Given to every stream (see :class:`FrameBoundStream`).
    """

    def __init__(
        self,
        listener: trio.abc.Listener[trio.abc.Stream],
        on_breach: Callable[[FrameBoundStream, str], None],
    ) -> None:
        self.listener = listener
        self._on_breach = on_breach

    async def accept(self) -> trio.abc.Stream:
        return FrameBoundStream(await self.listener.accept(), self._on_breach)

    async def aclose(self) -> None:
        await self.listener.aclose()
