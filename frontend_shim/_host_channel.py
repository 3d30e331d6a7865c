"""One end of the socket between a frontend's host process and one of its HTTP processes.

The messages and frames are in :mod:`frontend_shim._host_wire`; this is the Trio side:

1. Sending: :meth:`Channel.post` queues a message; the channel's sender task writes whatever
   queued while the last write was under way as one frame, writing without a checkpoint as
   far as the kernel takes it. Just before it makes a frame it calls ``before_frame``: the
   last moment to post what was held back.
2. Receiving: :meth:`Channel.receive` waits for a frame and returns its messages;
   :meth:`Channel.catch_up` returns, without waiting, the messages of every frame the socket
   already holds (the host reads its processes this way before it answers that no worker is
   free: :mod:`frontend_shim._picker`, rule 3). Both read through one frame reader, so a frame
   split between them is read once, whole.
3. The peer's end of file, or a frame that breaks :mod:`frontend_shim._host_wire` rule 6, ends
   the channel: :meth:`Channel.receive` raises :class:`ChannelClosed`.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from typing import Final, Generic, TypeVar

import trio

from frontend_shim._host_wire import FrameReader, FromHost, FromProcess, encode_frame

__all__ = ["Channel", "ChannelClosed"]

_READ_BYTES: Final = 256 * 1024
_AGAIN: Final = (BlockingIOError, InterruptedError)

_In = TypeVar("_In", FromHost, FromProcess)
_Out = TypeVar("_Out", FromHost, FromProcess)


class ChannelClosed(Exception):
    """The peer closed its end, or broke the frames (rule 3)."""


class Channel(Generic[_In, _Out]):
    """One end of a host-process socket (rules at the top of the module).

    Args:
        sock: a connected Unix stream socket (made non-blocking here; the channel owns it).
        incoming: the type of the messages the peer sends.
        before_frame: called before each frame is made of what was posted (the last moment
            to post what was held back until it was needed).
    """

    def __init__(
        self,
        sock: socket.socket,
        incoming: type[_In],
        before_frame: Callable[[], None] | None = None,
    ) -> None:
        sock.setblocking(False)
        self.before_frame = before_frame
        self._sock = sock
        self._reader = FrameReader(incoming)
        self._outbox: list[_Out] = []
        self._unsent = bytearray()
        self._wake = trio.Event()
        self._closed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        """Close the socket (the peer reads end of file)."""
        self._closed = True
        self._wake.set()
        self._sock.close()

    # ------------------------------------------------------------------ sending

    def post(self, message: _Out) -> None:
        """Queue ``message`` for the sender task (rule 1)."""
        self._outbox.append(message)
        self._wake.set()

    def wake(self) -> None:
        """Have the sender task make a frame at its next turn, even with nothing posted."""
        self._wake.set()

    def _frame_outbox(self) -> None:
        if self.before_frame is not None:
            self.before_frame()
        if self._outbox:
            self._unsent += encode_frame(self._outbox)
            self._outbox = []

    def _write_some(self) -> None:
        # Write without waiting; what the kernel does not take stays in ``_unsent``.
        unsent = self._unsent
        while unsent and not self._closed:
            try:
                sent = self._sock.send(unsent)
            except _AGAIN:
                return
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.EBADF):
                    unsent.clear()  # the peer is gone; the reader will say so
                    return
                raise
            del unsent[:sent]

    async def run_sender(self) -> None:
        """Write what is posted, until the channel is closed (run it in a task)."""
        while not self._closed:
            await self._wake.wait()
            self._wake = trio.Event()
            self._frame_outbox()
            while self._unsent and not self._closed:
                self._write_some()
                if self._unsent:
                    await trio.lowlevel.wait_writable(self._sock)
                # A frame of what was posted meanwhile joins the bytes still unsent.
                self._frame_outbox()

    # ------------------------------------------------------------------ receiving

    async def receive(self) -> list[_In]:
        """The messages of the next frames (at least one message; rules 2 and 3)."""
        while True:
            messages = self._read_ready()
            if messages:
                return messages
            await trio.lowlevel.wait_readable(self._sock)

    def catch_up(self) -> list[_In]:
        """The messages of every frame the socket holds now (rule 2); never waits."""
        return self._read_ready()

    def _read_ready(self) -> list[_In]:
        messages: list[_In] = []
        while True:
            try:
                data = self._sock.recv(_READ_BYTES)
            except _AGAIN:
                return messages
            except OSError as exc:
                raise ChannelClosed(f"read failed: {exc}") from exc
            if not data:
                if messages:
                    return messages  # the end of file is read again next time
                raise ChannelClosed("the peer closed its end")
            try:
                messages.extend(self._reader.feed(data))  # type: ignore[arg-type]
            except ValueError as exc:
                raise ChannelClosed(str(exc)) from exc
            if len(data) < _READ_BYTES:
                return messages
