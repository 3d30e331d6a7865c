"""A frontend process that protects itself: shedding when its own event loop falls behind (pure).

Every other limit looks at the workers. When the frontend's own core is full, requests wait in
its loop and in the kernel's queues before any limit sees them, and everyone gets slow. The
loop tells how far behind it is: one pass of the loop runs every task that became ready while
the last pass ran (a request whose bytes arrived waits, at most, for the pass under way and its
turn in the next), so the length of the passes is the wait a new request meets before its head
is read. :class:`LoopGuard` keeps that figure and says which new requests to turn away:

1. The lag. The time the loop spends running tasks between two waits for I/O is one pass; the
   lag is a moving average of passes (an exponential average with a time constant of
   :data:`SMOOTHING` seconds), so one long pass (a large body parsed, a scrape) does not shed.
   A pass is measured in the CPU time of the loop's thread, not on the wall clock: what is
   measured is this process's own work, so a core shared with other busy processes (whose
   waits no shedding here would shorten) does not make it shed.
2. The target. Below ``target`` seconds of lag nothing is shed, nor while the loop spends
   less than :data:`BUSY_FLOOR` of its time running tasks (on average, as the lag): a loop
   with time to spare is not behind, only bursty. Above it, a share of new requests is turned
   away, raised while the lag stays above the target and lowered while it is
   below, in proportion to the distance (a proportional-integral controller of the shed share,
   as PIE does for packets), every :data:`UPDATE` seconds. Turning a request away at its head
   costs a fraction of serving it, so shedding a share of arrivals brings the lag back to the
   target while the rest is served at the latency the target allows.
3. Which requests. The shed share is applied evenly, by a running credit (no randomness): with
   a share of 0.3, three requests in ten are turned away, spread out. Only completions are shed
   (``/live``, ``/health`` and ``/metrics`` are always answered), with HTTP 529, the reason
   ``frontend_overloaded`` and a ``Retry-After``, before their body is read.
4. Time is given by the caller (``now``, seconds of any monotonic clock).
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ["DEFAULT_TARGET", "LoopGuard"]

#: Seconds of loop lag the guard keeps the loop under (rule 2).
DEFAULT_TARGET: Final = 0.01
#: The share of its time a loop must spend running tasks to count as behind (rule 2).
BUSY_FLOOR: Final = 0.9
#: Seconds over which passes are averaged (rule 1).
SMOOTHING: Final = 0.05
#: Seconds between two updates of the shed share (rule 2).
UPDATE: Final = 0.02
#: The controller's gains: per :data:`UPDATE` seconds, the share moves by
#: ``ALPHA * (lag - target) / target``, plus ``BETA * (lag - last lag) / target`` per update:
#: a lag of three times the target raises the share by about 1.0 a second.
ALPHA: Final = 0.01
BETA: Final = 0.1
#: The largest share shed: a frontend always serves some requests, or it would learn nothing.
MAX_SHARE: Final = 0.95


class LoopGuard:
    """Which new requests a saturated loop turns away (rules at the top of the module).

    Args:
        target: the loop lag, in seconds, above which requests are shed.
    """

    __slots__ = (
        "_credit",
        "_last_pass_end",
        "_last_update",
        "_prior_lag",
        "busy",
        "lag",
        "share",
        "target",
    )

    def __init__(self, target: float = DEFAULT_TARGET) -> None:
        if not target > 0:
            raise ValueError(f"target must be > 0, got {target}")
        self.target = target
        #: The loop's lag now (rule 1), seconds.
        self.lag = 0.0
        #: The share of time the loop spends running tasks, on average (rule 2).
        self.busy = 0.0
        #: The share of new requests shed now (rule 2), in [0, MAX_SHARE].
        self.share = 0.0
        self._prior_lag = 0.0
        self._credit = 0.0
        self._last_pass_end: float | None = None
        self._last_update: float | None = None

    def pass_ran(self, length: float, ended: float) -> None:
        """One pass of the loop spent ``length`` seconds of CPU running tasks and ended at
        ``ended`` (rule 1)."""
        length = max(0.0, length)
        last = self._last_pass_end
        elapsed = length if last is None else max(length, ended - last)
        self._last_pass_end = ended
        # An average over time, not over passes: a thousand short passes weigh what they last.
        weight = 1.0 - math.exp(-elapsed / SMOOTHING)
        self.lag += weight * (length - self.lag)
        if elapsed > 0:
            self.busy += weight * (min(1.0, length / elapsed) - self.busy)
        self._update(ended)

    def _update(self, now: float) -> None:
        last = self._last_update
        if last is not None and now - last < UPDATE:
            return
        self._last_update = now
        periods = 1.0 if last is None else min(10.0, (now - last) / UPDATE)
        target = self.target
        # A loop with time to spare is not behind, however long its passes (rule 2).
        lag = self.lag if self.busy >= BUSY_FLOOR else min(self.lag, target / 2)
        step = ALPHA * periods * (lag - target) / target
        step += BETA * (lag - self._prior_lag) / target
        self._prior_lag = lag
        if lag <= target and self.share == 0.0:
            return
        self.share = min(MAX_SHARE, max(0.0, self.share + step))

    def admit(self, now: float) -> bool:
        """Whether to read a new request (rule 3); ``False``: answer it 529 at once."""
        share = self.share
        if share <= 0.0:
            return True
        self._credit += share
        if self._credit >= 1.0:
            self._credit -= 1.0
            return False
        return True
