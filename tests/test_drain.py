"""Drains seen from outside: SIGTERM to a worker, or to a frontend, during a streamed answer.

Each scenario is repeated (a drain that loses the end of a stream only sometimes is the bug this
guards against): every stream must end with its usage chunk and ``data: [DONE]`` and a cleanly
ended HTTP response, and every process that got SIGTERM must exit 0. Real processes on loopback,
port 0, found through their ready lines; the mocker runs fast so that a repetition takes a
fraction of a second after the processes are up.
"""

from __future__ import annotations

import json
import signal
import sys
import urllib.parse
from collections.abc import Callable
from typing import Any

import h11
import pytest
import trio
from test_fleet_faults import clean_env, started

pytestmark = pytest.mark.e2e

MODEL = "mock-model"
REPETITIONS = 8
#: Scenarios run this many at a time (each one a worker and a frontend of its own, or a
#: frontend of its own in front of the shared worker).
AT_ONCE = 2
#: A fast mocker: a thousand tokens stream in a fraction of a second.
MOCKER_FLAGS = ("--speedup-ratio", "20")
MAX_TOKENS = 1000
TIMEOUT = 120.0


def worker_cmd() -> list[str]:
    return [
        sys.executable, "-m", "worker_ingress", "--port", "0", "--system-port", "0",
        "--model", MODEL, *MOCKER_FLAGS,
    ]  # fmt: skip


def frontend_cmd(worker_url: str) -> list[str]:
    return [sys.executable, "-m", "frontend_shim", "--http-port", "0", "--worker", worker_url]


async def wait_connected(url: str) -> None:
    for _ in range(500):
        status, body = await _get(url, "/health")
        if status == 200 and json.loads(body)["workers_connected"] == 1:
            return
        await trio.sleep(0.02)
    raise AssertionError("the frontend never connected to its worker")


async def _get(url: str, path: str) -> tuple[int, bytes]:
    events = await _exchange(url, "GET", path, None, lambda: None)
    status = next(e.status_code for e in events if isinstance(e, h11.Response))
    return status, b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))


async def _exchange(
    url: str, method: str, path: str, payload: Any, on_first_data: Callable[[], None]
) -> list[h11.Event]:
    """One request on a fresh connection; every event up to the end of the response.

    ``on_first_data`` is called once, when the first piece of the body has arrived.
    """
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    data = b"" if payload is None else json.dumps(payload).encode()
    headers = [("host", parts.netloc), ("content-length", str(len(data)))]
    events: list[h11.Event] = []
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method=method, target=path, headers=headers)
        await stream.send_all(
            conn.send(request) + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage())
        )
        for _ in range(1_000_000):
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
                continue
            assert isinstance(event, h11.Event), event
            events.append(event)
            if isinstance(event, h11.Data) and sum(isinstance(e, h11.Data) for e in events) == 1:
                on_first_data()
            if isinstance(event, h11.EndOfMessage):
                return events
            # A connection that closes before the end of the response fails the test: h11
            # raises RemoteProtocolError for a chunked body cut short.
    raise AssertionError("the response did not end")


