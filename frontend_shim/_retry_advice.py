"""What an overload answer tells a client about trying again (pure: time passed in).

A 529 that says "retry in a second" to every client it turns away brings them all back at once
into the same full fleet: at twice its capacity, each shed request came back two more times and
most failed again. OpenAI's SDKs (and clients written like them) retry a 529 by default, wait
for ``retry-after-ms`` (or ``retry-after``), and obey ``x-should-retry``; they say how many times
a request was retried in ``x-stainless-retry-count``. Every overload answer carries:

1. When. ``retry-after-ms``: the time the fleet needs to turn over what it holds now (the
   requests in flight over the rate at which requests complete, scaled down when workers
   lowered their effective limits below what they run), in milliseconds within
   [:data:`MIN_WAIT_MS`, 30 s]; ``Retry-After`` is the same rounded up to whole seconds, within
   [1, 30] (as before). Before any completion was measured: one second.
2. Whether. ``x-should-retry``: ``true`` while the retry budget allows one more retry, ``false``
   past it. The budget grows by :data:`RETRY_SHARE` for every request that completes, up to
   :data:`RETRY_BURST` (a token bucket fed by the completions, as gRPC and Finagle bound
   retries), and each ``true`` spends one. So retries stay a small share of what the fleet
   serves however overloaded it is: they help ride out a burst, and do not double the load of
   a fleet that is full for good. A client that ignores the header is not refused for it.
3. Retries get their chance. A retry (``x-stainless-retry-count`` above 0) is not turned away
   by the frontend's own overload marks alone: like a request of a better class, it may go to
   a marked worker that is not busy, whose gate then decides (the marks, leased for a second,
   otherwise turned most retries into a certain second 529).
"""

from __future__ import annotations

import math
from typing import Final, NamedTuple

__all__ = ["Advice", "RetryAdvice"]

#: The shortest wait advised, milliseconds.
MIN_WAIT_MS: Final = 100
#: The longest wait advised, seconds (``Retry-After``'s cap, as before).
MAX_WAIT_S: Final = 30
#: Retries the budget allows for every completed request (rule 2).
RETRY_SHARE: Final = 0.1
#: The most retries the budget holds at once.
RETRY_BURST: Final = 20.0


class Advice(NamedTuple):
    """What one overload answer says (rules 1 and 2)."""

    retry_after_ms: int
    should_retry: bool

    @property
    def retry_after_s(self) -> int:
        """``Retry-After``: whole seconds, rounded up, in [1, 30]."""
        return max(1, min(MAX_WAIT_S, math.ceil(self.retry_after_ms / 1000)))


class RetryAdvice:
    """The retry advice of one frontend process (rules at the top of the module).

    Args:
        share: retries allowed per completed request.
        burst: retries the budget holds at most.
    """

    __slots__ = ("_budget", "_burst", "_share")

    def __init__(self, share: float = RETRY_SHARE, burst: float = RETRY_BURST) -> None:
        self._share = share
        self._burst = burst
        self._budget = burst

    def completed(self, count: int = 1) -> None:
        """``count`` requests completed: the budget grows (rule 2)."""
        self._budget = min(self._burst, self._budget + self._share * count)

    def advise(
        self, in_flight: int, completions_per_second: float | None, slot_share: float = 1.0
    ) -> Advice:
        """The advice of one overload answer (spends a retry from the budget when it says yes).

        Args:
            in_flight: requests in flight (read, not yet answered).
            completions_per_second: the measured completion rate; ``None`` before one is known.
            slot_share: the workers' effective limits over what they run (in (0, 1]).
        """
        should_retry = self._budget >= 1.0
        if should_retry:
            self._budget -= 1.0
        return Advice(_wait_ms(in_flight, completions_per_second, slot_share), should_retry)


def _wait_ms(in_flight: int, rate: float | None, slot_share: float) -> int:
    if rate is None or in_flight <= 0:
        return 1000
    if not rate > 0:
        return MAX_WAIT_S * 1000
    seconds = in_flight / (rate * min(1.0, max(slot_share, 1e-9)))
    if not math.isfinite(seconds):
        return MAX_WAIT_S * 1000
    return max(MIN_WAIT_MS, min(MAX_WAIT_S * 1000, math.ceil(seconds * 1000)))
