"""End-to-end: admission classes through real ``worker-ingress`` and ``frontend-shim`` processes.

What an operator sees of priorities, tenants and the waiting limit: the order in which queued
requests start, who is displaced at a full queue (its 529 and reason), a late tenant interleaved
with a heavy one, a request held by W until the first token, Dynamo 1.7's spellings and metric
families, the reason and queue-wait headers, and a busy-exempt priority passing the thresholds.

Start order is read, not timed: the worker has one slot (N = 1), so queued requests run one
after the other and their answers come back in the order they started. A long first request
holds the slot while the others are queued one at a time (each waits until the worker's queue
gauge shows it), so arrival order is known too.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from typing import Any

import h11
import pytest
import trio
from test_e2e import (
    MOCKER_FLAGS,
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
MODEL = "mock-model"
OVERLOAD_BODY = b'{"message":"Service temporarily overloaded","type":"Overloaded","code":529}'


async def post(
    url: str, payload: Any, headers: Sequence[tuple[str, str]] = ()
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One POST to ``/v1/completions`` on a fresh connection: status, headers, body."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    data = json.dumps(payload).encode()
    head = [("host", parts.netloc), ("content-length", str(len(data))), *headers]
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="POST", target="/v1/completions", headers=head)
        await stream.send_all(conn.send(request) + conn.send(h11.Data(data=data)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        status, reply_headers, body = 0, {}, b""
        for _ in range(100_000):
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                reply_headers = dict(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, reply_headers, body
    raise AssertionError("response did not end")


async def post_past_marks(
    url: str, payload: Any, headers: Sequence[tuple[str, str]] = ()
) -> tuple[int, dict[bytes, bytes], bytes]:
    """As :func:`post`, until the frontend routes it: a worker's refusal marks it at the
    frontend until its next load event, and meanwhile the frontend answers 529 ``marked``."""
    for _ in range(300):
        reply = await post(url, payload, headers)
        if reply[1].get(b"x-dynamo-reject-reason") != b"marked":
            return reply
        await trio.sleep(0.01)
    raise AssertionError("the worker stayed marked")


def completion(max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "one two three four", "max_tokens": max_tokens, **extra}


class Queue:
    """A frontend and a one-slot worker: hold the slot, queue requests in a known order."""

    def __init__(self, url: str, system: str) -> None:
        self.url = url
        self.system = system
        #: Names of the queued requests, in the order their answers came back (start order).
        self.order: list[str] = []
        #: Name -> (status, headers, body).
        self.replies: dict[str, tuple[int, dict[bytes, bytes], bytes]] = {}
        self.queued = 0

    async def send(
        self, nursery: trio.Nursery, name: str, headers: Sequence[tuple[str, str]]
    ) -> None:
        async def one() -> None:
            reply = await post(self.url, completion(), headers)
            self.replies[name] = reply
            if reply[0] == 200:
                self.order.append(name)

        nursery.start_soon(one)

    async def enqueue(
        self, nursery: trio.Nursery, name: str, *headers: tuple[str, str], displaces: bool = False
    ) -> None:
        """Send one request and wait until the worker has queued it (or refused it at once)."""
        before_rejected = await self.worker_metric("dynamo_rejection_request_total")
        await self.send(nursery, name, headers)
        if not displaces:
            self.queued += 1

        async def settled() -> bool:
            queued = await self.worker_metric("dynamo_request_queue")
            rejected = await self.worker_metric("dynamo_rejection_request_total")
            return queued == self.queued and (not displaces or rejected > before_rejected)

        for _ in range(500):
            if await settled() or name in self.replies:
                return
            await trio.sleep(0.01)
        raise AssertionError(f"{name} never reached the worker's queue")

    async def worker_metric(self, name: str, **labels: str) -> float:
        _, text = await call(self.system, "GET", "/metrics")
        if not labels:
            return metric(text, name)
        wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
        for line in text.decode().splitlines():
            if line.startswith(f"{name}{{{wanted}}} "):
                return float(line.split()[-1])
        return 0.0


def _worker(queue_limit: int, *flags: str) -> tuple[list[str], dict[str, str]]:
    env = clean_env(DYN_DYNAMO_REQUEST_QUEUE_LIMIT=str(queue_limit))
    return worker_cmd("--engine-request-limit", "1", *MOCKER_FLAGS, *flags), env


async def _blocker(queue: Queue, nursery: trio.Nursery, tokens: int = 100) -> None:
    """A long request of its own tenant that holds the one slot while the test queues."""

    async def hold() -> None:
        reply = await post(queue.url, completion(tokens), [("x-dynamo-tenant", "blocker")])
        assert reply[0] == 200

    nursery.start_soon(hold)
    await wait_for_metric(queue.system, "dynamo_engine_request", lambda v: v == 1, "the blocker")


@contextlib.asynccontextmanager
async def queue_through_frontend(queue_limit: int, *flags: str) -> AsyncIterator[Queue]:
    """A worker (:func:`_worker`'s arguments) behind a frontend, both up and connected, and the
    :class:`Queue` that sends requests through them."""
    worker, env = _worker(queue_limit, *flags)
    async with (
        started(worker, env) as (ws, system),
        started(frontend_cmd("--worker", ws), clean_env()) as (url,),
    ):
        await wait_connected(url)
        yield Queue(url, system)


# ----------------------------------------------------------------------------- start order


async def test_queued_requests_start_by_priority_then_in_arrival_order() -> None:
    with trio.fail_after(TIMEOUT):
        async with queue_through_frontend(8) as queue:
            async with trio.open_nursery() as nursery:
                await _blocker(queue, nursery)
                # The first one queued is in the dispatcher's hand: committed, it starts next.
                for name, priority in [("a5", 5), ("b5", 5), ("c0", 0), ("d9", 9), ("e0", 0)]:
                    await queue.enqueue(nursery, name, ("x-dynamo-priority", str(priority)))
                queued_by_priority = {
                    p: await queue.worker_metric("dynamo_request_queue_by_priority", priority=p)
                    for p in ("0", "5", "9")
                }
                assert queued_by_priority == {"0": 2, "5": 2, "9": 1}
            assert queue.order == ["a5", "c0", "e0", "b5", "d9"]
            # The body's priority works the same way as the header (checked on one pair).
            assert all(reply[0] == 200 for reply in queue.replies.values())


async def test_body_priority_orders_like_the_header_and_stays_in_the_body() -> None:
    with trio.fail_after(TIMEOUT):
        async with queue_through_frontend(8) as queue:
            async with trio.open_nursery() as nursery:
                await _blocker(queue, nursery)
                await queue.enqueue(nursery, "hand")
                for name, priority in [("late", 3), ("early", -2)]:
                    body = completion(priority=priority)

                    async def one(name: str = name, body: dict[str, Any] = body) -> None:
                        reply = await post(queue.url, body)
                        queue.replies[name] = reply
                        queue.order.append(name)

                    nursery.start_soon(one)
                    queue.queued += 1
                    await wait_for_metric(
                        queue.system, "dynamo_request_queue", lambda v: v == queue.queued, name
                    )
            assert queue.order == ["hand", "early", "late"]


# ----------------------------------------------------------------------------- displacement


async def test_a_better_priority_displaces_the_newest_of_the_worst_at_a_full_queue() -> None:
    with trio.fail_after(TIMEOUT):
        async with queue_through_frontend(3) as queue:  # the hand and two channel places
            async with trio.open_nursery() as nursery:
                await _blocker(queue, nursery)
                await queue.enqueue(nursery, "hand", ("x-dynamo-priority", "9"))
                await queue.enqueue(nursery, "old9", ("x-dynamo-priority", "9"))
                await queue.enqueue(nursery, "new9", ("x-dynamo-priority", "9"))
                # Full: N = 1 runs, Q = 3 wait. A priority-0 arrival takes new9's place.
                await queue.enqueue(nursery, "urgent", ("x-dynamo-priority", "0"), displaces=True)
                for _ in range(500):
                    if "new9" in queue.replies:
                        break
                    await trio.sleep(0.01)
                status, headers, body = queue.replies["new9"]
                assert (status, body) == (529, OVERLOAD_BODY)
                assert headers[b"x-dynamo-reject-reason"] == b"displaced"
                # An arrival no better than the worst waiting is simply refused.
                status, headers, body = await post_past_marks(
                    queue.url, completion(), [("x-dynamo-priority", "9")]
                )
                assert (status, body) == (529, OVERLOAD_BODY)
                assert headers[b"x-dynamo-reject-reason"] == b"queue_full"
                reasons = {
                    reason: await queue.worker_metric(
                        "dynamo_rejection_request_by_reason_total", reason=reason
                    )
                    for reason in ("displaced", "queue_full", "queue_timeout", "slo")
                }
            assert reasons == {"displaced": 1, "queue_full": 1, "queue_timeout": 0, "slo": 0}
            assert queue.order == ["hand", "urgent", "old9"]
            _, text = await call(queue.url, "GET", "/metrics")
            name = "dynamo_frontend_rejection_by_reason_total"
            for reason in ("displaced", "queue_full"):
                assert f'{name}{{model="mock-model",reason="{reason}"}} 1.0' in text.decode()


async def test_a_tenant_with_fewer_places_displaces_the_tenant_holding_the_most() -> None:
    with trio.fail_after(TIMEOUT):
        async with queue_through_frontend(4) as queue:  # the hand and three channel places
            heavy = ("x-dynamo-tenant", "heavy")
            async with trio.open_nursery() as nursery:
                await _blocker(queue, nursery)
                for index in range(4):
                    await queue.enqueue(nursery, f"heavy{index}", heavy)
                # The channel holds heavy1..3; a light tenant's request takes heavy3's place.
                await queue.enqueue(nursery, "light", ("x-dynamo-tenant", "light"), displaces=True)
                for _ in range(500):
                    if "heavy3" in queue.replies:
                        break
                    await trio.sleep(0.01)
                status, headers, _ = queue.replies["heavy3"]
                assert status == 529
                assert headers[b"x-dynamo-reject-reason"] == b"displaced"
                # heavy holds two places, light one: heavy cannot displace, it is refused.
                status, headers, _ = await post_past_marks(queue.url, completion(), [heavy])
                assert (status, headers[b"x-dynamo-reject-reason"]) == (529, b"queue_full")
                assert (
                    await queue.worker_metric(
                        "dynamo_tenant_requests_total", tenant="heavy", outcome="rejected"
                    )
                    >= 2
                )
            assert queue.order[0] == "heavy0"
            assert "light" in queue.order


# A worker that sends a load event or heartbeat at most every 10 s: a frontend's overload mark
# then lasts its whole lease (1 s), so what the mark lets through is what the test sees.
QUIET = ("--heartbeat-interval", "10", "--load-publish-interval", "10")


async def _past_the_mark(
    queue_limit: int,
    fill: Sequence[str],
    refused: Sequence[tuple[str, str]],
    better: Sequence[tuple[str, str]],
) -> tuple[Queue, bytes]:
    """Fill a one-slot worker's queue with ``fill`` (of the ``refused`` class), overflow it
    once, see the worker marked for that class, then send a ``better`` request (``better``): it
    passes the mark and displaces the newest of ``fill``. Returns the queue and the frontend's
    metrics."""
    with trio.fail_after(TIMEOUT):
        async with queue_through_frontend(queue_limit, *QUIET) as queue:
            async with trio.open_nursery() as nursery:
                await _blocker(queue, nursery)
                for name in fill:
                    await queue.enqueue(nursery, name, *refused)
                status, headers, _ = await post(queue.url, completion(), refused)
                assert (status, headers[b"x-dynamo-reject-reason"]) == (529, b"queue_full")
                # Marked for the class it refused: the next of that class is refused here.
                status, headers, body = await post(queue.url, completion(), refused)
                assert (status, body) == (529, OVERLOAD_BODY)
                assert headers[b"x-dynamo-reject-reason"] == b"marked"
                # A class that may displace there still reaches the worker, in the same lease.
                await queue.enqueue(nursery, "better", *better, displaces=True)
                for _ in range(500):
                    if fill[-1] in queue.replies:
                        break
                    await trio.sleep(0.01)
                status, headers, body = queue.replies[fill[-1]]
                assert (status, body) == (529, OVERLOAD_BODY)
                assert headers[b"x-dynamo-reject-reason"] == b"displaced"
            _, text = await call(queue.url, "GET", "/metrics")
    assert queue.replies["better"][0] == 200
    return queue, text


async def test_a_priority_that_may_displace_passes_the_mark_a_batch_refusal_left() -> None:
    # The hand and two channel places, all batch (priority 10).
    fill = ["hand", "old10", "new10"]
    batch = [("x-dynamo-priority", "10")]
    queue, text = await _past_the_mark(3, fill, batch, [("x-dynamo-priority", "0")])
    assert queue.order == ["hand", "better", "old10"]
    name = "dynamo_frontend_rejection_by_reason_total"
    for reason in ("queue_full", "marked", "displaced"):
        assert f'{name}{{model="mock-model",reason="{reason}"}} 1.0' in text.decode()


async def test_another_tenant_of_the_same_priority_passes_the_mark_of_the_heavy_one() -> None:
    # The hand and three channel places, all the heavy tenant's.
    fill = [f"heavy{index}" for index in range(4)]
    heavy = [("x-dynamo-tenant", "heavy")]
    queue, _ = await _past_the_mark(4, fill, heavy, [("x-dynamo-tenant", "light")])
    assert queue.order[0] == "heavy0"
    assert "better" in queue.order


async def test_a_late_light_tenant_is_interleaved_with_a_heavy_one() -> None:
    with trio.fail_after(TIMEOUT):
        async with queue_through_frontend(12) as queue:
            async with trio.open_nursery() as nursery:
                await _blocker(queue, nursery)
                for index in range(6):
                    await queue.enqueue(nursery, f"h{index}", ("x-dynamo-tenant", "heavy"))
                for index in range(3):
                    await queue.enqueue(nursery, f"l{index}", ("x-dynamo-tenant", "light"))
            assert len(queue.order) == 9
            # First come, first served would start the light tenant's three last (7th-9th);
            # fair sharing starts them alternately with the heavy tenant's.
            light_positions = [queue.order.index(f"l{index}") for index in range(3)]
            assert max(light_positions) <= 6, queue.order
            assert [name for name in queue.order if name.startswith("l")] == ["l0", "l1", "l2"]


# ----------------------------------------------------------------------------- waiting limit


async def test_the_waiting_limit_holds_a_second_request_until_the_first_token() -> None:
    # N = 2 slots, but W = 1: a long prompt prefilling in small chunks keeps the only waiting
    # place, so the second request queues next to a free slot until the first one's token.
    env = clean_env(DYN_BACKEND_ADMISSION_ENGINE_REQUEST_WAITING_LIMIT="1")
    worker = worker_cmd(
        "--engine-request-limit",
        "2",
        "--speedup-ratio",
        "0.2",
        "--max-num-batched-tokens",
        "16",
        "--num-gpu-blocks",
        "256",
        "--block-size",
        "4",
    )
    long_prompt = {"model": MODEL, "prompt": " ".join(["word"] * 160), "max_tokens": 2}
    with trio.fail_after(TIMEOUT):
        async with (
            started(worker, env) as (ws, system),
            started(frontend_cmd("--worker", ws), clean_env()) as (url,),
        ):
            await wait_connected(url)
            replies: dict[str, tuple[int, dict[bytes, bytes], bytes]] = {}
            order: list[str] = []

            async def one(name: str, body: dict[str, Any]) -> None:
                replies[name] = await post(url, body)
                order.append(name)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "first", long_prompt)
                await wait_for_metric(
                    system, "dynamo_engine_request_waiting", lambda v: v == 1, "first prefilling"
                )
                nursery.start_soon(one, "second", completion())
                await wait_for_metric(system, "dynamo_request_queue", lambda v: v == 1, "held")
                _, text = await call(system, "GET", "/metrics")
                # Held by W alone: one slot of two is in use.
                assert metric(text, "dynamo_engine_request") == 1
                assert metric(text, "dynamo_engine_request_waiting_limit") == 1
                assert metric(text, "dynamo_backend_admission_engine_wait_count") == 1
            assert replies["first"][0] == replies["second"][0] == 200
            # The second waited for the first one's prefill: the header says for how long.
            assert int(replies["second"][1][b"x-dynamo-queue-wait-ms"]) > 0
            assert replies["first"][1][b"x-dynamo-queue-wait-ms"] == b"0"
            _, text = await call(system, "GET", "/metrics")
            assert metric(text, "dynamo_engine_request_waiting") == 0


# ----------------------------------------------------------------------------- 1.7 and reasons


FAMILIES = (
    "dynamo_backend_admission_engine_request_count",
    "dynamo_backend_admission_engine_wait_count",
    "dynamo_backend_admission_request_queue_count",
    "dynamo_backend_admission_request_receive_total",
    "dynamo_backend_admission_request_admit_total",
    "dynamo_backend_admission_rejection_total",
    "dynamo_backend_admission_cancellation_total",
)


def _invariant(text: bytes) -> None:
    admitted = metric(text, "dynamo_backend_admission_request_admit_total")
    assert metric(text, "dynamo_backend_admission_request_receive_total") == (
        admitted
        + metric(text, "dynamo_backend_admission_rejection_total")
        + metric(text, "dynamo_backend_admission_cancellation_total")
        + metric(text, "dynamo_backend_admission_request_queue_count")
    )


async def test_dynamo_1_7_spellings_and_families_with_their_invariant() -> None:
    env = clean_env(
        DYN_BACKEND_ADMISSION_ENGINE_REQUEST_LIMIT="1",
        DYN_ENGINE_REQUEST_LIMIT="7",
        DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT="2",
        DYN_DYNAMO_REQUEST_QUEUE_LIMIT="9",
    )
    with trio.fail_after(TIMEOUT):
        async with (
            started(worker_cmd(*MOCKER_FLAGS), env) as (ws, system),
            started(frontend_cmd("--worker", ws), clean_env()) as (url,),
        ):
            _, text = await call(system, "GET", "/metrics")
            # Dynamo 1.7's names win over the older ones.
            assert metric(text, "dynamo_engine_request_limit") == 1
            assert metric(text, "dynamo_request_queue_limit") == 2
            lines = text.decode().splitlines()
            for family in FAMILIES:
                assert any(line.startswith(family) and line.endswith(" 0.0") for line in lines)
            assert 'dynamo_backend_admission_request_admit_total{source="queue"} 0.0' in lines
            await wait_connected(url)
            statuses = sorted(
                status for status, _, _ in await _burst(url, 6, completion(max_tokens=12))
            )
            assert statuses == [200, 200, 200, 529, 529, 529]
            _, text = await call(system, "GET", "/metrics")
            _invariant(text)
            assert metric(text, "dynamo_backend_admission_rejection_total") == 3
            assert metric(text, "dynamo_backend_admission_request_admit_total") == 3


async def _burst(
    url: str, count: int, body: dict[str, Any], headers: Sequence[tuple[str, str]] = ()
) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    replies: list[tuple[int, dict[bytes, bytes], bytes]] = []

    async def one() -> None:
        replies.append(await post(url, body, headers))

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return replies


@pytest.mark.parametrize(
    "name", ["DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT", "DYN_DYNAMO_REQUEST_QUEUE_LIMIT"]
)
@pytest.mark.parametrize("value", ["0", "1"])
def test_a_queue_limit_below_two_stops_the_worker_under_either_name(name: str, value: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "worker_ingress", "--engine-request-limit", "1"],
        env=clean_env(**{name: value}),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert name in lines[0]
    assert ">= 2" in lines[0]


async def test_every_rejection_says_why_and_every_answer_how_long_it_waited() -> None:
    worker, env = _worker(2)
    with trio.fail_after(TIMEOUT):
        async with (
            started(worker, env) as (ws, system),
            started(frontend_cmd("--worker", ws), clean_env()) as (url,),
        ):
            await wait_connected(url)
            status, headers, _ = await post(url, completion())
            assert status == 200
            assert headers[b"x-dynamo-queue-wait-ms"] == b"0"
            streamed = await post(url, completion(stream=True))
            assert streamed[0] == 200
            assert streamed[1][b"x-dynamo-queue-wait-ms"].isdigit()
            bad = await post(url, completion(), [("x-dynamo-priority", "urgent")])
            assert bad[0] == 400
            assert b"x-dynamo-priority" in bad[2]
            bad = await post(url, completion(priority=5000))
            assert bad[0] == 400
            assert b"priority" in bad[2]
            bad = await post(url, completion(), [("x-dynamo-tenant", "t" * 300)])
            assert bad[0] == 400
            assert b"x-dynamo-tenant" in bad[2]
            queue = Queue(url, system)
            async with trio.open_nursery() as nursery:
                await _blocker(queue, nursery, tokens=30)
                await queue.enqueue(nursery, "a")
                await queue.enqueue(nursery, "b")
                status, headers, body = await post(url, completion())
                assert (status, body) == (529, OVERLOAD_BODY)
                assert headers[b"x-dynamo-reject-reason"] == b"queue_full"
            for name in ("a", "b"):
                assert int(queue.replies[name][1][b"x-dynamo-queue-wait-ms"]) > 0
    # No worker at all: 503, byte for byte as before, with its reason.
    with trio.fail_after(TIMEOUT):
        async with started(frontend_cmd(), clean_env()) as (url,):
            status, headers, body = await post(url, completion())
            assert status == 503
            assert body == (
                b'{"message":"Service temporarily unavailable","type":"Service Unavailable",'
                b'"code":503}'
            )
            assert headers[b"x-dynamo-reject-reason"] == b"no_workers"


async def test_an_exempt_priority_passes_the_busy_thresholds() -> None:
    env = clean_env(DYN_DYNAMO_REQUEST_QUEUE_LIMIT="4")
    worker = worker_cmd("--engine-request-limit", "2", *MOCKER_FLAGS)
    # Busy as soon as any KV block is in use; priorities -1 and better are exempt (the default
    # priority, 0, is not).
    frontend_flags = ("--active-decode-blocks-threshold", "0", "--busy-exempt-priority", "-1")
    with trio.fail_after(TIMEOUT):
        async with (
            started(worker, env) as (ws, system),
            started(frontend_cmd("--worker", ws, *frontend_flags), clean_env()) as (url,),
        ):
            await wait_connected(url)
            async with trio.open_nursery() as nursery:

                async def hold() -> None:
                    assert (await post(url, completion(60), [("x-dynamo-priority", "-1")]))[
                        0
                    ] == 200

                nursery.start_soon(hold)
                await wait_for_metric(system, "dynamo_engine_request", lambda v: v == 1, "held")
                # Wait until the frontend sees the worker busy: a plain request is shed.
                for _ in range(300):
                    status, headers, _ = await post(url, completion())
                    if status == 529:
                        break
                    await trio.sleep(0.02)
                assert (status, headers[b"x-dynamo-reject-reason"]) == (529, b"busy")
                assert (await post(url, completion(), [("x-dynamo-priority", "0")]))[0] == 529
                # Exempt: by header, and by the body's field (no header: the body is read).
                assert (await post(url, completion(), [("x-dynamo-priority", "-1")]))[0] == 200
                assert (await post(url, completion(priority=-5)))[0] == 200
            _, text = await call(url, "GET", "/metrics")
            assert (
                b'dynamo_frontend_rejection_by_reason_total{model="mock-model",reason="busy"}'
                in text
            )
