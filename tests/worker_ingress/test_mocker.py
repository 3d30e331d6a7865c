"""Tests of the mocker engine: the sans-IO rank scheduler (_mock_scheduler) first, then the
Trio shell (_mocker).

Everything runs on trio's virtual clock (``autojump_clock`` or ``MockClock``), with tiny caches
and prompts so that a request takes a handful of steps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress.engines._base import Engine, EngineInputError, EngineOutput, PreparedRequest
from worker_ingress.engines._mock_scheduler import (
    GpuStepModel,
    MockSequence,
    RankScheduler,
    ScheduledStep,
    SequenceState,
)
from worker_ingress.engines._mocker import (
    DEFAULT_MAX_TOKENS,
    EMBEDDING_DIMENSIONS,
    MockerEngine,
    create,
    embedding_for,
    output_word,
)

# ----------------------------------------------------------------------------- helpers


def small_settings(**overrides: Any) -> MockerSettings:
    values: dict[str, Any] = {
        "num_gpu_blocks": 16,
        "block_size": 4,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 8,
        "data_parallel_size": 1,
        "speedup_ratio": 1.0,
    }
    values.update(overrides)
    return MockerSettings(**values)


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def completion(prompt_words: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": words(prompt_words), "max_tokens": max_tokens}


@asynccontextmanager
async def running(engine: MockerEngine) -> AsyncIterator[trio.Nursery]:
    """Run the engine's step loops for the duration of the block."""
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        yield nursery
        nursery.cancel_scope.cancel()


async def collect(engine: MockerEngine, request: PreparedRequest) -> list[EngineOutput]:
    async with aclosing(engine.generate(request)) as stream:
        return [output async for output in stream]


def scheduler(**overrides: Any) -> RankScheduler:
    values: dict[str, Any] = {
        "num_blocks": 16,
        "block_size": 4,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 8,
    }
    values.update(overrides)
    return RankScheduler(**values)


def check_counters(rank: RankScheduler) -> None:
    """The incremental counters agree with a recount, and the pool is never overdrawn."""
    assert rank.recount() == (rank.used_blocks, rank.prefill_tokens)
    assert 0 <= rank.used_blocks <= rank.num_blocks
    assert len(rank.running) <= rank.max_num_seqs


