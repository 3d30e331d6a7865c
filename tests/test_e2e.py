"""End-to-end: real ``worker-ingress`` and ``frontend-shim`` processes on loopback.

Every process gets port 0 and is found through its ready line on stdout; every process is killed
in ``finally``; every test runs under ``trio.fail_after``. Load comes from the mocker at a low
speedup ratio, so a request holds its slot and its KV blocks for a fraction of a second.
Independent processes of one test start concurrently to keep the file fast.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.parse
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import h11
import pytest
import trio

pytestmark = pytest.mark.e2e

TIMEOUT = 40.0
MODEL = "mock-model"
READY = re.compile(rb"\w+=(\S+)")
#: A slow mocker with a small cache: about 40 ms per decode step.
MOCKER_FLAGS = ("--speedup-ratio", "0.2", "--num-gpu-blocks", "64", "--block-size", "4")


def clean_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
    env.update(extra)
    return env


@asynccontextmanager
async def started(args: Sequence[str], env: Mapping[str, str]) -> AsyncIterator[list[str]]:
    """Run a process until the block ends; yields the URLs of its ready line."""
    process = await trio.lowlevel.open_process(
        list(args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=dict(env)
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(15):
            while not line.endswith(b"\n") and len(line) < 4096:
                chunk = await process.stdout.receive_some(4096)
                if not chunk:
                    break
                line += chunk
        assert b" ready " in line, line
        yield [url.decode() for url in READY.findall(line)]
    finally:
        # Shielded: a failing or timed-out test must still reap what it started.
        with trio.CancelScope(shield=True):
            process.terminate()
            with trio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


def worker_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "worker_ingress", "--port", "0", "--system-port", "0", *flags]


def frontend_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "frontend_shim", "--http-port", "0", *flags]


async def call(url: str, method: str, path: str, payload: Any = None) -> tuple[int, bytes]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    data = b"" if payload is None else json.dumps(payload).encode()
    headers = [("host", parts.netloc), ("content-length", str(len(data)))]
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method=method, target=path, headers=headers)
        await stream.send_all(conn.send(request) + conn.send(h11.Data(data=data)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        status, body = 0, b""
        for _ in range(100_000):
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, body
    raise AssertionError("response did not end")


def completion(max_tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "one two three four",
        "max_tokens": max_tokens,
        "stream": stream,
    }


def metric(text: bytes, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text exposition."""
    total = 0.0
    for line in text.decode().splitlines():
        match = re.fullmatch(rf"{name}(?:\{{[^}}]*\}})? (\S+)", line)
        if match:
            total += float(match[1])
    return total


async def wait_for_metric(url: str, name: str, predicate: Any, what: str) -> None:
    for _ in range(300):
        _, text = await call(url, "GET", "/metrics")
        if predicate(metric(text, name)):
            return
        await trio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def wait_connected(frontend: str, workers: int = 1) -> None:
    for _ in range(300):
        status, body = await call(frontend, "GET", "/health")
        if status == 200 and json.loads(body)["workers_connected"] == workers:
            return
        await trio.sleep(0.02)
    raise AssertionError("the frontend never connected to its workers")


async def burst(url: str, count: int, body: dict[str, Any]) -> list[int]:
    statuses: list[int] = []

    async def one() -> None:
        statuses.append((await call(url, "POST", "/v1/completions", body))[0])

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return statuses


# ----------------------------------------------------------------------------- tests


async def test_local_workers_n1_q2_fourth_request_is_rejected() -> None:
    """The smoke run of the task: one local worker, N = 1, Q = 2, five concurrent requests."""
    env = clean_env(DYN_DYNAMO_REQUEST_QUEUE_LIMIT="2")
    cmd = frontend_cmd("--local-workers", "1", "--engine-request-limit", "1", *MOCKER_FLAGS)
    with trio.fail_after(TIMEOUT):
        async with started(cmd, env) as (url,):
            await wait_connected(url)
            # Long enough that nothing finishes while the five arrive.
            statuses = await burst(url, 5, completion(max_tokens=12))
            assert sorted(statuses) == [200, 200, 200, 529, 529]
            # The fleet is idle again: a new request is served, not shed.
            assert (await call(url, "POST", "/v1/completions", completion(2)))[0] == 200


