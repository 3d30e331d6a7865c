"""The ``openai`` engine behind a real worker and frontend, in one process, against the fake
upstream: several choices stay several choices, the first upstream chunk gives the waiting place
back, and the upstream's cached prompt tokens are passed on and counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
from fake_upstream import (
    CHAT,
    TIMEOUT,
    Exchange,
    FakeUpstream,
    chat_chunk,
    collect,
    make_engine,
    models_m,
    usage_chunk,
)
from fake_upstream import (
    upstream_fixture as upstream_fixture,
)
from trio_websocket import open_websocket_url

from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from shim_common import wire
from worker_ingress._config import WorkerSettings
from worker_ingress._server import Worker

# ------------------------------------------------------------------------------------------
# Through a worker and a frontend (in-process): several choices stay several choices


async def _two_choices(exchange: Exchange) -> None:
    """An upstream answering ``n: 2``: the deltas of both choices interleave, as vLLM sends them."""
    chat = exchange.target.endswith("/chat/completions")

    def piece(index: int, text: str | None, finish: str | None = None) -> object:
        if chat:
            return chat_chunk(text, finish, index)
        return {"choices": [{"index": index, "text": text or "", "finish_reason": finish}]}

    assert exchange.json["n"] == 2
    await exchange.start_sse()
    for first, second in (("alpha", "gamma"), (" beta", " delta")):
        await exchange.event(piece(0, first))
        await exchange.event(piece(1, second))
    await exchange.event(piece(1, None, "length"))
    await exchange.event(piece(0, None, "stop"))
    await exchange.event(usage_chunk(3, 4))
    await exchange.end_sse()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_reach_the_client_apart(
    upstream: FakeUpstream, path: str, stream: bool
) -> None:
    upstream.routes["GET /v1/models"] = models_m
    upstream.routes["POST /v1/chat/completions"] = _two_choices
    upstream.routes["POST /v1/completions"] = _two_choices
    settings = WorkerSettings(worker_id="w", host="127.0.0.1", port=0, system_port=0, model="m")
    engine = make_engine(upstream)
    body: dict[str, Any] = {"model": "m", "n": 2, "stream": stream, "max_tokens": 2}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(Worker(settings, engine).serve)
            frontend = FrontendSettings(http_port=0, workers=(address.ws_url,))
            url = await nursery.start(run_frontend, frontend)
            async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
                for _ in range(500):  # until the frontend has the worker
                    if (await client.get("/health")).json()["workers_connected"] == 1:
                        break
                    await trio.sleep(0.01)
                if stream:
                    async with client.stream("POST", path, json=body) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            for choice in json.loads(line[len("data: ") :])["choices"]:
                                text = choice["delta"]["content"] if "delta" in choice else ""
                                text = text or choice.get("text") or ""
                                texts[choice["index"]] = texts.get(choice["index"], "") + text
                                if choice["finish_reason"]:
                                    finishes[choice["index"]] = choice["finish_reason"]
                else:
                    response = await client.post(path, json=body)
                    assert response.status_code == 200, response.text
                    answer = response.json()
                    assert [choice["index"] for choice in answer["choices"]] == [0, 1]
                    assert answer["usage"]["completion_tokens"] == 4
                    for choice in answer["choices"]:
                        message = choice.get("message")
                        texts[choice["index"]] = message["content"] if message else choice["text"]
                        finishes[choice["index"]] = choice["finish_reason"]
            nursery.cancel_scope.cancel()
    assert texts == {0: "alpha beta", 1: "gamma delta"}
    assert finishes == {0: "stop", 1: "length"}


async def test_the_first_upstream_chunk_gives_the_waiting_place_back(
    upstream: FakeUpstream,
) -> None:
    # N = 2 slots but W = 1: the second request waits while the first one has no output yet,
    # and starts as soon as the upstream's first chunk (role-only, no text) arrives.
    send_role = trio.Event()
    release = trio.Event()

    async def chat(exchange: Exchange) -> None:
        await exchange.start_sse()
        await send_role.wait()
        await exchange.event(chat_chunk(None))  # the role-only first chunk
        await release.wait()
        await exchange.event(chat_chunk(" hi", finish="stop"))
        await exchange.end_sse()

    upstream.routes["GET /v1/models"] = models_m
    upstream.routes["POST /v1/chat/completions"] = chat
    settings = WorkerSettings(
        worker_id="w",
        host="127.0.0.1",
        port=0,
        system_port=0,
        model="m",
        engine_request_limit=2,
        engine_request_waiting_limit=1,
    )
    worker = Worker(settings, make_engine(upstream))
    gate = worker.gate

    async def until(condition: Callable[[], bool]) -> None:
        for _ in range(500):
            if condition():
                return
            await trio.sleep(0.01)
        raise AssertionError("the gate never got there")

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(worker.serve)
            async with open_websocket_url(address.ws_url + wire.REQUESTS_PATH) as ws:
                await ws.get_message()  # the hello
                for request_id in (1, 2):
                    generate = wire.Generate(
                        request_id=request_id, endpoint="chat_completions", body=CHAT
                    )
                    await ws.send_message(wire.encode(generate))
                await until(lambda: (gate.running, gate.waiting, gate.queued) == (1, 1, 1))
                send_role.set()
                await until(lambda: gate.running == 2)
                await until(lambda: gate.waiting == 0)
                release.set()
                ended: set[int] = set()
                while ended != {1, 2}:
                    message = await ws.get_message()
                    assert isinstance(message, bytes)
                    reply = wire.decode_worker_message(message)
                    assert not isinstance(reply, wire.Chunk) or reply.text  # no empty chunk
                    if isinstance(reply, wire.End):
                        ended.add(reply.request_id)
            nursery.cancel_scope.cancel()
    assert gate.state.admitted_queue_total == 1


@pytest.mark.parametrize(
    ("tail", "cached"),
    [
        # vLLM (with --enable-prompt-tokens-details) and newer llama.cpp: OpenAI's field.
        (
            {
                "usage": {
                    "prompt_tokens": 9,
                    "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": 8},
                }
            },
            8,
        ),
        # llama.cpp's own count, beside a usage that does not say.
        ({"usage": {"prompt_tokens": 9, "completion_tokens": 1}, "timings": {"cache_n": 5}}, 5),
        # An upstream that says nothing: 0.
        ({"usage": {"prompt_tokens": 9, "completion_tokens": 1}}, 0),
        (
            {
                "usage": {
                    "prompt_tokens": 9,
                    "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": None},
                }
            },
            0,
        ),
    ],
)
async def test_the_upstreams_cached_tokens_are_passed_on_and_counted(
    upstream: FakeUpstream, tail: dict[str, Any], cached: int
) -> None:
    async def chat(exchange: Exchange) -> None:
        await exchange.start_sse()
        await exchange.event(chat_chunk(" one", finish="length"))
        await exchange.event({"choices": [], **tail})
        await exchange.end_sse()

    upstream.routes["POST /v1/chat/completions"] = chat
    engine = make_engine(upstream)
    with trio.fail_after(TIMEOUT):
        outputs = await collect(engine, engine.prepare("chat_completions", CHAT))
    assert outputs[-1].finish_reason == "length"
    assert outputs[-1].cached_tokens == cached
    (stats,) = engine.prefix_cache_stats()
    assert (stats.queried_tokens, stats.hit_tokens) == (9, cached)
