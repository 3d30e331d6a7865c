"""What an overload answer advises: when to retry (the fleet's turnover), and whether (a
budget of retries fed by completions)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from frontend_shim._retry_advice import RETRY_BURST, RETRY_SHARE, Advice, RetryAdvice


def _wait(in_flight: int, rate: float | None, share: float = 1.0) -> Advice:
    return RetryAdvice().advise(in_flight, rate, share)


def test_the_wait_is_the_fleets_turnover_within_bounds() -> None:
    assert _wait(100, None) == Advice(1000, True)  # no rate measured yet
    assert _wait(0, 5.0).retry_after_ms == 1000
    assert _wait(1, 1000.0).retry_after_ms == 100  # never under 100 ms
    assert _wait(100, 10.0).retry_after_ms == 10_000
    assert _wait(101, 10.0).retry_after_s == 11
    assert _wait(10**6, 1.0).retry_after_s == 30
    assert _wait(5, 0.0).retry_after_ms == 30_000
    assert _wait(5, 1e-300).retry_after_s == 30
    # Workers that lowered their limits below what they run turn over slower.
    assert _wait(100, 10.0, share=0.5).retry_after_s == 20
    assert _wait(100, 10.0, share=0.0).retry_after_s == 30  # capped, never a division by 0
    assert _wait(35, 100.0) == Advice(350, True)
    assert Advice(350, True).retry_after_s == 1


def test_retries_stay_a_share_of_what_completes() -> None:
    advice = RetryAdvice()
    yes = sum(advice.advise(10, 100.0).should_retry for _ in range(1000))
    assert yes == int(RETRY_BURST)  # the burst, then nothing without completions
    advice.completed(100)
    assert sum(advice.advise(10, 100.0).should_retry for _ in range(1000)) == 100 * RETRY_SHARE


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=100))
def test_retries_advised_never_exceed_the_budget(steps: list[tuple[int, int]]) -> None:
    advice = RetryAdvice()
    completed = yes = 0
    for done, shed in steps:
        advice.completed(done)
        completed += done
        yes += sum(advice.advise(1, 1.0).should_retry for _ in range(shed))
        assert yes <= RETRY_BURST + RETRY_SHARE * completed + 1e-9
