"""The worker's Prometheus metrics, read from the admission gate and the engine at scrape time.

Requests pay nothing for metrics: the gate keeps plain integer counters (it must anyway), and a
custom collector turns them into samples only when ``/metrics`` is scraped. The connection-error
count is a plain integer too (no lock, no ``_created`` series: everything runs on the Trio thread).

Stable names (the first table of docs/metrics.md: dashboards and alerts rely on them, so never
change them; only add new ones):

- ``dynamo_rejection_request_total`` (counter): overload rejections plus queue timeouts,
  displacements and objective refusals (draining excluded).
- ``dynamo_engine_request`` (gauge): requests running in the engine.
- ``dynamo_request_queue`` (gauge): requests waiting, the dispatcher's hand included (peaks at Q).
- ``dynamo_engine_request_limit``, ``dynamo_request_queue_limit`` (gauges): N and Q in force
  (N is 10000 when unset; Q is 40000 when neither N nor W is set).
- ``dynamo_component_total_blocks``, ``dynamo_component_kv_used_blocks`` (gauges): the KV cache.

Added here:

- ``dynamo_worker_queue_timeout_total``: of the rejections, the queue timeouts.
- ``dynamo_worker_draining_rejection_total``: arrivals turned away while draining (kept out of
  ``dynamo_rejection_request_total``: shutting down is not overload).
- ``dynamo_worker_started_request_total``: requests that entered the engine.
- ``dynamo_worker_received_request_total``: requests that reached the admission gate,
  whatever became of them (the gate's certain refusal comes before the input is checked, so a
  refused request counts whatever its input; one with invalid input that would not have been
  refused never reaches the gate).
- ``dynamo_worker_queue_cancelled_total``: queued requests withdrawn before they started (the
  client left or the frontend's connection dropped). With the counters above, at every scrape:
  received = started + rejection + draining rejection + queue cancelled + ``dynamo_request_queue``.
- ``dynamo_worker_connection_errors_total``: connections a peer broke (counted by the servers).
- ``dynamo_worker_unauthorized_total``: websocket handshakes refused with 401 (no or a wrong
  bearer token, with ``DYN_WORKER_TOKEN`` set).
- ``dynamo_worker_tls_handshake_failures_total``: TLS handshakes that failed or timed out, on the
  websocket port and the system port.
- ``dynamo_worker_event_subscribers`` (gauge) and ``dynamo_worker_event_subscribers_refused_total``:
  event-plane connections served now, and handshakes refused at a bound with no place to take
  (worker_ingress/_subscriber_places.py).

Admission classes (priorities, tenants, the waiting limit W):

- Dynamo 1.7's seven families, every series present from start-up:
  ``dynamo_backend_admission_engine_request_count``, ``..._engine_wait_count``,
  ``..._request_queue_count`` (gauges: running, waiting for a first output, queued),
  ``..._request_receive_total``, ``..._request_admit_total{source="direct"|"queue"}``,
  ``..._rejection_total`` (every rejection, draining included), ``..._cancellation_total``
  (withdrawn while queued). At every scrape: receive = admit(direct) + admit(queue) + rejection
  + cancellation + queue count.
- ``dynamo_engine_request_waiting`` and ``dynamo_engine_request_waiting_limit`` (W, 10000 unset).
- ``dynamo_rejection_request_by_reason_total{reason}``: ``dynamo_rejection_request_total`` split
  into ``queue_full``, ``displaced``, ``queue_timeout``, ``slo`` (all four always present).
- ``dynamo_request_queue_by_priority{priority}``: queued requests by priority; the first 16
  priorities seen at a scrape keep their label for the life of the process (a label that comes
  and goes would break rate() and graphs), the rest are summed under ``priority="other"``.
- ``dynamo_tenant_service_tokens_total{tenant}`` and ``dynamo_tenant_requests_total{tenant,
  outcome}`` (``admitted``, ``rejected``, ``cancelled``): from the gate's bounded ledger
  (``--tenant-metrics-limit`` tenants by name, the rest under ``tenant="other"``).

Prefix caching, by ``dp_rank``, from an engine that offers ``prefix_cache_stats()`` (the mocker
with its cache on; worker_ingress/engines/_cache_stats.py):

- ``dynamo_worker_prefix_cache_queried_tokens_total`` and
  ``dynamo_worker_prefix_cache_hit_tokens_total`` (counters): prompt tokens looked up in the
  cache, and of those found there.
- ``dynamo_component_kv_cache_hit_rate`` (gauge, 0-1): hit over queried tokens in the last minute
  (0 when nothing was looked up).

SLO-aware admission (a time-to-first-token objective):

- ``dynamo_engine_request_limit_effective`` (gauge): L, the engine limit in force now (N unless a
  TTFT objective lowered it); with an objective also ``dynamo_worker_slo_ttft_objective_seconds``,
  ``dynamo_worker_slo_ttft_p90_seconds``, ``dynamo_worker_slo_engine_ttft_p90_seconds`` and
  ``dynamo_worker_slo_queue_bound`` (the controller's last window, worker_ingress/_slo.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shim_common._status import render_registry
from worker_ingress._admission import REJECTION_KINDS, AdmissionGate
from worker_ingress._config import UNLIMITED_ENGINE_SLOTS
from worker_ingress.engines._cache_stats import PrefixCacheStats

__all__ = ["KvBlocks", "PrefixCacheSource", "WorkerMetrics"]

#: Returns ``(total_blocks, used_blocks)`` of the engine's KV cache, summed over its ranks.
KvBlocks = Callable[[], tuple[int, int]]
#: Returns what each rank's prefix cache found (the engine's ``prefix_cache_stats``).
PrefixCacheSource = Callable[[], list[PrefixCacheStats]]


#: Priorities labelled by name in ``dynamo_request_queue_by_priority``; the rest are ``other``.
PRIORITY_LABELS = 16


def _no_kv_blocks() -> tuple[int, int]:
    return (0, 0)


def _no_prefix_cache() -> list[PrefixCacheStats]:
    return []


class _GateCollector(Collector):
    """Samples of the gate and the KV cache, computed when the registry is collected."""

    def __init__(
        self, gate: AdmissionGate, kv_blocks: KvBlocks, prefix_cache: PrefixCacheSource
    ) -> None:
        self._gate = gate
        self._kv_blocks = kv_blocks
        self._prefix_cache = prefix_cache
        #: Bumped by :meth:`WorkerMetrics.count_connection_error`.
        self.connection_errors = 0
        #: Bumped by :meth:`WorkerMetrics.count_unauthorized`.
        self.unauthorized = 0
        #: Bumped by :meth:`WorkerMetrics.count_tls_failure`.
        self.tls_failures = 0
        #: Set by :meth:`WorkerMetrics.set_event_subscribers`.
        self.event_subscribers = 0
        #: Bumped by :meth:`WorkerMetrics.count_subscriber_refused`.
        self.subscribers_refused = 0
        #: Priorities that have a label of their own (first seen first), at most 16.
        self._priority_labels: dict[int, None] = {}

    def describe(self) -> Iterable[Metric]:
        # Names only: lets the registry check for duplicates without calling kv_blocks() early.
        return [
            *self._families(running=0, queued=0, total_blocks=0, used_blocks=0),
            *_prefix_cache_families([]),
        ]

    def collect(self) -> Iterable[Metric]:
        gate = self._gate
        total_blocks, used_blocks = self._kv_blocks()
        return [
            *self._families(
                running=gate.running,
                queued=gate.queued,
                total_blocks=total_blocks,
                used_blocks=used_blocks,
            ),
            *_prefix_cache_families(self._prefix_cache()),
        ]

    def _slo_families(self) -> list[Metric]:
        # Only with a TTFT objective: what the controller last measured and the bound it set.
        slo = self._gate.slo
        if slo is None:
            return []
        return [
            GaugeMetricFamily(
                "dynamo_worker_slo_ttft_objective_seconds",
                "The time-to-first-token objective S.",
                value=slo.objective,
            ),
            GaugeMetricFamily(
                "dynamo_worker_slo_ttft_p90_seconds",
                "90th percentile of arrival-to-first-output time over the controller's last "
                "window (NaN before the first).",
                value=slo.ttft_p90,
            ),
            GaugeMetricFamily(
                "dynamo_worker_slo_engine_ttft_p90_seconds",
                "90th percentile of start-to-first-output time in the engine over the "
                "controller's last window, the signal L follows (NaN before the first).",
                value=slo.engine_ttft_p90,
            ),
            GaugeMetricFamily(
                "dynamo_worker_slo_queue_bound",
                "Queued requests ahead of which an arrival is refused early (2^31-1: no bound "
                "yet).",
                value=slo.queue_bound,
            ),
        ]

    def _families(
        self, *, running: int, queued: int, total_blocks: int, used_blocks: int
    ) -> list[Metric]:
        state = self._gate.state
        return [
            CounterMetricFamily(
                "dynamo_rejection_request",
                "Requests rejected: queue full, displaced, queue timeouts and objective refusals"
                " (draining excluded).",
                value=state.rejected_total,
            ),
            GaugeMetricFamily(
                "dynamo_engine_request", "Requests running in the engine now.", value=running
            ),
            GaugeMetricFamily(
                "dynamo_request_queue",
                "Requests waiting in the ingress now, the one held by the dispatcher included.",
                value=queued,
            ),
            GaugeMetricFamily(
                "dynamo_engine_request_limit",
                "Requests that may run in the engine at once (N in force).",
                value=state.engine_slots,
            ),
            GaugeMetricFamily(
                "dynamo_request_queue_limit",
                "Requests that may wait in the ingress (Q in force).",
                value=state.queue_limit,
            ),
            GaugeMetricFamily(
                "dynamo_engine_request_limit_effective",
                "Requests that may run in the engine at once now (L: N unless a TTFT objective "
                "lowered it).",
                value=state.slot_limit,
            ),
            *self._slo_families(),
            GaugeMetricFamily(
                "dynamo_component_total_blocks",
                "KV cache blocks of the engine.",
                value=total_blocks,
            ),
            GaugeMetricFamily(
                "dynamo_component_kv_used_blocks",
                "KV cache blocks in use.",
                value=used_blocks,
            ),
            CounterMetricFamily(
                "dynamo_worker_queue_timeout",
                "Requests rejected because they waited in the queue longer than the timeout.",
                value=state.timed_out_total,
            ),
            CounterMetricFamily(
                "dynamo_worker_draining_rejection",
                "Requests turned away because the worker is draining.",
                value=state.draining_rejected_total,
            ),
            CounterMetricFamily(
                "dynamo_worker_started_request",
                "Requests that entered the engine.",
                value=state.started_total,
            ),
            CounterMetricFamily(
                "dynamo_worker_received_request",
                "Requests that reached the admission gate, whatever became of them.",
                value=state.received_total,
            ),
            CounterMetricFamily(
                "dynamo_worker_queue_cancelled",
                "Queued requests withdrawn before they started (the client left).",
                value=state.cancelled_queued_total,
            ),
            CounterMetricFamily(
                "dynamo_worker_connection_errors",
                "Connections a peer broke (protocol error, reset, bad message).",
                value=self.connection_errors,
            ),
            CounterMetricFamily(
                "dynamo_worker_unauthorized",
                "Websocket handshakes refused with 401: no bearer token, or a wrong one.",
                value=self.unauthorized,
            ),
            CounterMetricFamily(
                "dynamo_worker_tls_handshake_failures",
                "TLS handshakes that failed or timed out (websocket and system ports).",
                value=self.tls_failures,
            ),
            GaugeMetricFamily(
                "dynamo_worker_event_subscribers",
                "Event-plane connections served now.",
                value=self.event_subscribers,
            ),
            CounterMetricFamily(
                "dynamo_worker_event_subscribers_refused",
                "Event-plane handshakes refused at the subscriber cap, no place to take.",
                value=self.subscribers_refused,
            ),
            *self._class_families(running, queued),
        ]

    def _class_families(self, running: int, queued: int) -> list[Metric]:
        state = self._gate.state
        admit = CounterMetricFamily(
            "dynamo_backend_admission_request_admit",
            "Requests admitted into the engine, at once (direct) or from the queue.",
            labels=["source"],
        )
        admit.add_metric(["direct"], state.admitted_direct_total)
        admit.add_metric(["queue"], state.admitted_queue_total)
        by_reason = CounterMetricFamily(
            "dynamo_rejection_request_by_reason",
            "Rejections of dynamo_rejection_request_total by reason.",
            labels=["reason"],
        )
        kinds = state.rejected_by_kind()
        for kind in REJECTION_KINDS:
            by_reason.add_metric([kind], kinds[kind])
        by_priority = GaugeMetricFamily(
            "dynamo_request_queue_by_priority",
            "Requests waiting in the ingress by priority (lower is served first).",
            labels=["priority"],
        )
        labels = self._priority_labels
        counts = dict.fromkeys(labels, 0)
        other = 0
        for priority, count in state.queued_by_priority():
            if priority not in labels and len(labels) < PRIORITY_LABELS:
                labels[priority] = None
            if priority in labels:
                counts[priority] = count
            else:
                other += count
        for priority in sorted(counts):
            by_priority.add_metric([str(priority)], counts[priority])
        by_priority.add_metric(["other"], other)
        service = CounterMetricFamily(
            "dynamo_tenant_service_tokens",
            "Service each tenant got: prompt tokens plus two per generated token.",
            labels=["tenant"],
        )
        outcomes = CounterMetricFamily(
            "dynamo_tenant_requests",
            "Requests of each tenant by outcome (admitted, rejected, cancelled while queued).",
            labels=["tenant", "outcome"],
        )
        for tenant, account in state.ledger.items():
            service.add_metric([tenant], account.service_tokens)
            outcomes.add_metric([tenant, "admitted"], account.admitted)
            outcomes.add_metric([tenant, "rejected"], account.rejected)
            outcomes.add_metric([tenant, "cancelled"], account.cancelled)
        waiting_limit = state.waiting_limit
        return [
            GaugeMetricFamily(
                "dynamo_backend_admission_engine_request_count",
                "Requests admitted into the engine and not finished.",
                value=running,
            ),
            GaugeMetricFamily(
                "dynamo_backend_admission_engine_wait_count",
                "Requests in the engine that have not produced their first output.",
                value=state.waiting,
            ),
            GaugeMetricFamily(
                "dynamo_backend_admission_request_queue_count",
                "Requests waiting in the ingress, not yet in the engine.",
                value=queued,
            ),
            CounterMetricFamily(
                "dynamo_backend_admission_request_receive",
                "Requests that reached the admission gate.",
                value=state.received_total,
            ),
            admit,
            CounterMetricFamily(
                "dynamo_backend_admission_rejection",
                "Requests the gate turned away, for any reason (draining included).",
                value=state.rejected_total + state.draining_rejected_total,
            ),
            CounterMetricFamily(
                "dynamo_backend_admission_cancellation",
                "Requests withdrawn while queued.",
                value=state.cancelled_queued_total,
            ),
            GaugeMetricFamily(
                "dynamo_engine_request_waiting",
                "Requests in the engine before their first output.",
                value=state.waiting,
            ),
            GaugeMetricFamily(
                "dynamo_engine_request_waiting_limit",
                "Requests that may be in the engine before their first output (W in force).",
                # Unset, W is reported as N is when unset.
                value=UNLIMITED_ENGINE_SLOTS if waiting_limit is None else waiting_limit,
            ),
            by_reason,
            by_priority,
            service,
            outcomes,
        ]


def _prefix_cache_families(ranks: list[PrefixCacheStats]) -> list[Metric]:
    queried = CounterMetricFamily(
        "dynamo_worker_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache.",
        labels=["dp_rank"],
    )
    hit = CounterMetricFamily(
        "dynamo_worker_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache.",
        labels=["dp_rank"],
    )
    rate = GaugeMetricFamily(
        "dynamo_component_kv_cache_hit_rate",
        "Prompt tokens found in the prefix cache over those looked up, in the last minute.",
        labels=["dp_rank"],
    )
    for stats in ranks:
        label = [str(stats.dp_rank)]
        queried.add_metric(label, stats.queried_tokens)
        hit.add_metric(label, stats.hit_tokens)
        rate.add_metric(label, stats.hit_rate)
    return [queried, hit, rate]


class WorkerMetrics:
    """The metrics of one worker, in a registry of its own.

    Args:
        gate: The worker's admission gate (running, queued, limits, rejections).
        kv_blocks: Returns ``(total_blocks, used_blocks)`` of the engine's KV cache; called at
            each scrape. ``None``: both read 0.
        prefix_cache: Returns what each rank's prefix cache found; called at each scrape.
            ``None``: the prefix-cache families have no series.

    Attributes:
        registry: The registry to expose on ``/metrics``.
    """

    def __init__(
        self,
        gate: AdmissionGate,
        kv_blocks: KvBlocks | None = None,
        prefix_cache: PrefixCacheSource | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._collector = _GateCollector(
            gate, kv_blocks or _no_kv_blocks, prefix_cache or _no_prefix_cache
        )
        self.registry.register(self._collector)

    def count_connection_error(self) -> None:
        """Count one connection that a peer broke."""
        self._collector.connection_errors += 1

    def count_unauthorized(self) -> None:
        """Count one handshake refused for want of the right bearer token."""
        self._collector.unauthorized += 1

    def count_tls_failure(self, _error: BaseException | None = None) -> None:
        """Count one TLS handshake that failed or timed out."""
        self._collector.tls_failures += 1

    def set_event_subscribers(self, count: int) -> None:
        """Report how many event-plane connections are served now."""
        self._collector.event_subscribers = count

    def count_subscriber_refused(self) -> None:
        """Count one event-plane handshake refused at the subscriber cap."""
        self._collector.subscribers_refused += 1

    def render(self, accept_header: str | None) -> tuple[bytes, str]:
        """Encode every metric for a scrape, in the format the scraper asked for.

        Args:
            accept_header: The request's ``Accept`` header, or ``None`` when absent.

        Returns:
            The body and its ``Content-Type`` (Prometheus text 0.0.4 unless OpenMetrics is
            accepted; the type always matches the encoder that produced the body).
        """
        return render_registry(self.registry, accept_header)
