"""The Trio side of the frontend queue (``--router-queue-threshold``): parked requests.

:class:`~frontend_shim._router.FrontendQueue` decides who parks and who may go on; here each
parked request waits on a :class:`trio.Event`, which :meth:`WaitingRoom.release` sets when the
fleet has room again. The room is built before the links that report fleet changes and before
the API that parks requests, and both are given it.
"""

from __future__ import annotations

import trio

from frontend_shim._load import Fleet
from frontend_shim._router import FrontendQueue

__all__ = ["WaitingRoom"]


class WaitingRoom:
    """Requests parked until the fleet frees room for them.

    Args:
        fleet: the load state that says when a parked request may go on.
        capacity: requests parked at most; ``None``: no frontend queue (nothing ever parks).
    """

    __slots__ = ("_fleet", "_queue")

    def __init__(self, fleet: Fleet, capacity: int | None) -> None:
        self._fleet = fleet
        self._queue: FrontendQueue[trio.Event] | None = (
            None if capacity is None else FrontendQueue(capacity)
        )

    def should_park(self, model: str, now: float) -> bool:
        """Whether a request for ``model`` must wait before it is routed."""
        return self._queue is not None and self._queue.should_park(self._fleet, model, now)

    async def wait(self, model: str) -> bool:
        """Park a request until it is released; ``False`` at once when the room is full.

        A cancelled wait gives its place back.
        """
        assert self._queue is not None, "wait() without a frontend queue"
        waiter = trio.Event()
        if not self._queue.park(model, waiter):
            return False
        try:
            await waiter.wait()
        finally:
            if not waiter.is_set():
                self._queue.cancel(model, waiter)
        return True

    def release(self) -> None:
        """Release the parked requests that may go on now (call after every fleet change)."""
        if self._queue is not None and len(self._queue):
            for waiter in self._queue.release(self._fleet, trio.current_time()):
                waiter.set()

    def release_all(self) -> None:
        """Release every parked request (the frontend drains: each is routed now or answered)."""
        if self._queue is not None:
            for model in self._queue.models_waiting():
                for waiter in self._queue.pop(model, self._queue.waiting(model)):
                    waiter.set()