async def test_overload_probe_and_queued_requests_complete() -> None:
    env = clean_env(DYN_DYNAMO_REQUEST_QUEUE_LIMIT="2")
    with trio.fail_after(TIMEOUT):
        worker = worker_cmd("--engine-request-limit", "1", *MOCKER_FLAGS)
        async with (
            started(worker, env) as (ws, system),
            started(frontend_cmd("--worker", ws), env) as (url,),
        ):
            await wait_connected(url)
            # N = 1 and Q = 2: three held, the fourth gets 529, the three complete.
            first_three: list[int] = []

            async def held() -> None:
                first_three.extend(await burst(url, 3, completion(max_tokens=12)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(held)
                await wait_for_metric(
                    system, "dynamo_request_queue", lambda v: v == 2, "two queued requests"
                )
                status, body = await call(url, "POST", "/v1/completions", completion())
                assert status == 529
                assert json.loads(body)["code"] == 529
            assert first_three == [200, 200, 200]
            # The probe: every answer 200 or 529, some 529, the counter rose by as many.
            _, before = await call(url, "GET", "/metrics")
            statuses = await burst(url, 10, completion(max_tokens=6))
            _, after = await call(url, "GET", "/metrics")
            assert set(statuses) <= {200, 529}
            assert statuses.count(529) >= 1
            rise = metric(after, "dynamo_frontend_model_rejection_total") - metric(
                before, "dynamo_frontend_model_rejection_total"
            )
            assert rise == statuses.count(529)
            _, worker_metrics = await call(system, "GET", "/metrics")
            assert metric(worker_metrics, "dynamo_rejection_request_total") >= 1


async def test_thresholds_status_codes_admin_and_disconnects() -> None:
    """One unlimited worker, several frontends with different settings in front of it."""
    codes = {None: 529, "503": 503, "429": 429, "abc": 529, "700": 529}
    with trio.fail_after(TIMEOUT):
        async with started(worker_cmd(*MOCKER_FLAGS), clean_env()) as (ws, system):
            urls: dict[str, str] = {}

            async def frontend(name: str, env: dict[str, str], *flags: str) -> None:
                async with started(frontend_cmd("--worker", ws, *flags), env) as (url,):
                    urls[name] = url
                    await wait_connected(url)
                    await stop.wait()

            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(frontend, "plain", clean_env())
                nursery.start_soon(
                    frontend,
                    "no-admin",
                    clean_env(DYN_DISABLE_FRONTEND_ADMIN_API="1"),
                    "--active-decode-blocks-threshold",
                    "0.0",
                )
                for value in codes:
                    env = (
                        clean_env()
                        if value is None
                        else clean_env(DYN_HTTP_OVERLOAD_STATUS_CODE=value)
                    )
                    nursery.start_soon(
                        frontend, f"code-{value}", env, "--active-decode-blocks-threshold", "0.0"
                    )
                for _ in range(500):
                    if len(urls) == 2 + len(codes):
                        break
                    await trio.sleep(0.02)
                for url in urls.values():
                    await wait_connected(url)
                plain = urls["plain"]
                # Thresholds unset: no 529 under concurrent load.
                assert await burst(plain, 8, completion(max_tokens=4)) == [200] * 8
                # Admin API switched off.
                assert (await call(urls["no-admin"], "GET", "/busy_threshold"))[0] == 404
                # /busy_threshold through a real process.
                status, body = await call(plain, "GET", "/busy_threshold")
                assert status == 200
                assert json.loads(body)["thresholds"][0]["active_decode_blocks_threshold"] is None
                assert (await call(plain, "POST", "/busy_threshold", {"model": MODEL}))[0] == 200
                bad = {"model": MODEL, "active_decode_blocks_threshold": 2}
                assert (await call(plain, "POST", "/busy_threshold", bad))[0] == 400
                assert (await call(plain, "POST", "/busy_threshold", {"x": 1}))[0] == 422
                unknown = {"model": "nope", "active_prefill_tokens_threshold": 1}
                assert (await call(plain, "POST", "/busy_threshold", unknown))[0] == 404
                # A long request through the plain frontend holds KV blocks on the worker...
                async with trio.open_nursery() as holder:
                    holder.start_soon(call, plain, "POST", "/v1/completions", completion(200, True))
                    await wait_for_metric(
                        system, "dynamo_component_kv_used_blocks", lambda v: v > 0, "KV in use"
                    )
                    # ... so every frontend with a decode threshold of 0.0 sheds, with its code.
                    for value, code in codes.items():
                        status, body = await _shed(urls[f"code-{value}"])
                        assert status == code, value
                        assert json.loads(body) == {
                            "message": "Service temporarily overloaded",
                            "type": "Overloaded",
                            "code": code,
                        }
                    assert await burst(plain, 2, completion(2)) == [200, 200]
                    # The client of the long request goes away: its slot is freed.
                    holder.cancel_scope.cancel()
                await wait_for_metric(
                    system, "dynamo_engine_request", lambda v: v == 0, "the slot to be freed"
                )
                await wait_for_metric(
                    system, "dynamo_component_kv_used_blocks", lambda v: v == 0, "blocks freed"
                )
                stop.set()


async def _shed(url: str) -> tuple[int, bytes]:
    """The answer once the frontend has seen the worker's load (bounded retries)."""
    answer = (0, b"")
    for _ in range(100):
        answer = await call(url, "POST", "/v1/completions", completion(1))
        if answer[0] != 200:
            return answer
        await trio.sleep(0.02)
    return answer
