"""End-to-end: ``--router-mode kv`` through real processes (a frontend and two mockers with their
prefix caches on), on loopback, under ``trio.fail_after``.

The second turn of a conversation resends the first turn's prompt: the kv router sends it where
that prefix is cached, and the worker's answer says so in ``usage.prompt_tokens_details``.
Round-robin, side by side, sends it to the other worker (two workers), where nothing is cached:
the test would fail for a router that ignored the cache.
"""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any

import pytest
import trio
from test_e2e import (
    MODEL,
    call,
    clean_env,
    frontend_cmd,
    metric,
    started,
    wait_connected,
    wait_for_metric,
    worker_cmd,
)

pytestmark = pytest.mark.e2e

TIMEOUT = 60.0
BLOCK = 4
WORKER_FLAGS = ("--speedup-ratio", "50", "--block-size", str(BLOCK), "--num-gpu-blocks", "4096")
CONVERSATIONS = 6


def chat(words: list[str]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(words)}],
        "max_tokens": 2,
    }


async def cached_tokens(frontend: str, words: list[str]) -> int:
    # From an idle picture: the worker's last load event, sent while the previous turn ran,
    # may still be on its way, and its blocks would weigh against the cache (this test is about
    # the cache; how long a finished request's load lingers is another's).
    for name in ("active_decode_blocks", "active_prefill_tokens"):
        metric = f"dynamo_frontend_worker_{name}"
        await wait_for_metric(frontend, metric, lambda total: total == 0, f"{metric} at 0")
    status, body = await call(frontend, "POST", "/v1/chat/completions", chat(words))
    assert status == 200, body
    usage = json.loads(body)["usage"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


async def second_turns(frontend: str, seed: int) -> list[tuple[int, int]]:
    """(cached tokens of the first turn, of the second) for each conversation, one at a time."""
    rng = random.Random(seed)
    found = []
    for conversation in range(CONVERSATIONS):
        first = [f"c{seed}-{conversation}-{rng.randrange(10**6)}" for _ in range(40)]
        second = [*first, *(f"r{rng.randrange(10**6)}" for _ in range(12))]
        found.append((await cached_tokens(frontend, first), await cached_tokens(frontend, second)))
    return found


@pytest.mark.parametrize("events", ["--router-kv-events", "--no-router-kv-events"])
async def test_a_second_turn_lands_where_the_first_is_cached(events: str) -> None:
    env = clean_env()
    with trio.fail_after(TIMEOUT):
        async with (
            started(worker_cmd(*WORKER_FLAGS, "--worker-id", "w-a"), env) as (a, _),
            started(worker_cmd(*WORKER_FLAGS, "--worker-id", "w-b"), env) as (b, _),
        ):
            workers = ("--worker", a, "--worker", b)
            async with (
                started(frontend_cmd("--router-mode", "kv", events, *workers), env) as (kv,),
                started(frontend_cmd("--router-mode", "round-robin", *workers), env) as (rr,),
            ):
                await wait_connected(kv, 2)
                await wait_connected(rr, 2)
                by_kv = await second_turns(kv, seed=1)
                by_rr = await second_turns(rr, seed=2)
    # Each conversation is new: its first turn finds nothing; the kv router's second turn finds
    # all of the first turn's full blocks (40 words: 10 blocks of 4).
    assert [first for first, _ in by_kv] == [0] * CONVERSATIONS
    assert [second for _, second in by_kv] == [40] * CONVERSATIONS
    # Round-robin alternates between the two workers: the second turn finds nothing.
    assert [second for _, second in by_rr] == [0] * CONVERSATIONS


BURST_WORKERS = 4
BURST = 8
#: Rounds of the burst, each on a fresh fleet picture (the race is repeated, not run once).
BURST_ROUNDS = 3


async def test_a_burst_spreads_before_any_worker_has_answered() -> None:
    # Requests that arrive together are routed before the first of them has its first reply
    # from a worker. Each pick must see the ones before it on their ranks (the router's own
    # charge is made at the pick), or the whole burst goes to the rank that looked emptiest.
    # Equal prompts, nothing shared, long answers: each worker gets exactly its share.
    env = clean_env()
    flags = ("--speedup-ratio", "1", "--block-size", str(BLOCK), "--num-gpu-blocks", "4096")
    with trio.fail_after(TIMEOUT):
        async with contextlib.AsyncExitStack() as stack:
            workers = [
                await stack.enter_async_context(started(worker_cmd(*flags), env))
                for _ in range(BURST_WORKERS)
            ]
            links = [arg for ws, _ in workers for arg in ("--worker", ws)]
            (kv,) = await stack.enter_async_context(
                started(frontend_cmd("--router-mode", "kv", *links), env)
            )
            await wait_connected(kv, BURST_WORKERS)
            shares = []
            for round_ in range(BURST_ROUNDS):
                before = [await _started_requests(system) for _, system in workers]
                async with trio.open_nursery() as nursery:
                    for index in range(BURST):
                        words = [f"b{round_}-{index}-{word}" for word in range(64)]
                        body = {**chat(words), "max_tokens": 40}
                        nursery.start_soon(call, kv, "POST", "/v1/chat/completions", body)
                after = [await _started_requests(system) for _, system in workers]
                shares.append([int(b - a) for a, b in zip(before, after, strict=True)])
    assert shares == [[BURST // BURST_WORKERS] * BURST_WORKERS] * BURST_ROUNDS, shares


async def _started_requests(system: str) -> float:
    _, text = await call(system, "GET", "/metrics")
    return metric(text, "dynamo_worker_started_request_total")
