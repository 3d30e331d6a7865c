"""The mocker's prefix cache: the pool's rules (worker_ingress/engines/_kv_pool.py) and rule 8 of
the rank scheduler, as properties over random workloads, plus the engine end to end.

The model the properties compare with: a cache is a set of names closed under prefixes, at most
``num_blocks`` minus the held blocks big; a held block is always cached; what the events say
entered and left is exactly what the cache holds.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from shim_common.prefix import WordTokenizer, block_names
from worker_ingress._config import MockerSettings
from worker_ingress.engines._base import EngineOutput
from worker_ingress.engines._kv_pool import REMOVED, STORED, KvBlockPool
from worker_ingress.engines._mock_scheduler import MockSequence, RankScheduler, SequenceState
from worker_ingress.engines._mocker import MockerEngine

BLOCK = 2


def chain(prefix: tuple[int, ...], block_size: int = BLOCK) -> list[int]:
    return block_names(list(prefix), block_size)


class EventModel:
    """What a subscriber of the pool's events believes is cached."""

    def __init__(self) -> None:
        self.cached: dict[int, int | None] = {}

    def apply(self, pool: KvBlockPool) -> None:
        for kind, parent, names in pool.take_events():
            if kind == STORED:
                for name in names:
                    assert name not in self.cached, "stored twice without a removal"
                    assert parent is None or parent in self.cached, "stored under a missing parent"
                    self.cached[name] = parent
                    parent = name
            else:
                assert kind == REMOVED
                for name in names:
                    assert name in self.cached, "removed what was never stored"
                    del self.cached[name]


def check_rank(rank: RankScheduler, model: EventModel) -> None:
    pool = rank.pool
    model.apply(pool)
    cached = set(pool.names())
    # The events tell exactly what the cache holds, parents included.
    assert cached == set(model.cached)
    assert all(pool.parent_of(name) == parent for name, parent in model.cached.items())
    # Closed under prefixes: a cached block's parent is cached.
    assert all(parent is None or parent in cached for parent in model.cached.values())
    # Capacity (rule 1) and the recount of held blocks, shared ones once.
    assert pool.held + pool.evictable <= pool.num_blocks
    assert rank.recount()[0] == rank.used_blocks == pool.held
    # A held block is cached, and held by as many live sequences as the pool says.
    live = [*rank.running, *rank.waiting]
    holders: dict[int, int] = {}
    for seq in live:
        for name in seq.block_names[: seq.named]:
            holders[name] = holders.get(name, 0) + 1
    assert all(name in cached for name in holders)
    assert all(pool.holders(name) == count for name, count in holders.items())
    assert pool.evictable == sum(1 for name in cached if name not in holders)
    # A running sequence's named blocks are the leading blocks of its prompt, computed.
    for seq in rank.running:
        assert seq.named <= seq.num_computed // rank.block_size
        assert seq.named <= seq.blocks


# Prompts from a tiny alphabet of few shapes, so they share prefixes often.
prompts = st.lists(st.integers(0, 1), min_size=0, max_size=10).map(tuple)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), prompts, st.integers(0, 4)),
            st.tuples(st.just("step"), st.just(()), st.just(0)),
            st.tuples(st.just("abort"), st.just(()), st.integers(0, 30)),
        ),
        max_size=60,
    ),
    num_blocks=st.integers(6, 14),
    budget=st.integers(1, 8),
    max_num_seqs=st.integers(1, 4),
)
def test_the_cache_keeps_its_rules_under_random_workloads(
    ops: list[tuple[str, tuple[int, ...], int]], num_blocks: int, budget: int, max_num_seqs: int
) -> None:
    rank = RankScheduler(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
    )
    model = EventModel()
    added: list[MockSequence] = []
    for kind, prompt, number in ops:
        if kind == "add":
            if not rank.fits(len(prompt), number):
                continue
            seq = MockSequence(
                prompt_tokens=len(prompt), max_tokens=number, block_names=chain(prompt)
            )
            rank.add(seq)
            added.append(seq)
        elif kind == "step":
            step = rank.schedule()
            check_rank(rank, model)
            if step is not None:
                rank.complete(step)
        elif added:
            rank.abort(added[number % len(added)])
        check_rank(rank, model)
    for _ in range(10_000):
        step = rank.schedule()
        if step is None:
            break
        rank.complete(step)
        check_rank(rank, model)
    else:
        raise AssertionError("rank still busy after 10000 steps")
    assert (rank.used_blocks, rank.prefill_tokens, rank.live_sequences) == (0, 0, 0)
    for seq in added:
        assert seq.done
        if seq.state is SequenceState.FINISHED:
            assert seq.generated == seq.max_tokens
            assert seq.cached_tokens is not None
            assert seq.cached_tokens % BLOCK == 0
            assert seq.cached_tokens < max(seq.prompt_tokens, 1)
    assert rank.hit_tokens <= rank.queried_tokens


