"""The request plane's sender (worker_ingress._planes._FrameSender) against a recording
websocket: one message per batch, the bound on its queue, close and a broken connection."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed

from shim_common import wire
from worker_ingress._planes import SEND_QUEUE_FRAMES, _FrameSender

TIMEOUT = 10


class RecordingSocket:
    """Stands in for a WebSocketConnection: records each message; a write can be held."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []
        self.hold: trio.Event | None = None
        self.broken = False

    async def send_message(self, data: bytes) -> None:
        if self.hold is not None:
            await self.hold.wait()
        if self.broken:
            raise ConnectionClosed(None)
        self.messages.append(data)

    def decoded(self) -> list[list[object]]:
        out: list[list[object]] = []
        for data in self.messages:
            message = wire.decode_worker_message(data)
            out.append(list(message.messages) if isinstance(message, wire.Batch) else [message])
        return out


def _chunk(request_id: int, text: str) -> wire.Chunk:
    return wire.Chunk(request_id=request_id, text=text, tokens=1)


def _sender(ws: RecordingSocket) -> _FrameSender:
    return _FrameSender(ws, batching=True)  # type: ignore[arg-type]


async def test_a_frame_queued_with_room_costs_no_checkpoint() -> None:
    sender = _sender(RecordingSocket())
    with trio.CancelScope() as scope:
        scope.cancel()
        await sender.send(_chunk(1, "a"))  # would raise Cancelled at a checkpoint
    assert not scope.cancelled_caught


async def test_what_queued_during_a_write_leaves_as_one_message_merged_per_request() -> None:
    ws = RecordingSocket()
    sender = _sender(ws)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)
            ws.hold = trio.Event()
            await sender.send(_chunk(1, "a"))
            await trio.testing.wait_all_tasks_blocked()  # the sender is writing "a"
            for text in "bcd":
                await sender.send(_chunk(1, text))
            await sender.send(_chunk(2, "x"))
            await sender.send(wire.End(request_id=2, prompt_tokens=1, completion_tokens=1))
            ws.hold.set()
            ws.hold = None
            sender.close()
    assert ws.decoded() == [
        [_chunk(1, "a")],
        [
            wire.Chunk(request_id=1, text="bcd", tokens=3),
            _chunk(2, "x"),
            wire.End(request_id=2, prompt_tokens=1, completion_tokens=1),
        ],
    ]


async def test_a_full_queue_holds_the_request_tasks_until_the_sender_drains_it() -> None:
    ws = RecordingSocket()
    sender = _sender(ws)
    ws.hold = trio.Event()
    sent = 0
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.run)
            await sender.send(_chunk(0, "first"))
            await trio.testing.wait_all_tasks_blocked()  # the sender holds "first"

            async def fill() -> None:
                nonlocal sent
                for index in range(SEND_QUEUE_FRAMES + 5):
                    await sender.send(_chunk(index % 7 + 1, "t"))
                    sent += 1

            nursery.start_soon(fill)
            await trio.testing.wait_all_tasks_blocked()
            assert sent == SEND_QUEUE_FRAMES  # the next one waits for room
            ws.hold.set()
            ws.hold = None
            await trio.testing.wait_all_tasks_blocked()
            assert sent == SEND_QUEUE_FRAMES + 5
            sender.close()
    tokens = sum(
        item.tokens for batch in ws.decoded() for item in batch if isinstance(item, wire.Chunk)
    )
    assert tokens == 1 + SEND_QUEUE_FRAMES + 5  # every token went out, merged or not


async def test_after_close_the_queue_is_sent_and_later_frames_are_dropped() -> None:
    ws = RecordingSocket()
    sender = _sender(ws)
    await sender.send(_chunk(1, "a"))
    sender.close()
    await sender.send(_chunk(1, "late"))
    with trio.fail_after(TIMEOUT):
        await sender.run()
    assert ws.decoded() == [[_chunk(1, "a")]]


async def test_a_broken_connection_releases_the_tasks_waiting_for_room() -> None:
    ws = RecordingSocket()
    sender = _sender(ws)
    ws.hold = trio.Event()
    released = trio.Event()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                with pytest.raises(ConnectionClosed):
                    await sender.run()

            nursery.start_soon(run)
            await sender.send(_chunk(1, "a"))
            await trio.testing.wait_all_tasks_blocked()

            async def fill() -> None:
                for _ in range(SEND_QUEUE_FRAMES + 1):
                    await sender.send(_chunk(2, "t"))
                released.set()

            nursery.start_soon(fill)
            await trio.testing.wait_all_tasks_blocked()
            assert not released.is_set()
            ws.broken = True
            ws.hold.set()
            await released.wait()  # the frames are dropped, the task goes on
    await sender.send(_chunk(3, "after"))  # dropped at once
    assert ws.messages == []
