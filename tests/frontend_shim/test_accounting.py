"""Per-request accounting: what a request is counted as before any answer."""

from __future__ import annotations

from frontend_shim._accounting import CLIENT_CLOSED, Exchange


def test_an_exchange_counts_as_client_closed_until_an_answer_is_noted() -> None:
    exchange = Exchange("completions", "m", arrival=0.0)
    assert exchange.status == CLIENT_CLOSED == 499
