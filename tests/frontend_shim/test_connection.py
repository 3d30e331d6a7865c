"""One plane connection read from a stream: what a worker's close frame leaves behind, and reads in
place (the connection's rule 5) on a real socket."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
from client_frames import client_frames

from frontend_shim._connection import (
    CONTROL_BURST,
    PlaneClosed,
    PlaneConnection,
    ProtocolError,
)
from frontend_shim._websocket import (
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    close_payload,
)
from shim_common._control_rate import ControlFrameRate

CAP = 1 << 20


def server_frame(opcode: int, payload: bytes) -> bytes:
    """An unmasked frame, as a worker writes it (payloads under 126 bytes here)."""
    assert len(payload) < 126
    return bytes([0x80 | opcode, len(payload)]) + payload


async def test_messages_read_with_the_close_frame_come_out_before_the_close() -> None:
    # A draining worker writes a request's last replies and then its close frame; both often
    # arrive in one read, and the replies are what the frontend's clients are waiting for.
    client, worker = trio.testing.memory_stream_pair()
    last_words = (
        server_frame(OP_BINARY, b"last chunk")
        + server_frame(OP_BINARY, b"end")
        + server_frame(OP_CLOSE, close_payload(1001, "worker draining"))
    )
    connection = PlaneConnection(client, "/v1/requests", last_words, CAP)
    with trio.fail_after(5):
        assert await connection.messages() == [b"last chunk", b"end"]
        with pytest.raises(PlaneClosed) as closed:
            await connection.messages()
        assert (closed.value.code, closed.value.reason) == (1001, "worker draining")
        # The close was answered once, when it was read.
        answer = await worker.receive_some(1024)
        assert answer[0] & 0x0F == OP_CLOSE
        with pytest.raises(PlaneClosed):
            await connection.messages()


async def test_a_close_frame_alone_raises_at_once() -> None:
    client, _worker = trio.testing.memory_stream_pair()
    connection = PlaneConnection(
        client, "/v1/events", server_frame(OP_CLOSE, close_payload(1001, "worker draining")), CAP
    )
    with trio.fail_after(5), pytest.raises(PlaneClosed, match="1001"):
        await connection.messages()


# ----------------------------------------------------------------------------- reads in place


@contextlib.asynccontextmanager
async def socket_connection() -> AsyncIterator[tuple[PlaneConnection, trio.SocketStream]]:
    """A connection on one end of a connected socket pair, and the worker's end."""
    ours, theirs = trio.socket.socketpair()
    client, worker = trio.SocketStream(ours), trio.SocketStream(theirs)
    try:
        yield PlaneConnection(client, "/v1/events", b"", CAP), worker
    finally:
        await client.aclose()
        await worker.aclose()


async def test_a_read_in_place_returns_what_the_socket_holds_and_never_waits() -> None:
    with trio.fail_after(5):
        async with socket_connection() as (connection, worker):
            assert connection.reads_in_place
            assert connection.messages_now() == []  # nothing yet: no wait, no error
            await worker.send_all(server_frame(OP_BINARY, b"one") + server_frame(OP_BINARY, b"two"))
            assert connection.messages_now() == [b"one", b"two"]
            # Half a frame is held for the next read.
            frame = server_frame(OP_BINARY, b"three")
            await worker.send_all(frame[:3])
            assert connection.messages_now() == []
            await worker.send_all(frame[3:])
            assert connection.messages_now() == [b"three"]
            assert not connection.owes_reply


async def test_a_ping_read_in_place_is_owed_and_answered_by_send_owed() -> None:
    with trio.fail_after(5):
        async with socket_connection() as (connection, worker):
            await worker.send_all(server_frame(OP_PING, b"p1") + server_frame(OP_BINARY, b"load"))
            assert connection.messages_now() == [b"load"]
            assert connection.owes_reply
            await connection.send_owed()
            assert not connection.owes_reply
            assert client_frames(await worker.receive_some(1024)) == [(OP_PONG, b"p1")]


async def test_a_close_read_in_place_is_answered_before_it_raises() -> None:
    with trio.fail_after(5):
        async with socket_connection() as (connection, worker):
            await worker.send_all(
                server_frame(OP_BINARY, b"last")
                + server_frame(OP_CLOSE, close_payload(1001, "bye"))
            )
            assert connection.messages_now() == [b"last"]
            assert connection.owes_reply
            await connection.send_owed()
            [(opcode, payload)] = client_frames(await worker.receive_some(1024))
            assert (opcode, payload[:2]) == (OP_CLOSE, (1001).to_bytes(2, "big"))
            with pytest.raises(PlaneClosed, match="1001"):
                connection.messages_now()
            with pytest.raises(PlaneClosed, match="1001"):
                await connection.messages()


