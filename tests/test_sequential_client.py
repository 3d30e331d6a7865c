"""A finished request is gone at once: one client sending one request after another through a
real frontend to an idle fleet never gets a busy answer, under any threshold or router mode.

Real ``worker-ingress`` (mocker) and ``frontend-shim`` processes on loopback. The client keeps one
keep-alive connection and sends each request as soon as the previous answer's last byte arrived,
so the frontend routes it before it can have read the worker's event that says the previous
request ended. Each case runs several rounds, because a race lost now and then is still lost.
"""

from __future__ import annotations

import json
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import h11
import pytest
import trio
from test_e2e import MODEL, clean_env, frontend_cmd, started, wait_connected, worker_cmd

pytestmark = pytest.mark.e2e

TIMEOUT = 90.0
#: Requests per round, and rounds per case.
REQUESTS = 40
ROUNDS = 3
#: A fast mocker: a 48-token answer takes a few tens of milliseconds.
FAST_MOCKER = ("--speedup-ratio", "20")
#: A prompt of about 40 tokens: with a 16-block cache of 8-token blocks, a request holds more
#: than half the cache while it runs (prompt and answer together).
PROMPT = " ".join(f"w{i}" for i in range(40))


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

    async def chat(self, max_tokens: int) -> tuple[int, str]:
        """A streamed chat completion; returns the status and the reject reason (if any)."""
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": max_tokens,
                "stream": True,
            }
        ).encode()
        headers = [
            ("host", self._netloc),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ]
        conn = self._conn
        request = h11.Request(method="POST", target="/v1/chat/completions", headers=headers)
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
                if status == 200:
                    assert text.endswith(b"data: [DONE]\n\n"), text[-200:]
                return status, reason
            elif isinstance(event, h11.ConnectionClosed):
                raise AssertionError("the frontend closed a keep-alive connection")
        raise AssertionError("the answer did not end")


@asynccontextmanager
async def fleet(
    workers: int, worker_flags: Sequence[str], frontend_flags: Sequence[str]
) -> AsyncIterator[str]:
    """``workers`` mocker workers behind one frontend; yields the frontend's URL."""
    async with AsyncExitStack() as stack:
        urls = []
        for _ in range(workers):
            ws, _system = await stack.enter_async_context(
                started(worker_cmd(*FAST_MOCKER, *worker_flags), clean_env())
            )
            urls.append(ws)
        args = [arg for url in urls for arg in ("--worker", url)]
        (url,) = await stack.enter_async_context(
            started(frontend_cmd(*args, *frontend_flags), clean_env())
        )
        await wait_connected(url, workers)
        yield url


CASES = {
    "decode-0.0": (1, (), ("--active-decode-blocks-threshold", "0.0")),
    "decode-0.5-small-cache": (
        1,
        ("--num-gpu-blocks", "16", "--block-size", "8"),
        ("--active-decode-blocks-threshold", "0.5"),
    ),
    "prefill-0": (1, (), ("--active-prefill-tokens-threshold", "0")),
    "two-workers-decode-0.0": (2, (), ("--active-decode-blocks-threshold", "0.0")),
}


@pytest.mark.parametrize("mode", ["round-robin", "kv"])
@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_sequential_client_of_an_idle_fleet_is_never_shed(case: str, mode: str) -> None:
    workers, worker_flags, frontend_flags = CASES[case]
    with trio.fail_after(TIMEOUT):
        async with fleet(workers, worker_flags, (*frontend_flags, "--router-mode", mode)) as url:
            for _ in range(ROUNDS):
                outcomes: Counter[tuple[int, str]] = Counter()
                async with KeepAliveClient.connect(url) as client:
                    for _ in range(REQUESTS):
                        outcomes[await client.chat(48)] += 1
                assert outcomes == {(200, ""): REQUESTS}, outcomes
