"""A connection's reads and writes with the system call tried first, for the HTTP server.

Trio's :class:`trio.SocketStream` puts two layers (the stream, then the socket's non-blocking
helper) and a checkpoint around every ``recv`` and ``send``, so a request answered on a kept
connection yields to the scheduler twice: once after its read, once after its write. For a
small answer that is most of what a request costs above the system calls themselves.
:class:`ConnectionIO` keeps the system calls and drops the rest where it safely can:

1. Only a plain TCP :class:`trio.SocketStream` takes the direct path; any other stream (TLS)
   is used through its own ``receive_some`` and ``send_all``, unchanged.
2. A read is a checkpoint, as the stream's is: a cancelled task raises before it takes a byte.
   It tries ``os.read`` at once, except after a write (the client is reading an answer: its
   next bytes are almost never there yet), when it first waits until the socket is readable.
   Nothing there: it waits until the socket is readable and tries again. Data at once: it
   yields to the other tasks before returning (a client that keeps the socket full never
   starves them), without raising a cancel that would lose the bytes. EOF is ``b""``; a reset
   or any other error is :class:`trio.BrokenResourceError`, a closed socket
   :class:`trio.ClosedResourceError`, as the stream would raise.
3. A write tries ``os.write`` at once and returns without a checkpoint when the kernel took
   every byte (the caller's next read, or whatever it awaits next, is the checkpoint). What the
   kernel did not take is sent through the stream's ``send_all``, which waits for room and
   honours cancellation. Two writes at once are a programming error, refused with
   :class:`trio.BusyResourceError` as the stream refuses them, so bytes never interleave. An
   interim write (:meth:`ConnectionIO.send_interim`, from a task other than the writer's) sends
   what the kernel takes at once and owes the rest, which the next write sends first.
4. The descriptor is asked of the socket before every system call (``-1`` once closed), never
   remembered: a number freed by a close and reused by a new connection is never read from or
   written to.
"""

from __future__ import annotations

import os

import trio

__all__ = ["ConnectionIO"]


class ConnectionIO:
    """``receive_some`` and ``send_all`` of one connection's stream (rules at the top).

    Args:
        stream: the connection's stream.
    """

    __slots__ = ("_owed", "_sending", "_socket", "_stream", "_wrote")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._sending = False
        # A write since the last read: the client is reading an answer, so the next read waits
        # for readiness first instead of trying a read that would find nothing (rule 2).
        self._wrote = False
        # What an interim write left unsent: the next write sends it first (rule 3).
        self._owed = b""

    async def receive_some(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` bytes, at least one; ``b""`` at EOF (rule 2)."""
        sock = self._socket
        if sock is None:
            return bytes(await self._stream.receive_some(max_bytes))
        if self._wrote:
            # Just answered: the client's next bytes are not there yet, or epoll says so at
            # once. Waiting first spares the read that would fail.
            self._wrote = False
            if sock.fileno() < 0:
                raise trio.ClosedResourceError("the connection is closed")
            await trio.lowlevel.wait_readable(sock)
            waited = True
        else:
            # A cancelled task takes nothing off the socket: the cancel comes before the read.
            await trio.lowlevel.checkpoint_if_cancelled()
            waited = False
        # Each pass either returns or waits until the socket is readable: bounded by the
        # readiness reports, each a checkpoint.
        while True:
            fd = sock.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("the connection is closed")
            try:
                data = os.read(fd, max_bytes)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                waited = True
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"reading failed: {exc}") from exc
            if not waited:
                # Read at once: yield to the others all the same, but a cancel arriving now
                # leaves these bytes with the caller.
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data

    def send_now(self, data: bytes | bytearray | memoryview) -> int:
        """Write what the kernel takes of ``data`` now, without waiting: the bytes taken (rule
        3); 0 for a stream other than plain TCP, which :meth:`send_all` then sends whole."""
        sock = self._socket
        if sock is None:
            return 0
        if self._sending:
            raise trio.BusyResourceError("another task is writing to this connection")
        owed = self._owed
        written = self._write(bytes(owed) + bytes(data) if owed else data)
        if not owed:
            return written
        if written < len(owed):  # what is owed still goes first, through send_rest
            self._owed = owed[written:]
            return 0
        self._owed = b""
        return written - len(owed)

    def send_interim(self, data: bytes) -> bool:
        """Write what the kernel takes of ``data`` now and owe the rest to the next write (rule
        3); ``False`` when nothing went (a full socket, or a stream other than plain TCP)."""
        if self._socket is None or self._sending or self._owed:
            return False
        written = self._write(data)
        self._owed = data[written:] if written else b""
        return written > 0

    def _write(self, data: bytes | bytearray | memoryview) -> int:
        sock = self._socket
        assert sock is not None
        fd = sock.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("the connection is closed")
        self._wrote = True
        try:
            return os.write(fd, data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise trio.BrokenResourceError(f"writing failed: {exc}") from exc

    def pending_error(self) -> int:
        """The socket's pending error (``SO_ERROR``, read and cleared), 0 with none; 0 for a
        stream other than plain TCP or a closed socket. A reset from a peer that had sent its
        FIN shows here (``EPIPE`` on Linux) while reads still find a clean EOF."""
        sock = self._socket
        if sock is None or sock.fileno() < 0:
            return 0
        return int(sock.getsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_ERROR))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send every byte of ``data``, waiting for room as long as it takes (rule 3); a
        checkpoint only when it has to wait."""
        await self.send_rest(data, self.send_now(data))

    async def send_rest(self, data: bytes | bytearray | memoryview, sent: int) -> None:
        """Send what :meth:`send_now` did not take of ``data`` (its first ``sent`` bytes went),
        through the stream, which waits for room; nothing when it took every byte."""
        if sent >= len(data):
            return
        if self._sending:
            raise trio.BusyResourceError("another task is writing to this connection")
        self._sending = True
        owed, self._owed = self._owed, b""
        try:
            if owed:
                await self._stream.send_all(owed)
            await self._stream.send_all(memoryview(data)[sent:] if sent else data)
        finally:
            self._sending = False
