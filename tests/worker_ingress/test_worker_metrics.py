"""Worker metrics: the stable names of docs/metrics.md and their values, read at scrape time."""

from __future__ import annotations

from contextlib import aclosing

import msgspec
import trio
import trio.testing

from shim_common.wire import RejectReason
from worker_ingress._admission import AdmissionGate, GateRefusal, Rejection
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress._metrics import WorkerMetrics
from worker_ingress.engines._cache_stats import CacheHitCounter, PrefixCacheStats
from worker_ingress.engines._mocker import MockerEngine

STABLE_NAMES = [
    "dynamo_rejection_request_total",
    "dynamo_engine_request",
    "dynamo_request_queue",
    "dynamo_engine_request_limit",
    "dynamo_request_queue_limit",
    "dynamo_component_total_blocks",
    "dynamo_component_kv_used_blocks",
]


def _sample(metrics: WorkerMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


def _gauges(metrics: WorkerMetrics) -> tuple[float | None, float | None, float | None]:
    return (
        _sample(metrics, "dynamo_engine_request"),
        _sample(metrics, "dynamo_request_queue"),
        _sample(metrics, "dynamo_rejection_request_total"),
    )


def test_every_stable_name_is_exposed_without_labels() -> None:
    metrics = WorkerMetrics(AdmissionGate(engine_slots=2, queue_limit=3))
    body, _ = metrics.render(None)
    lines = body.decode().splitlines()
    for name in STABLE_NAMES:
        assert f"{name} " in "\n".join(lines)
        assert _sample(metrics, name) is not None, name
    # The stable names carry no labels (the families of admission classes do).
    for line in lines:
        if line.split("{")[0].split(" ")[0] in STABLE_NAMES:
            assert "{" not in line, line


def test_limit_gauges_show_the_large_defaults_when_n_is_unset() -> None:
    gate = AdmissionGate.from_settings(WorkerSettings(worker_id="w"))
    metrics = WorkerMetrics(gate)
    assert _sample(metrics, "dynamo_engine_request_limit") == 10_000
    assert _sample(metrics, "dynamo_request_queue_limit") == 40_000


def test_limit_gauges_show_n_and_q_when_set() -> None:
    gate = AdmissionGate.from_settings(
        WorkerSettings(worker_id="w", engine_request_limit=4, request_queue_limit=7)
    )
    metrics = WorkerMetrics(gate)
    assert _sample(metrics, "dynamo_engine_request_limit") == 4
    assert _sample(metrics, "dynamo_request_queue_limit") == 7


async def test_gauges_follow_the_gate_and_the_queue_gauge_peaks_at_q(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2, queue_timeout=10.0)
    metrics = WorkerMetrics(gate)
    releases: list[trio.Event] = []
    outcomes: list[str] = []

    async def client() -> None:
        release = trio.Event()
        releases.append(release)
        try:
            async with gate.slot():
                await release.wait()
            outcomes.append("done")
        except Rejection as rejection:
            outcomes.append(rejection.reason)

    async def arrive() -> None:
        nursery.start_soon(client)
        await trio.testing.wait_all_tasks_blocked()

    assert _gauges(metrics) == (0, 0, 0)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await arrive()
            assert _gauges(metrics) == (1, 0, 0)
            await arrive()
            assert _gauges(metrics) == (1, 1, 0)  # the dispatcher's hand is counted
            await arrive()
            assert _gauges(metrics) == (1, 2, 0)  # peak: Q
            await arrive()
            assert _gauges(metrics) == (1, 2, 1)  # full: rejected at once
            assert outcomes == [RejectReason.OVERLOADED]
            releases[0].set()
            await trio.testing.wait_all_tasks_blocked()
            assert _gauges(metrics) == (1, 1, 1)
            await trio.sleep(11)  # the last queued request times out: a rejection too
            assert _gauges(metrics) == (1, 0, 2)
            assert _sample(metrics, "dynamo_worker_queue_timeout_total") == 1
            releases[1].set()
    assert _gauges(metrics) == (0, 0, 2)
    assert _sample(metrics, "dynamo_worker_started_request_total") == 2


async def test_draining_rejections_are_counted_apart() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2)
    metrics = WorkerMetrics(gate)
    gate.drain()
    for _ in range(3):
        try:
            async with gate.slot():
                raise AssertionError("admitted while draining")
        except Rejection:
            pass
    assert _sample(metrics, "dynamo_rejection_request_total") == 0
    assert _sample(metrics, "dynamo_worker_draining_rejection_total") == 3


def test_kv_blocks_are_read_at_scrape_time_only() -> None:
    calls: list[tuple[int, int]] = []
    blocks = (100, 0)

    def kv_blocks() -> tuple[int, int]:
        calls.append(blocks)
        return blocks

    metrics = WorkerMetrics(AdmissionGate(engine_slots=1, queue_limit=2), kv_blocks)
    assert calls == []
    assert _sample(metrics, "dynamo_component_total_blocks") == 100
    assert _sample(metrics, "dynamo_component_kv_used_blocks") == 0
    blocks = (100, 42)
    assert _sample(metrics, "dynamo_component_kv_used_blocks") == 42


