"""A connection's reads and writes with the system call first (shim_common._socket_io), on real
loopback sockets."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from shim_common._socket_io import ConnectionIO

TIMEOUT = 10


@pytest.fixture
async def pair() -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    """A connected pair of TCP streams on loopback: (server side, client side)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    yield server, client
    await server.aclose()
    await client.aclose()
    await listeners[0].aclose()


async def test_a_read_returns_what_is_there_and_what_comes_later(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    server, client = pair
    io = ConnectionIO(server)
    with trio.fail_after(TIMEOUT):
        await client.send_all(b"first")
        await trio.testing.wait_all_tasks_blocked()
        assert await io.receive_some(100) == b"first"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send_all, b"later")
            assert await io.receive_some(100) == b"later"  # waited for it


async def test_a_read_with_data_at_once_is_still_a_checkpoint(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    server, client = pair
    io = ConnectionIO(server)
    with trio.fail_after(TIMEOUT):
        await client.send_all(b"ready")
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as scope:
            scope.cancel()
            await io.receive_some(100)
        assert scope.cancelled_caught
        assert await io.receive_some(100) == b"ready"  # nothing was lost to the cancel


async def test_eof_is_empty_and_a_reset_is_a_broken_connection(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    server, client = pair
    io = ConnectionIO(server)
    with trio.fail_after(TIMEOUT):
        await client.send_eof()
        assert await io.receive_some(100) == b""
        # An abortive close (SO_LINGER 0) resets the connection.
        client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await client.aclose()
        await trio.sleep(0.05)
        async def write_until_broken() -> None:
            for _ in range(100):  # the first write may still be taken before the reset lands
                await io.send_all(b"x" * 1000)
                await trio.sleep(0.01)

        with pytest.raises(trio.BrokenResourceError):
            await write_until_broken()


async def test_a_closed_socket_is_never_read_or_written(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    server, _client = pair
    io = ConnectionIO(server)
    with trio.fail_after(TIMEOUT):
        await io.send_all(b"x")  # a read after a write waits first: a closed socket all the same
        server.socket.close()
        with pytest.raises(trio.ClosedResourceError):
            await io.receive_some(100)
        with pytest.raises(trio.ClosedResourceError):
            await io.receive_some(100)
        with pytest.raises(trio.ClosedResourceError):
            await io.send_all(b"x")


async def test_a_write_the_kernel_cannot_take_at_once_goes_out_whole_and_in_order(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    server, client = pair
    io = ConnectionIO(server)
    payload = bytes(range(256)) * 40_000  # 10 MB: far beyond the socket buffers
    received = bytearray()

    async def read_all() -> None:
        while len(received) < len(payload):  # bounded: each read brings at least one byte
            data = await client.receive_some(1 << 20)
            assert data
            received.extend(data)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(io.send_all, payload)
            await trio.testing.wait_all_tasks_blocked()
            # The writer waits for room: a second write now would interleave, and is refused.
            with pytest.raises(trio.BusyResourceError):
                await io.send_all(b"interleaved")
            nursery.start_soon(read_all)
    assert received == payload


async def test_a_tls_stream_is_used_through_its_own_methods() -> None:
    left, right = trio.testing.memory_stream_pair()
    io = ConnectionIO(left)
    with trio.fail_after(TIMEOUT):
        await io.send_all(b"through the stream")
        assert await right.receive_some(100) == b"through the stream"
        assert io.send_now(b"not taken") == 0  # no socket: the stream sends it whole
        await right.send_all(b"back")
        assert await io.receive_some(100) == b"back"


async def test_after_a_write_a_read_finds_bytes_already_there_and_bytes_to_come(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    server, client = pair
    io = ConnectionIO(server)
    with trio.fail_after(TIMEOUT):
        # A pipelining client: its next request is in before the answer to the last goes out.
        await client.send_all(b"next")
        await trio.testing.wait_all_tasks_blocked()
        await io.send_all(b"answer")
        assert await io.receive_some(100) == b"next"
        assert await client.receive_some(100) == b"answer"
        # A client that waits for the answer first.
        await io.send_all(b"answer 2")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send_all, b"after")
            assert await io.receive_some(100) == b"after"
        # A cancel while waiting after a write takes nothing.
        await io.send_all(b"answer 3")
        with trio.move_on_after(0.05) as scope:
            await io.receive_some(100)
        assert scope.cancelled_caught
        await client.send_all(b"kept")
        assert await io.receive_some(100) == b"kept"


async def test_an_interim_write_goes_before_the_next_write_whatever_the_kernel_took(
    pair: tuple[trio.SocketStream, trio.SocketStream],
) -> None:
    # The half-close probe is written from the reader's task while the main task owns the
    # writes: what the kernel did not take of it is owed, and the next write sends it first.
    server, client = pair
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    io = ConnectionIO(server)
    with trio.fail_after(TIMEOUT):
        # Fill the socket so that the interim write is taken in part, or not at all.
        filler = b"f" * (1 << 20)
        sent = io.send_now(filler)
        interim = b"HTTP/1.1 100 Continue\r\n\r\n"
        went = io.send_interim(interim)
        received = bytearray()

        async def read_all() -> None:
            while len(received) < sent + (len(interim) if went else 0) + 5:
                received.extend(await client.receive_some(65536))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            await io.send_all(b"after")
    expected = filler[:sent] + (interim if went else b"") + b"after"
    assert bytes(received) == expected
    # Nothing owed after a whole write: a second interim write goes at once.
    assert io.send_interim(interim)
    assert await client.receive_some(100) == interim


async def test_no_interim_write_on_a_stream_other_than_plain_tcp() -> None:
    left, _right = trio.testing.memory_stream_pair()
    assert not ConnectionIO(left).send_interim(b"x")


async def test_the_part_of_an_interim_write_the_kernel_left_goes_first(
    pair: tuple[trio.SocketStream, trio.SocketStream], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, client = pair
    io = ConnectionIO(server)
    real_write = os.write
    limits = [10]  # the kernel takes 10 bytes of the interim write, then whatever it likes

    def write(fd: int, data: bytes | bytearray | memoryview) -> int:
        limit = limits.pop() if limits else len(data)
        return real_write(fd, bytes(data)[:limit])

    monkeypatch.setattr("shim_common._socket_io.os.write", write)
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    with trio.fail_after(TIMEOUT):
        assert io.send_interim(interim)
        assert io.send_now(b"answer") == len(b"answer")
        received = b""
        while len(received) < len(interim) + 6:
            received += await client.receive_some(100)
    assert received == interim + b"answer"
