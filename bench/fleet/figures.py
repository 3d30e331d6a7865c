"""The figures of the fleet benchmark: quantiles, the frontend's event-budget metrics read from
``/metrics``, one size's result, and the Markdown table the results print as.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

from bench.kit.metrics import samples
from bench.kit.stats import percentile

BUDGET_METRIC: Final = "dynamo_frontend_event_budget_messages_per_second"
INTERVAL_METRIC: Final = "dynamo_frontend_event_interval_seconds"
COST_METRIC: Final = "dynamo_frontend_event_message_cost_seconds"

# ----------------------------------------------------------------------------- figures


@dataclasses.dataclass
class EventMetrics:
    """What the frontend's ``/metrics`` says about the events it follows (``None``: absent)."""

    #: The sum of ``dynamo_frontend_*event*_total`` samples.
    applied: float | None = None
    #: The largest ``*_lag_seconds`` gauge sample (or a histogram's mean).
    lag: float | None = None
    #: :data:`BUDGET_METRIC`.
    budget: float | None = None
    #: The largest :data:`INTERVAL_METRIC` sample.
    interval: float | None = None
    #: :data:`COST_METRIC` (CPU seconds per event message, as the frontend measured it).
    cost: float | None = None


def event_metrics(text: str) -> EventMetrics:
    """The event figures of a Prometheus text exposition (see :class:`EventMetrics`)."""
    found = EventMetrics()
    applied: float | None = None
    lag: float | None = None
    lag_sum: float | None = None
    lag_count: float | None = None
    for name, _, value in samples(text):
        if name == BUDGET_METRIC:
            found.budget = value
        elif name == COST_METRIC:
            found.cost = value
        elif name == INTERVAL_METRIC:
            found.interval = value if found.interval is None else max(found.interval, value)
        elif name.startswith("dynamo_frontend_") and "event" in name and name.endswith("_total"):
            applied = (applied or 0.0) + value
        elif "lag_seconds" in name:
            if name.endswith("_sum"):
                lag_sum = (lag_sum or 0.0) + value
            elif name.endswith("_count"):
                lag_count = (lag_count or 0.0) + value
            elif not name.endswith(("_bucket", "_created")):
                lag = value if lag is None else max(lag, value)
    if lag is None and lag_sum is not None and lag_count:
        lag = lag_sum / lag_count
    found.applied, found.lag = applied, lag
    return found


