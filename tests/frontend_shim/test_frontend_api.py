"""The frontend's HTTP API, in one process: ``run_frontend`` against real in-process workers.

Plain requests, bad input, metrics and health, the OpenAI SDK, drain and hostile bodies, through
the fleet of ``frontend_fleet`` (the admission and busy-threshold paths are in
``test_frontend_admission.py``).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import h11
import pytest
import trio
from frontend_fleet import (
    MODEL,
    TIMEOUT,
    Fleet,
    Reply,
    address_of,
    call,
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

from frontend_shim._event_cost import DEFAULT_CORE_SHARE, MAX_MEASURED_BUDGET, MIN_MEASURED_BUDGET
from frontend_shim._responses import UNAVAILABLE_BODY
from shim_common import wire
from worker_ingress._planes import RequestConnection

# ----------------------------------------------------------------------------- plain requests


async def test_completion_chat_and_models() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:
            reply = await f.post("/v1/completions", completion_body())
            assert reply.status == 200
            body = reply.json()
            assert body["object"] == "text_completion"
            assert body["usage"] == {
                "prompt_tokens": 3,
                "completion_tokens": 3,
                "total_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            chat = await f.post("/v1/chat/completions", chat_body())
            assert chat.status == 200
            message = chat.json()["choices"][0]["message"]
            assert message["role"] == "assistant"
            assert message["content"]
            models = (await f.get("/v1/models")).json()
            assert models["object"] == "list"
            assert [m["id"] for m in models["data"]] == [MODEL]


async def test_embeddings() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:
            reply = await f.post("/v1/embeddings", {"model": MODEL, "input": ["a b", "c"]})
            assert reply.status == 200
            body = reply.json()
            assert body["object"] == "list"
            assert [item["index"] for item in body["data"]] == [0, 1]
            assert all(item["embedding"] for item in body["data"])
            assert body["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", chat_body(stream=True)), ("/v1/completions", completion_body(True))],
)
async def test_streaming_ends_with_done(path: str, body: dict[str, Any]) -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:
            body = {**body, "stream_options": {"include_usage": True}}
            reply = await f.post(path, body)
            assert reply.status == 200
            assert reply.headers[b"content-type"] == b"text/event-stream"
            events = reply.sse_events()
            assert events[-1] == b"data: [DONE]"
            chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]]
            assert chunks[-1]["usage"]["completion_tokens"] == body["max_tokens"]
            # At most one event per token: tokens that queued up may share an event.
            assert 1 <= len([c for c in chunks if c["choices"]]) <= body["max_tokens"]


async def test_failure_mid_stream_sends_error_event_and_no_done() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:
            f.engines[0].fail_mid_stream = True
            reply = await f.post("/v1/chat/completions", chat_body(stream=True))
            assert reply.status == 200
            events = reply.sse_events()
            assert b"data: [DONE]" not in events
            assert events[-1].startswith(b"event: error\ndata: ")
            error = json.loads(events[-1].split(b"data: ", 1)[1])
            assert "exploded" in error["error"]["message"]
            # Before the start, an engine failure is a plain error status, not a stream.
            plain = await f.post("/v1/completions", completion_body())
            assert plain.status == 500


# ----------------------------------------------------------------------------- bad input


async def test_bad_input_answers() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()], max_body_bytes=1000) as f:
            unknown = await f.post("/v1/completions", {**completion_body(), "model": "nope"})
            assert unknown.status == 404
            error = unknown.json()["error"]
            assert set(error) >= {"message", "type", "code"}
            assert "nope" in error["message"]
            malformed = await f.post("/v1/chat/completions", raw=b'{"model": ')
            assert malformed.status == 400
            assert malformed.json()["error"]["message"]
            no_messages = await f.post("/v1/chat/completions", {"model": MODEL})
            assert no_messages.status == 400
            too_big = await f.post("/v1/completions", completion_body(prompt="x " * 1000))
            assert too_big.status == 413
            assert "error" in too_big.json()
            no_path = await f.get("/v1/nothing")
            assert no_path.status == 404
            assert no_path.json()["error"]["code"] == 404


async def test_no_workers_answers_503_exact_body() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([]) as f:
            for path, body in [
                ("/v1/completions", completion_body()),
                ("/v1/chat/completions", chat_body(stream=True)),
                ("/v1/embeddings", {"model": "anything", "input": "x"}),
            ]:
                reply = await f.post(path, body)
                assert reply.status == 503
                assert reply.body == UNAVAILABLE_BODY
                assert reply.body == (
                    b'{"message":"Service temporarily unavailable",'
                    b'"type":"Service Unavailable","code":503}'
                )
                assert reply.headers[b"content-type"] == b"application/json"


async def test_a_refusal_with_neither_prefix_is_a_503_that_says_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A text no version of the protocol classifies (a foreign worker's) is no capacity problem:
    # not retried elsewhere, and its 503 says so rather than "draining".
    def foreign(_: RequestConnection, request_id: int, __: wire.RejectReason) -> wire.Rejected:
        return wire.Rejected(request_id=request_id, reason="Quota exceeded: tenant x")

    monkeypatch.setattr(RequestConnection, "_rejected", foreign)
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:
            f.workers[0].gate.drain()  # every request refused, in the text above
            refused = await f.post("/v1/completions", completion_body())
            assert refused.status == 503
            assert refused.body == UNAVAILABLE_BODY
            assert refused.headers[b"x-dynamo-reject-reason"] == b"other"
            counted = metric_value(
                await f.metrics(), "dynamo_frontend_rejection_by_reason_total", reason="other"
            )
            assert counted == 1


# ----------------------------------------------------------------------------- metrics, health


async def test_metrics_names_and_labels() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:
            f.engines[0].set_load(blocks=3, prefill=4)
            await wait_for_rank_gauge(f, "dynamo_frontend_worker_active_decode_blocks", 3)
            assert (await f.post("/v1/completions", completion_body())).status == 200
            text = await f.metrics()
            labels = {"worker_id": "w-a", "dp_rank": "0"}
            assert metric_value(text, "dynamo_frontend_worker_active_prefill_tokens", **labels) >= 4
            assert metric_value(text, "dynamo_frontend_worker_kv_total_blocks", **labels) == 100
            assert (
                metric_value(
                    text,
                    "dynamo_frontend_requests_total",
                    model=MODEL,
                    endpoint="completions",
                    status="200",
                )
                == 1
            )
            assert "dynamo_frontend_inflight_requests{" in text
            assert "# TYPE dynamo_frontend_model_rejection_total counter" in text
            for histogram in (
                "dynamo_frontend_time_to_first_token_seconds",
                "dynamo_frontend_request_duration_seconds",
            ):
                assert metric_value(text, histogram + "_count", model=MODEL) == 1
            assert (await f.get("/live")).status == 200
            health = (await f.get("/health")).json()
            assert health["status"] == "ready"
            assert health["workers_connected"] == 1


async def _take_events_until_measured(f: Fleet) -> str:
    """Change the workers' load until the frontend exports a measured cost; its metrics then."""
    for step in range(2000):
        for engine in f.engines:
            engine.set_load(blocks=step % 7)
        await trio.sleep(0.005)
        if step % 20 == 19:
            text = await f.metrics()
            if metric_value(text, "dynamo_frontend_event_message_cost_seconds") > 0:
                return text
    raise AssertionError("no cost per event message measured")


