"""The busy rule of one data-parallel rank, shared by the frontend's routing and the worker's
busy/free edge detection, so the two can never disagree on what "busy" means."""

from __future__ import annotations

from typing import Final, Protocol

__all__ = ["UNKNOWN_MAX_BATCHED_TOKENS", "BusyRule", "rank_busy"]

#: ``max_num_batched_tokens`` assumed when a worker announces none (Dynamo's default).
UNKNOWN_MAX_BATCHED_TOKENS: Final = 10_000_000


class BusyRule(Protocol):
    """Thresholds as the rule reads them; ``None`` leaves a check unset (skipped)."""

    @property
    def active_decode_blocks(self) -> float | None: ...

    @property
    def active_prefill_tokens(self) -> int | None: ...

    @property
    def active_prefill_tokens_frac(self) -> float | None: ...


def rank_busy(
    thresholds: BusyRule,
    *,
    blocks: int,
    prefill_tokens: int,
    kv_total_blocks: int,
    max_num_batched_tokens: int,
) -> bool:
    """Whether a rank is busy: any configured check exceeded, strictly.

    - decode: ``blocks / kv_total_blocks > active_decode_blocks`` (never when the total is 0);
    - prefill: ``prefill_tokens > active_prefill_tokens``;
    - prefill fraction: ``prefill_tokens > int(active_prefill_tokens_frac * max_batched)``, with
      integer truncation as Dynamo does and :data:`UNKNOWN_MAX_BATCHED_TOKENS` for a
      ``max_num_batched_tokens`` that is not positive.
    """
    decode = thresholds.active_decode_blocks
    if decode is not None and kv_total_blocks > 0 and blocks / kv_total_blocks > decode:
        return True
    prefill = thresholds.active_prefill_tokens
    if prefill is not None and prefill_tokens > prefill:
        return True
    frac = thresholds.active_prefill_tokens_frac
    if frac is None:
        return False
    max_batched = (
        max_num_batched_tokens if max_num_batched_tokens > 0 else UNKNOWN_MAX_BATCHED_TOKENS
    )
    return prefill_tokens > int(frac * max_batched)
