"""Several client messages in one (:class:`~shim_common.wire.RequestBatch`): how a frontend packs
them, and that a worker takes a batch exactly as its messages one by one, in order: the gate
sees its requests in the order they came (the tasks of one batch first run in no set order), a
refusal is written without a task, a cancel in the same batch frees the place at once, and a
batch that breaks the protocol closes the connection as a lone message would.
"""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from worker_harness import (
    TIMEOUT,
    HeldEngine,
    closed_code,
    collect_until_final,
    completion,
    make_settings,
    new_worker,
    receive,
    request_plane,
    running,
    wait_for,
)

from shim_common import wire
from shim_common.wire import (
    REQUEST_BATCH_BYTES,
    REQUEST_BATCH_MESSAGES,
    Cancel,
    End,
    Failed,
    Generate,
    Rejected,
    RequestBatch,
    Started,
)
from worker_ingress._server import Worker

# ----------------------------------------------------------------------------- packing (sans-IO)


def _unpacked(packed: list[bytes]) -> list[Generate | Cancel]:
    messages: list[Generate | Cancel] = []
    for data in packed:
        message = wire.decode_client_message(data)
        if isinstance(message, RequestBatch):
            assert len(message.messages) >= 2  # a lone message is never wrapped
            messages.extend(message.messages)
        else:
            messages.append(message)
    return messages


@given(
    st.lists(
        st.one_of(
            st.builds(
                lambda i, size: completion(i, prompt="w " * size),
                st.integers(0, 2**31),
                st.sampled_from([1, 10, 3000, 20_000]),
            ),
            st.builds(lambda i: Cancel(request_id=i), st.integers(0, 2**31)),
        ),
        max_size=600,
    )
)
def test_packing_keeps_every_message_in_order_within_both_bounds(
    messages: list[Generate | Cancel],
) -> None:
    encoded = [wire.encode(message) for message in messages]
    packed = wire.request_batches(encoded)
    assert _unpacked(packed) == messages
    for data in packed:
        if data in encoded:
            continue  # alone, as it was
        batch = wire.decode_client_message(data)
        assert isinstance(batch, RequestBatch)
        assert len(batch.messages) <= REQUEST_BATCH_MESSAGES
        assert sum(len(wire.encode(m)) for m in batch.messages) <= REQUEST_BATCH_BYTES


def test_a_lone_or_large_message_goes_as_it_was_and_small_ones_share_one() -> None:
    small = [wire.encode(completion(i)) for i in range(3)]
    large = wire.encode(completion(9, prompt="w " * REQUEST_BATCH_BYTES))
    assert wire.request_batches([]) == []
    assert wire.request_batches(small[:1]) == small[:1]
    packed = wire.request_batches([small[0], large, small[1], small[2]])
    assert packed[:2] == [small[0], large]
    assert len(packed) == 3
    assert _unpacked(packed[2:]) == [completion(1), completion(2)]
    # Seventeen messages need an array header of three bytes: still one batch.
    many = [wire.encode(Cancel(request_id=i)) for i in range(17)]
    (one,) = wire.request_batches(many)
    assert _unpacked([one]) == [Cancel(request_id=i) for i in range(17)]


def test_more_messages_than_the_bound_do_not_decode() -> None:
    cancels = [{"type": "cancel", "request_id": i} for i in range(REQUEST_BATCH_MESSAGES + 1)]
    with pytest.raises(msgspec.ValidationError):
        wire.decode_client_message(msgpack.packb({"type": "batch", "messages": cancels}))


# ----------------------------------------------------------------------------- the worker


def _held_worker(slots: int, queue: int) -> tuple[Worker, HeldEngine]:
    """A worker of N ``slots`` and Q ``queue`` whose requests wait for ``engine.release``."""
    settings = make_settings(engine_request_limit=slots, request_queue_limit=queue)
    engine = HeldEngine(settings)
    return new_worker(settings, engine), engine


def _batch(*messages: Generate | Cancel) -> bytes:
    (data,) = wire.request_batches([wire.encode(message) for message in messages])
    return data


async def test_the_hello_lists_the_feature() -> None:
    with trio.fail_after(TIMEOUT):
        async with running(new_worker(make_settings())) as address, request_plane(address) as ws:
            await ws.send_message(_batch(completion(1), completion(2)))
            frames = await collect_until_final(ws, {1, 2})
    assert all(isinstance(replies[-1], End) for replies in frames.values())
    assert wire.FEATURE_REQUEST_BATCH in new_worker(make_settings()).hello.features


