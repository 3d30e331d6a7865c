"""Tenants share the mocker's prefix cache (rules 7 and 8 of worker_ingress/engines/_kv_pool.py).

The attack: one tenant floods a rank with unique prompts (twice the cache's blocks between two
turns of another tenant's conversation). Under plain LRU the flood evicts the conversation's
prefix before each of its turns, and every turn is prefilled from scratch; under the pool's rule
the flooding tenant evicts its own blocks once it owns more than the victim. Sans-IO: a
:class:`RankScheduler` driven step by step, the same scenario at 1,024 and 16,384 blocks.
"""

from __future__ import annotations

import random

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from worker_harness import (
    TIMEOUT,
    collect_until_final,
    make_settings,
    new_worker,
    request_plane,
    running,
    send,
)

from shim_common.prefix import block_names
from shim_common.wire import Generate
from worker_ingress._config import MockerSettings
from worker_ingress.engines._kv_pool import KvBlockPool
from worker_ingress.engines._mock_scheduler import MockSequence, RankScheduler
from worker_ingress.engines._mocker import MockerEngine

BLOCK = 16
#: Requests a rank runs at once: the admission gate's N of a worker in front of it.
RUNNING = 4
TURNS = 8
#: Tokens of the conversation's system prompt, and what each turn adds (an answer, a question).
SYSTEM = 1024
TURN = 64


def run_until_idle(rank: RankScheduler) -> None:
    for _ in range(100_000):
        step = rank.schedule()
        if step is None:
            return
        rank.complete(step)
    raise AssertionError("the rank never went idle")


def victim_share(num_blocks: int, *, attacker: str, seed: int = 1) -> tuple[float, list[int]]:
    """The victim's cached share over its turns (cached prompt tokens over prompt tokens,
    each turn at its first admission), and the tokens each turn had to prefill."""
    rng = random.Random(seed)
    rank = RankScheduler(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_seqs=RUNNING,
        max_num_batched_tokens=8192,
    )
    # The conversation: a system prompt, then each turn adds the answer and a new question.
    conversation = [rng.randrange(50_000) for _ in range(SYSTEM)]
    flood_blocks = num_blocks // 16  # one attacker prompt: a sixteenth of the cache
    cached = prompted = 0
    prefilled: list[int] = []
    for turn in range(TURNS):
        conversation += [rng.randrange(50_000) for _ in range(TURN)]
        flood = [
            MockSequence(
                prompt_tokens=flood_blocks * BLOCK,
                max_tokens=1,
                block_names=[rng.getrandbits(63) for _ in range(flood_blocks)],
                tenant=attacker,
            )
            for _ in range(32)  # twice the cache, between two turns
        ]
        victim = MockSequence(
            prompt_tokens=len(conversation),
            max_tokens=32,
            block_names=block_names(conversation, BLOCK),
            tenant="victim",
        )
        for seq in flood[:16]:
            rank.add(seq)
        rank.add(victim)  # the turn arrives in the middle of the flood
        for seq in flood[16:]:
            rank.add(seq)
        run_until_idle(rank)
        assert victim.cached_tokens is not None
        if turn:  # the first turn has nothing to find
            cached += victim.cached_tokens
            prompted += victim.prompt_tokens
            prefilled.append(victim.prompt_tokens - victim.cached_tokens)
    return cached / prompted, prefilled


def unattacked_share(num_blocks: int) -> float:
    # The same turns, with the attacker's prompts sent as the victim's own tenant: one tenant,
    # plain LRU (rule 8), so what the victim keeps is what any cache of this size keeps when
    # the flood is its own. Without the flood at all the share is the same turns' prefixes.
    rng = random.Random(1)
    rank = RankScheduler(
        num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=RUNNING, max_num_batched_tokens=8192
    )
    conversation = [rng.randrange(50_000) for _ in range(SYSTEM)]
    cached = prompted = 0
    for turn in range(TURNS):
        conversation += [rng.randrange(50_000) for _ in range(TURN)]
        victim = MockSequence(
            prompt_tokens=len(conversation),
            max_tokens=32,
            block_names=block_names(conversation, BLOCK),
            tenant="victim",
        )
        rank.add(victim)
        run_until_idle(rank)
        assert victim.cached_tokens is not None
        if turn:
            cached += victim.cached_tokens
            prompted += victim.prompt_tokens
    return cached / prompted


@pytest.mark.parametrize("num_blocks", [1024, 16384])
def test_a_tenants_flood_of_unique_prompts_leaves_another_tenants_prefix_cached(
    num_blocks: int,
) -> None:
    alone = unattacked_share(num_blocks)
    assert alone > 0.9  # each turn finds the one before it
    # The flood from the victim's own tenant is plain LRU, as before tenants were known: the
    # conversation is evicted before every turn (the attack as it was, whatever the tenants).
    shared_share, _ = victim_share(num_blocks, attacker="victim")
    assert shared_share < 0.1
    # From another tenant, the flood evicts its own blocks.
    fair_share, prefilled = victim_share(num_blocks, attacker="attacker")
    assert fair_share >= 0.85 * alone
    assert max(prefilled) <= 2 * TURN + BLOCK  # only what each turn added, not the whole prefix


