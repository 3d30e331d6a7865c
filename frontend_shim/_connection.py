"""One websocket connection from the frontend to a worker plane: a Trio stream and the lean codec.

A :class:`PlaneConnection` is opened by :func:`open_plane` (TCP, TLS for ``wss://``, the upgrade
with any extra headers) and read by exactly one task through :meth:`PlaneConnection.messages`,
which returns every whole binary message that one read brought: no task hop, no channel and no
cancel scope per message, so a frontend following thousands of workers pays for bytes, not for
bookkeeping. Liveness is judged from :attr:`PlaneConnection.last_received` by the link's
watchdog, not by a timeout around every read.

Rules:

1. Writes go through :meth:`send_message`, :meth:`send_ping` and the reader's automatic pong,
   serialised by one lock, so frames never interleave.
2. The reader answers a ping with a pong and notes a pong (any bytes at all prove the peer
   alive: :attr:`last_received` moves and an outstanding ping is cleared).
3. A close frame from the worker is answered and raises :class:`PlaneClosed` with its code and
   reason, after the messages that came before it (the worker's last replies often share a read
   with its close frame); EOF raises it with 1006. A text message, a frame breaking the rules or
   a message over the size cap raises :class:`ProtocolError`.
4. :meth:`aclose` sends a close frame when it can (bounded by ``close_timeout``) and always
   closes the stream. The frame says 1000, or the code and reason :meth:`close_with` set (the
   link's reason for ending the session, when the worker is at fault).
5. A plain TCP connection can also be read *in place*: :meth:`messages_now` reads what the socket
   holds now, without waiting and without yielding to the scheduler (a frontend reading
   thousands of workers at an interval pays a syscall per read, not a task switch). It cannot
   write, so a ping or a close read that way leaves a reply *owed* (:attr:`owes_reply`) until
   :meth:`send_owed` writes it; its reader reads no more until then (a close raises
   :class:`PlaneClosed` only once its reply went out, as in rule 3). :meth:`messages` handles its
   frames the same way and writes what they owe before it returns. Under TLS only the SSL stream
   can read the bytes: :attr:`reads_in_place` is False and :meth:`messages` is the only way.
6. Control frames (pings and pongs) from the worker are bounded in rate by a
   :class:`ControlFrameRate` per connection: ``control_burst`` at once, then
   ``control_frames_per_second`` (a worker pings each plane every few seconds and pongs only
   what it is pinged). One past the bound raises :class:`ProtocolError`: a worker flooding
   pings would otherwise have the frontend write a pong for each, at a core's worth of CPU.
   The pong that answers the frontend's own outstanding ping is not counted, so a link that
   pings more often than the bound allows (a short keepalive on an idle plane) stays up.
7. :meth:`PlaneConnection.limit_messages` sets the size cap once the hello says how large the
   worker's messages can be (the event plane's bound, :mod:`frontend_shim._worker_hello`): a
   frame announcing more raises :class:`ProtocolError` from its header, before its payload is
   read or held. A connection opened with ``pause_after_first`` reads its first message (the
   hello) under the cap it was opened with, and nothing after it until then (rule 7 of
   :mod:`frontend_shim._websocket`); what came with the hello is read first afterwards.
"""

from __future__ import annotations

import contextlib
import math
import os
import ssl
from collections.abc import Sequence
from typing import Final

import trio

from frontend_shim._websocket import (
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    FrameReader,
    HandshakeReader,
    WebSocketProtocolError,
    close_payload,
    encode_frame,
    handshake_request,
    parse_close,
)
from shim_common._control_rate import ControlFrameRate
from shim_common._net import host_for_url

__all__ = [
    "CONTROL_BURST",
    "CONTROL_FRAMES_PER_SECOND",
    "EVENTS_RECEIVE_BUFFER",
    "PlaneClosed",
    "PlaneConnection",
    "ProtocolError",
    "open_plane",
]

