"""The registry of a server's idle HTTP connections: those closed first when the process runs
out of file descriptors (rule 8 of :mod:`shim_common._http_connection`)."""

from __future__ import annotations

import time
from typing import Final, Protocol

__all__ = ["MIN_IDLE_SECONDS", "IdleConnections"]

#: How long a connection must have been idle to be closed for its descriptor (see
#: :class:`IdleConnections`).
MIN_IDLE_SECONDS: Final = 0.5


class _Closable(Protocol):
    """A connection, as the registry sees it."""

    def close_idle(self) -> None:
        """End the connection now."""


class IdleConnections:
    """The connections of a server that wait for a request with none of it received yet, and
    those whose upload has fallen behind the minimum rate (rule 8).

    When the process runs out of file descriptors, closing the longest idle of these frees
    descriptors at the least cost: no request is lost, and a keep-alive client opens a new
    connection when it needs one (RFC 9112 9.3 lets a server close an idle connection); an
    upload that slow would hold its descriptor for minutes. A connection idle for less than
    :data:`MIN_IDLE_SECONDS` is not closed: one just accepted is idle until its reader has fed
    the request it carries, and closing it would turn away the very client the room was for.
    """

    def __init__(self) -> None:
        # Insertion-ordered, with when each went idle: the longest idle first.
        self._idle: dict[_Closable, float] = {}

    def __len__(self) -> int:
        return len(self._idle)

    def add(self, connection: _Closable) -> None:
        """Record that ``connection`` went idle."""
        self._idle[connection] = time.monotonic()

    def discard(self, connection: _Closable) -> None:
        """Record that ``connection`` is busy again (or gone)."""
        self._idle.pop(connection, None)

    def close_oldest(self, count: int) -> int:
        """Close up to ``count`` of the longest idle connections, idle for at least
        :data:`MIN_IDLE_SECONDS`; returns how many."""
        closed = 0
        since = time.monotonic() - MIN_IDLE_SECONDS
        while self._idle and closed < count:
            connection, idle_since = next(iter(self._idle.items()))
            if idle_since > since:
                break  # this one and every later one went idle too recently
            del self._idle[connection]
            connection.close_idle()
            closed += 1
        return closed