@pytest.mark.parametrize("round_", range(8))  # the tasks' order is random: repeat
async def test_a_batchs_requests_meet_the_gate_in_the_order_they_came(round_: int) -> None:
    worker, engine = _held_worker(slots=1, queue=3)
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await ws.send_message(_batch(*(completion(i) for i in range(1, 5))))
            # The first of the batch took the slot; the other three queue behind it in order.
            assert await receive(ws) == Started(request_id=1, prompt_tokens=3)
            await wait_for(lambda: worker.gate.queued == 3, "three queued")
            engine.release.set()
            started: list[int] = []
            ended: set[int] = set()
            while len(ended) < 4:
                message = await receive(ws)
                if isinstance(message, Started):
                    started.append(message.request_id)
                elif isinstance(message, End):
                    ended.add(message.request_id)
    assert started == [2, 3, 4]


async def test_a_batch_past_the_gates_room_refuses_its_last_requests() -> None:
    worker, engine = _held_worker(slots=1, queue=2)
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await ws.send_message(_batch(*(completion(i) for i in range(1, 6))))
            frames = await collect_until_final(ws, {4, 5})
            overloaded = wire.RejectReason.OVERLOADED
            assert frames == {
                4: [Rejected(request_id=4, reason=overloaded)],
                5: [Rejected(request_id=5, reason=overloaded)],
            }
            assert (worker.gate.running, worker.gate.queued) == (1, 2)
            engine.release.set()
            served = await collect_until_final(ws, {1, 2, 3})
    assert all(isinstance(replies[-1], End) for replies in served.values())


async def test_a_cancel_in_the_same_batch_gives_the_place_back_before_its_task_runs() -> None:
    worker, engine = _held_worker(slots=1, queue=2)
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            await ws.send_message(
                _batch(completion(1), completion(2), Cancel(request_id=2), completion(3))
            )
            frames = await collect_until_final(ws, {2})
            (failed,) = frames[2]
            assert isinstance(failed, Failed)
            assert failed.kind == "cancelled"
            await wait_for(lambda: worker.gate.queued == 1, "only the third queued")
            assert worker.gate.running == 1
            engine.release.set()
            served = await collect_until_final(ws, {1, 3})
    assert all(isinstance(replies[-1], End) for replies in served.values())
    assert (worker.gate.running, worker.gate.queued) == (0, 0)


@pytest.mark.parametrize("waiting", [False, True], ids=["task-not-run", "task-waiting"])
async def test_a_cancel_frees_its_place_for_the_next_message_of_its_batch(waiting: bool) -> None:
    worker, engine = _held_worker(slots=1, queue=2)
    first: list[Generate | Cancel] = [completion(1), completion(2), completion(3)]
    then: list[Generate | Cancel] = [Cancel(request_id=2), completion(4, prompt="w")]
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, request_plane(address) as ws:
            if waiting:  # the queue is full and request 2's task already waits in it
                await ws.send_message(_batch(*first))
                await wait_for(lambda: worker.gate.queued == 2, "two queued")
                await ws.send_message(_batch(*then))
            else:
                await ws.send_message(_batch(*first, *then))
            (failed,) = (await collect_until_final(ws, {2}))[2]
            assert isinstance(failed, Failed)
            assert failed.kind == "cancelled"
            # Request 4 took the place request 2 gave back: queued, not refused.
            await wait_for(lambda: worker.gate.queued == 2, "3 and 4 queued")
            assert worker.gate.rejected_total == 0
            engine.release.set()
            served = await collect_until_final(ws, {1, 3, 4})
    assert all(isinstance(replies[-1], End) for replies in served.values())
    assert worker.gate.in_flight == 0


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        # The same id twice in one batch, as in two messages.
        (_batch(completion(1), completion(1)), wire.CLOSE_DUPLICATE_REQUEST_ID),
        # A batch in a batch is not a client message.
        (
            msgpack.packb(
                {"type": "batch", "messages": [{"type": "batch", "messages": []}]},
            ),
            wire.CLOSE_UNDECODABLE,
        ),
        # More messages than a batch may hold.
        (
            msgpack.packb(
                {
                    "type": "batch",
                    "messages": [
                        {"type": "cancel", "request_id": i}
                        for i in range(REQUEST_BATCH_MESSAGES + 1)
                    ],
                }
            ),
            wire.CLOSE_UNDECODABLE,
        ),
    ],
    ids=["duplicate-id", "nested", "too-many"],
)
async def test_a_batch_that_breaks_the_protocol_closes_like_a_lone_message(
    payload: bytes, code: int
) -> None:
    with trio.fail_after(TIMEOUT):
        async with running(new_worker(make_settings())) as address, request_plane(address) as ws:
            await ws.send_message(payload)
            assert await closed_code(ws) == code
