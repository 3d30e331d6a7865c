"""Cost of reading an engine's ``/metrics`` page: the openai engine's parser, with and without
its line prefilter.

The page is built with ``prometheus_client`` to look like vLLM's (v1 engine): its request gauges
and token counters, its fourteen histograms with their buckets, the cache config info, the HTTP
server's histograms per route and the Python process collectors; ``--engines`` repeats the engine
series per data-parallel engine, as vLLM does.

Usage::

    python bench/bench_upstream_metrics.py                # 1 engine, 200 rounds
    python bench/bench_upstream_metrics.py --engines 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from worker_ingress.engines.upstream._metrics import facts_of_samples, parse_metrics_text
from worker_ingress.engines.upstream._probes import UpstreamFacts

TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_HISTOGRAMS = (
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
    "request_max_num_generation_tokens",
    "request_params_n",
    "request_params_max_tokens",
)
LATENCY_HISTOGRAMS = (
    "time_to_first_token_seconds",
    "time_per_output_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_inference_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics", "/health")


def vllm_like_page(engines: int = 1, model: str = "meta-llama/Llama-3.1-8B-Instruct") -> str:
    """A Prometheus text page shaped like vLLM's ``/metrics``, with observations in every series."""
    registry = CollectorRegistry(auto_describe=True)
    labels = ("model_name", "engine")
    gauges = {
        name: Gauge(f"vllm:{name}", name, labels, registry=registry)
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    }
    counters = {
        name: Counter(f"vllm:{name}", name, labels, registry=registry)
        for name in (
            "num_preemptions",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "prompt_tokens",
            "generation_tokens",
        )
    }
    success = Counter(
        "vllm:request_success", "finished", (*labels, "finished_reason"), registry=registry
    )
    histograms = [
        Histogram(f"vllm:{name}", name, labels, buckets=TOKEN_BUCKETS, registry=registry)
        for name in TOKEN_HISTOGRAMS
    ] + [
        Histogram(f"vllm:{name}", name, labels, buckets=LATENCY_BUCKETS, registry=registry)
        for name in LATENCY_HISTOGRAMS
    ]
    info = Gauge(
        "vllm:cache_config_info",
        "cache config",
        ("block_size", "cache_dtype", "enable_prefix_caching", "engine", "num_gpu_blocks"),
        registry=registry,
    )
    for engine in range(engines):
        values = (model, str(engine))
        gauges["num_requests_running"].labels(*values).set(12)
        gauges["num_requests_waiting"].labels(*values).set(3)
        gauges["kv_cache_usage_perc"].labels(*values).set(0.25 + 0.1 * engine)
        for counter in counters.values():
            counter.labels(*values).inc(1234)
        for reason in ("stop", "length", "abort"):
            success.labels(*values, reason).inc(17)
        for histogram in histograms:
            histogram.labels(*values).observe(0.3)
        info.labels("16", "auto", "True", str(engine), "27000").set(1)
    http = Histogram(
        "http_request_duration_seconds", "latency", ("handler", "method"), registry=registry
    )
    http_highr = Histogram(
        "http_request_duration_highr_seconds", "latency", buckets=LATENCY_BUCKETS, registry=registry
    )
    http_total = Counter(
        "http_requests", "requests", ("handler", "method", "status"), registry=registry
    )
    for route in ROUTES:
        http.labels(route, "POST").observe(0.2)
        http_total.labels(route, "POST", "2xx").inc(99)
    http_highr.observe(0.2)
    text = generate_latest(registry).decode()
    # The default registry's process and GC collectors, as a real server exposes them.
    from prometheus_client import REGISTRY

    return text + generate_latest(REGISTRY).decode()


def parse_whole_page(text: str) -> UpstreamFacts:
    """The same reading without the prefilter: every line of the page through the parser."""
    return facts_of_samples(
        [
            (sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
    )


def median_seconds(function: object, text: str, rounds: int) -> float:
    assert callable(function)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        function(text)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    text = vllm_like_page(args.engines)
    assert parse_whole_page(text) == parse_metrics_text(text)
    lines = text.count("\n")
    print(f"page: {lines} lines, {len(text) / 1024:.0f} KiB, {args.engines} engine(s)")
    filtered = median_seconds(parse_metrics_text, text, args.rounds)
    whole = median_seconds(parse_whole_page, text, args.rounds)
    print(f"with prefilter:    {filtered * 1e3:8.3f} ms per page (median of {args.rounds})")
    print(f"without prefilter: {whole * 1e3:8.3f} ms per page ({whole / filtered:.0f}x)")


if __name__ == "__main__":
    main()