def check_between_steps(rank: RankScheduler) -> None:
    """Outside a step a running sequence holds the blocks of its computed tokens, no more, and
    a waiting one holds none (it is prefilled again from scratch)."""
    check_counters(rank)
    for seq in rank.running:
        assert seq.state is SequenceState.RUNNING
        assert seq.blocks == -(-seq.num_computed // rank.block_size)
    for seq in rank.waiting:
        assert seq.state is SequenceState.WAITING
        assert (seq.blocks, seq.num_computed, seq.prefill_done) == (0, 0, False)


def run_step(rank: RankScheduler) -> ScheduledStep | None:
    """One synchronous step: schedule, check the budget, complete."""
    check_between_steps(rank)
    step = rank.schedule()
    check_counters(rank)
    if step is None:
        return None
    assert sum(tokens for _, tokens in step.entries) <= rank.max_num_batched_tokens
    assert all(seq.state is SequenceState.RUNNING for seq, _ in step.entries)
    rank.complete(step)
    check_between_steps(rank)
    return step


def drain(rank: RankScheduler, max_steps: int = 10_000) -> int:
    """Step until idle; return the number of steps (bounded, so a livelock fails the test)."""
    for count in range(max_steps):
        if run_step(rank) is None:
            return count
    raise AssertionError(f"rank still busy after {max_steps} steps")


# ----------------------------------------------------------------------------- sans-IO core


def test_engine_satisfies_protocol_and_factory_uses_mocker_settings() -> None:
    engine: Engine = create(WorkerSettings(worker_id="w", mocker=small_settings(block_size=8)))
    assert engine.config.block_size == 8
    assert engine.config.kv_total_blocks == 16
    assert engine.load()[0].kv_used_blocks == 0


def test_prefill_is_chunked_by_the_token_budget_and_every_decoder_advances() -> None:
    rank = scheduler(num_blocks=64, max_num_batched_tokens=8, max_num_seqs=8)
    sequences = [MockSequence(prompt_tokens=20, max_tokens=6) for _ in range(3)]
    for seq in sequences:
        rank.add(seq)
    steps = 0
    while (step := rank.schedule()) is not None:
        steps += 1
        assert steps < 200
        granted = dict(step.entries)
        assert sum(granted.values()) <= 8
        decoders = [s for s in rank.running if s.prefill_done]
        # With fewer decoders than budget, every one of them gets exactly one token.
        assert all(granted.get(s) == 1 for s in decoders)
        assert step.decode_sequences == len(decoders)
        assert step.prefill_tokens == sum(n for s, n in granted.items() if not s.prefill_done)
        rank.complete(step)
        check_counters(rank)
    assert [s.generated for s in sequences] == [6, 6, 6]
    # 60 prompt tokens at 8 per step cannot take fewer than 8 steps.
    assert steps >= 60 // 8
    assert rank.used_blocks == 0
    assert rank.prefill_tokens == 0


def test_a_step_gives_each_decoder_one_token_before_any_prefill() -> None:
    rank = scheduler(num_blocks=64, max_num_batched_tokens=4, max_num_seqs=8)
    early = [MockSequence(prompt_tokens=2, max_tokens=50) for _ in range(3)]
    for seq in early:
        rank.add(seq)
    run_step(rank)  # 3 * 2 prompt tokens do not fit 4: two prefill fully, one partly
    run_step(rank)
    assert all(s.prefill_done for s in early)
    late = MockSequence(prompt_tokens=40, max_tokens=1)
    rank.add(late)
    step = rank.schedule()
    assert step is not None
    granted = dict(step.entries)
    assert all(granted[s] == 1 for s in early)
    assert granted[late] == 1  # only the budget left after the three decoders
    assert step.prefill_tokens == 1
    assert step.decode_sequences == 3


def test_blocks_grow_per_block_size_tokens_and_are_freed_at_the_end() -> None:
    rank = scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    seq = MockSequence(prompt_tokens=5, max_tokens=4)
    rank.add(seq)
    assert rank.prefill_tokens == 5
    run_step(rank)  # prefill of 5 tokens: 2 blocks, first token emitted
    assert (seq.blocks, seq.generated, rank.prefill_tokens) == (2, 1, 0)
    held = []
    while not seq.done:
        run_step(rank)
        held.append(seq.blocks)
    # KV for 5 prompt + 3 fed-back generated tokens = 8 tokens = 2 blocks at most.
    assert seq.generated == 4
    assert held[-1] == 0
    assert max(held) == 2
    assert rank.used_blocks == 0


def test_running_sequences_preempt_the_newest_when_blocks_run_out_and_all_recover() -> None:
    # 4 blocks of 2 tokens; each request peaks at 2 + 5 = 7 tokens = 4 blocks: both cannot
    # grow to the end together, so the newer one is preempted and prefilled again later.
    rank = scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=16)
    older = MockSequence(prompt_tokens=2, max_tokens=6)
    newer = MockSequence(prompt_tokens=2, max_tokens=6)
    rank.add(older)
    rank.add(newer)
    drain(rank)
    assert rank.preemptions >= 1
    assert newer.preemptions >= 1
    assert older.preemptions == 0
    assert older.generated == 6
    assert newer.generated == 6
    assert rank.used_blocks == 0
    assert rank.prefill_tokens == 0


def test_waiting_work_waits_for_blocks_instead_of_preempting() -> None:
    rank = scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    big = MockSequence(prompt_tokens=16, max_tokens=1)
    small = MockSequence(prompt_tokens=4, max_tokens=1)
    rank.add(big)
    step = rank.schedule()
    assert step is not None
    rank.add(small)
    assert rank.free_blocks == 0
    rank.complete(step)  # big finishes in its prefill step (max_tokens 1) and frees its blocks
    assert big.state is SequenceState.FINISHED
    assert rank.free_blocks == 4
    # Now with big occupying the cache while small arrives: small waits in FIFO order.
    big2 = MockSequence(prompt_tokens=13, max_tokens=4)
    rank.add(big2)
    step = rank.schedule()
    assert step is not None
    assert small.state is SequenceState.RUNNING  # small was first in the queue and fits
    assert big2.state is SequenceState.WAITING  # 13 tokens need 4 blocks, only 3 are free
    assert rank.preemptions == 0
    rank.complete(step)
    drain(rank)
    assert big2.generated == 4
    assert rank.preemptions == 0
    assert rank.used_blocks == 0


