"""Reading an upstream's Prometheus ``/metrics`` (sans-IO).

vLLM announces its KV cache shape there (``vllm:cache_config_info``), and vLLM, SGLang and
llama.cpp expose a KV usage gauge that the engine polls; :func:`parse_metrics_text` picks both out.
"""

from __future__ import annotations

import math
from typing import Final

from worker_ingress.engines._upstream_probes import UpstreamFacts, positive_int

__all__ = ["USAGE_GAUGES", "parse_metrics_text"]

USAGE_GAUGES: Final = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "llamacpp:kv_cache_usage_ratio",
)
_CACHE_CONFIG_INFO: Final = "vllm:cache_config_info"


def _parse_labels(text: str) -> dict[str, str]:
    """Prometheus label set without the braces; tolerant of escapes, strict on nothing."""
    labels: dict[str, str] = {}
    index = 0
    while index < len(text):
        equals = text.find("=", index)
        if equals < 0 or equals + 1 >= len(text) or text[equals + 1] != '"':
            break
        name = text[index:equals].strip().lstrip(",").strip()
        cursor = equals + 2
        value_chars: list[str] = []
        while cursor < len(text) and text[cursor] != '"':
            if text[cursor] == "\\" and cursor + 1 < len(text):
                cursor += 1
            value_chars.append(text[cursor])
            cursor += 1
        labels[name] = "".join(value_chars)
        index = cursor + 1
    return labels


def parse_metrics_text(text: str) -> UpstreamFacts:
    """Pick what we use out of a Prometheus text exposition.

    Only lines that start with a known name are looked at, so a large ``/metrics`` page (vLLM's
    has many histograms) costs one ``startswith`` per line.

    Args:
        text: The body of ``GET /metrics``.

    Returns:
        The cache shape (vLLM) and the KV usage gauge, when present. Several samples of a usage
        gauge (one per data-parallel engine) are averaged.
    """
    facts = UpstreamFacts()
    usage_samples: list[float] = []
    total_blocks = 0
    for line in text.splitlines():
        if not line.startswith((_CACHE_CONFIG_INFO, *USAGE_GAUGES)):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        labels: dict[str, str] = {}
        rest = line[name_end:]
        if rest.startswith("{"):
            close = rest.rfind("}")
            if close < 0:
                continue
            labels = _parse_labels(rest[1:close])
            rest = rest[close + 1 :]
        fields = rest.split()
        if not fields:
            continue
        if name == _CACHE_CONFIG_INFO:
            blocks = positive_int(labels.get("num_gpu_blocks"))
            block_size = positive_int(labels.get("block_size"))
            if blocks is not None:
                total_blocks += blocks
            if block_size is not None:
                facts.block_size = block_size
        elif name in USAGE_GAUGES:
            if facts.usage_gauge not in (None, name):
                continue  # first gauge name found wins; never mix two engines' notions
            try:
                value = float(fields[0])
            except ValueError:
                continue
            if math.isfinite(value):
                facts.usage_gauge = name
                usage_samples.append(value)
    if total_blocks:
        facts.kv_total_blocks = total_blocks
    if usage_samples:
        facts.kv_usage = min(1.0, max(0.0, sum(usage_samples) / len(usage_samples)))
    return facts
