"""The loop guard: nothing shed under the target, a share shed while the loop stays behind."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_shim._loop_guard import MAX_SHARE, LoopGuard

T0 = 73_000.0


def _run(guard: LoopGuard, seconds: float, pass_length: float, start: float = T0) -> float:
    """Passes of ``pass_length`` CPU seconds back to back for ``seconds``; the end time."""
    now = start
    for _ in range(int(seconds / pass_length)):
        now += pass_length
        guard.pass_ran(pass_length, now)
    return now


def _shed(guard: LoopGuard, arrivals: int) -> int:
    return sum(not guard.admit(T0) for _ in range(arrivals))


def test_a_loop_under_its_target_sheds_nothing() -> None:
    guard = LoopGuard(target=0.02)
    _run(guard, seconds=5.0, pass_length=0.015)
    assert guard.share == 0.0
    assert _shed(guard, 1000) == 0


def test_one_long_pass_sheds_nothing() -> None:
    guard = LoopGuard(target=0.02)
    now = _run(guard, seconds=1.0, pass_length=0.001)
    guard.pass_ran(0.2, now + 0.2)  # a scrape, a large body: once
    _run(guard, seconds=1.0, pass_length=0.001, start=now + 0.2)
    assert _shed(guard, 1000) == 0


def test_a_loop_that_stays_behind_sheds_a_growing_share_and_stops_after() -> None:
    guard = LoopGuard(target=0.02)
    now = _run(guard, seconds=0.5, pass_length=0.06)
    assert guard.lag == pytest.approx(0.06, rel=0.05)
    shed_early = guard.share
    assert 0 < shed_early < MAX_SHARE
    now = _run(guard, seconds=0.3, pass_length=0.06, start=now)
    assert guard.share > shed_early
    shed = _shed(guard, 1000)
    assert shed == pytest.approx(1000 * guard.share, abs=1)
    # Back under the target: the share comes down to nothing.
    _run(guard, seconds=5.0, pass_length=0.005, start=now)
    assert guard.share == 0.0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 2.0)),  # pass length, idle after it
        max_size=200,
    )
)
def test_the_share_stays_a_share_and_the_lag_a_pass(passes: list[tuple[float, float]]) -> None:
    guard = LoopGuard(target=0.02)
    now = T0
    longest = 0.0
    for length, idle in passes:
        now += length
        guard.pass_ran(length, now)
        now += idle
        longest = max(longest, length)
        assert 0.0 <= guard.share <= MAX_SHARE
        assert 0.0 <= guard.lag <= longest + 1e-12


def test_the_target_must_be_positive() -> None:
    with pytest.raises(ValueError, match="target"):
        LoopGuard(target=0.0)


def test_long_passes_with_time_to_spare_shed_nothing() -> None:
    # 60 ms passes, each followed by 60 ms of waiting for I/O: bursty, not behind.
    guard = LoopGuard(target=0.01)
    now = T0
    for _ in range(50):
        now += 0.06
        guard.pass_ran(0.06, now)
        now += 0.06
    assert guard.busy < 0.9
    assert guard.share == 0.0
