"""The busy thresholds and the busy rule of one rank (shim_common._busy): the ranges each
threshold accepts with the API's error texts, merging, decoding as a wire message, and the rule."""

from __future__ import annotations

import math

import msgspec
import pytest

from shim_common import wire
from shim_common._busy import (
    UNKNOWN_MAX_BATCHED_TOKENS,
    ThresholdError,
    rank_busy,
    validate_active_decode_blocks_threshold,
    validate_active_prefill_tokens_threshold,
    validate_active_prefill_tokens_threshold_frac,
)
from shim_common.wire import BusyThresholds

# ----------------------------------------------------------------------------- ranges


@pytest.mark.parametrize("value", [0.0, 0.85, 1.0])
def test_decode_threshold_valid(value: float) -> None:
    assert validate_active_decode_blocks_threshold(value) == value


@pytest.mark.parametrize("value", [-0.1, 1.1, 1.5, math.nan, math.inf])
def test_decode_threshold_invalid(value: float) -> None:
    with pytest.raises(ThresholdError) as info:
        validate_active_decode_blocks_threshold(value)
    assert info.value.field == "active_decode_blocks_threshold"


def test_error_texts_are_those_of_the_api() -> None:
    decode_text = r"^active_decode_blocks_threshold must be between 0\.0 and 1\.0, got 1\.5$"
    with pytest.raises(ThresholdError, match=decode_text):
        validate_active_decode_blocks_threshold(1.5)
    with pytest.raises(
        ThresholdError,
        match=r"^active_prefill_tokens_threshold_frac must be a finite value greater than or "
        r"equal to 0\.0, got -0\.1$",
    ):
        validate_active_prefill_tokens_threshold_frac(-0.1)
    prefill_text = r"^active_prefill_tokens_threshold must be >= 0, got -1$"
    with pytest.raises(ThresholdError, match=prefill_text):
        validate_active_prefill_tokens_threshold(-1)


@pytest.mark.parametrize("value", [0.0, 0.9, 64.0])
def test_frac_threshold_valid(value: float) -> None:
    assert validate_active_prefill_tokens_threshold_frac(value) == value


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf])
def test_frac_threshold_invalid(value: float) -> None:
    with pytest.raises(ThresholdError):
        validate_active_prefill_tokens_threshold_frac(value)


def test_prefill_threshold_zero_is_valid_and_thresholds_validate_on_build() -> None:
    assert validate_active_prefill_tokens_threshold(0) == 0
    with pytest.raises(ThresholdError):
        BusyThresholds(active_decode_blocks=2.0)


def test_merge_sets_only_given_values() -> None:
    base = BusyThresholds(active_decode_blocks=0.5, active_prefill_tokens=10)
    merged = base.merged(BusyThresholds(active_prefill_tokens=20))
    assert merged == BusyThresholds(active_decode_blocks=0.5, active_prefill_tokens=20)
    assert base.merged(BusyThresholds()) == base
    assert not BusyThresholds().configured
    assert BusyThresholds(active_prefill_tokens_frac=0.0).configured



def test_a_subscribe_out_of_range_does_not_decode() -> None:
    # The struct's checks run on decode too: a worker refuses it like any undecodable message.
    good = {"type": "subscribe", "thresholds": {"active_decode_blocks": 0.5}}
    assert wire.decode_subscriber_message(msgspec.msgpack.encode(good)) == wire.Subscribe(
        thresholds=BusyThresholds(active_decode_blocks=0.5)
    )
    for thresholds in (
        {"active_decode_blocks": 1.5},
        {"active_prefill_tokens": -1},
        {"active_prefill_tokens_frac": math.nan},
    ):
        data = msgspec.msgpack.encode({"type": "subscribe", "thresholds": thresholds})
        with pytest.raises(msgspec.ValidationError):
            wire.decode_subscriber_message(data)


# ----------------------------------------------------------------------------- the rule


def busy(
    thresholds: BusyThresholds,
    *,
    blocks: int = 0,
    prefill: int = 0,
    total: int = 100,
    max_batched: int = 1000,
) -> bool:
    return rank_busy(
        thresholds,
        blocks=blocks,
        prefill_tokens=prefill,
        kv_total_blocks=total,
        max_num_batched_tokens=max_batched,
    )


def test_each_check_is_strict_and_unset_checks_are_skipped() -> None:
    assert not busy(BusyThresholds(), blocks=10**6, prefill=10**6)
    decode = BusyThresholds(active_decode_blocks=0.5)
    assert not busy(decode, blocks=50, prefill=10**6)
    assert busy(decode, blocks=51)
    prefill = BusyThresholds(active_prefill_tokens=100)
    assert not busy(prefill, prefill=100, blocks=100)
    assert busy(prefill, prefill=101)


def test_decode_is_never_busy_without_a_total() -> None:
    assert not busy(BusyThresholds(active_decode_blocks=0.0), blocks=10, total=0)


def test_fraction_truncates_and_defaults_when_max_batched_is_unknown() -> None:
    frac = BusyThresholds(active_prefill_tokens_frac=0.3339)
    assert not busy(frac, prefill=3, max_batched=10)  # int(3.339) = 3
    assert busy(frac, prefill=4, max_batched=10)
    whole = BusyThresholds(active_prefill_tokens_frac=1.0)
    assert not busy(whole, prefill=UNKNOWN_MAX_BATCHED_TOKENS, max_batched=0)
    assert busy(whole, prefill=UNKNOWN_MAX_BATCHED_TOKENS + 1, max_batched=-1)


def test_checks_are_ored() -> None:
    both = BusyThresholds(active_decode_blocks=0.5, active_prefill_tokens=100)
    assert busy(both, blocks=60)
    assert busy(both, prefill=101)
    assert not busy(both, blocks=50, prefill=100)