@settings(max_examples=100, deadline=None)
@given(
    history=st.lists(prompts, min_size=1, max_size=8),
    probe=prompts,
    num_blocks=st.integers(6, 12),
)
def test_a_prompt_reuses_its_longest_cached_prefix_and_prefills_only_the_rest(
    history: list[tuple[int, ...]], probe: tuple[int, ...], num_blocks: int
) -> None:
    # One request at a time: the cache is then exactly predictable from the LRU order alone.
    rank = RankScheduler(
        num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64
    )
    lru: list[int] = []  # a reference LRU of names, least recent first

    def run(prompt: tuple[int, ...]) -> MockSequence:
        seq = MockSequence(prompt_tokens=len(prompt), max_tokens=1, block_names=chain(prompt))
        rank.add(seq)
        prefilled = 0
        while (step := rank.schedule()) is not None:
            prefilled += step.prefill_tokens
            rank.complete(step)
        assert seq.state is SequenceState.FINISHED
        assert seq.cached_tokens is not None
        # Prefill time follows the uncached tokens only.
        assert prefilled == len(prompt) - seq.cached_tokens
        return seq

    for prompt in history:
        if not rank.fits(len(prompt), 1):
            continue
        names = chain(prompt)
        expected_hit = 0
        for name in names[: (len(prompt) - 1) // BLOCK]:
            if name not in lru:
                break
            expected_hit += 1
        # Reference: the hit blocks are held again, the rest of the prompt takes new blocks,
        # evicting the least recent until they fit; at the end the chain is released from its
        # end, so its last block is the least recent of it.
        for name in names[:expected_hit]:
            lru.remove(name)
        fresh = -(-len(prompt) // BLOCK) - expected_hit
        while len(lru) + expected_hit + fresh > num_blocks:
            lru.pop(0)
        seq = run(prompt)
        assert seq.cached_tokens == expected_hit * BLOCK
        for name in names:
            if name in lru:  # the last block of a prompt cached whole, computed again
                lru.remove(name)
        lru.extend(reversed(names))
        assert set(rank.pool.names()) == set(lru)
    if rank.fits(len(probe), 1):
        cached = set(rank.pool.names())
        longest = 0
        for name in chain(probe)[: (len(probe) - 1) // BLOCK]:
            if name not in cached:
                break
            longest += 1
        assert run(probe).cached_tokens == longest * BLOCK


def test_a_held_block_is_never_evicted_and_a_shared_block_counts_once() -> None:
    rank = RankScheduler(num_blocks=6, block_size=2, max_num_seqs=4, max_num_batched_tokens=64)
    shared = (1, 1, 1, 1)
    first = MockSequence(prompt_tokens=5, max_tokens=50, block_names=chain((*shared, 0)))
    rank.add(first)
    step = rank.schedule()
    assert step is not None
    rank.complete(step)
    assert rank.used_blocks == 3  # two named blocks and the partial one
    second = MockSequence(prompt_tokens=5, max_tokens=2, block_names=chain((*shared, 1)))
    rank.add(second)
    step = rank.schedule()
    assert step is not None
    rank.complete(step)
    # The two shared blocks count once.
    assert second.cached_tokens == 4
    assert rank.used_blocks == rank.recount()[0]
    assert rank.used_blocks < first.blocks + second.blocks
    for name in chain(shared):
        assert rank.pool.holders(name) == 2
    # Filling the rest of the cache evicts nothing that is held.
    while not second.done:
        step = rank.schedule()
        assert step is not None
        rank.complete(step)
    for name in chain(shared):
        assert name in rank.pool.names()
    rank.abort(first)


def test_prefix_caching_off_names_nothing_and_hits_nothing() -> None:
    rank = RankScheduler(
        num_blocks=8, block_size=2, max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=False
    )
    for _ in range(2):
        seq = MockSequence(prompt_tokens=4, max_tokens=1, block_names=chain((1, 2, 3, 4)))
        rank.add(seq)
        while (step := rank.schedule()) is not None:
            rank.complete(step)
        assert seq.cached_tokens == 0
    assert rank.pool.names() == []
    assert rank.pool.take_events() == []
    assert (rank.queried_tokens, rank.hit_tokens) == (0, 0)


def test_a_prompt_cached_whole_still_computes_its_last_block() -> None:
    rank = RankScheduler(num_blocks=8, block_size=2, max_num_seqs=4, max_num_batched_tokens=64)
    for expected in (0, 2):
        seq = MockSequence(prompt_tokens=4, max_tokens=1, block_names=chain((1, 2, 3, 4)))
        rank.add(seq)
        while (step := rank.schedule()) is not None:
            rank.complete(step)
        assert seq.cached_tokens == expected
    assert (rank.queried_tokens, rank.hit_tokens) == (8, 2)


def test_the_pool_refuses_to_overdraw() -> None:
    pool = KvBlockPool(2)
    pool.allocate(2)
    with pytest.raises(ValueError, match="1 blocks asked for, 0 free"):
        pool.allocate(1)


# ----------------------------------------------------------------------------- the engine


def engine_settings(**overrides: Any) -> MockerSettings:
    values: dict[str, Any] = {
        "num_gpu_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "speedup_ratio": 1.0,
    }
    values.update(overrides)
    return MockerSettings(**values)


async def first_token_time(engine: MockerEngine, body: dict[str, Any]) -> tuple[float, int]:
    request = engine.prepare("chat_completions", body)
    start = trio.current_time()
    first: EngineOutput | None = None
    async with aclosing(engine.generate(request)) as stream:
        async for output in stream:
            if first is None:
                first = output
                elapsed = trio.current_time() - start
    assert first is not None
    assert first.cached_tokens is not None
    return elapsed, first.cached_tokens


@pytest.mark.parametrize("caching", [True, False])
async def test_a_second_turn_hits_the_first_and_its_first_token_comes_sooner(
    autojump_clock: trio.testing.MockClock, caching: bool
) -> None:
    engine = MockerEngine(engine_settings(enable_prefix_caching=caching))
    history = " ".join(f"w{i}" for i in range(40))
    first_turn = {"messages": [{"role": "user", "content": history}], "max_tokens": 2}
    second_turn = {
        "messages": [
            {"role": "user", "content": history},
            {"role": "assistant", "content": "alpha bravo"},
            {"role": "user", "content": "and more"},
        ],
        "max_tokens": 2,
    }
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        with trio.fail_after(60):
            cold, cold_cached = await first_token_time(engine, second_turn | {"max_tokens": 1})
            _, _ = await first_token_time(engine, first_turn)
            warm, warm_cached = await first_token_time(engine, second_turn)
        nursery.cancel_scope.cancel()
    assert cold_cached == 0
    if caching:
        assert warm_cached == 40
        assert warm < cold
    else:
        assert warm_cached == 0
    assert engine.load()[0].active_decode_blocks == 0


def test_the_engine_names_blocks_of_the_shared_tokenisation() -> None:
    engine = MockerEngine(engine_settings())
    body = {"prompt": "a b c d e f g h i", "max_tokens": 1}
    prepared = engine.prepare("completions", body)
    expected = block_names(WordTokenizer().encode("a b c d e f g h i"), 4)
    assert prepared.payload.block_names == expected
    as_ids = engine.prepare("completions", {"prompt": WordTokenizer().encode("a b c d e f g h i")})
    assert as_ids.payload.block_names == expected
    assert as_ids.prompt_tokens == 9
    off = MockerEngine(engine_settings(enable_prefix_caching=False))
    assert off.prepare("completions", body).payload.block_names == []


async def test_the_engine_honours_the_rank_it_is_given(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = MockerEngine(engine_settings(data_parallel_size=3))
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        with trio.fail_after(60):
            for rank in (2, 1, 7, -1, None):
                request = engine.prepare("completions", {"prompt": "a b c d e", "max_tokens": 1})
                request = msgspec.structs.replace(request, dp_rank=rank)
                async with aclosing(engine.generate(request)) as stream:
                    async for _ in stream:
                        pass
        nursery.cancel_scope.cancel()
    # Ranks 2 and 1 were asked for; 7 and -1 fell back to the least loaded (rank 0).
    assert [r.queried_tokens for r in engine.ranks] == [15, 5, 5]
