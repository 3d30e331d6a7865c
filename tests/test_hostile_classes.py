"""Hostile input to the admission classes, through real ``worker-ingress`` and ``frontend-shim``
processes: tenant weights at the edge of their range, and out of it; priorities and tenants
claimed by clients that may not (docs/reliability.md, "Hostile input").
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import trio
from test_classes import (
    MODEL,
    Queue,
    _blocker,
    _worker,
    completion,
    post,
    post_past_marks,
    queue_through_frontend,
)
from test_e2e import (
    MOCKER_FLAGS,
    READY,
    call,
    clean_env,
    frontend_cmd,
    started,
    wait_connected,
    wait_for_metric,
)

pytestmark = pytest.mark.e2e

TIMEOUT = 60.0


def _worker_args(*flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "worker_ingress",
        "--port",
        "0",
        "--system-port",
        "0",
        "--engine-request-limit",
        "1",
        *MOCKER_FLAGS,
        *flags,
    ]


async def test_a_weight_at_the_edge_of_its_range_keeps_the_fair_queue_finite() -> None:
    # The probe of a worker that hung for good: N = 1, Q = 4, one long request, then three of
    # the tiny-weight tenant with an empty prompt and no tokens to generate. A weight of 1e-6,
    # the smallest taken, must leave it serving, answering /live, and stopping on SIGTERM.
    env = clean_env(DYN_DYNAMO_REQUEST_QUEUE_LIMIT="4")
    args = _worker_args("--tenant-weights", "gold=1e-6")
    with trio.fail_after(TIMEOUT):
        worker = await trio.lowlevel.open_process(
            args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
        try:
            assert worker.stdout is not None
            line = b""
            with trio.fail_after(15):
                while not line.endswith(b"\n") and len(line) < 4096:
                    chunk = await worker.stdout.receive_some(4096)
                    if not chunk:
                        break
                    line += chunk
            ws, system = (url.decode() for url in READY.findall(line))
            async with started(frontend_cmd("--worker", ws), clean_env()) as (url,):
                await wait_connected(url)
                replies: list[int] = []

                async def long_request() -> None:
                    body = {"model": MODEL, "prompt": "one two three", "max_tokens": 60}
                    replies.append((await post(url, body, [("x-dynamo-tenant", "blocker")]))[0])

                async def tiny_tenant() -> None:
                    body = {"model": MODEL, "prompt": "", "max_tokens": 0}
                    replies.append((await post(url, body, [("x-dynamo-tenant", "gold")]))[0])

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(long_request)
                    await wait_for_metric(
                        system, "dynamo_engine_request", lambda v: v == 1, "the long request"
                    )
                    for _ in range(3):
                        nursery.start_soon(tiny_tenant)
                    await wait_for_metric(
                        system, "dynamo_request_queue", lambda v: v == 3, "three queued"
                    )
                    with trio.fail_after(2):
                        assert (await call(system, "GET", "/live"))[0] == 200
                assert len(replies) == 4
                # Each is answered: served, or refused as any request may be; never a 503 of a
                # worker that stopped answering.
                assert all(status in (200, 400) for status in replies), replies
                with trio.fail_after(2):
                    assert (await call(system, "GET", "/live"))[0] == 200
            worker.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                assert await worker.wait() == 0
        finally:
            with trio.CancelScope(shield=True):
                if worker.returncode is None:
                    worker.kill()
                    await worker.wait()


@pytest.mark.parametrize("weight", ["1e-310", "1e-7", "0", "-1", "nan", "inf", "1e7"])
def test_a_weight_out_of_its_range_is_refused_at_start_up(weight: str) -> None:
    result = subprocess.run(
        _worker_args("--tenant-weights", f"gold={weight}"),
        capture_output=True,
        env=clean_env(),
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert b"--tenant-weights" in result.stderr
    assert b"from 1e-6 to 1e6" in result.stderr
    assert b" ready " not in result.stdout


async def test_a_client_may_not_claim_a_class_only_the_gateway_may() -> None:
    # One slot, so the start order is the answer order. With --max-client-priority 0 and a
    # gateway token, a client claiming -1000 is served as 0 (after the plain request queued
    # before it); the gateway's -5, carried with its token, overtakes both.
    worker, env = _worker(8)
    frontend_env = clean_env(DYN_GATEWAY_TOKEN="gw-token")
    frontend = frontend_cmd("--worker", "WS", "--max-client-priority", "0")
    with trio.fail_after(TIMEOUT):
        async with started(worker, env) as (ws, system):
            frontend[frontend.index("WS")] = ws
            async with started(frontend, frontend_env) as (url,):
                await wait_connected(url)
                queue = Queue(url, system)
                async with trio.open_nursery() as nursery:
                    await _blocker(queue, nursery)
                    await queue.enqueue(nursery, "hand")
                    await queue.enqueue(nursery, "plain")
                    await queue.enqueue(
                        nursery, "client", ("x-dynamo-priority", "-1000"), ("x-dynamo-tenant", "a")
                    )
                    await queue.enqueue(
                        nursery,
                        "gateway",
                        ("x-dynamo-priority", "-5"),
                        ("x-dynamo-gateway-token", "gw-token"),
                    )
                assert queue.order == ["hand", "gateway", "plain", "client"]


async def test_a_made_up_tenant_never_takes_another_tenants_only_place() -> None:
    # A one-slot worker whose queue (the hand and three places) is full of one request each of
    # three tenants: an arrival under a name the gate never saw is refused, not a displacement
    # (the attack that turned every refusal into one); a tenant served before, now idle, still
    # takes the place of a tenant holding two.
    with trio.fail_after(TIMEOUT):
        async with queue_through_frontend(4) as queue:
            async with trio.open_nursery() as nursery:
                await _blocker(queue, nursery)
                for name in ("t0", "t1", "t2", "t3"):
                    await queue.enqueue(nursery, name, ("x-dynamo-tenant", name))
                status, headers, _ = await post_past_marks(
                    queue.url, completion(), [("x-dynamo-tenant", "made-up-1")]
                )
                assert (status, headers[b"x-dynamo-reject-reason"]) == (529, b"queue_full")
                assert (
                    await queue.worker_metric(
                        "dynamo_rejection_request_by_reason_total", reason="displaced"
                    )
                    == 0
                )
            # The blocker's tenant was served and left; back, it is no newcomer.
            assert all(reply[0] == 200 for reply in queue.replies.values())
            async with trio.open_nursery() as nursery:
                await _blocker(queue, nursery)
                queue.queued = 0
                for label, name in (("t4", "t4"), ("t5a", "t5"), ("t5b", "t5"), ("t6", "t6")):
                    await queue.enqueue(nursery, label, ("x-dynamo-tenant", name))
                await queue.enqueue(nursery, "t0-again", ("x-dynamo-tenant", "t0"), displaces=True)
            assert queue.replies["t5b"][0] == 529
            assert queue.replies["t5b"][1][b"x-dynamo-reject-reason"] == b"displaced"
            assert queue.replies["t0-again"][0] == 200
