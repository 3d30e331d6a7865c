"""A frontend load state fed by hand: the worker configurations and the events a test feeds
:class:`~frontend_shim._load.Fleet`, and the questions it asks of it (is a worker free, its
load), shared by the tests of the load state and of the waiting room.
"""

from __future__ import annotations

from typing import Any

from frontend_shim._free_sets import WorkerLoad
from frontend_shim._load import Fleet
from shim_common import wire
from shim_common.wire import BusyThresholds

MODEL = "m"


def config(
    worker_id: str = "w0",
    *,
    model: str = MODEL,
    total: int = 100,
    block_size: int = 16,
    max_batched: int = 1000,
    dp: int = 1,
    heartbeat: float = 1.0,
) -> wire.RuntimeConfig:
    return wire.RuntimeConfig(
        worker_id=worker_id,
        model=model,
        kv_total_blocks=total,
        block_size=block_size,
        max_num_batched_tokens=max_batched,
        max_num_seqs=256,
        data_parallel_size=dp,
        engine_request_limit=None,
        request_queue_limit=40000,
        heartbeat_interval=heartbeat,
    )


class Feed:
    """Makes events with increasing ``seq`` per worker."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.seq: dict[str, int] = {}

    def _next(self, worker_id: str) -> int:
        self.seq[worker_id] = self.seq.get(worker_id, 0) + 1
        return self.seq[worker_id]

    def load(
        self,
        worker_id: str = "w0",
        *,
        rank: int = 0,
        decode: int = 0,
        prefill: int = 0,
        used: int = 0,
        now: float = 0.0,
    ) -> bool:
        event = wire.LoadEvent(
            seq=self._next(worker_id),
            ts=0.0,
            load=wire.RankLoad(
                dp_rank=rank,
                active_decode_blocks=decode,
                active_prefill_tokens=prefill,
                kv_used_blocks=used,
            ),
            engine_requests=0,
            queued_requests=0,
        )
        return self.fleet.apply(worker_id, event, now)

    def heartbeat(
        self,
        worker_id: str = "w0",
        loads: list[tuple[int, int]] = (),  # type: ignore[assignment]
        *,
        status: str = "ready",
        now: float = 0.0,
    ) -> bool:
        event = wire.Heartbeat(
            seq=self._next(worker_id),
            ts=0.0,
            loads=[
                wire.RankLoad(
                    dp_rank=r, active_decode_blocks=d, active_prefill_tokens=0, kv_used_blocks=0
                )
                for r, d in loads
            ],
            engine_requests=0,
            queued_requests=0,
            status=status,
        )
        return self.fleet.apply(worker_id, event, now)


def fleet_with(thresholds: BusyThresholds, **kwargs: Any) -> tuple[Fleet, Feed]:
    fleet = Fleet(default_thresholds=thresholds, **kwargs)
    return fleet, Feed(fleet)


def is_free(fleet: Fleet, worker_id: str = "w0", now: float = 0.0) -> bool:
    free = fleet.free_workers(MODEL, now)
    assert free is not None
    return any(w.worker_id == worker_id for w in free)


def state(fleet: Fleet, worker_id: str = "w0") -> WorkerLoad:
    worker = fleet.worker(worker_id)
    assert worker is not None
    return worker
