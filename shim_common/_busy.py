"""The busy thresholds and the busy rule of one data-parallel rank, shared by the frontend's
routing and the worker's busy/free edge detection, so the two can never disagree on what "busy"
means.

:class:`BusyThresholds` is the one value type of the thresholds: the frontend's settings and its
per-model state, the admin API's update, and the :class:`~shim_common.wire.Subscribe` message a
worker decodes are all this struct, so a value is checked by one set of rules wherever it enters
(:meth:`BusyThresholds.__post_init__`, which msgspec also runs on decode: a bad value on the wire
is a ``msgspec.ValidationError``, as any undecodable message).

Thresholds are per model; ``None`` leaves a check unset. A rank is busy when any configured check
is exceeded (strict ``>``; unset checks are skipped; all unset: never busy), see
:func:`rank_busy`.
"""

from __future__ import annotations

import math
from typing import Final, TypeVar

import msgspec

from shim_common._client_text import quote
from shim_common._numbers import (
    COUNT,
    FRACTION,
    RATIO,
    Count,
    Fraction,
    Kind,
    NumberError,
    Ratio,
)

__all__ = [
    "UNKNOWN_MAX_BATCHED_TOKENS",
    "BusyThresholds",
    "ThresholdError",
    "rank_busy",
    "validate_active_decode_blocks_threshold",
    "validate_active_prefill_tokens_threshold",
    "validate_active_prefill_tokens_threshold_frac",
]

#: ``max_num_batched_tokens`` assumed when a worker announces none (Dynamo's default).
UNKNOWN_MAX_BATCHED_TOKENS: Final = 10_000_000

_N = TypeVar("_N", int, float)


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


def validate_active_decode_blocks_threshold(value: object) -> float:
    """Check a decode-blocks threshold: a :data:`~shim_common._numbers.FRACTION`.

    Returns:
        ``value`` as a float.

    Raises:
        ThresholdError: not a number, out of range, NaN or infinite.
    """
    refusal = "must be between 0.0 and 1.0"
    return _checked(FRACTION, "active_decode_blocks_threshold", value, refusal, dynamo_high=1.0)


def validate_active_prefill_tokens_threshold(value: object) -> int:
    """Check an absolute prefill-tokens threshold: a :data:`~shim_common._numbers.COUNT`.

    Returns:
        ``value``.

    Raises:
        ThresholdError: not a whole number, negative, or past 2**53.
    """
    return _checked(COUNT, "active_prefill_tokens_threshold", value, "must be >= 0")


def validate_active_prefill_tokens_threshold_frac(value: object) -> float:
    """Check a prefill-tokens fraction threshold: a :data:`~shim_common._numbers.RATIO`.

    Returns:
        ``value`` as a float.

    Raises:
        ThresholdError: not a number, negative, NaN, infinite or past 1e6.
    """
    return _checked(
        RATIO,
        "active_prefill_tokens_threshold_frac",
        value,
        "must be a finite value greater than or equal to 0.0",
    )


def _checked(
    kind: Kind[_N], field: str, value: object, refusal: str, *, dynamo_high: float = math.inf
) -> _N:
    """``value`` checked as ``kind``. Refused with Dynamo's text (``refusal``) for what Dynamo
    refuses too; a finite value that Dynamo takes (up to ``dynamo_high``) but that is past the
    kind's top is refused with the kind's own text."""
    try:
        return kind.check(value)
    except NumberError as exc:
        past_the_top = (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and (not isinstance(value, float) or math.isfinite(value))
            and kind.high < value <= dynamo_high
        )
        message = f"{field} {exc}" if past_the_top else f"{field} {refusal}, got {quote(value)}"
        raise ThresholdError(field, value, message) from None


class BusyThresholds(msgspec.Struct, frozen=True, kw_only=True):
    """The busy thresholds of one model; ``None`` means that check is off.

    A rank is busy when any configured check is exceeded (strict ``>``): decode blocks over
    ``active_decode_blocks`` of the rank's KV blocks, prefill tokens over
    ``active_prefill_tokens``, or prefill tokens over ``active_prefill_tokens_frac`` of
    ``max_num_batched_tokens`` (:func:`rank_busy`).

    Raises:
        ThresholdError: on construction, a value out of range (msgspec turns it into a
            ``ValidationError`` on decode).
    """

    active_decode_blocks: Fraction | None = None
    active_prefill_tokens: Count | None = None
    active_prefill_tokens_frac: Ratio | None = None

    def __post_init__(self) -> None:
        if self.active_decode_blocks is not None:
            validate_active_decode_blocks_threshold(self.active_decode_blocks)
        if self.active_prefill_tokens is not None:
            validate_active_prefill_tokens_threshold(self.active_prefill_tokens)
        if self.active_prefill_tokens_frac is not None:
            validate_active_prefill_tokens_threshold_frac(self.active_prefill_tokens_frac)

    @classmethod
    def checked(
        cls,
        *,
        active_decode_blocks: object = None,
        active_prefill_tokens: object = None,
        active_prefill_tokens_frac: object = None,
    ) -> BusyThresholds:
        """Thresholds from values as they came from outside (JSON, say), each checked and
        converted by its rule (an integer fraction becomes a float); ``None`` leaves it unset.

        Raises:
            ThresholdError: the first value out of range, or not a number of its kind.
        """
        return cls(
            active_decode_blocks=None
            if active_decode_blocks is None
            else validate_active_decode_blocks_threshold(active_decode_blocks),
            active_prefill_tokens=None
            if active_prefill_tokens is None
            else validate_active_prefill_tokens_threshold(active_prefill_tokens),
            active_prefill_tokens_frac=None
            if active_prefill_tokens_frac is None
            else validate_active_prefill_tokens_threshold_frac(active_prefill_tokens_frac),
        )

    @property
    def configured(self) -> bool:
        """Whether any check is set (with none set, no rank is ever busy)."""
        return (
            self.active_decode_blocks is not None
            or self.active_prefill_tokens is not None
            or self.active_prefill_tokens_frac is not None
        )

    def merged(self, update: BusyThresholds) -> BusyThresholds:
        """These thresholds with every non-``None`` value of ``update`` put in (the POST rule).

        Args:
            update: the values to set; its ``None`` fields leave ours unchanged.

        Returns:
            The merged thresholds.
        """
        return BusyThresholds(
            active_decode_blocks=(
                self.active_decode_blocks
                if update.active_decode_blocks is None
                else update.active_decode_blocks
            ),
            active_prefill_tokens=(
                self.active_prefill_tokens
                if update.active_prefill_tokens is None
                else update.active_prefill_tokens
            ),
            active_prefill_tokens_frac=(
                self.active_prefill_tokens_frac
                if update.active_prefill_tokens_frac is None
                else update.active_prefill_tokens_frac
            ),
        )


def rank_busy(
    thresholds: BusyThresholds,
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