#: Bytes asked of the socket per read: many small event batches fit in one read.
RECEIVE_BYTES: Final = 64 * 1024
#: Receive buffer asked of the kernel for event-plane sockets. Small on purpose: a frontend that
#: falls behind should hold seconds of old events, not a backlog of minutes, so the worker's
#: latest-wins mailbox engages (its sends block) and the lag stays bounded.
EVENTS_RECEIVE_BUFFER: Final = 64 * 1024


#: Control frames a worker may send a connection at once (rule 6) ...
CONTROL_BURST: Final = 32
#: ... and a second after that: a worker's own keepalive is one ping per plane every 10 s.
CONTROL_FRAMES_PER_SECOND: Final = 4.0


#: What a write to a connection that is going away raises.
_SEND_ERRORS: Final = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class PlaneClosed(Exception):
    """The worker closed the connection (``code`` 1006: without a close frame)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"connection closed ({code}{' ' + reason if reason else ''})")
        self.code = code
        self.reason = reason


class ProtocolError(Exception):
    """The worker sent something out of protocol (here, or on a plane's session above: a second
    hello, a reply for a request never sent); the session ends and is retried."""


class PlaneConnection:
    """A client websocket on one plane of a worker (see the module rules).

    Attributes:
        path: the plane's path (for messages).
        last_received: ``trio.current_time()`` of the last bytes read.
        ping_sent_at: when the outstanding keepalive ping was sent; ``None`` when none is.
        send_started_at: when the write in progress started; ``None`` when none is. A write
            that takes long means the worker stopped reading (the watchdog judges it).
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        path: str,
        first_bytes: bytes,
        max_message_bytes: int,
        subprotocol: str | None = None,
        *,
        control_frames_per_second: float = CONTROL_FRAMES_PER_SECOND,
        control_burst: int = CONTROL_BURST,
        pause_after_first: bool = False,
    ) -> None:
        self.path = path
        #: The subprotocol the worker accepted, if any.
        self.subprotocol = subprotocol
        self.last_received = trio.current_time()
        self.ping_sent_at: float | None = None
        self.send_started_at: float | None = None
        self._stream = stream
        self._reader = FrameReader(max_message_bytes, pause_after_first=pause_after_first)
        self._control_rate = ControlFrameRate(
            control_frames_per_second, control_burst, self.last_received
        )
        self._first_bytes = first_bytes
        self._unread: list[bytes] = []
        self._send_lock = trio.StrictFIFOLock()
        self._closed = False
        #: The worker's close, held back while the messages read with it are returned.
        self._peer_closed: PlaneClosed | None = None
        # The socket's descriptor when the stream is plain TCP (rule 5), else -1.
        self._fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        # Replies owed by reads in place (rule 5): pong payloads, and the close code to answer.
        self._owed_pongs: list[bytes] = []
        self._owed_close: int | None = None
        # What aclose() says (rule 4).
        self._close_code = 1000
        self._close_reason = ""

    def close_with(self, code: int, reason: str) -> None:
        """Have :meth:`aclose` send ``code`` and ``reason`` (cut to fit the frame) instead of
        1000 (rule 4)."""
        self._close_code = code
        self._close_reason = reason

    def limit_messages(self, max_message_bytes: int) -> None:
        """Accept messages of at most ``max_message_bytes`` from now on (rule 7)."""
        # What the reader held (a frame under way, what came with the hello) is read first.
        self._first_bytes = self._reader.limit(max_message_bytes) + self._first_bytes

    @property
    def reads_in_place(self) -> bool:
        """Whether :meth:`messages_now` can read this connection (rule 5: plain TCP only)."""
        return self._fd >= 0

    @property
    def fileno(self) -> int:
        """The socket's descriptor when :attr:`reads_in_place`, else -1."""
        return self._fd

    @property
    def owes_reply(self) -> bool:
        """Whether a read in place left a pong or a close reply to write (rule 5)."""
        return bool(self._owed_pongs) or self._owed_close is not None

    async def messages(self) -> list[bytes]:
        """Wait for bytes from the worker and return the whole binary messages among them.

        Returns:
            One or more messages, in order.

        Raises:
            PlaneClosed: the worker closed the connection.
            ProtocolError: a text message or a broken frame (rule 3).
            trio.BrokenResourceError: the socket failed.
        """
        if self._unread:
            unread, self._unread = self._unread, []
            return unread
        if self._peer_closed is not None:
            raise self._peer_closed
        while True:
            if self._first_bytes:
                data, self._first_bytes = self._first_bytes, b""
            else:
                data = bytes(await self._stream.receive_some(RECEIVE_BYTES))
                if not data:
                    raise PlaneClosed(1006, "")
            messages = self._take(data)
            if self.owes_reply:
                await self.send_owed()
            if messages:
                return messages
            if self._peer_closed is not None:
                raise self._peer_closed

    def messages_now(self) -> list[bytes]:
        """The whole binary messages the socket holds now, read in place (rule 5).

        Never waits and never yields to the scheduler. Call only when :attr:`reads_in_place`
        and not :attr:`owes_reply`, and from the connection's one reader.

        Returns:
            The messages, in order; empty when the socket held none whole (nothing yet, part of
            a frame, or only control frames; a reply they call for is then owed).

        Raises:
            PlaneClosed: EOF, or the worker's close once its reply was sent.
            ProtocolError: a text message or a broken frame (rule 3).
            OSError: the socket failed.
        """
        if self._unread:
            unread, self._unread = self._unread, []
            return unread
        if self._peer_closed is not None:
            raise self._peer_closed
        if self._first_bytes:
            data, self._first_bytes = self._first_bytes, b""
        else:
            try:
                data = os.read(self._fd, RECEIVE_BYTES)
            except BlockingIOError:
                return []
            if not data:
                raise PlaneClosed(1006, "")
        return self._take(data)

    def _take(self, data: bytes) -> list[bytes]:
        """Rules 2 and 3 for what one read brought: its whole binary messages, in order; a
        ping's pong and a close's reply become owed, and the close is held for the next read."""
        self.last_received = trio.current_time()
        pinged = self.ping_sent_at is not None
        self.ping_sent_at = None
        try:
            frames = self._reader.receive(data)
        except WebSocketProtocolError as exc:
            raise ProtocolError(f"{exc} on {self.path}") from exc
        messages: list[bytes] = []
        controls = sum(1 for opcode, _ in frames if opcode in (OP_PING, OP_PONG))
        if pinged and any(opcode == OP_PONG for opcode, _ in frames):
            controls -= 1  # the answer to our own ping: as often as we ping, never a flood
        if controls and not self._control_rate.allow(controls, self.last_received):
            raise ProtocolError(f"control frames past {self._control_rate.bound} on {self.path}")
        for opcode, payload in frames:
            if opcode == OP_BINARY:
                messages.append(payload)
            elif opcode == OP_PING:
                self._owed_pongs.append(payload)
            elif opcode == OP_CLOSE:
                code, reason = parse_close(payload)
                self._owed_close = code
                self._peer_closed = PlaneClosed(code, reason)
                break
            elif opcode != OP_PONG:
                raise ProtocolError(f"a text message on {self.path} (the protocol is binary)")
        return messages

    async def send_owed(self) -> None:
        """Write the replies that reads in place left owed (rule 5), oldest first."""
        pongs, self._owed_pongs = self._owed_pongs, []
        for payload in pongs:
            await self._send_frame(encode_frame(OP_PONG, payload))
        if self._owed_close is not None:
            code, self._owed_close = self._owed_close, None
            await self._reply_close(code)

    def unread(self, messages: list[bytes]) -> None:
        """Give messages back, to be returned first by the next :meth:`messages`."""
        self._unread = messages + self._unread

    async def send_message(self, data: bytes) -> None:
        """Send one binary message (waits while the socket is full: backpressure)."""
        await self._send_frame(encode_frame(OP_BINARY, data))

    async def send_messages(self, messages: list[bytes]) -> None:
        """Send several binary messages with one write."""
        await self._send_frame(b"".join([encode_frame(OP_BINARY, data) for data in messages]))

    async def send_ping(self) -> None:
        """Send a keepalive ping and note when (rule 2 clears it)."""
        self.ping_sent_at = trio.current_time()
        await self._send_frame(encode_frame(OP_PING))

    async def aclose(self, close_timeout: float) -> None:
        """Send a close frame unless the caller is being cancelled, then close the stream.

        Never raises; runs shielded, so it finishes even under cancellation (the close frame
        is skipped then: the peer may be the reason, and waiting on it would only delay).
        """
        polite = not self._closed and trio.current_effective_deadline() != -math.inf
        self._closed = True
        with trio.CancelScope(shield=True):
            if polite:
                payload = close_payload(self._close_code, self._close_reason)
                with trio.move_on_after(close_timeout), contextlib.suppress(*_SEND_ERRORS):
                    await self._send_frame(encode_frame(OP_CLOSE, payload))
            await trio.aclose_forcefully(self._stream)

    async def _reply_close(self, code: int) -> None:
        if self._closed:
            return
        self._closed = True
        reply = close_payload(code if code not in (1005, 1006) else 1000)
        with trio.move_on_after(1.0), contextlib.suppress(*_SEND_ERRORS):
            await self._send_frame(encode_frame(OP_CLOSE, reply))

    async def _send_frame(self, frame: bytes) -> None:
        async with self._send_lock:
            self.send_started_at = trio.current_time()
            try:
                await self._stream.send_all(frame)
            finally:
                self.send_started_at = None


