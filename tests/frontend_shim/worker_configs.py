"""The configuration a worker announces in its hello, for the frontend's pure tests."""

from __future__ import annotations

from typing import Any

import msgspec

from shim_common import wire

_PLAIN = wire.RuntimeConfig(
    worker_id="w-1",
    model="m",
    kv_total_blocks=100,
    block_size=16,
    max_num_batched_tokens=1000,
    max_num_seqs=8,
    data_parallel_size=1,
    engine_request_limit=None,
    request_queue_limit=40000,
    heartbeat_interval=1.0,
)


def runtime_config(worker_id: str = "w-1", **changes: Any) -> wire.RuntimeConfig:
    """A plausible hello configuration (one rank, 100 blocks of 16), with ``changes`` put in."""
    return msgspec.structs.replace(_PLAIN, worker_id=worker_id, **changes)