async def test_without_a_budget_flag_the_budget_follows_the_measured_cost() -> None:
    # Short windows of few messages so that a test's trickle of events is measured.
    workers = [worker_settings(worker_id=f"w-{n}", load_publish_interval=0.0) for n in range(2)]
    with trio.fail_after(TIMEOUT):
        async with fleet(workers, event_cost_window=0.2, event_cost_min_messages=20) as f:
            text = await _take_events_until_measured(f)
            cost = metric_value(text, "dynamo_frontend_event_message_cost_seconds")
            budget = metric_value(text, "dynamo_frontend_event_budget_messages_per_second")
            assert metric_value(text, "dynamo_frontend_event_budget_measured") == 1
            # An order of magnitude: Python spends microseconds to milliseconds on a message.
            assert 1e-6 < cost < 1e-2
            # The budget in force is the share of a core over that cost, clamped; to an order of
            # magnitude, as the estimate moves on between two moves of the budget.
            wanted = min(MAX_MEASURED_BUDGET, max(MIN_MEASURED_BUDGET, DEFAULT_CORE_SHARE / cost))
            assert MIN_MEASURED_BUDGET <= budget <= MAX_MEASURED_BUDGET
            assert wanted / 3 <= budget <= wanted * 3
            interval = metric_value(text, "dynamo_frontend_event_interval_seconds")
            assert interval == pytest.approx(2 / budget)


