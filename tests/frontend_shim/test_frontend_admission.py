"""The frontend's admission paths, in one process: ``run_frontend`` against real in-process workers.

A worker's 529 and its reasons, migration to a free worker, the overload mark, a disconnecting
client, and the busy thresholds (set through the API, parking and releasing), through the fleet
of ``frontend_fleet``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import trio
from frontend_fleet import (
    MODEL,
    TIMEOUT,
    Fleet,
    Reply,
    address_of,
    chat_body,
    completion_body,
    fleet,
    metric_value,
    nested_json,
    read_reply,
    wait_for_rank_gauge,
    wait_until,
    wait_until_async,
    worker_settings,
)
from trio_websocket import open_websocket_url

from frontend_shim._responses import REJECT_REASON_HEADER, overload_body
from shim_common import wire
from shim_common.wire import BusyThresholds
from worker_ingress._admission import AdmissionGate

# ----------------------------------------------------------------------------- admission


@asynccontextmanager
async def held_requests(
    f: Fleet, count: int, worker: int = 0, body: dict[str, Any] | None = None
) -> AsyncIterator[list[Reply]]:
    """``count`` requests held in worker ``worker``'s gate (running or queued) until exit.

    On exit the engine releases them and their replies are awaited (collected in the list).
    """
    engine = f.engines[worker]
    gate = f.workers[worker].gate
    engine.hold = True
    replies: list[Reply] = []
    before = gate.in_flight

    async def one() -> None:
        replies.append(await f.post("/v1/completions", body or completion_body()))

    async with trio.open_nursery() as nursery:
        for sent in range(1, count + 1):
            nursery.start_soon(one)
            # One at a time, so arrival order is the order they were sent.
            await wait_until(functools.partial(_reached, gate, before + sent), "the gate")
        yield replies
        engine.hold = False
        engine.release.set()
    engine.release = trio.Event()


@asynccontextmanager
async def filled_directly(f: Fleet, worker: int = 0) -> AsyncIterator[None]:
    """Fill worker ``worker``'s gate to its cap N + Q from a client of its own, behind the
    frontend's back (the frontend sees no load: the instant engine reports none)."""
    engine = f.engines[worker]
    gate = f.workers[worker].gate
    engine.hold = True
    cap = gate.engine_slots + gate.queue_limit
    url = f.addresses[worker].ws_url + "/v1/requests"
    async with open_websocket_url(url, max_message_size=wire.MAX_MESSAGE_BYTES) as ws:
        hello = await ws.get_message()
        assert isinstance(hello, bytes)
        assert isinstance(wire.decode_worker_message(hello), wire.Hello)
        for request_id in range(1, cap + 1):
            generate = wire.Generate(
                request_id=request_id, endpoint="completions", body={"prompt": "a", "max_tokens": 1}
            )
            await ws.send_message(wire.encode(generate))
        await wait_until(lambda: gate.in_flight == cap, "the worker to fill up")
        yield
        engine.hold = False
        engine.release.set()
    engine.release = trio.Event()


def _reached(gate: AdmissionGate, in_flight: int) -> bool:
    return gate.in_flight >= in_flight


def assert_overloaded(reply: Reply, status: int = 529) -> None:
    assert reply.status == status
    assert reply.body == overload_body(status)
    assert reply.headers[b"content-type"] == b"application/json"
    retry_after = reply.headers[b"retry-after"]
    assert retry_after.isdigit()
    assert int(retry_after) >= 1


async def test_fourth_request_gets_529_and_queued_ones_complete() -> None:
    # N = 1, Q = 2: one runs, two wait, the fourth is rejected by the worker.
    settings = worker_settings(engine_request_limit=1, request_queue_limit=2)
    with trio.fail_after(TIMEOUT):
        async with fleet([settings]) as f:
            gate = f.workers[0].gate
            async with held_requests(f, 3) as replies:
                assert (gate.running, gate.queued) == (1, 2)
                fourth = await f.post("/v1/completions", completion_body())
                assert_overloaded(fourth)
                assert fourth.body == (
                    b'{"message":"Service temporarily overloaded","type":"Overloaded","code":529}'
                )
                # A rejection before the start is a real 529 with stream=true as well.
                streamed = await f.post("/v1/chat/completions", chat_body(stream=True))
                assert_overloaded(streamed)
            assert [reply.status for reply in replies] == [200, 200, 200]
            assert gate.in_flight == 0
            text = await f.metrics()
            rejected = metric_value(
                text,
                "dynamo_frontend_model_rejection_total",
                model=MODEL,
                endpoint="completions",
            )
            assert rejected == 1
            assert (
                metric_value(
                    text,
                    "dynamo_frontend_model_rejection_total",
                    model=MODEL,
                    endpoint="chat_completions",
                )
                == 1
            )


