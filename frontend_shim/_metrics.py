"""The frontend's Prometheus metrics, in a registry of its own.

Request counters are updated on the request path, so their labelled children are cached: a 529
costs one dict lookup and one increment. Per-worker load gauges are not updated per event at all;
a collector reads the router's load state when Prometheus scrapes.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, TypeVar

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shim_common._status import render_registry

__all__ = [
    "BudgetSample",
    "FrontendMetrics",
    "LinkSample",
    "RankLoadSample",
    "UNKNOWN_MODEL_LABEL",
]

_A = TypeVar("_A")
_R = TypeVar("_R")

#: The ``model`` label of requests for a model no worker has announced: client input must not
#: create series without bound.
UNKNOWN_MODEL_LABEL = "unknown"

# Latency buckets in seconds: an LLM request spans milliseconds (a shed) to minutes (long outputs).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RankLoadSample(NamedTuple):
    """The load of one worker rank as the router sees it, read at scrape time."""

    worker_id: str
    dp_rank: int
    active_decode_blocks: int
    active_prefill_tokens: int
    kv_total_blocks: int


class LinkSample(NamedTuple):
    """What one worker link says of itself, read at scrape time."""

    #: The worker's announced id; its address until it has said hello.
    worker_id: str
    connected: bool
    lagging: bool
    #: Seconds behind of the latest event batch, and the most seen.
    lag: float
    max_lag: float
    event_batches: int
    lag_episodes: int
    #: Sessions ended because the worker's KV events went past the budget.
    kv_budget_closes: int = 0


class BudgetSample(NamedTuple):
    """The event budget in use, read at scrape time."""

    #: The budget (event messages a second over the fleet; 0: none).
    messages_per_second: float
    #: The interval each worker is asked for or read at (seconds).
    interval: float
    #: Connected workers that take the interval, and links read at it.
    negotiated: int
    paced: int
    #: Times event work waited for the next slice.
    slice_yields: int
    #: The measured CPU seconds per event message (0: not measured yet).
    cost_per_message: float = 0.0
    #: Whether the budget follows that cost (no ``--event-budget``).
    measured: bool = False


_BUDGET_SNAPSHOT: contextvars.ContextVar[BudgetSample | None] = contextvars.ContextVar(
    "budget_snapshot", default=None
)


class _BudgetCollector(Collector):
    def __init__(self, sample: Callable[[], BudgetSample]) -> None:
        self._sample = sample

    def collect(self) -> Iterator[Metric]:
        sample = _BUDGET_SNAPSHOT.get() or self._sample()
        yield GaugeMetricFamily(
            "dynamo_frontend_event_budget_messages_per_second",
            "Event messages a second this frontend takes from all its workers (0: no budget)",
            value=sample.messages_per_second,
        )
        yield GaugeMetricFamily(
            "dynamo_frontend_event_interval_seconds",
            "Seconds between two event batches each worker is asked for, or read at",
            value=sample.interval,
        )
        yield GaugeMetricFamily(
            "dynamo_frontend_workers_event_interval_negotiated",
            "Connected workers that send at the interval asked of them",
            value=sample.negotiated,
        )
        yield GaugeMetricFamily(
            "dynamo_frontend_workers_event_read_paced",
            "Connected workers that do not negotiate the interval, read at it (latest wins)",
            value=sample.paced,
        )
        yield GaugeMetricFamily(
            "dynamo_frontend_event_message_cost_seconds",
            "Measured CPU seconds this frontend spends per event message (0: not measured yet)",
            value=sample.cost_per_message,
        )
        yield GaugeMetricFamily(
            "dynamo_frontend_event_budget_measured",
            "1: the event budget follows the measured cost per message; 0: fixed or none",
            value=1.0 if sample.measured else 0.0,
        )
        yield CounterMetricFamily(
            "dynamo_frontend_event_slice_yields",
            "Times event work waited a pass of the event loop for HTTP and link set-up",
            value=sample.slice_yields,
        )


#: Samples taken on the event loop for one exposition formatted in a worker thread: the
#: collectors must not read the live fleet from another thread.
_SNAPSHOT: contextvars.ContextVar[tuple[list[RankLoadSample], list[LinkSample]] | None] = (
    contextvars.ContextVar("metrics_snapshot", default=None)
)


class _LinkCollector(Collector):
    def __init__(self, samples: Callable[[], Iterable[LinkSample]]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[Metric]:
        snapshot = _SNAPSHOT.get()
        samples = snapshot[1] if snapshot is not None else self._samples()
        lag = GaugeMetricFamily(
            "dynamo_frontend_worker_event_lag_seconds",
            "How far behind this frontend reads the worker's load events (seconds, latest batch)",
            labels=["worker_id"],
        )
        connected = lagging = batches = episodes = kv_closes = 0
        max_lag = 0.0
        for sample in samples:
            connected += sample.connected
            lagging += sample.lagging
            batches += sample.event_batches
            episodes += sample.lag_episodes
            kv_closes += sample.kv_budget_closes
            max_lag = max(max_lag, sample.max_lag)
            if sample.connected:
                lag.add_metric([sample.worker_id], sample.lag)
        yield lag
        yield GaugeMetricFamily(
            "dynamo_frontend_worker_event_lag_max_seconds",
            "The largest event lag seen on any worker link",
            value=max_lag,
        )
        yield GaugeMetricFamily(
            "dynamo_frontend_workers_connected",
            "Worker links with a session up",
            value=connected,
        )
        yield GaugeMetricFamily(
            "dynamo_frontend_workers_lagging",
            "Workers not routed to because their events are read too far behind",
            value=lagging,
        )
        yield CounterMetricFamily(
            "dynamo_frontend_event_batches",
            "Load-event batches applied, over all worker links",
            value=batches,
        )
        yield CounterMetricFamily(
            "dynamo_frontend_worker_lag_episodes",
            "Times a worker link's event lag went over the bound",
            value=episodes,
        )
        yield CounterMetricFamily(
            "dynamo_frontend_worker_kv_budget_closes",
            "Worker sessions ended because the worker's KV events went past their budget",
            value=kv_closes,
        )


class _WorkerLoadCollector(Collector):
    def __init__(self, samples: Callable[[], Iterable[RankLoadSample]]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["worker_id", "dp_rank"]
        decode = GaugeMetricFamily(
            "dynamo_frontend_worker_active_decode_blocks",
            "Latest active decode blocks per worker and DP rank",
            labels=labels,
        )
        prefill = GaugeMetricFamily(
            "dynamo_frontend_worker_active_prefill_tokens",
            "Latest active prefill tokens per worker and DP rank",
            labels=labels,
        )
        total = GaugeMetricFamily(
            "dynamo_frontend_worker_kv_total_blocks",
            "KV cache blocks per worker and DP rank",
            labels=labels,
        )
        snapshot = _SNAPSHOT.get()
        for sample in snapshot[0] if snapshot is not None else self._samples():
            key = [sample.worker_id, str(sample.dp_rank)]
            decode.add_metric(key, sample.active_decode_blocks)
            prefill.add_metric(key, sample.active_prefill_tokens)
            total.add_metric(key, sample.kv_total_blocks)
        yield decode
        yield prefill
        yield total


class FrontendMetrics:
    """All metrics of one frontend.

    Args:
        worker_loads: called at scrape time; yields the load of every worker rank.
    """

    def __init__(self, worker_loads: Callable[[], Iterable[RankLoadSample]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._rejections = Counter(
            "dynamo_frontend_model_rejection",
            "Total number of requests rejected due to resource exhaustion",
            ["model", "endpoint"],
            registry=self.registry,
        )
        self._requests = Counter(
            "dynamo_frontend_requests",
            "HTTP requests answered, by status code",
            ["model", "endpoint", "status"],
            registry=self.registry,
        )
        self._inflight = Gauge(
            "dynamo_frontend_inflight_requests",
            "Requests being served now",
            ["model"],
            registry=self.registry,
        )
        self._ttft = Histogram(
            "dynamo_frontend_time_to_first_token_seconds",
            "Seconds from request arrival to the first generated token",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self._duration = Histogram(
            "dynamo_frontend_request_duration_seconds",
            "Seconds from request arrival to the end of the response",
            ["model"],
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self._connection_errors = Counter(
            "dynamo_frontend_http_connection_errors",
            "HTTP connections that ended in an unexpected error",
            registry=self.registry,
        )
        self._worker_loads = worker_loads
        self._link_samples: Callable[[], Iterable[LinkSample]] = lambda: ()
        self._budget_sample: Callable[[], BudgetSample] | None = None
        self._send_stalls = Counter(
            "dynamo_frontend_http_send_stalls",
            "HTTP clients dropped because they read nothing for the send timeout",
            registry=self.registry,
        )
        self._tls_failures = Counter(
            "dynamo_frontend_tls_handshake_failures",
            "TLS handshakes on the HTTP listener that failed or timed out",
            registry=self.registry,
        )
        self._worker_id_collisions = Counter(
            "dynamo_frontend_worker_id_collisions",
            "Worker hellos announcing an id another worker address holds (served apart)",
            registry=self.registry,
        )
        self.registry.register(_WorkerLoadCollector(worker_loads))
        self._rejections_by_reason = Counter(
            "dynamo_frontend_rejection_by_reason",
            "Requests answered 529 or 503, by model and by reason (x-dynamo-reject-reason)",
            ["model", "reason"],
            registry=self.registry,
        )
        self._rejection_children: dict[tuple[str, str], Counter] = {}
        self._reason_children: dict[tuple[str, str], Counter] = {}
        self._request_children: dict[tuple[str, str, int], Counter] = {}
        self._inflight_children: dict[str, Gauge] = {}
        self._ttft_children: dict[str, Histogram] = {}
        self._duration_children: dict[str, Histogram] = {}

    def watch_links(self, samples: Callable[[], Iterable[LinkSample]]) -> None:
        """Export the worker links' own figures (connected, lag), read at scrape time."""
        self._link_samples = samples
        self.registry.register(_LinkCollector(samples))

    def watch_event_budget(self, sample: Callable[[], BudgetSample]) -> None:
        """Export the event budget in use and the interval it gives, read at scrape time."""
        self._budget_sample = sample
        self.registry.register(_BudgetCollector(sample))

    def count_rejection(self, model: str, endpoint: str) -> None:
        """One request answered with the overload status (all workers busy or rejecting)."""
        key = (model, endpoint)
        child = self._rejection_children.get(key)
        if child is None:
            child = self._rejection_children[key] = self._rejections.labels(model, endpoint)
        child.inc()

    def count_rejection_reason(self, model: str, reason: str) -> None:
        """One request answered 529 or 503, by reason (``queue_full``, ``busy``, ...)."""
        key = (model, reason)
        child = self._reason_children.get(key)
        if child is None:
            child = self._reason_children[key] = self._rejections_by_reason.labels(model, reason)
        child.inc()

    def count_request(self, model: str, endpoint: str, status: int) -> None:
        """One request answered (any status)."""
        key = (model, endpoint, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self._requests.labels(
                model, endpoint, str(status)
            )
        child.inc()

    def inflight(self, model: str) -> Gauge:
        """The in-flight gauge of one model (``inc()`` on start, ``dec()`` at the end)."""
        child = self._inflight_children.get(model)
        if child is None:
            child = self._inflight_children[model] = self._inflight.labels(model)
        return child

    def observe_ttft(self, model: str, seconds: float) -> None:
        """Time to the first token of a generating request."""
        child = self._ttft_children.get(model)
        if child is None:
            child = self._ttft_children[model] = self._ttft.labels(model)
        child.observe(seconds)

    def observe_duration(self, model: str, seconds: float) -> None:
        """Time from arrival to the end of the response."""
        child = self._duration_children.get(model)
        if child is None:
            child = self._duration_children[model] = self._duration.labels(model)
        child.observe(seconds)

    def count_connection_error(self) -> None:
        """An HTTP connection ended in an unexpected error (the server itself goes on)."""
        self._connection_errors.inc()

    def count_send_stall(self) -> None:
        """An HTTP client was dropped because a write to it made no progress in time."""
        self._send_stalls.inc()

    def count_tls_failure(self, _error: BaseException | None = None) -> None:
        """A TLS handshake on the HTTP listener failed or timed out."""
        self._tls_failures.inc()

    def count_worker_id_collision(self) -> None:
        """A worker address announced an id another address holds; it is served apart."""
        self._worker_id_collisions.inc()

    def render(self, accept_header: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type, as the scraper asked for it."""
        return render_registry(self.registry, accept_header)

    async def render_off_loop(self, accept_header: str | None) -> tuple[bytes, str]:
        """:meth:`render`, formatted in a worker thread from samples taken here.

        Formatting the per-worker series of a 1,024-worker fleet takes a fifth of a second; on
        the event loop that would stall every link and request for as long at each scrape.
        """
        return await self.off_loop(self.render, accept_header)

    async def off_loop(self, read: Callable[[_A], _R], argument: _A) -> _R:
        """``read(argument)``, in a worker thread, with its collectors reading samples of the
        fleet taken here, on the loop (what :meth:`render_off_loop` does, for any reader)."""
        links = self._link_samples()
        _SNAPSHOT.set((list(self._worker_loads()), list(links)))
        if self._budget_sample is not None:
            _BUDGET_SNAPSHOT.set(self._budget_sample())
        try:
            # The thread runs in a copy of this context, so its collectors see the snapshot.
            return await trio.to_thread.run_sync(read, argument)
        finally:
            _SNAPSHOT.set(None)
            _BUDGET_SNAPSHOT.set(None)
