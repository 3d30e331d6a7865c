"""The busy thresholds of a model and the busy rule of one rank (pure: no I/O, no state).

Thresholds are per model; ``None`` leaves a check unset. A rank is busy when any configured check
is exceeded (strict ``>``; unset checks are skipped; all unset: never busy):

- decode: ``blocks / kv_total_blocks > active_decode_blocks``, never when the total is 0 or
  unknown.
- prefill: ``prefill_tokens > active_prefill_tokens``.
- prefill fraction: ``prefill_tokens > int(active_prefill_tokens_frac * max_num_batched_tokens)``
  (integer truncation as in Dynamo; ``max_num_batched_tokens <= 0`` counts as 10,000,000).

``blocks`` and ``prefill_tokens`` are the figures the caller judges by: in the frontend, the larger
of what the worker reports and the router's own count (see :mod:`frontend_shim._load`).
``kv_total_blocks`` and ``max_num_batched_tokens`` are per-rank figures, as Dynamo takes them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TypeVar

from shim_common import wire
from shim_common._busy import UNKNOWN_MAX_BATCHED_TOKENS
from shim_common._busy import rank_busy as shared_rank_busy

__all__ = [
    "UNKNOWN_MAX_BATCHED_TOKENS",
    "ThresholdError",
    "Thresholds",
    "max_batched",
    "rank_busy",
    "validate_active_decode_blocks_threshold",
    "validate_active_prefill_tokens_threshold",
    "validate_active_prefill_tokens_threshold_frac",
]

#: ``max_num_batched_tokens`` assumed when a worker announces none (Dynamo's default).


class ThresholdError(ValueError):
    """A threshold value out of range; ``str(error)`` is the text the HTTP API returns (400).

    Attributes:
        field: the name of the threshold, as in the API (``active_decode_blocks_threshold``...).
        value: the value given.
    """

    def __init__(self, field: str, value: object, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


def validate_active_decode_blocks_threshold(value: float) -> float:
    """Check a decode-blocks threshold: a finite float in [0.0, 1.0].

    Args:
        value: the threshold given.

    Returns:
        ``value`` as a float.

    Raises:
        ThresholdError: out of range, NaN or infinite.
    """
    value = float(value)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        field = "active_decode_blocks_threshold"
        raise ThresholdError(field, value, f"{field} must be between 0.0 and 1.0, got {value}")
    return value


def validate_active_prefill_tokens_threshold(value: int) -> int:
    """Check an absolute prefill-tokens threshold: an integer >= 0.

    Args:
        value: the threshold given.

    Returns:
        ``value``.

    Raises:
        ThresholdError: negative.
    """
    if value < 0:
        field = "active_prefill_tokens_threshold"
        raise ThresholdError(field, value, f"{field} must be >= 0, got {value}")
    return value


def validate_active_prefill_tokens_threshold_frac(value: float) -> float:
    """Check a prefill-tokens fraction threshold: a finite float >= 0.0.

    Args:
        value: the threshold given.

    Returns:
        ``value`` as a float.

    Raises:
        ThresholdError: negative, NaN or infinite.
    """
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        field = "active_prefill_tokens_threshold_frac"
        raise ThresholdError(
            field,
            value,
            f"{field} must be a finite value greater than or equal to 0.0, got {value}",
        )
    return value


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Thresholds:
    """The busy thresholds of one model; ``None`` leaves a check unset (skipped)."""

    active_decode_blocks: float | None = None
    active_prefill_tokens: int | None = None
    active_prefill_tokens_frac: float | None = None

    def __post_init__(self) -> None:
        if self.active_decode_blocks is not None:
            validate_active_decode_blocks_threshold(self.active_decode_blocks)
        if self.active_prefill_tokens is not None:
            validate_active_prefill_tokens_threshold(self.active_prefill_tokens)
        if self.active_prefill_tokens_frac is not None:
            validate_active_prefill_tokens_threshold_frac(self.active_prefill_tokens_frac)

    @property
    def configured(self) -> bool:
        """Whether any check is set (with none set, no worker is ever busy)."""
        return (
            self.active_decode_blocks is not None
            or self.active_prefill_tokens is not None
            or self.active_prefill_tokens_frac is not None
        )

    def to_wire(self) -> wire.BusyThresholds:
        """These thresholds as a worker reads them (:class:`wire.Subscribe`)."""
        return wire.BusyThresholds(
            active_decode_blocks=self.active_decode_blocks,
            active_prefill_tokens=self.active_prefill_tokens,
            active_prefill_tokens_frac=self.active_prefill_tokens_frac,
        )

    def merged(self, update: Thresholds) -> Thresholds:
        """These thresholds with every non-``None`` value of ``update`` put in (the POST rule).

        Args:
            update: the values to set; its ``None`` fields leave ours unchanged.

        Returns:
            The merged thresholds.
        """
        return Thresholds(
            active_decode_blocks=_first_set(update.active_decode_blocks, self.active_decode_blocks),
            active_prefill_tokens=_first_set(
                update.active_prefill_tokens, self.active_prefill_tokens
            ),
            active_prefill_tokens_frac=_first_set(
                update.active_prefill_tokens_frac, self.active_prefill_tokens_frac
            ),
        )


_T = TypeVar("_T")


def _first_set(new: _T | None, old: _T | None) -> _T | None:
    return old if new is None else new


def rank_busy(config: wire.RuntimeConfig, t: Thresholds, blocks: int, prefill: int) -> bool:
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