async def open_plane(
    *,
    host: str,
    port: int,
    path: str,
    headers: Sequence[tuple[str, str]] = (),
    subprotocols: Sequence[str] = (),
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    max_message_bytes: int,
    pause_after_first: bool = False,
    receive_buffer: int | None = None,
) -> PlaneConnection:
    """Connect to ``host:port``, upgrade ``path`` and return the open connection.

    The caller bounds the time (a cancel scope around the whole session start).

    Args:
        host: The IP address to connect to.
        port: The port.
        path: The full request target (path prefix plus plane path).
        headers: Extra upgrade headers (the bearer token).
        subprotocols: Subprotocols offered (the chosen one is the connection's ``subprotocol``).
        ssl_context: TLS for ``wss://``; ``None`` for plain ``ws://``.
        server_hostname: The name the certificate must carry (default: ``host``).
        max_message_bytes: The size cap of one message, until
            :meth:`~PlaneConnection.limit_messages`.
        pause_after_first: Read nothing after the first message until
            :meth:`~PlaneConnection.limit_messages` (rule 7).
        receive_buffer: ``SO_RCVBUF`` to ask of the kernel (``None``: the default).

    Raises:
        OSError: the TCP connection failed.
        trio.BrokenResourceError: TLS failed (its cause says why) or the socket broke.
        HandshakeError: the upgrade was refused (``HandshakeRejected``) or malformed.
    """
    tcp = await trio.open_tcp_stream(host, port)
    if receive_buffer is not None:
        tcp.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, receive_buffer)
    stream: trio.abc.Stream = tcp
    try:
        if ssl_context is not None:
            tls = trio.SSLStream(
                tcp, ssl_context, server_hostname=server_hostname or host, https_compatible=True
            )
            await tls.do_handshake()
            stream = tls
        request, key = handshake_request(
            f"{host_for_url(host)}:{port}", path, headers, subprotocols
        )
        await stream.send_all(request)
        answer = HandshakeReader(key, subprotocols)
        while True:
            first_bytes = answer.receive(bytes(await stream.receive_some(RECEIVE_BYTES)))
            if first_bytes is not None:
                return PlaneConnection(
                    stream,
                    path,
                    first_bytes,
                    max_message_bytes,
                    answer.subprotocol,
                    pause_after_first=pause_after_first,
                )
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
