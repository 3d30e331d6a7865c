"""The request plane of one worker session (frontend_shim._request_plane), without sockets: the
per-request buffer and its merging, the request table, the outbox, and a property over random
interleavings of requests, replies, cancels, sends and a close."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from frontend_shim._links import LinkSettings
from frontend_shim._request_plane import LinkStats, RequestPlane, RequestStream, ResponseBuffer
from shim_common import wire

_DEFAULTS = LinkSettings()


def _chunk(text: str, *, finish: str | None = None, rid: int = 1) -> wire.Chunk:
    return wire.Chunk(request_id=rid, text=text, tokens=1, finish_reason=finish)


async def test_full_buffer_merges_text_chunks_and_keeps_room_for_the_end() -> None:
    buffer = ResponseBuffer(2)
    assert buffer.push(wire.Started(request_id=1, prompt_tokens=3)) == "ok"
    assert buffer.push(_chunk("a")) == "ok"
    assert buffer.push(_chunk("b")) == "merged"
    assert buffer.push(_chunk("c", finish="length")) == "merged"
    assert buffer.push(_chunk("d")) == "full"  # the last buffered chunk is final: no merge
    assert buffer.push(wire.End(request_id=1, prompt_tokens=3, completion_tokens=3)) == "ok"
    assert buffer.finished
    assert isinstance(await buffer.get(), wire.Started)
    merged = await buffer.get()
    assert merged == wire.Chunk(request_id=1, text="abc", tokens=3, finish_reason="length")
    assert isinstance(await buffer.get(), wire.End)


async def test_full_buffer_refuses_embeddings() -> None:
    buffer = ResponseBuffer(1)
    vector = wire.Chunk(request_id=1, embedding=[0.5], index=0)
    assert buffer.push(vector) == "ok"
    assert buffer.push(wire.Chunk(request_id=1, embedding=[0.5], index=1)) == "full"


def _generate_ids(data: Sequence[bytes]) -> list[tuple[str, int]]:
    out = []
    for item in data:
        message = wire.decode_client_message(item)
        assert not isinstance(message, wire.RequestBatch)  # the plane queues messages one by one
        out.append((type(message).__name__, message.request_id))
    return out


async def _drain_outbox(plane: RequestPlane) -> list[bytes]:
    sent: list[bytes] = []
    while True:
        with trio.move_on_after(0) as scope:
            sent.append(await plane.next_outgoing())
        if scope.cancelled_caught:
            return sent


def fast_plane(stats: LinkStats) -> RequestPlane:
    return RequestPlane(
        request_buffer=_DEFAULTS.request_buffer, send_queue=_DEFAULTS.send_queue, stats=stats
    )


async def test_request_table_routes_replies_and_forgets_finished_requests() -> None:
    stats = LinkStats()
    plane = fast_plane(stats)
    with trio.fail_after(5):
        first_id, first = await plane.open("completions", {"prompt": "a"})
        second_id, second = await plane.open("completions", {"prompt": "b"})
        assert _generate_ids(await _drain_outbox(plane)) == [
            ("Generate", first_id),
            ("Generate", second_id),
        ]
        plane.deliver(wire.Rejected(request_id=second_id, reason=wire.RejectReason.OVERLOADED))
        plane.deliver(wire.Started(request_id=first_id, prompt_tokens=1))
        plane.deliver(wire.End(request_id=first_id, prompt_tokens=1, completion_tokens=0))
        assert plane.open_requests == 0
        assert isinstance(await second.get(), wire.Rejected)
        assert isinstance(await first.get(), wire.Started)
        assert isinstance(await first.get(), wire.End)
        plane.deliver(_chunk("late", rid=first_id))
        assert stats.late_replies == 1
        plane.cancel(first_id)  # already ended: nothing to send
        assert await _drain_outbox(plane) == []


async def test_cancel_before_the_generate_left_sends_nothing() -> None:
    plane = fast_plane(LinkStats())
    with trio.fail_after(5):
        request_id, _ = await plane.open("completions", {"prompt": "a"})
        plane.cancel(request_id)
        assert await _drain_outbox(plane) == []


async def test_cancel_after_the_generate_left_sends_cancel() -> None:
    plane = fast_plane(LinkStats())
    with trio.fail_after(5):
        request_id, _ = await plane.open("completions", {"prompt": "a"})
        await _drain_outbox(plane)
        plane.cancel(request_id)
        plane.cancel(request_id)  # idempotent
        assert _generate_ids(await _drain_outbox(plane)) == [("Cancel", request_id)]


async def test_a_consumer_too_far_behind_fails_alone_and_cancels_on_the_worker() -> None:
    stats = LinkStats()
    plane = RequestPlane(request_buffer=1, send_queue=256, stats=stats)
    with trio.fail_after(5):
        slow_id, slow = await plane.open("embeddings", {"input": ["a", "b"]})
        other_id, other = await plane.open("embeddings", {"input": ["c"]})
        await _drain_outbox(plane)
        plane.deliver(wire.Started(request_id=slow_id, prompt_tokens=2))
        # Room for one message and one vector per input: a third vector overflows.
        for index in range(3):
            plane.deliver(wire.Chunk(request_id=slow_id, embedding=[1.0], index=index))
        plane.deliver(wire.Started(request_id=other_id, prompt_tokens=1))
        assert stats.requests_overflowed == 1
        assert _generate_ids(await _drain_outbox(plane)) == [("Cancel", slow_id)]
        assert isinstance(await slow.get(), wire.Started)
        assert [type(await slow.get()) for _ in range(2)] == [wire.Chunk, wire.Chunk]
        failure = await slow.get()
        assert isinstance(failure, wire.Failed)
        assert failure.kind == "cancelled"
        assert "too slowly" in failure.message
        assert isinstance(await other.get(), wire.Started)  # the other request is untouched


async def test_the_vectors_of_an_embeddings_request_fit_in_one_burst() -> None:
    stats = LinkStats()
    plane = RequestPlane(request_buffer=1, send_queue=256, stats=stats)
    with trio.fail_after(5):
        request_id, buffer = await plane.open("embeddings", {"input": ["w"] * 2048})
        await _drain_outbox(plane)
        plane.deliver(wire.Started(request_id=request_id, prompt_tokens=2048))
        for index in range(2048):
            plane.deliver(wire.Chunk(request_id=request_id, embedding=[0.5], index=index))
        plane.deliver(wire.End(request_id=request_id, prompt_tokens=2048, completion_tokens=0))
        assert stats.requests_overflowed == 0
        assert isinstance(await buffer.get(), wire.Started)
        vectors = [await buffer.get() for _ in range(2048)]
        assert [vector.index for vector in vectors if isinstance(vector, wire.Chunk)] == list(
            range(2048)
        )
        assert isinstance(await buffer.get(), wire.End)


async def test_closing_the_session_fails_every_open_request() -> None:
    plane = fast_plane(LinkStats())
    with trio.fail_after(5):  # open waits for room in the outbox
        ids = [(await plane.open("completions", {"prompt": "x"}))[0] for _ in range(3)]
        await _drain_outbox(plane)
        plane.deliver(wire.Started(request_id=ids[0], prompt_tokens=1))
        assert plane.close("connection closed") == 3
        late_id, late = await plane.open("completions", {"prompt": "x"})
        assert isinstance(await late.get(), wire.Failed)
    assert late_id not in ids


async def test_generate_waits_for_room_in_the_outbox() -> None:
    plane = RequestPlane(request_buffer=256, send_queue=2, stats=LinkStats())
    await plane.open("completions", {"prompt": "x"})
    await plane.open("completions", {"prompt": "x"})
    with trio.move_on_after(0.01) as scope:
        await plane.open("completions", {"prompt": "x"})
    assert scope.cancelled_caught
    await plane.next_outgoing()
    with trio.fail_after(1):
        await plane.open("completions", {"prompt": "x"})


@pytest.mark.parametrize("listed", [True, False])
async def test_generate_tells_a_worker_that_counts_it_the_time_spent_in_the_frontend(
    listed: bool,
) -> None:
    plane = RequestPlane(request_buffer=256, send_queue=4, stats=LinkStats(), frontend_time=listed)
    with trio.fail_after(5):
        arrival = trio.current_time() - 0.25  # the request came a quarter of a second ago
        await plane.open("completions", {"prompt": "x"}, arrival=arrival)
        await plane.open("completions", {"prompt": "x"}, arrival=trio.current_time() - 1e9)
        sent = [wire.decode_client_message(await plane.next_outgoing()) for _ in range(2)]
    assert all(isinstance(m, wire.Generate) for m in sent)
    spent = [m.frontend_ms for m in sent if isinstance(m, wire.Generate)]
    if listed:
        assert 250 <= spent[0] < 2500
        assert spent[1] == wire.MAX_FRONTEND_MS  # bounded as the decoder requires
    else:
        assert spent == [0, 0]  # an older worker is sent what it always was


async def test_the_time_in_the_frontend_counts_the_wait_in_the_outbox(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Taken as the sender takes the message, not as the request queues it: a link whose writes
    # are behind holds requests here, and that time is the client's too.
    plane = RequestPlane(request_buffer=256, send_queue=4, stats=LinkStats(), frontend_time=True)
    arrival = trio.current_time()
    await plane.open("completions", {"prompt": "x"}, priority=1, tenant="t", arrival=arrival)
    await trio.sleep(1.5)
    sent = wire.decode_client_message(await plane.next_outgoing())
    assert sent == wire.Generate(
        request_id=1,
        endpoint="completions",
        body={"prompt": "x"},
        priority=0,
        tenant="",
        frontend_ms=1500,
    )


async def test_stream_hands_out_replies_in_order() -> None:
    buffer = ResponseBuffer(8)
    for reply in (
        wire.Started(request_id=1, prompt_tokens=2),
        _chunk("a"),
        _chunk("b", finish="stop"),
        wire.End(request_id=1, prompt_tokens=2, completion_tokens=2),
    ):
        buffer.push(reply)
    stream = RequestStream(1, buffer)
    with pytest.raises(RuntimeError):
        await stream.__anext__()
    assert isinstance(await stream.first(), wire.Started)
    assert [type(r).__name__ for r in [r async for r in stream]] == ["Chunk", "Chunk", "End"]
    assert [r async for r in stream] == []


async def test_ready_hands_out_everything_that_arrived_together_and_ends_at_the_final() -> None:
    buffer = ResponseBuffer(8)
    buffer.push(wire.Started(request_id=1, prompt_tokens=2))
    stream = RequestStream(1, buffer)
    with pytest.raises(RuntimeError):
        await stream.ready()  # before first()
    assert isinstance(await stream.first(), wire.Started)
    for text in "abc":
        buffer.push(_chunk(text))
    assert [reply.text for reply in await stream.ready() if isinstance(reply, wire.Chunk)] == [
        "a",
        "b",
        "c",
    ]
    # Nothing buffered: ready() waits for the next reply, then hands over what came with it.
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            got: list[list[wire.Chunk | wire.End | wire.Failed]] = []

            async def read() -> None:
                got.append(await stream.ready())

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            buffer.push(_chunk("d", finish="stop"))
            buffer.push(wire.Rejected(request_id=1, reason="late"))  # out of protocol: a failure
    assert [type(reply).__name__ for reply in got[0]] == ["Chunk", "Failed"]
    assert await stream.ready() == []  # the stream ended with the failure


async def test_ready_after_a_chunk_without_started_starts_with_that_chunk() -> None:
    buffer = ResponseBuffer(8)
    buffer.push(_chunk("a"))
    buffer.push(_chunk("b"))
    stream = RequestStream(1, buffer)
    assert isinstance(await stream.first(), wire.Started)
    first = await stream.ready()
    assert [reply.text for reply in first if isinstance(reply, wire.Chunk)] == ["a"]
    second = await stream.ready()
    assert [reply.text for reply in second if isinstance(reply, wire.Chunk)] == ["b"]


# ----------------------------------------------------------------------------- property


_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("open")),
        st.tuples(st.just("send")),
        st.tuples(
            st.sampled_from(["started", "chunk", "end", "failed", "rejected", "cancel"]),
            st.integers(0, 7),
        ),
        st.tuples(st.just("close")),
    ),
    max_size=60,
)


@given(program=_OPERATIONS)
def test_every_request_ends_exactly_once_whatever_happens(program: list[tuple[Any, ...]]) -> None:
    """Random interleavings of requests, replies, cancels, sends and a close never leave a
    request without its end, never end one twice, and never cancel an unsent request."""

    async def main() -> None:
        stats = LinkStats()
        plane = RequestPlane(request_buffer=3, send_queue=256, stats=stats)
        buffers: list[ResponseBuffer] = []
        ids: list[int] = []
        sent: set[int] = set()
        cancelled: set[int] = set()
        for operation in program:
            kind = operation[0]
            if kind == "open":
                request_id, buffer = await plane.open("completions", {"prompt": "x"})
                ids.append(request_id)
                buffers.append(buffer)
            elif kind == "send":
                for data in await _drain_outbox(plane):
                    message = wire.decode_client_message(data)
                    assert not isinstance(message, wire.RequestBatch)
                    if isinstance(message, wire.Generate):
                        sent.add(message.request_id)
                    else:
                        assert message.request_id in sent
                        cancelled.add(message.request_id)
            elif kind == "close":
                plane.close("test")
            elif ids:
                request_id = ids[operation[1] % len(ids)]
                if kind == "cancel":
                    plane.cancel(request_id)
                    continue
                if request_id not in sent:
                    continue  # a worker cannot answer what it never received
                replies: dict[str, wire.WorkerMessage] = {
                    "started": wire.Started(request_id=request_id, prompt_tokens=1),
                    "chunk": wire.Chunk(request_id=request_id, text="t", tokens=1),
                    "end": wire.End(request_id=request_id, prompt_tokens=1, completion_tokens=1),
                    "failed": wire.Failed(request_id=request_id, kind="engine", message="x"),
                    "rejected": wire.Rejected(request_id=request_id, reason="r"),
                }
                plane.deliver(replies[kind])
        plane.close("end of program")
        assert plane.open_requests == 0
        for buffer in buffers:
            assert buffer.finished
            terminals = 0
            with trio.move_on_after(1):
                while True:
                    reply = await buffer.get()
                    if isinstance(reply, wire.End | wire.Failed | wire.Rejected):
                        terminals += 1
                        break
            assert terminals == 1

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("classes", [False, True])
async def test_priority_and_tenant_go_only_to_a_worker_that_speaks_them(classes: bool) -> None:
    # An older worker (no "classes" in its hello) gets the generate it always got: plain msgpack
    # without the two fields, so even a decoder that refuses unknown fields reads it.
    plane = RequestPlane(request_buffer=1, send_queue=256, stats=LinkStats(), classes=classes)
    with trio.fail_after(5):
        await plane.open("completions", {"prompt": "a"}, priority=7, tenant="nightly")
        (data,) = await _drain_outbox(plane)
    fields = msgpack.unpackb(data)
    assert ("priority" in fields, "tenant" in fields) == (classes, classes)
    if classes:
        assert (fields["priority"], fields["tenant"]) == (7, "nightly")
