"""Prefix-cache hit counts of an engine, per data-parallel rank, and their rate over the last
minute (sans-IO: the caller passes the time).

An engine that knows what its prefix cache found (the mocker counts it, the ``openai`` engine
reads it from the upstream's usage) offers ``prefix_cache_stats()``, returning
:class:`PrefixCacheStats` per rank; the worker's metrics export them when the method exists.

Rules: the counters only grow; the rate is hit tokens over queried tokens of the requests counted
in the last :data:`HIT_RATE_WINDOW` seconds (0.0 when none were), kept in one bucket per second,
so the memory is bounded by the window whatever the request rate.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import msgspec

__all__ = ["HIT_RATE_WINDOW", "CacheHitCounter", "PrefixCacheStats"]

#: Seconds the hit rate looks back over.
HIT_RATE_WINDOW: Final = 60.0


class PrefixCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank's prefix cache found."""

    dp_rank: int
    #: Prompt tokens looked up in the cache, since start.
    queried_tokens: int
    #: Of those, the tokens found there.
    hit_tokens: int
    #: ``hit / queried`` over the last minute (0.0 when nothing was looked up).
    hit_rate: float


class CacheHitCounter:
    """Counts looked-up and found prompt tokens per rank (see the module rules).

    Args:
        ranks: Data-parallel ranks.
        window: Seconds the hit rate looks back over.
    """

    def __init__(self, ranks: int, *, window: float = HIT_RATE_WINDOW) -> None:
        self._window = window
        self._queried = [0] * ranks
        self._hit = [0] * ranks
        # Per rank: [second, queried, hit] buckets, oldest first, at most window + 1 of them.
        self._buckets: list[deque[list[int]]] = [deque() for _ in range(ranks)]

    def count(self, dp_rank: int, queried: int, hit: int, now: float) -> None:
        """Add one request's (or several requests') looked-up and found tokens at time ``now``."""
        self._queried[dp_rank] += queried
        self._hit[dp_rank] += hit
        buckets = self._buckets[dp_rank]
        second = int(now)
        if buckets and buckets[-1][0] == second:
            buckets[-1][1] += queried
            buckets[-1][2] += hit
        else:
            buckets.append([second, queried, hit])
        self._expire(buckets, now)

    def stats(self, now: float) -> list[PrefixCacheStats]:
        """Every rank's counters and its hit rate over the window ending at ``now``."""
        result: list[PrefixCacheStats] = []
        for rank, buckets in enumerate(self._buckets):
            self._expire(buckets, now)
            queried = sum(bucket[1] for bucket in buckets)
            hit = sum(bucket[2] for bucket in buckets)
            result.append(
                PrefixCacheStats(
                    dp_rank=rank,
                    queried_tokens=self._queried[rank],
                    hit_tokens=self._hit[rank],
                    hit_rate=hit / queried if queried else 0.0,
                )
            )
        return result

    def _expire(self, buckets: deque[list[int]], now: float) -> None:
        oldest = now - self._window
        while buckets and buckets[0][0] + 1 <= oldest:
            buckets.popleft()
