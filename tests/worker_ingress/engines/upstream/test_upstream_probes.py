"""What an upstream says about itself: llama.cpp's ``/props`` and ``/slots``, SGLang's
``/get_server_info`` (sans-IO parsers)."""

from __future__ import annotations

from worker_ingress.engines.upstream._metrics import parse_metrics_text
from worker_ingress.engines.upstream._probes import (
    SlotsReading,
    parse_llamacpp_props,
    parse_llamacpp_slots,
    parse_sglang_server_info,
)


def test_parse_llamacpp_props_and_slots() -> None:
    # llama.cpp's /metrics has request counts but no KV usage gauge.
    facts = parse_metrics_text("llamacpp:requests_processing 1\nllamacpp:n_tokens_max 72\n")
    assert (facts.usage_gauge, facts.kv_usage, facts.kv_total_blocks) == (None, None, None)
    slots = [
        {"id": 0, "n_ctx": 1024, "is_processing": True, "n_prompt_tokens": 447},
        {"id": 1, "n_ctx": 1024, "is_processing": False, "n_prompt_tokens": 913},  # cache only
        {"id": 2, "is_processing": True, "next_token": [{"n_decoded": 5}]},  # an older version
    ]
    assert parse_llamacpp_slots(slots) == SlotsReading(processing=2, tokens=452)
    assert parse_llamacpp_slots([]) is None
    assert parse_llamacpp_slots({"error": "slots endpoint disabled"}) is None
    assert parse_llamacpp_slots([{"id": 0}]) is None
    props = {"total_slots": 4, "default_generation_settings": {"n_ctx": 4096}}
    facts = parse_llamacpp_props(props, block_size=16)
    assert (facts.kv_total_blocks, facts.max_num_seqs) == (1024, 4)
    assert parse_llamacpp_props({"total_slots": 4}, 16).kv_total_blocks is None


def test_parse_sglang_server_info() -> None:
    info = {
        "max_total_num_tokens": 100_000,
        "page_size": 1,
        "max_running_requests": 128,
        "chunked_prefill_size": 8192,
        "dp_size": 2,
    }
    facts = parse_sglang_server_info(info)
    assert (facts.kv_total_blocks, facts.block_size) == (200_000, 1)
    assert (facts.max_num_seqs, facts.max_num_batched_tokens) == (256, 16384)
    nested = {"internal_states": [{"max_total_num_tokens": 64}], "page_size": 16}
    assert parse_sglang_server_info(nested).kv_total_blocks == 4
    assert parse_sglang_server_info({"something": "else"}).kv_total_blocks is None
