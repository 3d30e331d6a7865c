"""The limits and usage the ``openai`` engine reads from its upstream when it runs: waiting for the
upstream, its metrics or the flags' fallback, absurd figures refused, a configuration read before
the run kept fixed, and llama.cpp's slots against the request limit.
"""

from __future__ import annotations

import pytest
import trio
from fake_upstream import (
    CHAT,
    FALLBACK,
    TIMEOUT,
    Exchange,
    FakeUpstream,
    assert_idle,
    chat_chunk,
    collect,
    make_engine,
    models_m,
    usage_chunk,
)
from fake_upstream import (
    upstream_fixture as upstream_fixture,
)


async def test_run_waits_for_the_upstream_then_reads_its_limits_and_usage(
    upstream: FakeUpstream,
) -> None:
    probes = 0
    usage = [0.25]

    async def models(exchange: Exchange) -> None:
        nonlocal probes
        probes += 1
        if probes < 3:
            await exchange.send_json(503, {"error": "loading"})
        else:
            await exchange.send_json(200, {"object": "list", "data": [{"id": "m"}]})

    async def metrics(exchange: Exchange) -> None:
        text = (
            'vllm:cache_config_info{block_size="8",num_gpu_blocks="400"} 1.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage[0]}\n'
        )
        await exchange.send_raw(200, text.encode())

    upstream.routes["GET /v1/models"] = models
    upstream.routes["GET /metrics"] = metrics
    engine = make_engine(upstream, metrics_poll_interval=0.01)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            assert probes == 3
            assert (engine.config.kv_total_blocks, engine.config.block_size) == (400, 8)
            (load,) = engine.load()
            assert (load.kv_used_blocks, load.active_decode_blocks) == (100, 100)
            usage[0] = 0.0
            while engine.load()[0].kv_used_blocks != 0:
                await engine.load_changed.wait_past(engine.load_changed.version)
            nursery.cancel_scope.cancel()
    assert_idle(engine)


async def test_a_request_that_ended_leaves_the_polled_usage_at_once(
    upstream: FakeUpstream,
) -> None:
    # A reading taken while the request ran counts it; until the next reading, the request's
    # end takes it off, so the worker's first event after the end does not count it.
    usage = [0.0]
    held_back = [False]
    hold_readings = trio.Event()
    answer = trio.Event()

    async def metrics(exchange: Exchange) -> None:
        if held_back[0]:
            await hold_readings.wait()  # no fresher reading until the test is done
        text = (
            'vllm:cache_config_info{block_size="4",num_gpu_blocks="400"} 1.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage[0]}\n'
        )
        await exchange.send_raw(200, text.encode())

    async def chat(exchange: Exchange) -> None:
        await exchange.start_sse()
        await exchange.event(chat_chunk("one"))
        await answer.wait()
        await exchange.event(chat_chunk(" two", finish="stop"))
        await exchange.event(usage_chunk(5, 2))
        await exchange.end_sse()

    upstream.routes["GET /v1/models"] = models_m
    upstream.routes["GET /metrics"] = metrics
    upstream.routes["POST /v1/chat/completions"] = chat
    engine = make_engine(upstream, metrics_poll_interval=0.01)

    async def wait_for_load(blocks: int) -> None:
        while engine.load()[0].kv_used_blocks != blocks:
            await engine.load_changed.wait_past(engine.load_changed.version)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)  # the first reading: 0 blocks
            ended = trio.Event()

            async def request() -> None:
                await collect(engine, engine.prepare("chat_completions", CHAT))
                ended.set()

            nursery.start_soon(request)
            while engine.load()[0].kv_used_blocks == 0:
                await engine.load_changed.wait_past(engine.load_changed.version)
            held = engine.load()[0].kv_used_blocks  # the estimate of the request
            usage[0] = 2 * held / 400  # the request, and as much of another client's
            await wait_for_load(2 * held)  # a reading came while it ran
            held_back[0] = True
            answer.set()
            await ended.wait()
            assert engine.load()[0].kv_used_blocks == held  # the other client's blocks only
            # A request that started after that reading was never in it: its end takes
            # nothing off it.
            await collect(engine, engine.prepare("chat_completions", CHAT))
            assert engine.load()[0].kv_used_blocks == held
            hold_readings.set()
            nursery.cancel_scope.cancel()