async def test_overload_status_follows_the_setting() -> None:
    settings = worker_settings(engine_request_limit=1, request_queue_limit=2)
    with trio.fail_after(TIMEOUT):
        async with fleet([settings], overload_status=429) as f, held_requests(f, 3):
            assert_overloaded(await f.post("/v1/completions", completion_body()), 429)


async def test_migration_retries_on_a_free_worker() -> None:
    full = worker_settings(engine_request_limit=1, request_queue_limit=2)
    free = worker_settings(worker_id="w-b")
    with trio.fail_after(TIMEOUT):
        async with fleet([full, free], migration_limit=1) as f, filled_directly(f):
            gate = f.workers[0].gate
            statuses = []
            for _ in range(10):
                statuses.append((await f.post("/v1/completions", completion_body())).status)
                if gate.rejected_total >= 2:
                    break
            assert gate.rejected_total >= 1, "no request was sent to the full worker"
            assert set(statuses) == {200}


async def test_overload_mark_skips_the_worker_then_its_lease_ends() -> None:
    # Worker A never sends an event on its own (long heartbeat, and every change published at
    # once, so no event of the filling arrives after the mark): only the lease lifts its mark.
    full = worker_settings(
        engine_request_limit=1,
        request_queue_limit=2,
        heartbeat_interval=30,
        load_publish_interval=0.0,
    )
    free = worker_settings(worker_id="w-b", heartbeat_interval=30)
    lease = 0.4  # shorter than the 1 s default, still long enough for six local requests
    with trio.fail_after(TIMEOUT):
        async with fleet([full, free], overload_mark_lease=lease) as f, filled_directly(f):
            gate = f.workers[0].gate
            statuses = []
            for _ in range(4):
                statuses.append((await f.post("/v1/completions", completion_body())).status)
                if gate.rejected_total:
                    break
            assert gate.rejected_total == 1
            assert statuses[-1] == 529
            # Marked: every request goes to B for now.
            for _ in range(6):
                assert (await f.post("/v1/completions", completion_body())).status == 200
            assert gate.rejected_total == 1
            await trio.sleep(lease + 0.1)  # the mark lease has run out
            for _ in range(4):
                await f.post("/v1/completions", completion_body())
                if gate.rejected_total > 1:
                    break
            assert gate.rejected_total == 2, "the lease ended but the worker was never tried"


async def test_disconnecting_client_frees_its_slot_and_queue_place() -> None:
    settings = worker_settings(engine_request_limit=1, request_queue_limit=2)
    with trio.fail_after(TIMEOUT):
        async with fleet([settings]) as f:
            gate = f.workers[0].gate
            f.engines[0].hold = True
            host, port = address_of(f.url)
            data = json.dumps(completion_body()).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n\r\n"
            ).encode()
            clients = []
            for expected in (1, 2):  # one running, one queued
                stream = await trio.open_tcp_stream(host, port)
                clients.append(stream)
                await stream.send_all(head + data)
                await wait_until(functools.partial(_reached, gate, expected), "the request")
            assert (gate.running, gate.queued) == (1, 1)
            for stream in reversed(clients):  # the queued client leaves first, then the runner
                await stream.aclose()
            await wait_until(lambda: gate.in_flight == 0, "both places to be freed")
            f.engines[0].hold = False
            assert (await f.post("/v1/completions", completion_body())).status == 200
            text = await f.metrics()
            assert metric_value(text, "dynamo_frontend_inflight_requests", model=MODEL) == 0


# ----------------------------------------------------------------------------- busy thresholds