async def stream_and_signal(url: str, process: trio.Process) -> None:
    """Stream one completion; SIGTERM ``process`` once the first event arrives; check the end."""
    body = {
        "model": MODEL,
        "prompt": "one two three four",
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    signalled_at = 0.0

    def terminate() -> None:
        nonlocal signalled_at
        process.send_signal(signal.SIGTERM)
        signalled_at = trio.current_time()

    events = await _exchange(url, "POST", "/v1/completions", body, terminate)
    # The stream was in flight when the signal went: it went on for a while after it.
    assert trio.current_time() - signalled_at > 0.1
    status = next(e.status_code for e in events if isinstance(e, h11.Response))
    assert status == 200
    text = b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data)).decode()
    assert "event: error" not in text, text[-800:]
    payloads = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]", text[-500:]
    usage = json.loads(payloads[-2])["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    tokens = sum(len(json.loads(p)["choices"][0]["text"]) > 0 for p in payloads[:-2])
    assert tokens > 0


async def repeated(scenario: Callable[[], Any]) -> None:
    """Run ``scenario`` :data:`REPETITIONS` times, :data:`AT_ONCE` at a time."""
    limiter = trio.CapacityLimiter(AT_ONCE)

    async def one() -> None:
        async with limiter:
            await scenario()

    async with trio.open_nursery() as nursery:
        for _ in range(REPETITIONS):
            nursery.start_soon(one)


async def test_sigterm_to_a_worker_mid_stream_loses_nothing() -> None:
    async def scenario() -> None:
        async with (
            started(worker_cmd(), clean_env()) as ((ws, _system), worker),
            started(frontend_cmd(ws), clean_env()) as ((url,), _frontend),
        ):
            await wait_connected(url)
            await stream_and_signal(url, worker)
            with trio.fail_after(30):
                assert await worker.wait() == 0

    with trio.fail_after(TIMEOUT):
        await repeated(scenario)


async def test_sigterm_to_a_frontend_mid_stream_loses_nothing() -> None:
    with trio.fail_after(TIMEOUT):
        async with started(worker_cmd(), clean_env()) as ((ws, _system), _worker):

            async def scenario() -> None:
                async with started(frontend_cmd(ws), clean_env()) as ((url,), frontend):
                    await wait_connected(url)
                    await stream_and_signal(url, frontend)
                    with trio.fail_after(30):
                        assert await frontend.wait() == 0

            await repeated(scenario)


# -- arrivals at the frontend's exit ---------------------------------------------------------

#: Connections opened before the exit (accepted, nothing sent), and new ones opened at it.
EARLY_CONNECTIONS = 4
LATE_CONNECTIONS = 4


async def _answer_or_refusal(url: str, stream: trio.SocketStream | None, request: bytes) -> str:
    """What one arrival at the exit got: ``"status"``, ``"refused"`` or ``"no status"``.

    ``stream``: a connection opened before the exit, or ``None`` to open one now.
    """
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    if stream is None:
        try:
            stream = await trio.open_tcp_stream(parts.hostname, parts.port)
        except OSError:
            return "refused"  # the listener was closed: the kernel refused the connection
    received = b""
    async with stream:
        try:
            await stream.send_all(request)
            for _ in range(1000):
                data = await stream.receive_some(65536)
                received += data
                if not data or b"\r\n" in received:
                    break
        except (trio.BrokenResourceError, OSError):
            pass
    return "status" if received.startswith(b"HTTP/1.1 ") else "no status"


async def test_arrivals_at_a_frontends_exit_get_a_status_line_or_a_refused_connection() -> None:
    # The interleaving, driven on purpose: connections accepted before the exit send their
    # request, and new connections are opened, the moment the last stream in flight ends, which
    # is when the drain ends and the frontend exits. Each is owed a status line (the accepted
    # ones) or is refused; none may be closed with no answer.
    body = json.dumps({"model": MODEL, "prompt": "one", "max_tokens": 4}).encode()

    async def scenario() -> None:
        async with started(frontend_cmd(ws), clean_env()) as ((url,), frontend):
            await wait_connected(url)
            parts = urllib.parse.urlsplit(url)
            assert parts.hostname is not None
            assert parts.port is not None
            request = (
                b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (parts.netloc.encode(), len(body), body)
            )
            early = [
                await trio.open_tcp_stream(parts.hostname, parts.port)
                for _ in range(EARLY_CONNECTIONS)
            ]
            await stream_and_signal(url, frontend)  # returns as the stream ends: the exit
            outcomes: list[str] = []

            async def arrive(stream: trio.SocketStream | None) -> None:
                got = await _answer_or_refusal(url, stream, request)
                outcomes.append(f"{'late' if stream is None else 'early'}: {got}")

            async with trio.open_nursery() as nursery:
                for stream in [*early, *[None] * LATE_CONNECTIONS]:
                    nursery.start_soon(arrive, stream)
            with trio.fail_after(30):
                assert await frontend.wait() == 0
            assert not [o for o in outcomes if o.endswith("no status")], outcomes
            assert len(outcomes) == EARLY_CONNECTIONS + LATE_CONNECTIONS

    with trio.fail_after(TIMEOUT):
        async with started(worker_cmd(), clean_env()) as ((ws, _system), _worker):
            await repeated(scenario)
