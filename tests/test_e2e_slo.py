"""End-to-end, SLO-aware admission: real ``worker-ingress --ttft-slo`` and ``frontend-shim``.

A request that queues behind a long one past the objective is refused by the worker with the SLO
reason, and the client sees a 529 saying ``slo``; the worker exports L and counts the refusal.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

import h11
import pytest
import trio
from test_e2e import (
    MOCKER_FLAGS,
    TIMEOUT,
    call,
    clean_env,
    completion,
    frontend_cmd,
    metric,
    started,
    wait_connected,
    wait_for_metric,
    worker_cmd,
)

pytestmark = pytest.mark.e2e


async def post_with_headers(url: str, payload: Any) -> tuple[int, dict[bytes, bytes]]:
    """POST a completion; the status and the response headers (the body is read and dropped)."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    data = json.dumps(payload).encode()
    headers = [("host", parts.netloc), ("content-length", str(len(data)))]
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="POST", target="/v1/completions", headers=headers)
        await stream.send_all(conn.send(request) + conn.send(h11.Data(data=data)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        status, answer = 0, {}
        for _ in range(100_000):
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status, answer = event.status_code, dict(event.headers)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, answer
    raise AssertionError("response did not end")


async def test_a_request_that_would_be_late_gets_a_529_that_says_slo() -> None:
    env = clean_env(DYN_DYNAMO_REQUEST_QUEUE_LIMIT="4")
    worker = worker_cmd("--engine-request-limit", "1", "--ttft-slo", "0.1", *MOCKER_FLAGS)
    with trio.fail_after(TIMEOUT):
        async with (
            started(worker, env) as (ws, system),
            started(frontend_cmd("--worker", ws), env) as (url,),
        ):
            await wait_connected(url)
            _, text = await call(system, "GET", "/metrics")
            assert metric(text, "dynamo_engine_request_limit_effective") == 1
            assert metric(text, "dynamo_worker_slo_ttft_objective_seconds") == 0.1
            long_one: list[int] = []

            async def hold() -> None:
                long_one.append((await call(url, "POST", "/v1/completions", completion(40)))[0])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold)
                await wait_for_metric(
                    system, "dynamo_engine_request", lambda v: v == 1, "the long request running"
                )
                # It queues behind the long one (about 1.6 s) and its 0.1 s run out.
                status, headers = await post_with_headers(url, completion(2))
                assert status == 529
                assert headers[b"x-dynamo-reject-reason"] == b"slo"
                assert int(headers[b"retry-after"]) >= 1
            assert long_one == [200]
            _, text = await call(system, "GET", "/metrics")
            assert metric(text, 'dynamo_rejection_request_by_reason_total{reason="slo"}') == 1
            _, text = await call(url, "GET", "/metrics")
            assert "dynamo_frontend_rejection_by_reason_total" in text.decode()
