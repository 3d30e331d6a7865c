"""Small network helpers (shim_common._net): the reconnection backoff."""

from __future__ import annotations

import random

import pytest

from shim_common._net import Backoff


def test_backoff_doubles_to_the_cap_without_jitter() -> None:
    backoff = Backoff(initial=0.05, cap=2.0, jitter=0.0)
    delays = [backoff.next_delay() for _ in range(10)]
    assert delays == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0, 2.0])
    backoff.reset()
    assert backoff.next_delay() == pytest.approx(0.05)


def test_backoff_jitter_stays_within_its_band_and_varies() -> None:
    backoff = Backoff(initial=0.05, cap=2.0, jitter=0.5, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(200)]
    ceilings = [min(2.0, 0.05 * 2**n) for n in range(200)]
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling * 0.5 <= delay <= ceiling
    capped = delays[10:]
    assert max(capped) <= 2.0
    assert len(set(capped)) > 100  # jittered: workers that lost the same peer do not stampede


def test_backoff_survives_a_very_long_outage() -> None:
    backoff = Backoff(initial=0.05, cap=2.0, jitter=0.0)
    for _ in range(5000):
        delay = backoff.next_delay()
    assert delay == 2.0