async def test_a_budget_flag_stays_fixed_and_the_cost_is_measured_beside_it() -> None:
    workers = [worker_settings(load_publish_interval=0.0)]
    with trio.fail_after(TIMEOUT):
        async with fleet(
            workers, event_budget=2500.0, event_cost_window=0.2, event_cost_min_messages=20
        ) as f:
            text = await _take_events_until_measured(f)
            assert metric_value(text, "dynamo_frontend_event_budget_messages_per_second") == 2500
            assert metric_value(text, "dynamo_frontend_event_budget_measured") == 0


async def test_status_routes_take_head_name_allowed_methods_and_are_not_cached() -> None:
    # The same routes as the worker's system port (shim_common._status).
    with trio.fail_after(TIMEOUT):
        async with fleet([]) as f:
            for path in ("/health", "/live"):
                got = await f.get(path)
                assert got.status == 200
                assert got.headers[b"cache-control"] == b"no-store"
                head = await call(f.url, "HEAD", path)
                assert head.status == 200
                assert head.body == b""
                assert head.headers[b"content-length"] == str(len(got.body)).encode()
            assert (await call(f.url, "HEAD", "/metrics")).status == 200
            for method, path, allow in [
                ("POST", "/health", b"GET, HEAD"),
                ("DELETE", "/metrics", b"GET, HEAD"),
                ("GET", "/v1/completions", b"POST"),
                ("DELETE", "/busy_threshold", b"GET, POST"),
            ]:
                refused = await call(f.url, method, path)
                assert refused.status == 405, (method, path)
                assert refused.headers[b"allow"] == allow
                assert refused.json()["error"]["code"] == 405


# ----------------------------------------------------------------------------- the OpenAI SDK


async def test_openai_sdk_streams_a_chat_completion() -> None:
    openai = pytest.importorskip("openai")
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:

            def chat() -> list[str]:
                client = openai.OpenAI(base_url=f.url + "/v1", api_key="unused", max_retries=0)
                with client:
                    stream = client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "say something"}],
                        max_tokens=5,
                        stream=True,
                    )
                    return [chunk.choices[0].delta.content or "" for chunk in stream]

            pieces = await trio.to_thread.run_sync(chat)
            assert 1 <= len(pieces) <= 5
            assert all(pieces)
            assert len("".join(pieces).split()) == 5  # the instant engine: one word a token


# ----------------------------------------------------------------------------- drain


async def test_sigterm_drains_requests_in_flight_and_refuses_new_ones() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:
            f.engines[0].hold = True
            replies: list[Reply] = []

            async def one_request() -> None:
                replies.append(await f.post("/v1/completions", completion_body()))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one_request)
                gate = f.workers[0].gate
                await wait_until(lambda: gate.running == 1, "the request to start")
                # The frontend's own signal receiver takes it (the workers here use none).
                os.kill(os.getpid(), signal.SIGTERM)

                async def draining() -> bool:
                    return (await f.get("/health")).status == 503

                await wait_until_async(draining, "/health to say draining")
                health = await f.get("/health")
                assert health.json()["status"] == "draining"
                # Every 503 says why, the health probe's too.
                assert health.headers[b"x-dynamo-reject-reason"] == b"draining"
                refused = await f.post("/v1/completions", completion_body())
                assert refused.status == 503
                assert refused.body == UNAVAILABLE_BODY
                assert refused.headers[b"connection"] == b"close"
                assert refused.headers[b"x-dynamo-reject-reason"] == b"draining"
                f.engines[0].release.set()
            # The request in flight finished normally during the drain.
            assert [reply.status for reply in replies] == [200]