def test_kv_blocks_default_to_zero() -> None:
    metrics = WorkerMetrics(AdmissionGate(engine_slots=1, queue_limit=2))
    assert _sample(metrics, "dynamo_component_total_blocks") == 0
    assert _sample(metrics, "dynamo_component_kv_used_blocks") == 0


def test_connection_errors_are_counted() -> None:
    metrics = WorkerMetrics(AdmissionGate(engine_slots=1, queue_limit=2))
    assert _sample(metrics, "dynamo_worker_connection_errors_total") == 0
    metrics.count_connection_error()
    metrics.count_connection_error()
    assert _sample(metrics, "dynamo_worker_connection_errors_total") == 2


def test_two_workers_in_one_process_do_not_share_metrics() -> None:
    first = WorkerMetrics(AdmissionGate(engine_slots=1, queue_limit=2))
    second = WorkerMetrics(AdmissionGate(engine_slots=5, queue_limit=9))
    first.count_connection_error()
    assert _sample(second, "dynamo_worker_connection_errors_total") == 0
    assert _sample(first, "dynamo_engine_request_limit") == 1
    assert _sample(second, "dynamo_engine_request_limit") == 5


async def test_render_text_format_shows_the_values() -> None:
    gate = AdmissionGate(engine_slots=3, queue_limit=4)
    metrics = WorkerMetrics(gate, lambda: (512, 64))
    with trio.fail_after(5):
        async with gate.slot():
            body, content_type = metrics.render(None)
    assert content_type.startswith("text/plain; version=0.0.4")
    text = body.decode()
    assert "# TYPE dynamo_rejection_request_total counter" in text
    assert "# TYPE dynamo_request_queue gauge" in text
    for line in (
        "dynamo_engine_request 1.0",
        "dynamo_request_queue 0.0",
        "dynamo_engine_request_limit 3.0",
        "dynamo_request_queue_limit 4.0",
        "dynamo_component_total_blocks 512.0",
        "dynamo_component_kv_used_blocks 64.0",
        "dynamo_rejection_request_total 0.0",
    ):
        assert line in text.splitlines(), line