def test_batch_never_exceeds_max_num_seqs() -> None:
    rank = scheduler(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    sequences = [MockSequence(prompt_tokens=1, max_tokens=3) for _ in range(5)]
    for seq in sequences:
        rank.add(seq)
    run_step(rank)
    assert len(rank.running) == 2
    assert rank.waiting_count == 3
    drain(rank)
    assert all(s.generated == 3 for s in sequences)


def test_abort_frees_blocks_at_once_in_every_state() -> None:
    rank = scheduler(num_blocks=16, max_num_batched_tokens=4)
    partial = MockSequence(prompt_tokens=10, max_tokens=3)
    waiting = MockSequence(prompt_tokens=3, max_tokens=3)
    rank.add(partial)
    rank.add(waiting)
    run_step(rank)
    assert partial.state is SequenceState.RUNNING
    assert not partial.prefill_done
    assert waiting.state is SequenceState.WAITING
    rank.abort(waiting)
    rank.abort(partial)
    check_counters(rank)
    assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)
    rank.abort(partial)  # a second abort is a no-op
    assert rank.schedule() is None


def test_abort_during_a_step_skips_the_sequence_when_the_step_completes() -> None:
    rank = scheduler()
    seq = MockSequence(prompt_tokens=4, max_tokens=3)
    rank.add(seq)
    step = rank.schedule()
    assert step is not None
    assert rank.used_blocks == 1
    rank.abort(seq)
    assert rank.used_blocks == 0
    assert rank.complete(step) == []
    check_counters(rank)
    assert seq.generated == 0


def test_many_cancelled_waiters_are_compacted_away() -> None:
    rank = scheduler(max_num_seqs=1)
    sequences = [MockSequence(prompt_tokens=1, max_tokens=1) for _ in range(300)]
    for seq in sequences:
        rank.add(seq)
    for seq in sequences[1:]:
        rank.abort(seq)
    check_counters(rank)
    assert rank.waiting_count == 1
    assert rank.live_sequences == 1
    assert drain(rank) == 1


def test_zero_max_tokens_and_empty_prompts_still_finish() -> None:
    rank = scheduler()
    empty = MockSequence(prompt_tokens=0, max_tokens=2)
    prefill_only = MockSequence(prompt_tokens=3, max_tokens=0)
    rank.add(empty)
    rank.add(prefill_only)
    drain(rank)
    assert empty.generated == 2
    assert prefill_only.generated == 0
    assert empty.done
    assert prefill_only.state is SequenceState.FINISHED


def test_step_model_follows_dynamo_polynomial() -> None:
    model = GpuStepModel()
    assert model.prefill_ms(0) == 0.0
    # 1000 prompt tokens: 0.42 + 15.18 + 16.50 ms.
    assert model.prefill_ms(1000) == pytest.approx(32.1, abs=0.1)
    assert model.decode_ms(0.0) == pytest.approx(5.74)
    assert model.decode_ms(1.0) == pytest.approx(34.01)
    assert model.decode_ms(5.0) == model.decode_ms(1.0)
    assert model.step_seconds(prefill_tokens=0, emitting=0, kv_fraction=0.0) == 0.001
    mixed = model.step_seconds(prefill_tokens=1000, emitting=3, kv_fraction=0.0)
    assert mixed == pytest.approx((32.1 + 5.74) / 1000, abs=1e-4)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("endpoint", "body", "fragment"),
    [
        ("completions", {}, "'prompt' is required"),
        ("completions", {"prompt": 3}, "'prompt' must be"),
        ("completions", {"prompt": ["a", 1]}, "'prompt' must be"),
        ("completions", {"prompt": []}, "'prompt' must be"),
        ("completions", {"prompt": "a", "max_tokens": -1}, "'max_tokens' must be"),
        ("completions", {"prompt": "a", "max_tokens": 1.5}, "'max_tokens' must be"),
        ("completions", {"prompt": "a", "max_tokens": "4"}, "'max_tokens' must be"),
        ("completions", {"prompt": "a", "max_tokens": True}, "'max_tokens' must be"),
        ("chat_completions", {}, "'messages'"),
        ("chat_completions", {"messages": []}, "'messages'"),
        ("chat_completions", {"messages": "hi"}, "'messages'"),
        ("chat_completions", {"messages": ["hi"]}, "messages[0] must be an object"),
        ("chat_completions", {"messages": [{"role": "user"}]}, "has no 'content'"),
        ("chat_completions", {"messages": [{"content": 5}]}, "messages[0].content"),
        (
            "chat_completions",
            {"messages": [{"content": [{"type": "text", "text": 5}]}]},
            "content[0].text",
        ),
        (
            "chat_completions",
            {"messages": [{"content": "a"}], "max_completion_tokens": -3},
            "'max_completion_tokens' must be",
        ),
        ("embeddings", {}, "'input' is required"),
        ("embeddings", {"input": [1, 2]}, "'input' must be"),
    ],
)
def test_bad_inputs_raise_engine_input_error(
    endpoint: Any, body: dict[str, Any], fragment: str
) -> None:
    engine = MockerEngine(small_settings())
    with pytest.raises(EngineInputError) as caught:
        engine.prepare(endpoint, body)
    assert fragment in str(caught.value)