async def test_run_without_metrics_keeps_the_fallback(upstream: FakeUpstream) -> None:
    async def models(exchange: Exchange) -> None:
        await exchange.send_json(200, {"object": "list", "data": [{"id": "other"}]})

    upstream.routes["GET /v1/models"] = models
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            nursery.cancel_scope.cancel()
    assert engine.config == FALLBACK
    probed = [f"{exchange.method} {exchange.target}" for exchange in upstream.seen]
    assert probed == ["GET /v1/models", "GET /metrics", "GET /get_server_info", "GET /props"]


async def test_absurd_limits_from_the_upstream_fall_back_to_the_flags(
    upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    # A count past 2**53 could not go into the worker's hello (msgpack carries 64 bits at most).
    async def server_info(exchange: Exchange) -> None:
        info = {"max_total_num_tokens": 10**40, "page_size": 1, "max_running_requests": 4}
        await exchange.send_json(200, info)

    upstream.routes["GET /v1/models"] = models_m
    upstream.routes["GET /get_server_info"] = server_info
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            nursery.cancel_scope.cancel()
    assert engine.config.kv_total_blocks == FALLBACK.kv_total_blocks
    assert engine.config.max_num_seqs == 4  # the sane values are still taken
    assert any("kv_total_blocks" in r.getMessage() for r in caplog.records)


async def test_config_read_before_run_stays_fixed(
    upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    async def models(exchange: Exchange) -> None:
        await exchange.send_json(200, {"object": "list", "data": [{"id": "m"}]})

    async def metrics(exchange: Exchange) -> None:
        text = (
            'vllm:cache_config_info{block_size="8",num_gpu_blocks="400"} 1.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        )
        await exchange.send_raw(200, text.encode())

    upstream.routes["GET /v1/models"] = models
    upstream.routes["GET /metrics"] = metrics
    engine = make_engine(upstream, metrics_poll_interval=3600)
    announced = engine.config  # what a worker puts in its hello before starting the engine
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            nursery.cancel_scope.cancel()
    assert engine.config == announced == FALLBACK
    # The usage fraction is scaled to the announced total, so the decode ratio stays right.
    assert engine.load()[0].kv_used_blocks == 250
    assert "--num-gpu-blocks 400 --block-size 8" in caplog.text


@pytest.mark.parametrize("request_limit", [None, 2, 8])
async def test_llamacpp_limits_load_and_request_limit(
    upstream: FakeUpstream, caplog: pytest.LogCaptureFixture, request_limit: int | None
) -> None:
    processing = [True]

    async def props(exchange: Exchange) -> None:
        settings = {"n_ctx": 1024, "params": {}}
        await exchange.send_json(200, {"total_slots": 2, "default_generation_settings": settings})

    async def slots(exchange: Exchange) -> None:
        held = {"is_processing": processing[0], "n_prompt_tokens": 30}
        await exchange.send_json(200, [{"id": 0, **held}, {"id": 1, "is_processing": False}])

    upstream.routes["GET /v1/models"] = models_m
    upstream.routes["GET /props"] = props
    upstream.routes["GET /slots"] = slots
    engine = make_engine(upstream, metrics_poll_interval=0.01, request_limit=request_limit)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            # 2 slots of 1024 tokens in blocks of 4; 30 tokens held in one slot.
            assert (engine.config.kv_total_blocks, engine.config.max_num_seqs) == (512, 2)
            assert engine.load()[0].kv_used_blocks == 8
            processing[0] = False
            while engine.load()[0].kv_used_blocks != 0:
                await engine.load_changed.wait_past(engine.load_changed.version)
            nursery.cancel_scope.cancel()
    warned = [r.getMessage() for r in caplog.records if "--engine-request-limit" in r.getMessage()]
    if request_limit == 2:
        assert warned == []
    else:
        assert len(warned) == 1
        assert "runs at" in warned[0]
        assert "set --engine-request-limit 2" in warned[0]
