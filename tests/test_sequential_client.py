"""A finished request is gone at once: a client sending one request after another through a
real frontend to an idle fleet never gets a busy answer, under any threshold or router mode.

Real ``worker-ingress`` (mocker) and ``frontend-shim`` processes on loopback. Each client keeps
one keep-alive connection and sends each request as soon as the previous answer's last byte
arrived, so the frontend routes it before it can have read the worker's event that says the
previous request ended. What could bring a finished request back into the frontend's picture,
each case provokes:

- the engine's speed: at ``--speedup-ratio 1000`` a whole answer, its last chunks and its
  ``End`` often arrive in one read of the worker's request plane; at 20 they come one by one;
- the size: an 18-token prompt with 48 tokens of answer holds 18 + 48 - 1 = 65 tokens of KV,
  one past a 16-token block boundary (a release one token short leaves a block), and a 40-token
  one more than half of a 16-block cache of 8-token blocks;
- the thresholds: decode blocks at 0.0 together with prefill tokens at 0 and a prefill
  fraction of 0.0 (any load at all is busy), and decode blocks at 0.5 of the small cache;
- the answer: chat and text completions, streamed and whole (their ends are read differently);
- the router mode (``round-robin``, ``random``, ``kv``: ``kv`` charges at the pick, with its
  own tokenisation of the prompt);
- two workers at decode 0.0 with two such clients at once: while one client's request runs on
  one worker, the other client's next request finds a free worker only if its own last
  request left the other one at once.

Every worker serves a model of its own, so one frontend per router mode runs every case at
once (each case on its own workers), and each case runs several rounds of every answer shape,
because a race lost now and then is still lost.
"""

from __future__ import annotations

import json
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import h11
import pytest
import trio
from test_e2e import call, clean_env, frontend_cmd, started, wait_connected, worker_cmd

pytestmark = pytest.mark.e2e

TIMEOUT = 120.0
#: Tokens of every answer.
MAX_TOKENS = 48
#: Prompts by length in tokens (words): 18 + MAX_TOKENS - 1 is one past a 16-token block.
PROMPTS = {length: " ".join(f"w{i}" for i in range(length)) for length in (40, 18)}
#: (endpoint, streamed): every answer shape.
SHAPES = [
    (path, stream)
    for path in ("/v1/chat/completions", "/v1/completions")
    for stream in (True, False)
]
#: Rounds of every shape and prompt, and requests of each in a round.
ROUNDS = 3
REQUESTS = 3
SMALL_CACHE = ("--num-gpu-blocks", "16", "--block-size", "8")
#: Busy on any load at all: the thresholds of the cases that are not the small cache's.
ANY_LOAD = {
    "active_decode_blocks_threshold": 0.0,
    "active_prefill_tokens_threshold": 0,
    "active_prefill_tokens_threshold_frac": 0.0,
}
#: model -> (workers, speedup ratio, worker flags, thresholds, clients at once).
CASES: dict[str, tuple[int, str, tuple[str, ...], dict[str, float], int]] = {
    "any-load-slow": (1, "20", (), ANY_LOAD, 1),
    "any-load-fast": (1, "1000", (), ANY_LOAD, 1),
    "small-cache-slow": (1, "20", SMALL_CACHE, {"active_decode_blocks_threshold": 0.5}, 1),
    "small-cache-fast": (1, "1000", SMALL_CACHE, {"active_decode_blocks_threshold": 0.5}, 1),
    "two-workers-fast": (2, "1000", (), {"active_decode_blocks_threshold": 0.0}, 2),
}


