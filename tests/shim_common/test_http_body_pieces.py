"""A request body that arrives in many small reads costs a small multiple of its size.

Each read of a body becomes one piece (the pieces one read parses are delivered as one); a body
sent a byte per TCP segment is read a byte at a time. Kept as a list of the pieces, such a body
cost one object per byte, some 40 times its size; gathered in one buffer grown in place, a few
times its size. The client is played by a stream that hands the server one byte per read.
"""

from __future__ import annotations

import tracemalloc

import trio
import trio.lowlevel

from shim_common._httpserver import HTTPRequest, HTTPResponder, serve_connection

#: The body: large enough that an object per byte shows (3 MB before), small enough to be
#: read a byte at a time in well under a second.
BODY_BYTES = 32 * 1024
#: What reading a body a byte at a time costs whatever its size, as tracemalloc sees it.
CONSTANT_BYTES = 256 * 1024


class OneByteAtATime(trio.abc.Stream):
    """A client that sends ``data`` one byte per read, then waits; what is written to it is
    dropped."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._at = 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        # A turn for the server's main task between reads, as between TCP segments.
        await trio.lowlevel.checkpoint()
        if self._at >= len(self._data):
            await trio.sleep_forever()
        self._at += 1
        return self._data[self._at - 1 : self._at]

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_a_body_read_a_byte_at_a_time_costs_a_small_multiple_of_its_size() -> None:
    body = bytes(range(256)) * (BODY_BYTES // 256)
    head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    read: list[bytes] = []
    peaks: list[int] = []
    done = trio.Event()

    async def handler(request: HTTPRequest, responder: HTTPResponder) -> None:
        # What reading the body costs, from the end of the head to the body returned.
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        read.append(await request.read_body())
        peaks.append(tracemalloc.get_traced_memory()[1] - before)
        done.set()
        await responder.send(200, [], b"")

    with trio.fail_after(30):
        tracemalloc.start()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_connection, OneByteAtATime(head + body), handler)
                await done.wait()
                nursery.cancel_scope.cancel()
        finally:
            tracemalloc.stop()
    assert read == [body]
    # Gathered in one buffer: the buffer and its copy returned, besides what a read costs the
    # server whatever the body (its tasks' turns, garbage between collections: about 200 KB
    # here). An object per byte was about 3 MB here.
    assert peaks[0] < CONSTANT_BYTES + 4 * BODY_BYTES, peaks
