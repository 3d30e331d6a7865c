"""Reading an upstream's Prometheus ``/metrics`` page (sans-IO)."""

from __future__ import annotations

import pytest

from worker_ingress.engines.upstream._metrics import parse_metrics_text

VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="573"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="573"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_parse_vllm_metrics() -> None:
    facts = parse_metrics_text(VLLM_METRICS)
    assert (facts.kv_total_blocks, facts.block_size) == (1146, 16)
    assert facts.usage_gauge == "vllm:kv_cache_usage_perc"
    assert facts.kv_usage == pytest.approx(0.5)


def test_parse_metrics_reads_escaped_labels_and_skips_broken_lines() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} oops\n'  # not a wanted name: never parsed
        'vllm:cache_config_info{note="a\\"b\\nc",block_size="32",num_gpu_blocks="10"} 1.0\n'
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="5" 1.0\n'  # broken: skipped
        "sglang:token_usage 0.5\n"
        "vllm:gpu_cache_usage_perc 0.25\n"  # preferred to SGLang's gauge, wherever it stands
    )
    facts = parse_metrics_text(text)
    assert (facts.kv_total_blocks, facts.block_size) == (10, 32)
    assert (facts.usage_gauge, facts.kv_usage) == ("vllm:gpu_cache_usage_perc", 0.25)