async def test_threshold_set_through_the_api_takes_effect_and_sheds_before_the_body() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:
            f.engines[0].set_load(blocks=5)
            await wait_for_rank_gauge(f, "dynamo_frontend_worker_active_decode_blocks", 5)
            # Load present, no threshold: served.
            assert (await f.post("/v1/completions", completion_body())).status == 200
            update = {"model": MODEL, "active_decode_blocks_threshold": 0.0}
            entry = await f.post("/busy_threshold", update)
            assert entry.status == 200
            assert entry.json() == {
                "model": MODEL,
                "active_decode_blocks_threshold": 0.0,
                "active_prefill_tokens_threshold": None,
                "active_prefill_tokens_threshold_frac": None,
            }
            assert_overloaded(await f.post("/v1/chat/completions", chat_body(stream=True)))
            # The fast shed answers from the head alone: the body is never sent here.
            host, port = address_of(f.url)
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                conn = h11.Connection(h11.CLIENT)
                head = [("host", "x"), ("content-length", "1000000")]
                await stream.send_all(
                    conn.send(h11.Request(method="POST", target="/v1/completions", headers=head))
                )
                reply = await read_reply(stream, conn)
            assert_overloaded(reply)
            assert reply.headers[b"connection"] == b"close"
            # The load goes away: served again.
            f.engines[0].set_load(blocks=0)
            await wait_for_rank_gauge(f, "dynamo_frontend_worker_active_decode_blocks", 0)
            assert (await f.post("/v1/completions", completion_body())).status == 200
            text = await f.metrics()
            assert (
                metric_value(
                    text,
                    "dynamo_frontend_model_rejection_total",
                    model=MODEL,
                    endpoint="completions",
                )
                == 1
            )
            assert (
                metric_value(
                    text,
                    "dynamo_frontend_model_rejection_total",
                    model=MODEL,
                    endpoint="chat_completions",
                )
                == 1
            )


async def test_busy_threshold_get_and_post_cases() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet(
            [worker_settings()], thresholds=BusyThresholds(active_prefill_tokens=7)
        ) as f:
            listed = (await f.get("/busy_threshold")).json()
            assert listed == {
                "thresholds": [
                    {
                        "model": MODEL,
                        "active_decode_blocks_threshold": None,
                        "active_prefill_tokens_threshold": 7,
                        "active_prefill_tokens_threshold_frac": None,
                    }
                ]
            }
            unchanged = await f.post("/busy_threshold", {"model": MODEL})
            assert unchanged.status == 200
            assert unchanged.json() == listed["thresholds"][0]
            both = await f.post(
                "/busy_threshold",
                {
                    "model": MODEL,
                    "active_decode_blocks_threshold": 0.5,
                    "active_prefill_tokens_threshold_frac": 1.5,
                },
            )
            assert both.status == 200
            assert both.json()["active_decode_blocks_threshold"] == 0.5
            assert both.json()["active_prefill_tokens_threshold"] == 7
            assert both.json()["active_prefill_tokens_threshold_frac"] == 1.5
            for field, value in [
                ("active_decode_blocks_threshold", 1.5),
                ("active_decode_blocks_threshold", -0.1),
                ("active_prefill_tokens_threshold", -1),
                ("active_prefill_tokens_threshold_frac", -2.0),
            ]:
                reply = await f.post("/busy_threshold", {"model": MODEL, field: value})
                assert reply.status == 400, (field, value)
                message = reply.json()["error"]
                assert field in message
                assert str(value) in message
            for body in [
                {"model": MODEL, "active_decode_blocks_threshold": "high"},
                {"model": MODEL, "active_prefill_tokens_threshold": 1.5},
                {"model": MODEL, "active_prefill_tokens_threshold_frac": True},
                {"active_decode_blocks_threshold": 0.5},
                {"model": 3},
            ]:
                reply = await f.post("/busy_threshold", body)
                assert reply.status == 422, body
                assert "error" in reply.json()
            unknown = await f.post(
                "/busy_threshold", {"model": "nope", "active_prefill_tokens_threshold": 1}
            )
            assert unknown.status == 404
            assert "nope" in unknown.json()["error"]
            # Hostile bodies: refused in the admin shape, naming the bound, echoing no input.
            deep = await f.post("/busy_threshold", raw=b'{"model": ' + nested_json(1000) + b"}")
            assert deep.status == 400
            assert "levels deep" in deep.json()["error"]
            many = b",".join(b'"k%d":1' % index for index in range(200_000))
            wide = await f.post("/busy_threshold", raw=b'{"model": "m", ' + many + b"}")
            assert wide.status == 413
            assert "JSON values" in wide.json()["error"]
            long_name = await f.post("/busy_threshold", {"model": "n" * (1 << 20)})
            assert long_name.status == 404
            assert len(long_name.body) < 1000
            # Nothing above changed what is in force.
            assert (await f.get("/busy_threshold")).json()["thresholds"][0] == both.json()


