"""The benchmark engine of ``bench/kit/fixed_engine.py``: its shape, its slots and its load.

Timing runs on the autojump clock; what is checked is order and counts, never durations.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from bench.kit.fixed_engine import (
    DEFAULT_SERVICE_SECONDS,
    DEFAULT_SLOTS,
    SERVICE_ENV,
    SLOTS_ENV,
    FixedEngine,
    FixedShape,
    shape_from_env,
)
from worker_ingress.engines import EngineInputError, PreparedRequest

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


def make_engine(slots: int = 2, service: float = 0.2) -> FixedEngine:
    return FixedEngine(
        FixedShape(slots=slots, service_seconds=service), block_size=16, max_num_batched_tokens=64
    )


def test_shape_defaults_and_capacity() -> None:
    shape = shape_from_env({})
    assert shape == FixedShape(slots=DEFAULT_SLOTS, service_seconds=DEFAULT_SERVICE_SECONDS)
    assert shape.capacity == pytest.approx(DEFAULT_SLOTS / DEFAULT_SERVICE_SECONDS)
    assert shape_from_env({SLOTS_ENV: "8", SERVICE_ENV: "0.05"}) == FixedShape(
        slots=8, service_seconds=0.05
    )
    assert shape_from_env({SLOTS_ENV: "", SERVICE_ENV: ""}) == shape


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({SLOTS_ENV: "0"}, SLOTS_ENV),
        ({SLOTS_ENV: "two"}, SLOTS_ENV),
        ({SLOTS_ENV: "1.5"}, SLOTS_ENV),
        ({SERVICE_ENV: "0"}, SERVICE_ENV),
        ({SERVICE_ENV: "-1"}, SERVICE_ENV),
        ({SERVICE_ENV: "inf"}, SERVICE_ENV),
        ({SERVICE_ENV: "nan"}, SERVICE_ENV),
        ({SERVICE_ENV: "soon"}, SERVICE_ENV),
    ],
)
def test_shape_refuses_bad_values(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        shape_from_env(env)


def test_config_announces_one_block_per_slot() -> None:
    engine = make_engine(slots=3)
    assert engine.config.kv_total_blocks == 3
    assert engine.config.max_num_seqs == 3
    assert engine.config.data_parallel_size == 1
    [load] = engine.load()
    assert load.kv_used_blocks == load.active_decode_blocks == 0


def test_prepare_reads_the_body_like_every_engine() -> None:
    engine = make_engine()
    request = engine.prepare("chat_completions", CHAT)
    assert request.prompt_tokens == 2
    assert request.max_tokens == 3
    with pytest.raises(EngineInputError):
        engine.prepare("chat_completions", {"messages": []})
    with pytest.raises(EngineInputError):
        engine.prepare("embeddings", {"input": "x"})


async def _serve(engine: FixedEngine, request: PreparedRequest, done: list[str]) -> None:
    async for output in engine.generate(request):
        done.append(output.finish_reason or "")


async def test_requests_beyond_the_slots_wait_and_load_counts_the_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine(slots=2)
    request = engine.prepare("completions", {"prompt": "a b", "max_tokens": 1})
    done: list[str] = []
    seen_running: list[int] = []

    async def watch() -> None:
        version = engine.load_changed.version
        while True:
            version = await engine.load_changed.wait_past(version)
            seen_running.append(engine.load()[0].kv_used_blocks)

    with trio.fail_after(60):
        async with trio.open_nursery() as outer:
            outer.start_soon(watch)
            await trio.testing.wait_all_tasks_blocked()
            async with trio.open_nursery() as servers:
                for _ in range(5):
                    servers.start_soon(_serve, engine, request, done)
            outer.cancel_scope.cancel()
    assert done == ["length"] * 5
    assert max(seen_running) == 2
    assert engine.running == 0
    assert engine.load()[0].active_decode_blocks == 0


async def test_cancelling_a_waiting_request_gives_its_turn_away(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine(slots=1)
    request = engine.prepare("completions", {"prompt": "a", "max_tokens": 1})
    done: list[str] = []
    waiter = trio.CancelScope()

    async def wait_then_leave() -> None:
        with waiter:
            await _serve(engine, request, done)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve, engine, request, done)
            await trio.testing.wait_all_tasks_blocked()
            assert engine.running == 1
            nursery.start_soon(wait_then_leave)
            await trio.testing.wait_all_tasks_blocked()
            waiter.cancel()
            nursery.start_soon(_serve, engine, request, done)
    assert waiter.cancelled_caught
    assert done == ["length", "length"]
    assert engine.running == 0
