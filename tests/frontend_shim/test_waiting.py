"""The Trio side of the frontend queue (frontend_shim._waiting): parking, release, a full room,
a cancelled wait, and the release of everyone at drain. The queue's own rules are tested in
test_router.py; here a real fleet state says when a request may go on."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from load_feed import MODEL, Feed, config, fleet_with

from frontend_shim._waiting import WaitingRoom
from shim_common.wire import BusyThresholds

TIMEOUT = 5.0


def saturated_room(capacity: int | None, now: float = 0.0) -> tuple[WaitingRoom, Feed]:
    """A room over one worker whose prefill is past the queue threshold (0.5 of 100 tokens),
    fresh at ``now`` (the room reads the Trio clock, against which a worker goes stale)."""
    fleet, feed = fleet_with(BusyThresholds(), queue_threshold=0.5)
    fleet.register(config(max_batched=100), now)
    feed.load(prefill=51, now=now)
    return WaitingRoom(fleet, capacity), feed


def test_without_a_queue_nothing_parks() -> None:
    room, _ = saturated_room(None)
    assert not room.should_park(MODEL, 0.0)
    room.release()
    room.release_all()


async def test_a_parked_request_goes_on_once_the_fleet_has_room() -> None:
    room, feed = saturated_room(4, trio.current_time())
    assert room.should_park(MODEL, trio.current_time())
    went_on: list[bool] = []

    async def request() -> None:
        went_on.append(await room.wait(MODEL))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(request)
            await trio.testing.wait_all_tasks_blocked()
            room.release()  # still saturated: stays parked
            await trio.testing.wait_all_tasks_blocked()
            assert went_on == []
            feed.load(prefill=10, now=trio.current_time())
            room.release()
    assert went_on == [True]


async def test_a_full_room_refuses_at_once_and_a_cancelled_wait_gives_its_place_back() -> None:
    room, _ = saturated_room(1, trio.current_time())
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(room.wait, MODEL)
            await trio.testing.wait_all_tasks_blocked()
            assert await room.wait(MODEL) is False  # the one place is taken
            nursery.cancel_scope.cancel()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(room.wait, MODEL)  # the place was given back
            await trio.testing.wait_all_tasks_blocked()
            room.release_all()


async def test_release_all_lets_every_parked_request_go_on() -> None:
    room, _ = saturated_room(8, trio.current_time())
    results: list[bool] = []

    async def request() -> None:
        results.append(await room.wait(MODEL))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(request)
            await trio.testing.wait_all_tasks_blocked()
            room.release_all()
    assert results == [True, True, True]


def test_waiting_without_a_queue_is_a_bug() -> None:
    room, _ = saturated_room(None)
    with pytest.raises(AssertionError):
        trio.run(room.wait, MODEL)
