"""What an upstream engine server says about itself at start-up (sans-IO parsers).

Each parser takes the decoded JSON of one endpoint and returns :class:`UpstreamFacts`, with
``None`` wherever the answer said nothing, so the engine can try one server kind after another:

- SGLang ``GET /get_server_info``: :func:`parse_sglang_server_info`;
- llama.cpp ``GET /props``: :func:`parse_llamacpp_props`.

vLLM says what we need in its ``/metrics`` (:mod:`worker_ingress.engines.upstream._metrics`).

llama.cpp's ``/metrics`` has no KV usage gauge (only request counts), so its load is read from
``GET /slots`` instead: :func:`parse_llamacpp_slots`.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "SlotsReading",
    "UpstreamFacts",
    "parse_llamacpp_props",
    "parse_llamacpp_slots",
    "parse_sglang_server_info",
    "positive_int",
]


class UpstreamFacts(msgspec.Struct, kw_only=True):
    """Limits an upstream revealed; ``None`` where it said nothing."""

    kv_total_blocks: int | None = None
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    #: Name of the KV usage gauge found in ``/metrics`` (worth polling), if any.
    usage_gauge: str | None = None
    #: Its current value, a fraction in [0, 1].
    kv_usage: float | None = None


def positive_int(value: object) -> int | None:
    """A count an upstream gave, as an integer or a string of digits; ``None`` for anything
    else, zero and negatives included."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            return None
        return number if number > 0 else None
    return None


def parse_sglang_server_info(info: object) -> UpstreamFacts:
    """Read SGLang's ``/get_server_info`` answer.

    Args:
        info: The decoded JSON.

    Returns:
        The limits found (KV tokens are turned into blocks of ``page_size``).
    """
    facts = UpstreamFacts()
    if not isinstance(info, dict):
        return facts
    sources: list[dict[str, Any]] = [info]
    internal = info.get("internal_states")
    if isinstance(internal, list) and internal and isinstance(internal[0], dict):
        sources.append(internal[0])

    def first(key: str) -> int | None:
        for source in sources:
            value = positive_int(source.get(key))
            if value is not None:
                return value
        return None

    kv_tokens = first("max_total_num_tokens")
    if kv_tokens is None:
        return facts  # not SGLang
    dp_size = first("dp_size") or 1
    page_size = first("page_size") or 1
    facts.block_size = page_size
    facts.kv_total_blocks = -(-kv_tokens // page_size) * dp_size
    running = first("max_running_requests")
    facts.max_num_seqs = running * dp_size if running is not None else None
    chunk = first("chunked_prefill_size")
    facts.max_num_batched_tokens = chunk * dp_size if chunk is not None else None
    return facts


def parse_llamacpp_props(props: object, block_size: int) -> UpstreamFacts:
    """Read llama.cpp's ``/props`` answer.

    Args:
        props: The decoded JSON.
        block_size: Block size to count KV tokens in (llama.cpp has no paged blocks).

    Returns:
        The limits found.
    """
    facts = UpstreamFacts()
    if not isinstance(props, dict):
        return facts
    slots = positive_int(props.get("total_slots"))
    settings = props.get("default_generation_settings")
    n_ctx = positive_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    if slots is None or n_ctx is None:
        return facts
    facts.max_num_seqs = slots
    facts.kv_total_blocks = -(-(slots * n_ctx) // block_size)
    return facts


class SlotsReading(msgspec.Struct, frozen=True):
    """What llama.cpp's ``/slots`` says about the requests it runs now."""

    #: Slots running a request.
    processing: int
    #: Tokens those slots hold in the KV cache (prompt and generated so far).
    tokens: int


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def parse_llamacpp_slots(slots: object) -> SlotsReading | None:
    """Read llama.cpp's ``/slots`` answer (a list with one object per slot).

    A slot that runs a request (``is_processing``) holds ``n_prompt_tokens`` tokens in the KV
    cache: llama.cpp counts the prompt and every token generated so far there. An idle slot keeps
    its last prompt for reuse, but that is cache, not load, so it counts nothing. Versions without
    ``n_prompt_tokens`` count the ``n_decoded`` of their ``next_token`` instead.

    Args:
        slots: The decoded JSON.

    Returns:
        The reading, or ``None`` when the answer is not a list of slots.
    """
    if not isinstance(slots, list) or not slots:
        return None
    processing = tokens = 0
    for slot in slots:
        if not isinstance(slot, dict) or "is_processing" not in slot:
            return None
        if slot["is_processing"] is not True:
            continue
        processing += 1
        held = _count(slot.get("n_prompt_tokens"))
        if held is None:
            next_token = slot.get("next_token")
            first = next_token[0] if isinstance(next_token, list) and next_token else next_token
            held = _count(first.get("n_decoded")) if isinstance(first, dict) else None
        tokens += held or 0
    return SlotsReading(processing=processing, tokens=tokens)
