"""A change counter that tasks can sleep on: the cheapest "something changed" signal.

Producers call :meth:`ChangeSignal.bump` (synchronous, O(1), no allocation beyond one
``trio.Event`` when someone is waiting); consumers remember the last version they handled and
sleep in :meth:`ChangeSignal.wait_past` until the counter moves. Many bumps while a consumer is busy
collapse into one wake-up, which is what latest-wins publishing wants. A signal may forward its
bumps to another (:meth:`ChangeSignal.forward_to`), so a consumer of several sources waits on one
signal without a task that wakes for every bump only to pass it on.
"""

from __future__ import annotations

import trio

__all__ = ["ChangeSignal"]


class ChangeSignal:
    """A monotonic version number with a wait-for-change operation."""

    __slots__ = ("_event", "_forward", "_version")

    def __init__(self) -> None:
        self._version = 0
        self._event: trio.Event | None = None
        self._forward: ChangeSignal | None = None

    @property
    def version(self) -> int:
        """How many changes have been signalled so far."""
        return self._version

    def forward_to(self, other: ChangeSignal) -> None:
        """Bump ``other`` too on every later bump of this signal (one forward at a time)."""
        if other is self:
            raise ValueError("a signal cannot forward to itself")
        self._forward = other

    def bump(self) -> None:
        """Record a change and wake every waiter (and bump the signal forwarded to)."""
        self._version += 1
        if self._forward is not None:
            self._forward.bump()
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait_past(self, version: int) -> int:
        """Sleep until the version is greater than ``version``; return the current version."""
        while self._version <= version:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        return self._version
