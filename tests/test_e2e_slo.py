"""End-to-end, SLO-aware admission: real ``worker-ingress --ttft-slo`` and ``frontend-shim``.

A request that queues behind a long one past the objective is refused by the worker with the SLO
reason, and the client sees a 529 saying ``slo``; the worker exports L and counts the refusal.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections import Counter
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


async def post_with_headers(
    url: str, payload: Any, extra: dict[str, str] | None = None
) -> tuple[int, dict[bytes, bytes]]:
    """POST a completion (with the ``extra`` headers); the status and the response headers (the
    body is read and dropped)."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    data = json.dumps(payload).encode()
    headers = [("host", parts.netloc), ("content-length", str(len(data))), *(extra or {}).items()]
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


def labelled(text: bytes, name: str, label: str) -> float:
    """The sum of the samples of ``name`` that carry ``label`` (``""``: every sample)."""
    total = 0.0
    for line in text.decode().splitlines():
        match = re.fullmatch(rf"{name}(\{{[^}}]*\}})? (\S+)", line)
        if match and label in (match[1] or ""):
            total += float(match[2])
    return total


async def arrivals(url: str, *, every: float, seconds: float, classes: int) -> Counter[int]:
    """An open loop: a streamed completion every ``every`` seconds for ``seconds``, each on its
    own connection, of priority 0, 5, ... in turn (``classes`` of them); the statuses seen."""
    statuses: Counter[int] = Counter()

    async def one(priority: int) -> None:
        status, _ = await post_with_headers(
            url, completion(8, stream=True), {"x-dynamo-priority": str(priority)}
        )
        statuses[status] += 1

    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        for number in range(int(seconds / every)):
            await trio.sleep_until(start + number * every)
            nursery.start_soon(one, 5 * (number % classes))
    return statuses


async def test_under_an_objective_the_frontend_refuses_no_more_than_the_worker() -> None:
    # Twice what the worker serves, in two classes, after a warm-up that gives the objective's
    # controller its evidence. The worker refuses for its objective what would queue behind its
    # bound, counting only what is queued of the request's priority or better; the frontend
    # holds a refusal at that depth, of that class, so its own 529s on the worker's behalf
    # (marked) stay at most the worker's refusals. Held at the depth of the whole queue, the
    # frontend answered more of them than the worker refused.
    env = clean_env(DYN_DYNAMO_REQUEST_QUEUE_LIMIT="32")
    flags = ("--speedup-ratio", "2", "--num-gpu-blocks", "256", "--block-size", "4")
    worker = worker_cmd("--engine-request-limit", "2", "--ttft-slo", "0.3", *flags)
    with trio.fail_after(TIMEOUT):
        async with (
            started(worker, env) as (ws, system),
            started(frontend_cmd("--worker", ws), env) as (url,),
        ):
            await wait_connected(url)
            await arrivals(url, every=0.01, seconds=2.0, classes=2)
            _, front_before = await call(url, "GET", "/metrics")
            _, back_before = await call(system, "GET", "/metrics")
            statuses = await arrivals(url, every=0.01, seconds=4.0, classes=2)
            _, front = await call(url, "GET", "/metrics")
            _, back = await call(system, "GET", "/metrics")
    by_reason = "dynamo_rejection_request_by_reason_total"
    marked = labelled(front, "dynamo_frontend_rejection_by_reason_total", 'reason="marked"')
    marked -= labelled(front_before, "dynamo_frontend_rejection_by_reason_total", 'reason="marked"')
    refused = labelled(back, by_reason, "") - labelled(back_before, by_reason, "")
    slo = labelled(back, by_reason, 'reason="slo"') - labelled(
        back_before, by_reason, 'reason="slo"'
    )
    assert statuses[200] > 0
    assert slo > 0, statuses  # the objective did refuse: the holds were put to the test
    assert marked <= refused, (marked, refused, statuses)
