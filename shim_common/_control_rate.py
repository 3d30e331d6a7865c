"""A token bucket for the control frames of one websocket connection.

A ping costs its receiver a pong to write; a peer that floods them would have the receiver spend a
core on pongs. Both sides allow a burst and a steady rate far above what a keepalive needs.
"""

from __future__ import annotations

import math

__all__ = ["ControlFrameRate"]


class ControlFrameRate:
    """A token bucket for the control frames of one websocket connection (sans-IO): the
    frontend bounds what a worker sends it, the worker the pings a client sends it.

    Args:
        per_second: Frames allowed a second, once the burst is spent; > 0.
        burst: Frames allowed at once; at least 1.
    """

    __slots__ = ("_burst", "_per_second", "_tokens", "_updated")

    def __init__(self, per_second: float, burst: int, now: float) -> None:
        if not (per_second > 0 and math.isfinite(per_second)) or burst < 1:
            raise ValueError(f"need per_second > 0 and burst >= 1, got {per_second}, {burst}")
        self._per_second = per_second
        self._burst = float(burst)
        self._tokens = float(burst)
        self._updated = now

    @property
    def bound(self) -> str:
        """The bound in words, for the log."""
        return f"{self._burst:g} at once and {self._per_second:g} a second"

    def allow(self, frames: int, now: float) -> bool:
        """Take ``frames`` frames arriving at ``now``; False when they exceed the bound."""
        tokens = min(self._burst, self._tokens + (now - self._updated) * self._per_second)
        self._updated = now
        self._tokens = tokens - frames
        return self._tokens >= 0
