"""Reading an upstream's Prometheus ``/metrics`` (sans-IO).

vLLM announces its KV cache shape there (``vllm:cache_config_info``), and vLLM and SGLang expose a
KV usage gauge that the engine polls (llama.cpp has none: its load comes from ``/slots``);
:func:`parse_metrics_text` picks both out.

The text format is parsed by ``prometheus_client``'s parser (label escapes and all). An engine's
page is long (vLLM's has many histograms, one sample line per bucket) and only a handful of its
lines matter here, so lines are first filtered by name with one ``startswith`` each. Measured with
``bench/bench_upstream_metrics.py`` on a vLLM-shaped page of 600 lines (one engine), a poll costs
0.4 ms with the filter and 40 ms without it, which at one poll a second would be 4% of a core.
Each kept line is parsed on its own, so a malformed line costs only itself.
"""

from __future__ import annotations

import math
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

from worker_ingress.engines.upstream._probes import UpstreamFacts, positive_int

__all__ = [
    "CACHE_CONFIG_INFO",
    "USAGE_GAUGES",
    "WANTED",
    "Sample",
    "facts_of_samples",
    "parse_metrics_text",
]

#: KV usage gauges, a fraction in [0, 1], in order of preference.
USAGE_GAUGES: Final = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
)
#: vLLM's cache shape: labels ``num_gpu_blocks`` and ``block_size``, one sample per engine.
CACHE_CONFIG_INFO: Final = "vllm:cache_config_info"
#: Every metric name read (a line is kept when it starts with one of them).
WANTED: Final = (CACHE_CONFIG_INFO, *USAGE_GAUGES)


#: One sample: metric name, labels, value.
Sample = tuple[str, dict[str, str], float]


def _wanted_samples(text: str) -> list[Sample]:
    samples: list[Sample] = []
    for line in text.splitlines():
        if not line.startswith(WANTED):
            continue
        try:
            families = list(text_string_to_metric_families(line))
        except ValueError:
            continue  # one broken line of an otherwise good page
        samples.extend(
            (sample.name, sample.labels, sample.value)
            for family in families
            for sample in family.samples
        )
    return samples


def parse_metrics_text(text: str) -> UpstreamFacts:
    """Pick what we use out of a Prometheus text exposition.

    Args:
        text: The body of ``GET /metrics``.

    Returns:
        The cache shape (vLLM: blocks summed over data-parallel engines) and the KV usage gauge,
        when present. Several samples of a usage gauge (one per data-parallel engine) are
        averaged; when a page has two usage gauges, the first of :data:`USAGE_GAUGES` wins.
    """
    return facts_of_samples(_wanted_samples(text))


def facts_of_samples(samples: list[Sample]) -> UpstreamFacts:
    """What :func:`parse_metrics_text` returns, from samples already parsed.

    Args:
        samples: Samples of a page; names not in :data:`WANTED` are ignored.

    Returns:
        The facts.
    """
    facts = UpstreamFacts()
    total_blocks = 0
    usage: dict[str, list[float]] = {}
    for name, labels, value in samples:
        if name == CACHE_CONFIG_INFO:
            blocks = positive_int(labels.get("num_gpu_blocks"))
            block_size = positive_int(labels.get("block_size"))
            if blocks is not None:
                total_blocks += blocks
            if block_size is not None:
                facts.block_size = block_size
        elif name in USAGE_GAUGES and math.isfinite(value):
            usage.setdefault(name, []).append(value)
    if total_blocks:
        facts.kv_total_blocks = total_blocks
    for gauge in USAGE_GAUGES:
        values = usage.get(gauge)
        if values:
            facts.usage_gauge = gauge
            facts.kv_usage = min(1.0, max(0.0, sum(values) / len(values)))
            break
    return facts