def test_one_tenant_is_plain_lru_in_release_order() -> None:
    # Rule 8: with one tenant, whatever its name, eviction follows release order exactly.
    for tenant in ("", "only"):
        pool = KvBlockPool(4)
        for name in (1, 2, 3, 4):
            pool.allocate(1)
            pool.commit(None, name, tenant)
        pool.release([3], tenant)
        pool.release([1], tenant)
        pool.release([4, 2], tenant)  # the last first: 2, then 4
        pool.allocate(3)
        assert pool.take_events()[-1] == ("removed", None, [3, 1, 2])


def test_the_tenant_owning_the_most_gives_a_block_up_first() -> None:
    pool = KvBlockPool(6)
    for tenant, names in (("small", [1]), ("big", [2, 3, 4])):
        for name in names:
            pool.allocate(1)
            pool.commit(None, name, tenant)
        pool.release(names, tenant)  # a chain: the last first
    # "small" released first (least recently used overall), but "big" owns three times more.
    pool.take_events()
    pool.allocate(4)
    assert pool.take_events() == [("removed", None, [4, 3])]
    pool.allocate(1)  # now the two own one block each: the usage that stood longer goes first
    assert pool.take_events() == [("removed", None, [1])]
    assert (pool.usage("small"), pool.usage("big")) == (0, 1)


def test_a_shared_block_belongs_to_the_last_tenant_that_let_it_go() -> None:
    pool = KvBlockPool(4)
    pool.allocate(1)
    pool.commit(None, 7, "a")
    pool.acquire([7])  # "b" finds it cached and holds it too
    pool.release([7], "a")
    assert (pool.owner_of(7), pool.usage("a"), pool.usage("b")) == ("a", 1, 0)
    pool.release([7], "b")
    assert (pool.owner_of(7), pool.usage("a"), pool.usage("b")) == ("b", 0, 1)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["commit", "release", "acquire", "allocate"]), st.integers(0, 3)),
        max_size=120,
    )
)
def test_usage_and_eviction_keep_rule_7_under_random_operations(
    ops: list[tuple[str, int]],
) -> None:
    # A model of rule 7 beside the pool: owners, usages, and the victim of each eviction.
    pool = KvBlockPool(8)
    tenants = ["", "a", "b", "c"]
    held: list[tuple[int, str]] = []  # (name, tenant) holds, in the order taken
    anonymous = 0
    names = iter(range(1, 10**6))
    last_released: dict[int, int] = {}
    clock = iter(range(10**6))
    for kind, which in ops:
        tenant = tenants[which]
        if kind == "allocate" and pool.free >= 1:
            before = {name: pool.owner_of(name) for name in pool.names() if not pool.holders(name)}
            usage = {t: pool.usage(t) for t in tenants}
            pool.allocate(1)
            anonymous += 1
            evicted = [n for event in pool.take_events() for n in event[2] if event[0] == "removed"]
            for name in evicted:
                owner = before[name]
                owners = {before[n] for n in before}
                # The victim's tenant owns the most among those with something evictable ...
                assert usage[owner] == max(usage[t] for t in owners)
                # ... and the block is its least recently released one.
                assert last_released[name] == min(
                    last_released[n] for n in before if before[n] == owner
                )
        elif kind == "commit" and anonymous:
            anonymous -= 1
            name = next(names)
            pool.commit(None, name, tenant)
            held.append((name, tenant))
        elif kind == "acquire":
            free = [n for n in pool.names() if not pool.holders(n)]
            if free:
                pool.acquire([free[0]])
                held.append((free[0], tenant))
        elif kind == "release" and held:
            name, holder = held.pop(0)
            pool.release([name], holder)
            if not pool.holders(name):
                last_released[name] = next(clock)
                assert pool.owner_of(name) == holder
        pool.take_events()
        cached = pool.names()
        assert sum(pool.usage(t) for t in tenants) == len(cached)
        for t in tenants:
            assert pool.usage(t) == sum(1 for n in cached if pool.owner_of(n) == t)
        assert pool.evictable == sum(1 for n in cached if not pool.holders(n))
        assert pool.held + pool.evictable <= pool.num_blocks


async def test_the_tenant_of_a_generate_owns_the_blocks_its_prompt_leaves_cached() -> None:
    # Through a real worker: the gate reads Generate.tenant, and so does the engine's cache.
    settings = make_settings(
        mocker=MockerSettings(num_gpu_blocks=64, block_size=4, speedup_ratio=1000.0)
    )
    engine = MockerEngine(settings.mocker)
    prompts = {"acme": "one two three four five six seven eight nine", "": "a b c d e f g h i"}
    with trio.fail_after(TIMEOUT):
        async with running(new_worker(settings, engine)) as address, request_plane(address) as ws:
            for request_id, (tenant, prompt) in enumerate(prompts.items()):
                generate = Generate(
                    request_id=request_id,
                    endpoint="completions",
                    body={"prompt": prompt, "max_tokens": 1},
                    tenant=tenant,
                )
                await send(ws, generate)
                await collect_until_final(ws, {request_id})
    pool = engine.ranks[0].pool
    assert (pool.usage("acme"), pool.usage("")) == (2, 2)
