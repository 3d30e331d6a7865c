"""End-to-end: a real worker and frontend report the mocker's prefix-cache hits to the client.

A conversation's second turn resends the first; the worker's cache holds the first turn's
blocks, so the answer's ``usage.prompt_tokens_details.cached_tokens`` says so, streamed or not,
and the worker's hit metrics agree. With ``--no-enable-prefix-caching`` nothing is cached.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from test_e2e import TIMEOUT, call, clean_env, frontend_cmd, metric, started, wait_connected
from test_e2e import worker_cmd as base_worker_cmd

pytestmark = pytest.mark.e2e

HISTORY = " ".join(f"word{i}" for i in range(40))
FLAGS = ("--speedup-ratio", "20", "--num-gpu-blocks", "256", "--block-size", "4")


def chat(messages: list[dict[str, str]], *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "mock-model", "messages": messages, "max_tokens": 3}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def usage_of(body: bytes, *, stream: bool) -> dict[str, Any]:
    if not stream:
        usage: dict[str, Any] = json.loads(body)["usage"]
        return usage
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last: dict[str, Any] = json.loads(events[-2])
    assert last["choices"] == []
    usage = last["usage"]
    return usage


@pytest.mark.parametrize("caching", [True, False])
async def test_a_second_turn_reports_the_first_turns_cached_tokens(caching: bool) -> None:
    flags = FLAGS if caching else (*FLAGS, "--no-enable-prefix-caching")
    first = [{"role": "user", "content": HISTORY}]
    second = [*first, {"role": "assistant", "content": "alpha bravo charlie"}]
    second.append({"role": "user", "content": "tell me more"})
    env = clean_env()
    with trio.fail_after(TIMEOUT):
        async with (
            started(base_worker_cmd(*flags), env) as (ws, system),
            started(frontend_cmd("--worker", ws), env) as (url,),
        ):
            await wait_connected(url)
            seen: list[int] = []
            for stream in (False, True):
                for messages in (first, second):
                    status, body = await call(
                        url, "POST", "/v1/chat/completions", chat(messages, stream=stream)
                    )
                    assert status == 200, body
                    usage = usage_of(body, stream=stream)
                    seen.append(usage["prompt_tokens_details"]["cached_tokens"])
                    assert usage["prompt_tokens"] == sum(
                        len(m["content"].split()) for m in messages
                    )
            _, text = await call(system, "GET", "/metrics")
    if caching:
        # Blocks of 4 tokens. The first turn (40 words) is new; the second (46) finds the first's
        # 10 blocks. Asked again, the first is cached whole, and one block is computed again
        # (at least one token always is): 36; the second finds its 11 full blocks: 44.
        assert seen[0] == 0
        assert seen[1] == 40
        assert seen[2] == 36
        assert seen[3] == 44
        assert metric(text, "dynamo_worker_prefix_cache_hit_tokens_total") == sum(seen)
    else:
        assert seen == [0, 0, 0, 0]
        assert metric(text, "dynamo_worker_prefix_cache_hit_tokens_total") == 0
