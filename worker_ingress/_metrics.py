"""The worker's Prometheus metrics, read from the admission gate and the engine at scrape time.

Requests pay nothing for metrics: the gate keeps plain integer counters (it must anyway), and a
custom collector turns them into samples only when ``/metrics`` is scraped. The connection-error
count is a plain integer too (no lock, no ``_created`` series: everything runs on the Trio thread).

Stable names (the first table of docs/metrics.md: dashboards and alerts rely on them, so never
change them; only add new ones):

- ``dynamo_rejection_request_total`` (counter): overload rejections plus queue timeouts.
- ``dynamo_engine_request`` (gauge): requests running in the engine.
- ``dynamo_request_queue`` (gauge): requests waiting, the dispatcher's hand included (peaks at Q).
- ``dynamo_engine_request_limit``, ``dynamo_request_queue_limit`` (gauges): N and Q in force
  (10000 and 40000 when N is unset).
- ``dynamo_component_total_blocks``, ``dynamo_component_kv_used_blocks`` (gauges): the KV cache.

Added here:

- ``dynamo_worker_queue_timeout_total``: of the rejections, the queue timeouts.
- ``dynamo_worker_draining_rejection_total``: arrivals turned away while draining (kept out of
  ``dynamo_rejection_request_total``: shutting down is not overload).
- ``dynamo_worker_started_request_total``: requests that entered the engine.
- ``dynamo_worker_received_request_total``: requests that reached the admission gate (valid
  input), whatever became of them.
- ``dynamo_worker_queue_cancelled_total``: queued requests withdrawn before they started (the
  client left or the frontend's connection dropped). With the counters above, at every scrape:
  received = started + rejection + draining rejection + queue cancelled + ``dynamo_request_queue``.
- ``dynamo_worker_connection_errors_total``: connections a peer broke (counted by the servers).
- ``dynamo_worker_unauthorized_total``: websocket handshakes refused with 401 (no or a wrong
  bearer token, with ``DYN_WORKER_TOKEN`` set).
- ``dynamo_worker_tls_handshake_failures_total``: TLS handshakes that failed or timed out, on the
  websocket port and the system port.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shim_common._status import render_registry
from worker_ingress._admission import AdmissionGate

__all__ = ["KvBlocks", "WorkerMetrics"]

#: Returns ``(total_blocks, used_blocks)`` of the engine's KV cache, summed over its ranks.
KvBlocks = Callable[[], tuple[int, int]]


def _no_kv_blocks() -> tuple[int, int]:
    return (0, 0)


class _GateCollector(Collector):
    """Samples of the gate and the KV cache, computed when the registry is collected."""

    def __init__(self, gate: AdmissionGate, kv_blocks: KvBlocks) -> None:
        self._gate = gate
        self._kv_blocks = kv_blocks
        #: Bumped by :meth:`WorkerMetrics.count_connection_error`.
        self.connection_errors = 0
        #: Bumped by :meth:`WorkerMetrics.count_unauthorized`.
        self.unauthorized = 0
        #: Bumped by :meth:`WorkerMetrics.count_tls_failure`.
        self.tls_failures = 0

    def describe(self) -> Iterable[Metric]:
        # Names only: lets the registry check for duplicates without calling kv_blocks() early.
        return self._families(running=0, queued=0, total_blocks=0, used_blocks=0)

    def collect(self) -> Iterable[Metric]:
        gate = self._gate
        total_blocks, used_blocks = self._kv_blocks()
        return self._families(
            running=gate.running,
            queued=gate.queued,
            total_blocks=total_blocks,
            used_blocks=used_blocks,
        )

    def _families(
        self, *, running: int, queued: int, total_blocks: int, used_blocks: int
    ) -> list[Metric]:
        state = self._gate.state
        return [
            CounterMetricFamily(
                "dynamo_rejection_request",
                "Requests rejected because engine and queue were full, queue timeouts included.",
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
        ]


class WorkerMetrics:
    """The metrics of one worker, in a registry of its own.

    Args:
        gate: The worker's admission gate (running, queued, limits, rejections).
        kv_blocks: Returns ``(total_blocks, used_blocks)`` of the engine's KV cache; called at
            each scrape. ``None``: both read 0.

    Attributes:
        registry: The registry to expose on ``/metrics``.
    """

    def __init__(self, gate: AdmissionGate, kv_blocks: KvBlocks | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._collector = _GateCollector(gate, kv_blocks or _no_kv_blocks)
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

    def render(self, accept_header: str | None) -> tuple[bytes, str]:
        """Encode every metric for a scrape, in the format the scraper asked for.

        Args:
            accept_header: The request's ``Accept`` header, or ``None`` when absent.

        Returns:
            The body and its ``Content-Type`` (Prometheus text 0.0.4 unless OpenMetrics is
            accepted; the type always matches the encoder that produced the body).
        """
        return render_registry(self.registry, accept_header)