def test_render_openmetrics_when_asked_and_the_type_matches_the_body() -> None:
    metrics = WorkerMetrics(AdmissionGate(engine_slots=1, queue_limit=2))
    body, content_type = metrics.render(
        "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    )
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert text.endswith("# EOF\n")
    assert "# TYPE dynamo_rejection_request counter" in text
    assert "dynamo_rejection_request_total 0.0" in text.splitlines()
    # An Accept header that does not ask for OpenMetrics gets the classic text format.
    body, content_type = metrics.render("text/plain")
    assert content_type.startswith("text/plain; version=0.0.4")
    assert not body.decode().endswith("# EOF\n")


DYNAMO_1_7_FAMILIES = {
    "dynamo_backend_admission_engine_request_count": None,
    "dynamo_backend_admission_engine_wait_count": None,
    "dynamo_backend_admission_request_queue_count": None,
    "dynamo_backend_admission_request_receive_total": None,
    "dynamo_backend_admission_request_admit_total": {"source": "direct"},
    "dynamo_backend_admission_rejection_total": None,
    "dynamo_backend_admission_cancellation_total": None,
}


def _dynamo_sample(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    assert value is not None, (name, labels)
    return value


def _invariant_holds(metrics: WorkerMetrics) -> None:
    received = _dynamo_sample(metrics, "dynamo_backend_admission_request_receive_total")
    assert received == (
        _dynamo_sample(metrics, "dynamo_backend_admission_request_admit_total", source="direct")
        + _dynamo_sample(metrics, "dynamo_backend_admission_request_admit_total", source="queue")
        + _dynamo_sample(metrics, "dynamo_backend_admission_rejection_total")
        + _dynamo_sample(metrics, "dynamo_backend_admission_cancellation_total")
        + _dynamo_sample(metrics, "dynamo_backend_admission_request_queue_count")
    )


def test_dynamo_1_7_families_and_reasons_are_present_at_zero_from_start_up() -> None:
    metrics = WorkerMetrics(AdmissionGate(engine_slots=2, queue_limit=3, waiting_limit=1))
    for name, labels in DYNAMO_1_7_FAMILIES.items():
        assert _dynamo_sample(metrics, name, **(labels or {})) == 0
    assert (
        _dynamo_sample(metrics, "dynamo_backend_admission_request_admit_total", source="queue") == 0
    )
    for reason in ("queue_full", "displaced", "queue_timeout", "slo"):
        assert (
            _dynamo_sample(metrics, "dynamo_rejection_request_by_reason_total", reason=reason) == 0
        )
    assert _dynamo_sample(metrics, "dynamo_engine_request_waiting") == 0
    assert _dynamo_sample(metrics, "dynamo_engine_request_waiting_limit") == 1
    assert _dynamo_sample(metrics, "dynamo_request_queue_by_priority", priority="other") == 0
    _invariant_holds(metrics)


def test_the_invariant_holds_through_admissions_displacements_and_cancels() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=2, waiting_limit=1)
    metrics = WorkerMetrics(gate)
    state = gate.state
    running = state.arrive(5, "batch", 10, now=0.0)
    queued = [state.arrive(5, "batch", 10, now=0.0), state.arrive(5, "batch", 10, now=0.0)]
    state.arrive(0, "user", 3, now=0.0)  # displaces the newest batch request
    state.arrive(9, "late", 3, now=0.0)  # nothing to displace: queue_full
    _invariant_holds(metrics)
    assert (
        _dynamo_sample(metrics, "dynamo_rejection_request_by_reason_total", reason="displaced") == 1
    )
    assert (
        _dynamo_sample(metrics, "dynamo_rejection_request_by_reason_total", reason="queue_full")
        == 1
    )
    assert _dynamo_sample(metrics, "dynamo_request_queue_by_priority", priority="0") == 1
    assert _dynamo_sample(metrics, "dynamo_request_queue_by_priority", priority="5") == 1
    assert _dynamo_sample(metrics, "dynamo_engine_request_waiting") == 1
    assert not isinstance(running, GateRefusal)
    state.charge(running, 4)
    state.first_output(running, now=0.0)  # W frees, but the slot is still taken
    assert _dynamo_sample(metrics, "dynamo_engine_request_waiting") == 0
    first = queued[0]
    assert not isinstance(first, GateRefusal)
    state.cancel(first, now=0.0)
    _invariant_holds(metrics)
    assert _dynamo_sample(metrics, "dynamo_backend_admission_cancellation_total") == 1
    assert _dynamo_sample(metrics, "dynamo_tenant_service_tokens_total", tenant="batch") == 18
    assert (
        _dynamo_sample(metrics, "dynamo_tenant_requests_total", tenant="batch", outcome="rejected")
        == 1
    )
    assert (
        _dynamo_sample(metrics, "dynamo_tenant_requests_total", tenant="late", outcome="rejected")
        == 1
    )


def test_priorities_beyond_sixteen_are_summed_under_other() -> None:
    gate = AdmissionGate(engine_slots=1, queue_limit=40)
    metrics = WorkerMetrics(gate)
    gate.state.arrive(0, "", 1, now=0.0)
    for priority in range(20):
        gate.state.arrive(priority, "", 1, now=0.0)
    assert _dynamo_sample(metrics, "dynamo_request_queue_by_priority", priority="other") == 4
    body, _ = metrics.render(None)
    labels = [
        line
        for line in body.decode().splitlines()
        if line.startswith("dynamo_request_queue_by_priority{")
    ]
    assert len(labels) == 17


def test_the_hit_counter_rates_the_last_minute_only() -> None:
    counter = CacheHitCounter(2, window=60.0)
    counter.count(0, 100, 40, now=10.0)
    counter.count(1, 10, 0, now=10.5)
    counter.count(0, 100, 60, now=50.0)
    assert counter.stats(now=60.0) == [
        PrefixCacheStats(dp_rank=0, queried_tokens=200, hit_tokens=100, hit_rate=0.5),
        PrefixCacheStats(dp_rank=1, queried_tokens=10, hit_tokens=0, hit_rate=0.0),
    ]
    # A minute after the first request only the second counts; the totals keep everything.
    assert counter.stats(now=100.0)[0] == PrefixCacheStats(
        dp_rank=0, queried_tokens=200, hit_tokens=100, hit_rate=0.6
    )
    assert counter.stats(now=200.0)[0].hit_rate == 0.0


async def test_the_mocker_reports_prefix_cache_hits_by_rank(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = MockerEngine(
        MockerSettings(num_gpu_blocks=64, block_size=2, data_parallel_size=2, speedup_ratio=10.0)
    )
    metrics = WorkerMetrics(
        AdmissionGate(engine_slots=2, queue_limit=3), None, engine.prefix_cache_stats
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        with trio.fail_after(60):
            for _ in range(2):
                request = engine.prepare("completions", {"prompt": "a b c d e", "max_tokens": 1})
                request = msgspec.structs.replace(request, dp_rank=1)
                async with aclosing(engine.generate(request)) as stream:
                    async for _output in stream:
                        pass
        nursery.cancel_scope.cancel()
    labels = {"dp_rank": "1"}
    get = metrics.registry.get_sample_value
    assert get("dynamo_worker_prefix_cache_queried_tokens_total", labels) == 10
    assert get("dynamo_worker_prefix_cache_hit_tokens_total", labels) == 4
    assert get("dynamo_component_kv_cache_hit_rate", labels) == 0.4
    assert get("dynamo_worker_prefix_cache_queried_tokens_total", {"dp_rank": "0"}) == 0
    assert get("dynamo_component_kv_cache_hit_rate", {"dp_rank": "0"}) == 0.0


def test_without_a_prefix_cache_the_families_have_no_series() -> None:
    metrics = WorkerMetrics(AdmissionGate(engine_slots=2, queue_limit=3))
    body, _ = metrics.render(None)
    assert "dynamo_worker_prefix_cache_hit_tokens_total{" not in body.decode()
