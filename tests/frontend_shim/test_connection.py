"""One plane connection read from a memory stream: what a worker's close frame leaves behind."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from frontend_shim._connection import PlaneClosed, PlaneConnection
from frontend_shim._websocket import OP_BINARY, OP_CLOSE, close_payload

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
