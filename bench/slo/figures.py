"""What ``bench_slo`` compares and how it judges, without I/O: the workloads, the configurations
(fixed N or the adaptive limit), one request's record, a row's summary (goodput, TTFT
percentiles, L over time), the recovery time of L, the best fixed N, the verdict on the
targets, and the table.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Final

from bench.kit.stats import percentile

#: The recovery target: L within this share of its steady value.
RECOVERY_BAND: Final = 0.1


@dataclasses.dataclass(frozen=True)
class Workload:
    """A kind of request and the engine shape it runs on, with its usual fixed setting."""

    name: str
    prompt_tokens: int
    max_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    usual_queue: int
    #: The ``model`` field of the body (an upstream server checks it); none for the mocker.
    model: str | None = None

    @property
    def usual_limit(self) -> int:
        """The usual N: the engine's batch size."""
        return self.max_num_seqs

    def describe(self) -> str:
        return (
            f"{self.prompt_tokens}-token prompts, {self.max_tokens} out, batch "
            f"{self.max_num_seqs}, step budget {self.max_num_batched_tokens}"
        )


WORKLOADS: Final = (
    Workload(
        name="short",
        prompt_tokens=256,
        max_tokens=48,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        usual_queue=64,
    ),
    Workload(
        name="long",
        prompt_tokens=1024,
        max_tokens=16,
        max_num_seqs=256,
        max_num_batched_tokens=1024,
        usual_queue=16,
    ),
)


@dataclasses.dataclass(frozen=True)
class Config:
    """One gate setting: fixed N and Q, or the adaptive limit with an objective."""

    kind: str  # "usual", "fixed" or "adaptive"
    limit: int
    queue: int
    objective: float | None = None

    @property
    def label(self) -> str:
        if self.kind == "adaptive":
            return f"adaptive N={self.limit} Q={self.queue}"
        return f"{self.kind} N={self.limit} Q={self.queue}"


@dataclasses.dataclass(frozen=True)
class Record:
    """What became of one request: ``ttft`` is NaN unless it produced a first output."""

    arrived: float
    ttft: float
    completed: bool
    refused: bool


@dataclasses.dataclass(frozen=True)
class Row:
    """The figures of one configuration at one load."""

    sent: int
    goodput: float
    completed: float
    refused: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    limit_median: float
    limit_min: float
    limit_max: float


# ----------------------------------------------------------------------------- pure parts


def summarize(
    records: Sequence[Record],
    *,
    objective: float,
    start: float,
    end: float,
    limits: Sequence[tuple[float, int]] = (),
) -> Row:
    """Figures over the requests that arrived in ``[start, end)``.

    Args:
        records: Every request of the run.
        objective: S: a completed request counts towards goodput when its TTFT is <= S.
        start: Start of the counted window (after the warm-up).
        end: End of the arrival window.
        limits: ``(time, L)`` samples; those in the window give the L columns.

    Returns:
        Goodput and completions per second, the share refused, TTFT quantiles of the completed
        in milliseconds, and L's median, min and max in the window (NaN when not sampled).
    """
    counted = [r for r in records if start <= r.arrived < end]
    seconds = end - start
    done = [r.ttft for r in counted if r.completed]
    good = sum(1 for value in done if value <= objective)
    refused = sum(1 for r in counted if r.refused)
    in_window = [value for at, value in limits if start <= at < end]
    return Row(
        sent=len(counted),
        goodput=good / seconds,
        completed=len(done) / seconds,
        refused=refused / len(counted) if counted else math.nan,
        p50_ms=percentile(done, 0.5) * 1e3,
        p90_ms=percentile(done, 0.9) * 1e3,
        p99_ms=percentile(done, 0.99) * 1e3,
        limit_median=statistics.median(in_window) if in_window else math.nan,
        limit_min=min(in_window) if in_window else math.nan,
        limit_max=max(in_window) if in_window else math.nan,
    )


