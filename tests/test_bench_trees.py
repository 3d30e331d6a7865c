"""The pure part of ``bench/bench_trees.py``: the report of medians and per-round ratios."""

from __future__ import annotations

from bench.bench_trees import Round, report


def test_the_report_gives_medians_and_per_round_ratios_to_the_first_tree() -> None:
    rounds = {
        "old": [Round(1000.0, 150.0, 100.0, 1.9, 0.1), Round(2000.0, 170.0, 110.0, 2.1, 0.1),
                Round(1000.0, 160.0, 90.0, 2.0, 0.1)],
        "new": [Round(1500.0, 100.0, 100.0, 0.6, 0.1), Round(2000.0, 110.0, 100.0, 0.5, 0.1),
                Round(1200.0, 105.0, 100.0, 0.7, 0.1)],
    }  # fmt: skip
    table = report(["old", "new"], rounds)
    assert "| old | 1,000 | 160 | 100 | 2.00 / 0.10 | 1.00 (1.00, 1.00, 1.00) |" in table
    assert "| new | 1,500 | 105 | 100 | 0.60 / 0.10 | 1.20 (1.50, 1.00, 1.20) |" in table


def test_without_the_one_connection_figures_the_latency_is_not_available() -> None:
    rounds = {"only": [Round(1000.0, 100.0, 100.0)]}
    assert "| only | 1,000 | 100 | 100 | n/a | 1.00 (1.00) |" in report(["only"], rounds)