async def test_admin_api_can_be_disabled() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()], admin_api_disabled=True) as f:
            assert (await f.get("/busy_threshold")).status == 404
            reply = await f.post(
                "/busy_threshold", {"model": MODEL, "active_prefill_tokens_threshold": 1}
            )
            assert reply.status == 404
            assert (await f.post("/v1/completions", completion_body())).status == 200


async def test_router_queue_threshold_parks_then_releases() -> None:
    # max_num_batched_tokens is 100 (worker_settings): saturated above 50 prefill tokens.
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()], router_queue_threshold=0.5) as f:
            f.engines[0].set_load(prefill=80)
            await wait_for_rank_gauge(f, "dynamo_frontend_worker_active_prefill_tokens", 80)
            replies: list[Reply] = []

            async def one() -> None:
                replies.append(await f.post("/v1/completions", completion_body()))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one)
                await wait_until_async(
                    lambda: _inflight(f, 1), "the request to be parked in the frontend"
                )
                await trio.sleep(0.3)
                assert replies == [], "a request was routed to a saturated worker"
                assert f.workers[0].gate.in_flight == 0
                f.engines[0].set_load(prefill=10)
            assert [reply.status for reply in replies] == [200]


async def test_a_full_frontend_queue_answers_529_with_its_reason() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet(
            [worker_settings()], router_queue_threshold=0.5, router_queue_capacity=1
        ) as f:
            f.engines[0].set_load(prefill=80)
            await wait_for_rank_gauge(f, "dynamo_frontend_worker_active_prefill_tokens", 80)
            replies: list[Reply] = []

            async def one() -> None:
                replies.append(await f.post("/v1/completions", completion_body()))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one)
                await wait_until_async(lambda: _inflight(f, 1), "the request to be parked")
                refused = await f.post("/v1/completions", completion_body())
                assert refused.status == 529
                assert refused.headers[b"x-dynamo-reject-reason"] == b"busy"
                f.engines[0].set_load(prefill=10)
            assert [reply.status for reply in replies] == [200]


async def _inflight(f: Fleet, count: int) -> bool:
    text = await f.metrics()
    return metric_value(text, "dynamo_frontend_inflight_requests", model=MODEL) == count


async def test_a_529_says_when_and_whether_to_retry_and_a_retry_passes_a_mark() -> None:
    """At twice its capacity, an SDK's default retries came back into the frontend's own mark
    and met a certain second 529: a retry now goes to the worker, whose gate decides."""
    full = worker_settings(
        engine_request_limit=1,
        request_queue_limit=2,
        heartbeat_interval=30,
        load_publish_interval=0.0,
    )
    with trio.fail_after(TIMEOUT):
        async with fleet([full]) as f, filled_directly(f):
            gate = f.workers[0].gate
            first = await f.post("/v1/completions", completion_body())
            assert_overloaded(first)
            assert first.headers[REJECT_REASON_HEADER] == b"queue_full"  # the worker's refusal
            assert int(first.headers[b"retry-after-ms"]) >= 100
            assert first.headers[b"x-should-retry"] == b"true"  # within the retry budget
            assert gate.rejected_total == 1
            # Marked for a second: a plain request is refused by the mark, the worker unasked.
            marked = await f.post("/v1/completions", completion_body())
            assert_overloaded(marked)
            assert gate.rejected_total == 1
            # The client's retry is not refused by the mark alone: the worker's gate decides.
            retry = await f.post(
                "/v1/completions", completion_body(), headers=[("x-stainless-retry-count", "1")]
            )
            assert_overloaded(retry)
            assert gate.rejected_total == 2