async def test_drain_waits_for_a_request_still_uploading_its_body() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:
            host, port = address_of(f.url)
            data = json.dumps(completion_body()).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n\r\n"
            ).encode()
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(head + data[:5])
                await trio.sleep(0.1)  # the handler is reading the body now
                os.kill(os.getpid(), signal.SIGTERM)

                async def draining() -> bool:
                    return (await f.get("/health")).status == 503

                await wait_until_async(draining, "/health to say draining")
                await stream.send_all(data[5:])
                conn = h11.Connection(h11.CLIENT)
                conn.send(h11.Request(method="POST", target="/", headers=[("host", "x")]))
                reply = await read_reply(stream, conn)
            assert reply.status == 200


# ----------------------------------------------------------------------------- hostile bodies


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


async def test_hostile_bodies_get_a_4xx_in_the_openai_shape_counted_by_status() -> None:
    """Absurd numbers, deep nesting, too many values or inputs, a huge model name: each a 4xx
    naming its bound, none echoing more than a short prefix, and the frontend serves on."""
    huge_name = "m" * (1 << 20)
    many_keys = b",".join(b'"k%d":1' % index for index in range(200_000))
    cases: list[tuple[str, bytes, int, str]] = [
        ("/v1/completions", _json(completion_body(max_tokens=2**64 + 1)), 400, "64-bit"),
        ("/v1/completions", _json(completion_body(seed=-(2**70))), 400, "64-bit"),
        ("/v1/completions", b'{"model": "m", "temperature": 1e999}', 400, "not valid JSON"),
        ("/v1/chat/completions", b'{"model": "m", "x": ' + nested_json(1000) + b"}", 400, "deep"),
        ("/v1/completions", _json(completion_body(n=10000)), 400, "`n`"),
        ("/v1/completions", _json(completion_body(n=-1)), 400, "`n`"),
        ("/v1/embeddings", _json({"model": MODEL, "input": ["w"] * 100_000}), 400, "at most 2048"),
        ("/v1/completions", b'{"model": "m", "o": {' + many_keys + b"}}", 413, "JSON values"),
    ]
    with trio.fail_after(TIMEOUT * 2):
        async with fleet([worker_settings()]) as f:
            for path, raw, status, says in cases:
                reply = await f.post(path, raw=raw)
                assert reply.status == status, (path, raw[:80], reply.body[:200])
                error = reply.json()["error"]
                assert error["code"] == status
                assert error["type"] == "invalid_request_error"
                assert says in error["message"]
                assert len(reply.body) < 1000
            unknown = await f.post("/v1/completions", completion_body(model=huge_name))
            assert unknown.status == 404
            assert len(unknown.body) < 1000
            assert "1048576 characters" in unknown.json()["error"]["message"]
            served = await f.post("/v1/completions", completion_body(n=1))
            assert served.status == 200
            metrics = await f.metrics()
            counted = {
                (endpoint, status): metric_value(
                    metrics,
                    "dynamo_frontend_requests_total",
                    model="unknown",
                    endpoint=endpoint,
                    status=str(status),
                )
                for endpoint in ("completions", "chat_completions", "embeddings")
                for status in (400, 404, 413)
            }
            assert {key: count for key, count in counted.items() if count} == {
                ("completions", 400): 5,
                ("chat_completions", 400): 1,
                ("embeddings", 400): 1,
                ("completions", 404): 1,
                ("completions", 413): 1,
            }


async def test_the_bound_of_embedding_inputs_is_served() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet([worker_settings()]) as f:
            inputs = [f"w{index}" for index in range(2048)]
            # Repeated: the vectors arrive in bursts whose size depends on the scheduling.
            for _ in range(5):
                reply = await f.post("/v1/embeddings", {"model": MODEL, "input": inputs})
                assert reply.status == 200, reply.body[:200]
                assert [item["index"] for item in reply.json()["data"]] == list(range(2048))