class KeepAliveClient:
    """One HTTP/1.1 connection, one request at a time, read to its last byte."""

    def __init__(self, stream: trio.SocketStream, netloc: str) -> None:
        self._stream = stream
        self._netloc = netloc
        self._conn = h11.Connection(h11.CLIENT)

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str) -> AsyncIterator[KeepAliveClient]:
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        stream = await trio.open_tcp_stream(parts.hostname, parts.port)
        async with stream:
            yield cls(stream, parts.netloc)

    async def complete(self, model: str, path: str, prompt: str, stream: bool) -> tuple[int, str]:
        """One completion; returns the status and the reject reason (if any)."""
        payload: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "stream": stream}
        if path == "/v1/chat/completions":
            payload["messages"] = [{"role": "user", "content": prompt}]
        else:
            payload["prompt"] = prompt
        body = json.dumps(payload).encode()
        headers = [
            ("host", self._netloc),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ]
        conn = self._conn
        request = h11.Request(method="POST", target=path, headers=headers)
        await self._stream.send_all(
            conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        )
        status, reason, text = 0, "", b""
        for _ in range(100_000):
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self._stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                reason = dict(event.headers).get(b"x-dynamo-reject-reason", b"").decode()
            elif isinstance(event, h11.Data):
                text += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert conn.our_state is h11.DONE
                assert conn.their_state is h11.DONE
                conn.start_next_cycle()
                if status == 200 and stream:
                    assert text.endswith(b"data: [DONE]\n\n"), text[-200:]
                elif status == 200:
                    assert json.loads(text)["usage"]["completion_tokens"] == MAX_TOKENS
                return status, reason
            elif isinstance(event, h11.ConnectionClosed):
                raise AssertionError("the frontend closed a keep-alive connection")
        raise AssertionError("the answer did not end")


#: (status, reject reason, endpoint, streamed) -> how many.
Outcomes = Counter[tuple[int, str, str, bool]]


async def sequential_client(url: str, model: str, outcomes: Outcomes) -> None:
    """Every shape and prompt, ROUNDS times, one request after another on one connection."""
    async with KeepAliveClient.connect(url) as client:
        for _ in range(ROUNDS):
            for path, stream in SHAPES:
                for prompt in PROMPTS.values():
                    for _ in range(REQUESTS):
                        status, reason = await client.complete(model, path, prompt, stream)
                        outcomes[(status, reason, path, stream)] += 1


@asynccontextmanager
async def fleet(mode: str) -> AsyncIterator[str]:
    """The workers of every case behind one frontend in ``mode``; yields the frontend's URL."""
    async with AsyncExitStack() as stack:
        urls = []
        for model, (workers, speed, flags, _, _) in CASES.items():
            for _ in range(workers):
                command = worker_cmd("--model", model, "--speedup-ratio", speed, *flags)
                ws, _system = await stack.enter_async_context(started(command, clean_env()))
                urls.append(ws)
        args = [arg for url in urls for arg in ("--worker", url)]
        # A threshold on the command line turns the busy check on; each model then gets its own.
        command = frontend_cmd(
            *args, "--router-mode", mode, "--active-decode-blocks-threshold", "0"
        )
        (url,) = await stack.enter_async_context(started(command, clean_env()))
        await wait_connected(url, len(urls))
        for model, (*_, thresholds, _) in CASES.items():
            status, _body = await call(
                url, "POST", "/busy_threshold", {"model": model, **thresholds}
            )
            assert status == 200, _body
        yield url


@pytest.mark.parametrize("mode", ["round-robin", "random", "kv"])
async def test_a_sequential_client_of_an_idle_fleet_is_never_shed(mode: str) -> None:
    outcomes: dict[str, Outcomes] = {model: Counter() for model in CASES}
    with trio.fail_after(TIMEOUT):
        async with fleet(mode) as url, trio.open_nursery() as nursery:
            for model, (*_, clients) in CASES.items():
                for _ in range(clients):
                    nursery.start_soon(sequential_client, url, model, outcomes[model])
    per_client = ROUNDS * len(SHAPES) * len(PROMPTS) * REQUESTS
    shed = {
        model: {outcome: count for outcome, count in counts.items() if outcome[0] != 200}
        for model, counts in outcomes.items()
    }
    assert shed == {model: {} for model in CASES}
    for model, counts in outcomes.items():
        assert sum(counts.values()) == per_client * CASES[model][4], model
