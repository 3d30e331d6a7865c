"""The busy rule as the frontend reads it off a worker's announced configuration
(frontend_shim._thresholds)."""

from __future__ import annotations

from frontend_shim._thresholds import max_batched, rank_busy
from shim_common import wire
from shim_common._busy import UNKNOWN_MAX_BATCHED_TOKENS
from shim_common.wire import BusyThresholds


def config(*, total: int = 100, max_batched: int = 1000) -> wire.RuntimeConfig:
    return wire.RuntimeConfig(
        worker_id="w",
        model="m",
        kv_total_blocks=total,
        block_size=16,
        max_num_batched_tokens=max_batched,
        max_num_seqs=256,
        data_parallel_size=1,
        engine_request_limit=None,
        request_queue_limit=40000,
        heartbeat_interval=1.0,
    )


def test_the_rule_reads_the_per_rank_capacities_of_the_config() -> None:
    decode = BusyThresholds(active_decode_blocks=0.5)
    assert not rank_busy(config(total=100), decode, 50, 0)
    assert rank_busy(config(total=100), decode, 51, 0)
    assert not rank_busy(config(total=0), decode, 51, 0)
    frac = BusyThresholds(active_prefill_tokens_frac=0.5)
    assert not rank_busy(config(max_batched=10), frac, 0, 5)
    assert rank_busy(config(max_batched=10), frac, 0, 6)


def test_max_batched_falls_back_to_the_default() -> None:
    assert max_batched(config(max_batched=8192)) == 8192
    assert max_batched(config(max_batched=0)) == UNKNOWN_MAX_BATCHED_TOKENS