@dataclasses.dataclass
class SizeResult:
    """Everything measured for one fleet size (``None``: not measured or not reached)."""

    workers: int
    ranks: int
    simulators: int
    rate: float
    protocol: str = "new"
    #: Which simulator ran the fleet (a key of :data:`SIMULATORS`).
    simulator: str = "lean"
    error: str | None = None
    sims_ready_s: float | None = None
    ready_line_s: float | None = None
    http_first_s: float | None = None
    all_up_s: float | None = None
    connected_after: int | None = None
    window_s: float | None = None
    generated_per_s: float | None = None
    offered_events_per_s: float | None = None
    offered_messages_per_s: float | None = None
    #: With ``--kv-blocks``: KV events the simulators sent per second, and their messages.
    kv_events_per_s: float | None = None
    kv_messages_per_s: float | None = None
    applied_events_per_s: float | None = None
    frontend_cpu: float | None = None
    #: Share of the window the frontend was runnable but waited for its CPU (other work on it).
    frontend_wait: float | None = None
    simulator_cpu: float | None = None
    simulator_wait: float | None = None
    frontend_rss_mb: float | None = None
    frontend_peak_rss_mb: float | None = None
    simulator_rss_mb: float | None = None
    unread_kb_start: float | None = None
    unread_kb_end: float | None = None
    live_ms: list[float] = dataclasses.field(default_factory=list)
    live_errors: int = 0
    #: Completions answered 200 during the steady window, and the others.
    completion_ms: list[float] = dataclasses.field(default_factory=list)
    completion_errors: int = 0
    #: ``(seconds since the frontend started, workers connected)`` while it came up.
    up_curve: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    busy_ms: list[float] = dataclasses.field(default_factory=list)
    #: Per flip: from the command until every simulator had given its engines the new load.
    sim_apply_ms: list[float] = dataclasses.field(default_factory=list)
    free_ms: list[float] = dataclasses.field(default_factory=list)
    flip_timeouts: int = 0
    saw_529: bool = False
    saw_200: bool = False
    metrics_scrape_ms: float | None = None
    lag_s: float | None = None
    budget: float | None = None
    interval_s: float | None = None
    cost_s: float | None = None
    #: What was being done last (names the phase a timeout interrupted).
    phase: str = "starting the simulators"

    @property
    def target_events_per_s(self) -> float:
        return self.workers * self.ranks * self.rate

    def summary(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("live_ms", "completion_ms", "busy_ms", "free_ms", "sim_apply_ms"):
            values = data.pop(name)
            data[name] = {
                "n": len(values),
                "p50": percentile(values, 0.5) if values else None,
                "p99": percentile(values, 0.99) if values else None,
            }
        data["target_events_per_s"] = self.target_events_per_s
        return data


# ----------------------------------------------------------------------------- report


def _ms(values: Sequence[float]) -> str:
    if not values:
        return "n/a"
    return f"{percentile(values, 0.5):.0f} / {percentile(values, 0.99):.0f}"


def _num(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


HEADER: Final = (
    "| workers x ranks | protocol | simulator | target ev/s | offered ev/s (msg/s) | applied msg/s "
    "| budget msg/s (interval s; measured us/msg) "
    "| frontend CPU (run-queue wait) | sim CPU (wait) | frontend RSS MB "
    "| ready line / HTTP up / all up s | busy->529 ms p50/p99 "
    "| free->200 ms p50/p99 | sim's share of a flip ms p50/p99 | /live ms p50/p99 "
    "| completions ms p50/p99 | unread KB start->end | max lag | note |"
)


def table_row(r: SizeResult) -> str:
    if r.all_up_s is None:
        return (
            f"| {r.workers} x {r.ranks} | {r.protocol} | {r.simulator} "
            f"| {r.target_events_per_s:.0f} | {r.error or 'not up'} |" + " |" * 14
        )
    lag = "n/a (no lag metric)" if r.lag_s is None else f"{r.lag_s * 1000:.0f} ms"
    applied = (
        "n/a (no counter)" if r.applied_events_per_s is None else f"{r.applied_events_per_s:.0f}"
    )
    busy = _ms(r.busy_ms) + (f" ({r.flip_timeouts} timed out)" if r.flip_timeouts else "")
    completions = _ms(r.completion_ms) + (
        f" ({r.completion_errors} not 200)" if r.completion_errors else ""
    )
    kv = ""
    if r.kv_events_per_s is not None:
        kv = f" + kv {r.kv_events_per_s:.0f} ({_num(r.kv_messages_per_s, '.0f')})"
    return (
        f"| {r.workers} x {r.ranks} | {r.protocol} | {r.simulator} "
        f"| {r.target_events_per_s:.0f} "
        f"| {_num(r.offered_events_per_s, '.0f')} ({_num(r.offered_messages_per_s, '.0f')}){kv} "
        f"| {applied} | {_num(r.budget, '.0f')} ({_num(r.interval_s, '.2f')}; "
        f"{_num(r.cost_s, '.0f', 1e6)}) "
        f"| {_num(r.frontend_cpu, '.0f', 100)}% ({_num(r.frontend_wait, '.0f', 100)}%) "
        f"| {_num(r.simulator_cpu, '.0f', 100)}% ({_num(r.simulator_wait, '.0f', 100)}%) "
        f"| {_num(r.frontend_rss_mb, '.0f')} "
        f"| {_num(r.ready_line_s, '.2f')} / {_num(r.http_first_s, '.2f')} "
        f"/ {_num(r.all_up_s, '.1f')} | {busy} | {_ms(r.free_ms)} | {_ms(r.sim_apply_ms)} "
        f"| {_ms(r.live_ms)} | {completions} "
        f"| {_num(r.unread_kb_start, '.0f')} -> {_num(r.unread_kb_end, '.0f')} | {lag} "
        f"| {r.error or ''} |"
    )