def test_prompt_tokens_are_words_of_every_message_and_prompt() -> None:
    engine = MockerEngine(small_settings(num_gpu_blocks=1000))
    chat = engine.prepare(
        "chat_completions",
        {
            "messages": [
                {"role": "system", "content": "be  brief"},
                {"role": "user", "content": [{"type": "text", "text": "one two\nthree"}]},
                {"role": "assistant", "content": None, "tool_calls": []},
            ],
            "max_tokens": 3,
        },
    )
    assert (chat.prompt_tokens, chat.max_tokens) == (5, 3)
    listed = engine.prepare("completions", {"prompt": ["a b", "c"]})
    assert (listed.prompt_tokens, listed.max_tokens) == (3, DEFAULT_MAX_TOKENS)
    nulled = engine.prepare("completions", {"prompt": "a", "max_tokens": None})
    assert nulled.max_tokens == DEFAULT_MAX_TOKENS
    embed = engine.prepare("embeddings", {"input": ["x y", "z"]})
    assert (embed.prompt_tokens, embed.max_tokens) == (3, 0)


def test_a_request_bigger_than_the_whole_cache_is_refused() -> None:
    engine = MockerEngine(small_settings(num_gpu_blocks=4, block_size=4))
    engine.prepare("completions", completion(10, 7))  # peaks at 16 tokens: exactly fits
    with pytest.raises(EngineInputError, match="more than the KV cache holds"):
        engine.prepare("completions", completion(10, 8))
    with pytest.raises(EngineInputError, match="more than the KV cache holds"):
        engine.prepare("embeddings", {"input": words(17)})


def test_settings_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        MockerEngine(small_settings(num_gpu_blocks=0))
    with pytest.raises(ValueError, match="speedup_ratio"):
        MockerEngine(small_settings(speedup_ratio=0.0))


# ----------------------------------------------------------------------------- Trio shell


@pytest.mark.parametrize("max_tokens", [0, 1, 5, None])
async def test_generated_token_counts_are_exact(
    autojump_clock: trio.testing.MockClock, max_tokens: int | None
) -> None:
    engine = MockerEngine(small_settings())
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hello there"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    request = engine.prepare("chat_completions", body)
    expected = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    with trio.fail_after(60):
        async with running(engine):
            outputs = await collect(engine, request)
    assert sum(o.tokens for o in outputs) == expected
    assert outputs[-1].finish_reason == "length"
    assert all(o.finish_reason is None for o in outputs[:-1])
    if expected:
        assert len(outputs) == expected
        assert [o.text for o in outputs] == [output_word(i) for i in range(expected)]
    else:
        assert outputs == [EngineOutput(finish_reason="length", cached_tokens=0)]
    assert outputs[0].cached_tokens == 0
    assert engine.load()[0].kv_used_blocks == 0


async def test_blocks_return_to_zero_after_concurrent_requests_complete(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = MockerEngine(small_settings(num_gpu_blocks=8, block_size=4))
    counts: list[int] = []

    async def one(prompt_words: int, max_tokens: int) -> None:
        outputs = await collect(engine, engine.prepare("completions", completion(prompt_words, 6)))
        counts.append(sum(o.tokens for o in outputs))

    with trio.fail_after(60):
        async with running(engine), trio.open_nursery() as clients:
            for i in range(6):
                clients.start_soon(one, 3 + i, 6)
    assert counts == [6] * 6
    rank = engine.ranks[0]
    assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)
    assert rank.recount() == (0, 0)


async def test_cancel_mid_prefill_frees_blocks_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = MockerEngine(small_settings(num_gpu_blocks=32, max_num_batched_tokens=4))
    rank = engine.ranks[0]
    request = engine.prepare("completions", completion(40, 4))  # 10 prefill steps
    with trio.fail_after(60):
        async with running(engine):
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as clients:
                    clients.start_soon(collect, engine, request)
                    for _ in range(100):
                        await trio.sleep(0.001)
                        if rank.used_blocks >= 2:
                            break
                    seq = rank.running[0]
                    assert not seq.prefill_done
                    assert 0 < rank.prefill_tokens < 40
                    scope.cancel()
            assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)
            assert seq.state is SequenceState.ABORTED
            assert engine.load()[0].kv_used_blocks == 0


async def test_cancel_mid_decode_frees_blocks_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = MockerEngine(small_settings())
    rank = engine.ranks[0]
    request = engine.prepare("completions", completion(6, 10))
    with trio.fail_after(60):
        async with running(engine):
            received = 0
            async with aclosing(engine.generate(request)) as stream:
                async for _ in stream:
                    received += 1
                    if received == 3:
                        break
            assert received == 3
            assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)
            assert engine.load()[0].kv_used_blocks == 0


async def test_preemption_in_the_engine_still_gives_exact_counts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = MockerEngine(small_settings(num_gpu_blocks=6, block_size=2, max_num_batched_tokens=16))
    results: list[int] = []

    async def one() -> None:
        outputs = await collect(engine, engine.prepare("completions", completion(3, 8)))
        results.append(sum(o.tokens for o in outputs))

    with trio.fail_after(60):
        async with running(engine), trio.open_nursery() as clients:
            for _ in range(3):
                clients.start_soon(one)
    assert results == [8, 8, 8]
    assert engine.ranks[0].preemptions > 0
    assert engine.ranks[0].used_blocks == 0


async def test_data_parallel_ranks_share_the_load(autojump_clock: trio.testing.MockClock) -> None:
    engine = MockerEngine(small_settings(data_parallel_size=2))
    peak: list[list[int]] = []

    async def watch() -> None:
        version = 0
        while True:
            version = await engine.load_changed.wait_past(version)
            peak.append([rank.live_sequences for rank in engine.ranks])

    with trio.fail_after(60):
        async with running(engine) as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as clients:
                for i in range(4):
                    clients.start_soon(
                        collect, engine, engine.prepare("completions", completion(i, 3))
                    )
            await trio.sleep(1)
    assert [2, 2] in peak
    assert [load.dp_rank for load in engine.load()] == [0, 1]
    assert all(load.kv_used_blocks == 0 for load in engine.load())
    assert all(rank.used_blocks == 0 for rank in engine.ranks)


async def test_load_changes_bump_the_signal_and_the_loop_parks_when_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = MockerEngine(small_settings())
    seen: list[tuple[int, int]] = []

    async def watch() -> None:
        version = 0
        while True:
            version = await engine.load_changed.wait_past(version)
            load = engine.load()[0]
            seen.append((load.active_prefill_tokens, load.kv_used_blocks))

    with trio.fail_after(60):
        async with running(engine) as nursery:
            nursery.start_soon(watch)
            before = engine.load_changed.version
            await collect(engine, engine.prepare("completions", completion(6, 4)))
            await trio.lowlevel.checkpoint()
            assert engine.load_changed.version > before
            # Bumps collapse (latest wins), but the 6 pending prompt tokens were visible.
            assert any(prefill == 6 for prefill, _ in seen)
            assert any(blocks > 0 for _, blocks in seen)
            assert seen[-1] == (0, 0)
            settled = engine.load_changed.version
            (rank,) = engine.ranks
            scheduled = rank.schedule
            asked: list[object] = []

            def schedule() -> ScheduledStep | None:
                asked.append(None)
                return scheduled()

            rank.schedule = schedule  # type: ignore[method-assign]
            await trio.sleep(30)
            # Idle: the loop parked (no step asked for) and nothing was published while virtual
            # time passed.
            assert asked == []
            assert engine.load_changed.version == settled


async def test_embeddings_yield_one_vector_per_input_after_prefill(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = MockerEngine(small_settings())
    request = engine.prepare("embeddings", {"input": ["a b c", "d"]})
    with trio.fail_after(60):
        async with running(engine):
            outputs = await collect(engine, request)
            single = await collect(engine, engine.prepare("embeddings", {"input": "a b c"}))
    assert [o.index for o in outputs] == [0, 1]
    assert all(o.tokens == 0 and o.embedding is not None for o in outputs)
    first = outputs[0].embedding
    assert first is not None
    assert len(first) == EMBEDDING_DIMENSIONS
    assert first == single[0].embedding == embedding_for("a b c")
    assert first != outputs[1].embedding
    assert sum(v * v for v in first) == pytest.approx(1.0)
    assert engine.ranks[0].used_blocks == 0


def test_speedup_ratio_divides_the_simulated_time() -> None:
    async def simulated_seconds(speedup: float) -> float:
        engine = MockerEngine(small_settings(speedup_ratio=speedup))
        request = engine.prepare("completions", completion(12, 5))
        with trio.fail_after(60):
            async with running(engine):
                start = trio.current_time()
                await collect(engine, request)
                return trio.current_time() - start

    def measure(speedup: float) -> float:
        clock = trio.testing.MockClock(autojump_threshold=0)
        return trio.run(simulated_seconds, speedup, clock=clock)

    slow = measure(1.0)
    fast = measure(10.0)
    assert fast == pytest.approx(slow / 10)
    # Prefill steps of 8 and 4 tokens, then 4 decode steps: tens of milliseconds on a GPU.
    assert 0.02 < slow < 0.2


# ----------------------------------------------------------------------------- properties

request_shapes = st.tuples(st.integers(0, 12), st.integers(0, 8))


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), request_shapes),
            st.tuples(st.just("step"), st.just((0, 0))),
            st.tuples(st.just("abort"), st.tuples(st.integers(0, 30), st.just(0))),
        ),
        max_size=60,
    ),
    num_blocks=st.integers(5, 12),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 10),
    max_num_seqs=st.integers(1, 4),
)
def test_scheduler_invariants_hold_for_random_operation_mixes(
    ops: list[tuple[str, tuple[int, int]]],
    num_blocks: int,
    block_size: int,
    budget: int,
    max_num_seqs: int,
) -> None:
    rank = scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
    )
    added: list[MockSequence] = []
    for kind, (a, b) in ops:
        if kind == "add":
            if not rank.fits(a, b):
                continue
            seq = MockSequence(prompt_tokens=a, max_tokens=b)
            rank.add(seq)
            added.append(seq)
        elif kind == "step":
            run_step(rank)
        elif added:
            rank.abort(added[a % len(added)])
        check_counters(rank)
    drain(rank)
    assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)
    for seq in added:
        assert seq.done
        if seq.state is SequenceState.FINISHED:
            assert seq.generated == seq.max_tokens


async def _run_engine_scenario(
    requests: list[tuple[int, int, int | None, float]], dp: int, num_blocks: int
) -> None:
    """Start every request (after its delay), cancel some after a number of tokens, check."""
    engine = MockerEngine(
        small_settings(
            num_gpu_blocks=num_blocks, block_size=2, max_num_batched_tokens=6, data_parallel_size=dp
        )
    )
    over_budget: list[int] = []

    async def watch() -> None:
        version = 0
        while True:
            version = await engine.load_changed.wait_past(version)
            for load in engine.load():
                if load.kv_used_blocks > num_blocks:
                    over_budget.append(load.kv_used_blocks)

    async def client(
        prompt_words: int, max_tokens: int, cancel_after: int | None, delay: float
    ) -> None:
        await trio.sleep(delay)
        request = engine.prepare("completions", completion(prompt_words, max_tokens))
        received = 0
        last: EngineOutput | None = None
        async with aclosing(engine.generate(request)) as stream:
            async for output in stream:
                received += output.tokens
                last = output
                if cancel_after is not None and received >= cancel_after:
                    return
        assert received == max_tokens
        assert last is not None
        assert last.finish_reason == "length"

    with trio.fail_after(600):
        async with running(engine) as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as clients:
                for shape in requests:
                    clients.start_soon(client, *shape)
            await trio.lowlevel.checkpoint()
    assert over_budget == []
    for rank in engine.ranks:
        assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)
        assert rank.recount() == (0, 0)


@settings(max_examples=25, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(0, 8),
            st.integers(0, 6),
            st.one_of(st.none(), st.integers(0, 5)),
            st.sampled_from([0.0, 0.003, 0.01, 0.05]),
        ),
        min_size=1,
        max_size=10,
    ),
    dp=st.integers(1, 2),
    num_blocks=st.integers(7, 12),
)
def test_engine_gives_exact_counts_and_frees_everything_for_random_mixes(
    requests: list[tuple[int, int, int | None, float]], dp: int, num_blocks: int
) -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    trio.run(_run_engine_scenario, requests, dp, num_blocks, clock=clock)
