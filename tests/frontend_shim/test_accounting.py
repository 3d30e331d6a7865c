"""Per-request accounting: metrics by status, TTFT once, and the router's own count."""

from __future__ import annotations

import trio
from worker_configs import runtime_config

from frontend_shim._accounting import CLIENT_CLOSED, Exchange, Progress
from frontend_shim._load import Fleet
from frontend_shim._metrics import FrontendMetrics
from shim_common import wire


def _chunk(tokens: int) -> wire.Chunk:
    return wire.Chunk(request_id=1, text="x", tokens=tokens)


def _own(fleet: Fleet) -> list[tuple[int, int]]:
    worker = fleet.worker("w-1")
    assert worker is not None
    return [(rank.own.blocks, rank.own.prefill) for rank in worker.ranks]


def _sample(metrics: FrontendMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model": "m"})
    return 0.0 if value is None else value


def test_an_exchange_counts_as_client_closed_until_an_answer_is_noted() -> None:
    exchange = Exchange("completions", "m", arrival=0.0)
    assert exchange.status == CLIENT_CLOSED == 499


async def test_progress_charges_the_worker_moves_the_charge_with_output_and_drops_it_once() -> None:
    fleet = Fleet()
    fleet.register(runtime_config(data_parallel_size=2), now=0.0)
    metrics = FrontendMetrics(lambda: ())
    exchange = Exchange("completions", "m", trio.current_time())
    progress = Progress.start(fleet, metrics, exchange, "w-1", prompt_tokens=40)
    # Charged to the rank with the fewest own blocks (ties: the lowest): 3 blocks of 16.
    assert _own(fleet) == [(3, 40), (0, 0)]
    progress.output(_chunk(tokens=1))
    progress.output(_chunk(tokens=1))
    assert _own(fleet) == [(3, 0), (0, 0)]  # prefill is over at the first output
    # The time to first token is taken when the first token is written, once.
    assert _sample(metrics, "dynamo_frontend_time_to_first_token_seconds_count") == 0
    progress.written()
    progress.written()
    assert _sample(metrics, "dynamo_frontend_time_to_first_token_seconds_count") == 1
    progress.status = 200
    assert exchange.status == 200
    progress.completed()
    assert _sample(metrics, "dynamo_frontend_request_duration_seconds_count") == 1
    progress.finished()
    progress.finished()
    assert _own(fleet) == [(0, 0), (0, 0)]


async def test_progress_of_a_worker_gone_before_the_start_charges_nothing() -> None:
    fleet = Fleet()
    metrics = FrontendMetrics(lambda: ())
    exchange = Exchange("completions", "m", trio.current_time())
    progress = Progress.start(fleet, metrics, exchange, "w-gone", prompt_tokens=40)
    progress.written()  # nothing was output yet: no time to first token
    progress.output(_chunk(tokens=3))
    progress.written()
    progress.finished()
    assert _sample(metrics, "dynamo_frontend_time_to_first_token_seconds_count") == 1


async def test_output_blocks_are_charged_with_track_output_blocks() -> None:
    fleet = Fleet(track_output_blocks=True)
    fleet.register(runtime_config(data_parallel_size=2), now=0.0)
    metrics = FrontendMetrics(lambda: ())
    progress = Progress.start(
        fleet, metrics, Exchange("completions", "m", 0.0), "w-1", prompt_tokens=16
    )
    progress.output(_chunk(tokens=17))
    assert _own(fleet)[0] == (3, 0)  # 33 tokens in blocks of 16
    progress.finished()
    assert _own(fleet) == [(0, 0), (0, 0)]
