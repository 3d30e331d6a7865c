"""A ``/metrics`` page (the Prometheus text format) read as numbers.

Every sample line is ``name{label="value",...} value``, labels optional; comments, blank lines
and lines that do not parse are skipped. What a benchmark asks: one metric's sum over the
samples whose labels include some (:func:`metric_sum`), every metric's sum (:func:`sums`), or one
metric's samples keyed by a label (:func:`by_label`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Final

__all__ = ["by_label", "labels_of", "metric_sum", "samples", "sums"]

_SAMPLE: Final = re.compile(r"([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? +(\S+)")
_LABEL: Final = re.compile(r'(\w+)="([^"]*)"')


def samples(text: str) -> Iterator[tuple[str, str, float]]:
    """Every sample of the page: its metric name, its labels as written, its value."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match[3])
        except ValueError:
            continue
        yield match[1], match[2] or "", value


def labels_of(written: str) -> dict[str, str]:
    """The labels of a sample (as :func:`samples` gives them) by name."""
    return dict(_LABEL.findall(written))


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    total = 0.0
    for sample, written, value in samples(text):
        if sample == name and (not labels or labels.items() <= labels_of(written).items()):
            total += value
    return total


def sums(text: str) -> dict[str, float]:
    """Every metric's samples summed, labels and all, by metric name."""
    totals: dict[str, float] = {}
    for name, _, value in samples(text):
        totals[name] = totals.get(name, 0.0) + value
    return totals


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` summed by the value of one of their labels ("" when absent)."""
    out: dict[str, float] = {}
    for sample, written, value in samples(text):
        if sample == name:
            key = labels_of(written).get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out