def recovery_seconds(
    limits: Sequence[tuple[float, int]], *, drop_at: float, end: float
) -> tuple[float, float]:
    """How long after a load drop L takes to settle within :data:`RECOVERY_BAND` of its value.

    The steady value is the median of L over the last third of ``[drop_at, end)``; the recovery
    time is from ``drop_at`` to the first sample after which every sample stays in the band.

    Returns:
        ``(steady value, seconds)``; seconds is NaN when L never settled.
    """
    after = [(at, value) for at, value in limits if drop_at <= at < end]
    if not after:
        return math.nan, math.nan
    tail = [value for at, value in after if at >= end - (end - drop_at) / 3]
    steady = statistics.median(tail) if tail else float(after[-1][1])
    band = RECOVERY_BAND * steady
    settled_at = math.nan
    for at, value in reversed(after):
        if abs(value - steady) > band:
            break
        settled_at = at
    return steady, settled_at - drop_at


def every(limits: Sequence[tuple[float, int]], seconds: float) -> list[int]:
    """The first sample of L in each period of ``seconds`` (for printing L over time)."""
    picked: list[int] = []
    period = -1
    for at, value in limits:
        if math.floor(at / seconds) > period:
            period = math.floor(at / seconds)
            picked.append(value)
    return picked


def best_fixed(rows: Mapping[str, Row], configs: Sequence[Config]) -> Config:
    """The fixed configuration (usual included) with the highest goodput among ``rows``."""
    fixed = [c for c in configs if c.kind != "adaptive" and c.label in rows]
    return max(fixed, key=lambda c: rows[c.label].goodput)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One target of the SLO benchmark, as measured."""

    target: str
    figure: str
    met: bool


def check_targets(
    results: Mapping[tuple[str, float], Mapping[str, Row]],
    configs: Mapping[str, Sequence[Config]],
    recoveries: Mapping[str, tuple[float, float]],
) -> list[Verdict]:
    """The targets for each workload, from the rows of every load: at every load, adaptive
    goodput >= 90% of the best fixed configuration's; from 2x on, >= 3x the usual setting's; at
    0.5x, <= 1% refused; after the 4x -> 0.5x step, L within 10% of steady in under 10 s.

    Args:
        results: Rows by (workload, load multiple), then by configuration label.
        configs: The configurations of each workload.
        recoveries: ``(steady L, seconds)`` after the 4x -> 0.5x step, per workload.
    """
    verdicts: list[Verdict] = []
    for (workload, load), rows in sorted(results.items()):
        adaptive = next(c for c in configs[workload] if c.kind == "adaptive")
        usual = next(c for c in configs[workload] if c.kind == "usual")
        ours = rows[adaptive.label]
        best = best_fixed(rows, configs[workload])
        share = ours.goodput / rows[best.label].goodput if rows[best.label].goodput else math.inf
        verdicts.append(
            Verdict(
                f"{workload} {load:g}x: adaptive >= 90% of best fixed ({best.label})",
                f"{share:.0%}",
                share >= 0.9,
            )
        )
        if load >= 2:
            base = rows[usual.label].goodput
            ratio = ours.goodput / base if base else math.inf
            verdicts.append(
                Verdict(
                    f"{workload} {load:g}x: adaptive >= 3x the usual", f"{ratio:.1f}x", ratio >= 3
                )
            )
        if load == 0.5:
            verdicts.append(
                Verdict(
                    f"{workload} 0.5x: <= 1% refused",
                    f"{ours.refused:.2%}",
                    ours.refused <= 0.01,
                )
            )
    for workload, (steady, seconds) in sorted(recoveries.items()):
        verdicts.append(
            Verdict(
                f"{workload}: L within 10% of steady ({steady:g}) < 10 s after 4x -> 0.5x",
                f"{seconds:.1f} s",
                seconds < 10,
            )
        )
    return verdicts


def format_rows(rows: Mapping[str, Row], order: Sequence[str], best: str) -> list[str]:
    """The table lines of one load."""
    lines = []
    for label in order:
        row = rows[label]
        mark = " (best fixed)" if label == best else ""
        limit = (
            f"{row.limit_median:5.0f} [{row.limit_min:.0f}-{row.limit_max:.0f}]"
            if not math.isnan(row.limit_median)
            else "    -"
        )
        lines.append(
            f"  {label + mark:34} {row.goodput:8.1f} {row.completed:8.1f} {row.refused:8.1%} "
            f"{row.p50_ms:7.0f} {row.p90_ms:7.0f} {row.p99_ms:7.0f}  {limit}"
        )
    return lines


TABLE_HEAD: Final = (
    f"  {'configuration':34} {'goodput':>8} {'done/s':>8} {'refused':>8} "
    f"{'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7}  L median [min-max]"
)
