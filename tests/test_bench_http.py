"""The pure part of ``bench/bench_http.py``: the report and its per-round ratios."""

from __future__ import annotations

from bench.bench_http import report


def test_ratios_are_medians_of_the_rounds_ratios() -> None:
    rates = {
        "llhttp": [10_000.0, 20_000.0, 10_000.0],
        "h11": [2_500.0, 5_000.0, 2_500.0],
        "hypercorn": [],
        "live": [5_000.0, 10_000.0, 6_000.0],
        "shed": [5_000.0, 9_000.0, 6_000.0],
        "one_token": [1_000.0, 2_000.0, 1_000.0],
        "streamed": [100.0, 200.0, 100.0],
    }
    cpu = {"h11": [(300.0, 300.0)], "live": [(90.0, 80.0), (110.0, 100.0), (100.0, 90.0)]}
    table = report(rates, cpu)
    h11_row = "| floor: bare Trio + h11 hello world | 2,500 | 400.0 | 300.0 | 0.25 |"
    assert h11_row in table
    assert "| frontend-shim GET /live | 6,000 | 166.7 | 100.0 (90.0) | 0.50 |" in table
    assert "| frontend-shim completion, 1 token | 1,000 | 1000.0 | - |" in table
    assert "hypercorn" not in table  # not measured, no row
    assert "529s / GET /live: 1.00 (+0.0 us per 529)" in table
    assert "GET /live / llhttp floor: 0.50" in table
