"""The numbers of a run: percentiles, a median that skips what was not measured, and the seeded
Poisson arrivals an open-loop load plays."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable

__all__ = ["median", "percentile", "poisson_arrivals"]


def percentile(values: Iterable[float], share: float) -> float:
    """The ``share`` quantile (0 to 1) of ``values``, interpolated linearly between the two
    nearest ranks; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = share * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Iterable[float]) -> float:
    """The median of the values that are numbers (NaN, a figure not measured, is skipped);
    NaN when none is."""
    present = [value for value in values if not math.isnan(value)]
    return statistics.median(present) if present else math.nan


def poisson_arrivals(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Arrival offsets of a Poisson process: exponential gaps of mean ``1 / rate``.

    Args:
        rate: Mean arrivals per second (> 0).
        seconds: Length of the window; every offset is in ``[0, seconds)``.
        rng: The source of randomness (seeded, so a run can be replayed).

    Returns:
        The offsets in seconds, increasing.

    Raises:
        ValueError: ``rate`` is not positive.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    offsets: list[float] = []
    now = rng.expovariate(rate)
    while now < seconds:
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets
