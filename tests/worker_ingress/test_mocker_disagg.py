"""The mocker in disaggregated serving: a prefill hop ends with a hand-off, a decode hop receives
the prompt's KV and decodes. The sans-IO rank scheduler first (rule 9 of _mock_scheduler), then
the Trio shell on trio's virtual clock, where the transfer's time is exact.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from shim_common.prefix import WordTokenizer, block_names, prompt_token_ids
from shim_common.wire import Handoff
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress.engines._base import EngineOutput, PreparedRequest, hands_off_kv
from worker_ingress.engines._mock_scheduler import (
    GpuStepModel,
    MockSequence,
    RankScheduler,
    SequenceState,
)
from worker_ingress.engines._mocker import MockerEngine, create

BLOCK = 4

# ----------------------------------------------------------------------------- helpers


def scheduler(**overrides: Any) -> RankScheduler:
    values: dict[str, Any] = {
        "num_blocks": 16,
        "block_size": BLOCK,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 8,
    }
    values.update(overrides)
    return RankScheduler(**values)


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


def check(rank: RankScheduler) -> None:
    """The counters agree with a recount; nothing is overdrawn; the batch, transfers included,
    stays within ``max_num_seqs``; a transfer holds its whole prompt and waits for no prefill."""
    assert rank.recount() == (rank.used_blocks, rank.prefill_tokens)
    assert 0 <= rank.used_blocks <= rank.num_blocks
    assert len(rank.running) + len(rank.transferring) <= rank.max_num_seqs
    for seq in rank.transferring:
        assert seq.state is SequenceState.TRANSFERRING
        assert seq.blocks == -(-seq.prompt_tokens // rank.block_size)
        assert seq.pending_prefill == 0


def step(rank: RankScheduler) -> bool:
    check(rank)
    scheduled = rank.schedule()
    check(rank)
    if scheduled is None:
        return False
    assert all(seq.state is SequenceState.RUNNING for seq, _ in scheduled.entries)
    rank.complete(scheduled)
    check(rank)
    return True


def drain(rank: RankScheduler, max_steps: int = 10_000) -> None:
    """Step until idle, finishing every transfer that starts (bounded: a livelock fails)."""
    for _ in range(max_steps):
        progressed = step(rank)
        rank.take_started_transfers()
        transfers = rank.transferring
        for seq in transfers:
            rank.finish_transfer(seq)
        if not progressed and not transfers:
            return
    raise AssertionError(f"rank still busy after {max_steps} steps")


# ----------------------------------------------------------------------------- sans-IO core


def test_a_handoff_holds_its_whole_prompt_from_the_transfers_start_and_never_prefills() -> None:
    rank = scheduler()
    seq = MockSequence(prompt_tokens=9, max_tokens=3, handed_off=True)  # 2 full blocks + 1 token
    rank.add(seq)
    assert rank.prefill_tokens == 0
    assert rank.schedule() is None  # no step computes for a transfer
    assert rank.take_started_transfers() == [seq]
    assert seq.state is SequenceState.TRANSFERRING
    # The last partial block too, counted as any running sequence's blocks are.
    assert rank.used_blocks == blocks_for(9) == 3
    assert rank.load(0).active_decode_blocks == rank.load(0).kv_used_blocks == 3
    assert rank.load(0).active_prefill_tokens == 0
    assert rank.schedule() is None
    assert rank.take_started_transfers() == []

    rank.finish_transfer(seq)
    first = rank.schedule()
    assert first is not None
    # A decode step: the prompt's last token, and the first output comes out of it.
    assert (first.prefill_tokens, first.decode_sequences, first.emitting) == (0, 1, 1)
    assert first.entries == [(seq, 1)]
    assert rank.complete(first) == [seq]
    assert seq.generated == 1
    drain(rank)
    assert seq.done
    assert seq.generated == 3
    assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)


def test_a_cancel_in_the_middle_of_a_transfer_frees_exactly_its_blocks() -> None:
    rank = scheduler()
    other = MockSequence(prompt_tokens=6, max_tokens=4)
    rank.add(other)
    step(rank)
    held_by_other = rank.used_blocks
    seq = MockSequence(prompt_tokens=13, max_tokens=2, handed_off=True)
    rank.add(seq)
    step(rank)
    assert rank.take_started_transfers() == [seq]
    assert rank.used_blocks == held_by_other + blocks_for(13)
    rank.abort(seq)
    assert seq.state is SequenceState.ABORTED
    assert rank.used_blocks == held_by_other
    assert rank.transferring == []
    rank.finish_transfer(seq)  # the transfer's end, after the cancel: nothing
    assert rank.used_blocks == held_by_other
    check(rank)
    drain(rank)
    assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)


def test_a_cancel_before_or_after_the_transfer_frees_exactly_too() -> None:
    rank = scheduler(num_blocks=4)
    big = MockSequence(prompt_tokens=12, max_tokens=2)
    rank.add(big)
    step(rank)
    waiting = MockSequence(prompt_tokens=8, max_tokens=2, handed_off=True)
    rank.add(waiting)
    step(rank)
    # Two blocks are not free: the hand-off waits, holding nothing.
    assert (waiting.state, waiting.blocks, rank.take_started_transfers()) == (
        SequenceState.WAITING,
        0,
        [],
    )
    rank.abort(waiting)
    check(rank)
    decoding = MockSequence(prompt_tokens=5, max_tokens=6, handed_off=True)
    rank.add(decoding)
    drain_until = 100
    while decoding.state is not SequenceState.TRANSFERRING and drain_until:
        step(rank)
        drain_until -= 1
    assert rank.take_started_transfers() == [decoding]
    rank.finish_transfer(decoding)
    step(rank)
    step(rank)
    assert decoding.generated == 2
    rank.abort(decoding)
    check(rank)
    drain(rank)
    assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)


def test_a_handoff_waits_its_turn_for_blocks_and_batch_places() -> None:
    rank = scheduler(num_blocks=6, max_num_seqs=2)
    first = MockSequence(prompt_tokens=16, max_tokens=1, handed_off=True)
    second = MockSequence(prompt_tokens=8, max_tokens=1, handed_off=True)
    third = MockSequence(prompt_tokens=1, max_tokens=1)
    for seq in (first, second, third):
        rank.add(seq)
    step(rank)
    # Four blocks for the first; the second's two fit too; the third has no batch place.
    assert rank.take_started_transfers() == [first, second]
    assert third.state is SequenceState.WAITING
    assert rank.used_blocks == 6
    rank.finish_transfer(first)
    drain(rank)
    assert all(seq.state is SequenceState.FINISHED for seq in (first, second, third))
    assert rank.used_blocks == 0


def test_a_preempted_handoff_is_prefilled_again_like_any_sequence() -> None:
    rank = scheduler(num_blocks=4, max_num_batched_tokens=16)
    seq = MockSequence(prompt_tokens=8, max_tokens=6, handed_off=True)
    rank.add(seq)
    step(rank)
    rank.take_started_transfers()
    rank.finish_transfer(seq)
    newer = MockSequence(prompt_tokens=4, max_tokens=8)
    rank.add(newer)
    preempted = 0
    for _ in range(100):
        step(rank)
        if seq.preemptions or newer.preemptions:
            preempted += 1
            break
    assert preempted
    victim = seq if seq.preemptions else newer
    assert victim.state is SequenceState.WAITING
    assert not victim.handed_off
    assert rank.prefill_tokens >= victim.num_tokens
    drain(rank)
    assert seq.done
    assert seq.generated == 6
    assert (rank.used_blocks, rank.prefill_tokens) == (0, 0)


def test_a_handed_off_prompts_full_blocks_enter_the_cache_as_they_decode() -> None:
    rank = scheduler()
    names = block_names(list(range(9)), BLOCK)
    seq = MockSequence(prompt_tokens=9, max_tokens=2, block_names=names, handed_off=True)
    rank.add(seq)
    step(rank)
    rank.take_started_transfers()
    rank.finish_transfer(seq)
    assert rank.pool.cached == 0
    drain(rank)
    # Named by the step that completed them (rule 8), cached and evictable once it finished.
    assert rank.pool.names() == names
    assert (rank.used_blocks, rank.pool.evictable) == (0, 2)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "handoff", "step", "finish", "abort"]),
            st.tuples(st.integers(0, 40), st.integers(0, 6)),
        ),
        max_size=60,
    ),
    num_blocks=st.integers(5, 12),
    budget=st.integers(1, 10),
    max_num_seqs=st.integers(1, 4),
)
def test_counts_stay_exact_for_random_mixes_of_handoffs_and_prefills(
    ops: list[tuple[str, tuple[int, int]]], num_blocks: int, budget: int, max_num_seqs: int
) -> None:
    rank = scheduler(
        num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs
    )
    added: list[MockSequence] = []
    started: list[MockSequence] = []
    for kind, (a, b) in ops:
        if kind in ("add", "handoff"):
            prompt = a if kind == "add" else max(a, 1)
            if not rank.fits(prompt, b):
                continue
            seq = MockSequence(prompt_tokens=prompt, max_tokens=b, handed_off=kind == "handoff")
            rank.add(seq)
            added.append(seq)
        elif kind == "step":
            step(rank)
            started.extend(rank.take_started_transfers())
        elif kind == "finish" and started:
            rank.finish_transfer(started.pop(a % len(started)))
        elif added:
            rank.abort(added[a % len(added)])
        check(rank)
    for seq in started:
        rank.finish_transfer(seq)
    drain(rank)
    assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)
    for seq in added:
        assert seq.done
        if seq.state is SequenceState.FINISHED:
            assert seq.generated == seq.max_tokens


# ----------------------------------------------------------------------------- the Trio shell


def mocker_settings(**overrides: Any) -> MockerSettings:
    values: dict[str, Any] = {
        "num_gpu_blocks": 64,
        "block_size": BLOCK,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "kv_bytes_per_token": 1_000_000,
    }
    values.update(overrides)
    return MockerSettings(**values)


def completion(prompt_words: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": " ".join(f"w{i}" for i in range(prompt_words)), "max_tokens": max_tokens}


@asynccontextmanager
async def running(*engines: MockerEngine) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        for engine in engines:
            await nursery.start(engine.run)
        yield
        nursery.cancel_scope.cancel()


async def collect(engine: MockerEngine, request: PreparedRequest) -> list[EngineOutput]:
    async with aclosing(engine.generate(request)) as stream:
        return [output async for output in stream]


def prefill_request(engine: MockerEngine, body: dict[str, Any]) -> PreparedRequest:
    prepared = engine.prepare("completions", body)
    return PreparedRequest(
        endpoint=prepared.endpoint,
        prompt_tokens=prepared.prompt_tokens,
        max_tokens=prepared.max_tokens,
        payload=prepared.payload,
        prefill_only=True,
    )


def decode_request(engine: MockerEngine, body: dict[str, Any], handoff: Handoff) -> PreparedRequest:
    prepared = engine.prepare("completions", body)
    return PreparedRequest(
        endpoint=prepared.endpoint,
        prompt_tokens=prepared.prompt_tokens,
        max_tokens=prepared.max_tokens,
        payload=prepared.payload,
        handoff=handoff,
    )


def test_every_mocker_hands_kv_off_and_names_its_worker() -> None:
    engine = create(WorkerSettings(worker_id="p-1", mocker=mocker_settings()))
    assert hands_off_kv(engine)
    assert not hands_off_kv(object())


async def test_a_prefill_hop_ends_with_a_handoff_and_its_blocks_cached(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = MockerEngine(mocker_settings(), worker_id="p-1")
    body = completion(10, 5)
    names = block_names(prompt_token_ids("completions", body, WordTokenizer()), BLOCK)
    async with running(engine):
        (output,) = await collect(engine, prefill_request(engine, body))
        # The second time the prompt's full blocks are found in the cache.
        (again,) = await collect(engine, prefill_request(engine, body))
    handoff = output.handoff
    assert handoff is not None
    assert (output.tokens, output.text, output.finish_reason) == (0, "", None)
    assert (output.cached_tokens, again.cached_tokens) == (0, 8)
    assert handoff.worker_id == "p-1"
    assert (handoff.dp_rank, handoff.block_size, handoff.prompt_tokens) == (0, BLOCK, 10)
    assert handoff.block_names == names
    assert handoff.kv_bytes == 10 * 1_000_000
    assert again.handoff is not None
    assert again.handoff.cached_tokens == 8
    assert again.handoff.handle != handoff.handle
    rank = engine.ranks[0]
    # Given back, evictable, as a finished request's: the hand-off names what is cached.
    assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)
    assert rank.pool.names() == names
    assert rank.pool.evictable == len(names)


@pytest.mark.parametrize("speedup", [1.0, 10.0])
async def test_a_decode_hop_waits_out_the_transfer_holding_its_blocks_then_decodes(
    autojump_clock: trio.testing.MockClock, speedup: float
) -> None:
    bandwidth = 2.0  # GB/s: 10 tokens of 1 MB each take 5 ms
    prefill = MockerEngine(mocker_settings(), worker_id="p-1")
    decode = MockerEngine(
        mocker_settings(kv_transfer_bandwidth=bandwidth, speedup_ratio=speedup), worker_id="d-1"
    )
    body = completion(10, 3)
    async with running(prefill, decode):
        (done,) = await collect(prefill, prefill_request(prefill, body))
        assert done.handoff is not None
        handoff = msgspec_replace(done.handoff, cached_tokens=4)
        rank = decode.ranks[0]
        outputs: list[tuple[float, EngineOutput]] = []
        start = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                request = decode_request(decode, body, handoff)
                async with aclosing(decode.generate(request)) as stream:
                    async for output in stream:
                        outputs.append((trio.current_time(), output))

            nursery.start_soon(run)
            await trio.sleep(0.001)
            # In the middle of the transfer: the whole prompt's blocks, no prefill.
            assert rank.transferring != []
            assert decode.load()[0].kv_used_blocks == decode.load()[0].active_decode_blocks == 3
            assert decode.load()[0].active_prefill_tokens == 0
    transfer = handoff.kv_bytes / (bandwidth * 1e9)
    assert transfer == pytest.approx(0.005)
    # The transfer is not divided by the speedup ratio (as in Dynamo's mocker); the decode
    # step after it is.
    first_step = GpuStepModel().step_seconds(
        prefill_tokens=0, emitting=1, kv_fraction=3 / decode.config.kv_total_blocks
    )
    first_at, first = outputs[0]
    assert first_at - start == pytest.approx(transfer + first_step / speedup)
    assert sum(output.tokens for _, output in outputs) == 3
    assert outputs[-1][1].finish_reason == "length"
    assert first.cached_tokens == 4  # the hand-off's
    assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)


def msgspec_replace(handoff: Handoff, **changes: Any) -> Handoff:
    import msgspec

    return msgspec.structs.replace(handoff, **changes)


async def test_without_a_bandwidth_the_kv_arrives_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    prefill = MockerEngine(mocker_settings())
    decode = MockerEngine(mocker_settings())
    body = completion(7, 1)
    async with running(prefill, decode):
        (done,) = await collect(prefill, prefill_request(prefill, body))
        assert done.handoff is not None
        start = trio.current_time()
        (output,) = await collect(decode, decode_request(decode, body, done.handoff))
        took = trio.current_time() - start
    step_time = GpuStepModel().step_seconds(
        prefill_tokens=0, emitting=1, kv_fraction=2 / decode.config.kv_total_blocks
    )
    assert took == pytest.approx(step_time)
    assert (output.tokens, output.finish_reason) == (1, "length")


async def test_a_decode_hop_cancelled_in_the_middle_of_its_transfer_frees_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    decode = MockerEngine(mocker_settings(kv_transfer_bandwidth=1.0))
    body = completion(10, 50)
    handoff = Handoff(
        handle="h-1",
        worker_id="p-1",
        dp_rank=0,
        block_size=BLOCK,
        prompt_tokens=10,
        cached_tokens=0,
        block_names=[],
        kv_bytes=10**9,  # a second at 1 GB/s
    )
    rank = decode.ranks[0]
    seen: list[int] = []

    async def watch() -> None:
        version = 0
        while True:
            version = await decode.load_changed.wait_past(version)
            seen.append(decode.load()[0].kv_used_blocks)

    async with running(decode), trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        with trio.move_on_after(0.5) as scope:
            await collect(decode, decode_request(decode, body, handoff))
        assert scope.cancelled_caught
        assert (rank.used_blocks, rank.live_sequences, rank.transferring) == (0, 0, [])
        assert decode.load()[0].kv_used_blocks == 0
        nursery.cancel_scope.cancel()
    assert seen[0] == 3
    assert seen[-1] == 0
    assert math.isclose(trio.current_time(), 0.5, abs_tol=0.01)