async def test_eof_and_a_text_message_end_a_read_in_place() -> None:
    with trio.fail_after(5):
        async with socket_connection() as (connection, worker):
            await worker.send_all(server_frame(OP_TEXT, b"hi"))
            with pytest.raises(ProtocolError, match="text"):
                connection.messages_now()
        async with socket_connection() as (connection, worker):
            await worker.aclose()
            with pytest.raises(PlaneClosed, match="1006"):
                connection.messages_now()


async def test_a_stream_that_is_not_a_plain_socket_cannot_be_read_in_place() -> None:
    client, _worker = trio.testing.memory_stream_pair()
    assert not PlaneConnection(client, "/v1/events", b"", CAP).reads_in_place


def test_control_frames_are_allowed_a_burst_then_a_rate() -> None:
    rate = ControlFrameRate(per_second=4.0, burst=32, now=0.0)
    assert rate.allow(32, now=0.0)  # the burst
    assert not rate.allow(1, now=0.0)  # one more at once is over
    rate = ControlFrameRate(per_second=4.0, burst=32, now=0.0)
    # A ping a second for an hour (more than a worker's keepalive) never runs out.
    assert all(rate.allow(1, now=float(second)) for second in range(3600))
    # Refilled up to the burst, never past it.
    assert rate.allow(32, now=10_000.0)
    assert not rate.allow(1, now=10_000.0)
    with pytest.raises(ValueError, match="per_second > 0"):
        ControlFrameRate(per_second=float("nan"), burst=1, now=0.0)


async def test_a_ping_flood_ends_the_connection_with_a_protocol_error() -> None:
    with trio.fail_after(5):
        async with socket_connection() as (connection, worker):
            pings = b"".join(server_frame(OP_PING, b"%d" % n) for n in range(CONTROL_BURST + 1))
            await worker.send_all(pings)
            await trio.sleep(0.05)
            with pytest.raises(ProtocolError, match="control frames past 32 at once"):
                connection.messages_now()


async def test_the_pong_to_our_own_ping_never_counts_against_the_bound() -> None:
    with trio.fail_after(5):
        async with socket_connection() as (connection, worker):
            # Three bursts' worth of pings answered at once, faster than the bound's refill.
            for _ in range(3 * CONTROL_BURST):
                await connection.send_ping()
                await worker.send_all(server_frame(OP_PONG, b""))
                assert connection.messages_now() == []
                assert connection.ping_sent_at is None
            # Pongs nobody asked for still count.
            pongs = b"".join(server_frame(OP_PONG, b"") for _ in range(CONTROL_BURST + 1))
            await worker.send_all(pongs)
            with pytest.raises(ProtocolError, match="control frames past 32 at once"):
                connection.messages_now()


async def test_a_message_over_the_lowered_cap_is_refused_from_its_header() -> None:
    with trio.fail_after(5):
        async with socket_connection() as (connection, worker):
            connection.limit_messages(1000)
            # Only the header of a 2,000-byte message arrives: refused before its payload.
            await worker.send_all(bytes([0x82, 126]) + (2000).to_bytes(2, "big"))
            await trio.sleep(0.05)
            with pytest.raises(ProtocolError, match="a message over 1000 bytes"):
                connection.messages_now()


async def test_the_lowered_cap_applies_to_a_message_already_under_way() -> None:
    # The hello and the header of a large message (under the connection's first cap) come in
    # one read, before the hello says how large the worker's messages can be: the cap lowered
    # then still refuses that message.
    with trio.fail_after(5):
        async with socket_connection() as (connection, worker):
            header = bytes([0x82, 127]) + (CAP // 2).to_bytes(8, "big")
            await worker.send_all(server_frame(OP_BINARY, b"hello") + header + b"x" * 1000)
            await trio.sleep(0.05)
            assert connection.messages_now() == [b"hello"]
            connection.limit_messages(66560)
            await worker.send_all(b"x" * 1000)
            await trio.sleep(0.05)
            with pytest.raises(ProtocolError, match="a message over 66560 bytes"):
                connection.messages_now()
