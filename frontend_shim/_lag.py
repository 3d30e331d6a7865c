"""How far behind the frontend reads a worker's event stream (sans-IO).

Each event batch carries the worker's wall-clock time of sending. :class:`LagMeter` keeps the
smallest ``arrival - sent`` seen in the last two windows of ``window`` seconds (clock skew and
transit); the excess over it is how far behind this frontend reads that worker. Above the bound
the stream counts as lagging; back under half of it (plus :attr:`LagMeter.allowance`, the
interval a link is read at on purpose), as caught up. The link that owns the meter
(:mod:`frontend_shim._links`, rule 3) tells its listener about each edge.
"""

from __future__ import annotations

import math

__all__ = ["LagMeter"]


class LagMeter:
    """How far behind a worker's event stream is read, and whether that is too far.

    Args:
        window: Seconds of each window of the smallest transit time.
        bound: The lag past which the stream counts as lagging; it counts as caught up again
            under half of it.
    """

    __slots__ = (
        "_bound",
        "_current_min",
        "_previous_min",
        "_window",
        "_window_end",
        "allowance",
        "lag",
        "lagging",
        "max_lag",
    )

    def __init__(self, window: float, bound: float) -> None:
        self._window = window
        self._bound = bound
        self._window_end = -math.inf
        self._current_min = math.inf
        self._previous_min = math.inf
        #: The lag of the latest batch (seconds).
        self.lag = 0.0
        #: The largest lag seen.
        self.max_lag = 0.0
        #: Whether the stream is lagging now (with the hysteresis above).
        self.lagging = False
        #: Seconds of lag allowed on top of the bound (a link read at an interval on purpose).
        self.allowance = 0.0

    def observe(self, arrival: float, sent: float, now: float) -> bool:
        """Record one batch: wall-clock ``arrival`` here, ``sent`` there; ``now`` is monotonic.

        Returns:
            True when this batch turned :attr:`lagging` on or off.
        """
        delay = arrival - sent
        if now >= self._window_end:
            self._previous_min = self._current_min
            self._current_min = math.inf
            self._window_end = now + self._window
        if delay < self._current_min:
            self._current_min = delay
        base = self._current_min if self._current_min < self._previous_min else self._previous_min
        lag = delay - base
        self.lag = lag
        if lag > self.max_lag:
            self.max_lag = lag
        if self.lagging:
            if lag < self._bound / 2 + self.allowance:
                self.lagging = False
                return True
        elif lag > self._bound + self.allowance:
            self.lagging = True
            return True
        return False
