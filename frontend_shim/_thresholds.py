"""The busy rule of one rank as the frontend applies it to a worker's announced configuration
(pure: no I/O, no state).

The thresholds themselves, their ranges and the rule are :mod:`shim_common._busy`'s (one value
type, :class:`~shim_common.wire.BusyThresholds`, shared with the workers); this module only
reads the per-rank capacities out of a worker's :class:`~shim_common.wire.RuntimeConfig`.

``blocks`` and ``prefill_tokens`` are the figures the caller judges by: in the frontend, the larger
of what the worker reports and the router's own count (see :mod:`frontend_shim._load`).
``kv_total_blocks`` and ``max_num_batched_tokens`` are per-rank figures, as Dynamo takes them.
"""

from __future__ import annotations

from shim_common import wire
from shim_common._busy import UNKNOWN_MAX_BATCHED_TOKENS
from shim_common._busy import rank_busy as shared_rank_busy
from shim_common.wire import BusyThresholds

__all__ = ["max_batched", "rank_busy"]


def rank_busy(config: wire.RuntimeConfig, t: BusyThresholds, blocks: int, prefill: int) -> bool:
    """The busy rule of one rank (the one shared with the workers' edge detection).

    Args:
        config: the worker's announced configuration (its per-rank capacities).
        t: the thresholds of the worker's model.
        blocks: the KV blocks the rank holds.
        prefill: the prompt tokens waiting for prefill on the rank.
    """
    return shared_rank_busy(
        t,
        blocks=blocks,
        prefill_tokens=prefill,
        kv_total_blocks=config.kv_total_blocks,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )


def max_batched(config: wire.RuntimeConfig) -> int:
    """A worker's per-rank ``max_num_batched_tokens``; the default when it announced none."""
    if config.max_num_batched_tokens > 0:
        return config.max_num_batched_tokens
    return UNKNOWN_MAX_BATCHED_TOKENS
