"""The frontend's HTTP API, in one process: ``run_frontend`` against real in-process workers.

Each test starts :class:`~worker_ingress._server.Worker` instances on loopback (port 0) with a
:class:`ControlledEngine` (the instant engine, plus a switch that holds requests before their
first token, one that fails a stream after its first chunk, and a settable load), then the
frontend itself with :func:`~frontend_shim._app.run_frontend`, and talks HTTP to it with a small
h11 client. Wall-clock time is real (sockets), so every test runs under ``trio.fail_after`` and
every wait is a bounded poll.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import signal
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import h11
import pytest
import trio
from trio_websocket import open_websocket_url

from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from frontend_shim._event_cost import DEFAULT_CORE_SHARE, MAX_MEASURED_BUDGET, MIN_MEASURED_BUDGET
from frontend_shim._responses import UNAVAILABLE_BODY, overload_body
from shim_common import wire
from shim_common._busy import BusyThresholds
from shim_common.wire import RankLoad
from worker_ingress._admission import AdmissionGate
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress._server import Worker, WorkerAddress
from worker_ingress.engines._base import EngineOutput, PreparedRequest
from worker_ingress.engines._instant import InstantEngine, create

TIMEOUT = 20.0
MODEL = "mock-model"

# ----------------------------------------------------------------------------- the engine


class ControlledEngine(InstantEngine):
    """The instant engine with three switches a test turns.

    - ``hold``: requests wait for :attr:`release` before their first chunk (they keep their
      engine slot meanwhile, so the admission gate fills).
    - ``fail_mid_stream``: a request yields one chunk, then the engine raises.
    - :meth:`set_load`: the load every rank reports (and an event is published).
    """

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(create(settings).config)
        self.hold = False
        self.release = trio.Event()
        self.fail_mid_stream = False
        self._reported: list[RankLoad] | None = None

    def load(self) -> list[RankLoad]:
        return list(self._reported) if self._reported is not None else super().load()

    def set_load(self, *, blocks: int = 0, prefill: int = 0) -> None:
        self._reported = [
            RankLoad(
                dp_rank=rank,
                active_decode_blocks=blocks,
                active_prefill_tokens=prefill,
                kv_used_blocks=blocks,
            )
            for rank in range(self.config.data_parallel_size)
        ]
        self.load_changed.bump()

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        if self.hold:
            await self.release.wait()
        if self.fail_mid_stream:
            yield EngineOutput(text="partial", tokens=1)
            raise RuntimeError("engine exploded mid-stream")
        async for output in super().generate(request):
            yield output


def worker_settings(**changes: Any) -> WorkerSettings:
    base = WorkerSettings(
        worker_id="w-a",
        host="127.0.0.1",
        port=0,
        system_port=0,
        heartbeat_interval=0.2,
        drain_grace=1.0,
        mocker=MockerSettings(num_gpu_blocks=100, block_size=4, max_num_batched_tokens=100),
    )
    return dataclasses.replace(base, **changes)


# ----------------------------------------------------------------------------- HTTP client


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def sse_events(self) -> list[bytes]:
        """The server-sent events of the body, each without its trailing blank line."""
        return [event for event in self.body.split(b"\n\n") if event]


def _address(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    return parts.hostname, parts.port


async def _read_reply(stream: trio.SocketStream, conn: h11.Connection) -> Reply:
    status = 0
    headers: dict[bytes, bytes] = {}
    body = bytearray()
    for _ in range(100_000):
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {name.lower(): value for name, value in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return Reply(status, headers, bytes(body))
    raise AssertionError("response did not end")


async def call(
    url: str,
    method: str,
    path: str,
    payload: Any = None,
    *,
    raw: bytes | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> Reply:
    """One request on a fresh connection; the reply in full (SSE bodies included)."""
    host, port = _address(url)
    data = raw if raw is not None else b"" if payload is None else json.dumps(payload).encode()
    head = [("host", f"{host}:{port}"), *headers]
    if method != "GET" or data:
        head.append(("content-length", str(len(data))))
        head.append(("content-type", "application/json"))
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        out = conn.send(h11.Request(method=method, target=path, headers=head))
        out += conn.send(h11.Data(data=data)) if data else b""
        out += conn.send(h11.EndOfMessage())
        await stream.send_all(out)
        return await _read_reply(stream, conn)


def completion_body(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "one two three", "max_tokens": 3, "stream": stream, **extra}


def chat_body(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        "stream": stream,
        **extra,
    }


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0.0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if match is None or match[1] != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match[2] or ""))
        if all(found.get(key) == value for key, value in labels.items()):
            return float(match[3])
    return 0.0


# ----------------------------------------------------------------------------- the fleet


@dataclasses.dataclass
class Fleet:
    url: str
    workers: list[Worker]
    engines: list[ControlledEngine]
    addresses: list[WorkerAddress]

    async def post(self, path: str, payload: Any = None, **options: Any) -> Reply:
        return await call(self.url, "POST", path, payload, **options)

    async def get(self, path: str) -> Reply:
        return await call(self.url, "GET", path)

    async def metrics(self) -> str:
        return (await self.get("/metrics")).body.decode()


async def wait_until(condition: Callable[[], bool], what: str, *, tries: int = 500) -> None:
    for _ in range(tries):
        if condition():
            return
        await trio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def wait_until_async(
    condition: Callable[[], Any], what: str, *, tries: int = 300, interval: float = 0.02
) -> None:
    for _ in range(tries):
        if await condition():
            return
        await trio.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


@asynccontextmanager
async def fleet(
    workers: Sequence[WorkerSettings] = (),
    **frontend: Any,
) -> AsyncIterator[Fleet]:
    """Workers (in-process) and a frontend routing to them; every worker connected on entry."""
    async with trio.open_nursery() as nursery:
        started: list[Worker] = []
        engines: list[ControlledEngine] = []
        addresses: list[WorkerAddress] = []
        for settings in workers:
            engine = ControlledEngine(settings)
            worker = Worker(settings, engine)
            addresses.append(await nursery.start(worker.serve))
            started.append(worker)
            engines.append(engine)
        frontend_settings = FrontendSettings(
            http_port=0, workers=tuple(address.ws_url for address in addresses), **frontend
        )
        # The frontend in a nursery of its own, stopped before the workers it is linked to.
        async with trio.open_nursery() as frontend_nursery:
            url: str = await frontend_nursery.start(run_frontend, frontend_settings)
            running = Fleet(url, started, engines, addresses)

            async def connected() -> bool:
                health = (await running.get("/health")).json()
                return bool(health["workers_connected"] == len(workers))

            await wait_until_async(connected, "every worker connected")
            yield running
            frontend_nursery.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


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
            host, port = _address(f.url)
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


async def wait_for_rank_gauge(f: Fleet, name: str, value: float) -> None:
    async def seen() -> bool:
        return metric_value(await f.metrics(), name, worker_id="w-a", dp_rank="0") == value

    await wait_until_async(seen, f"{name} to reach {value}")


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
            host, port = _address(f.url)
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                conn = h11.Connection(h11.CLIENT)
                head = [("host", "x"), ("content-length", "1000000")]
                await stream.send_all(
                    conn.send(h11.Request(method="POST", target="/v1/completions", headers=head))
                )
                reply = await _read_reply(stream, conn)
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
            deep = await f.post("/busy_threshold", raw=b'{"model": ' + _nested(1000) + b"}")
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
            host, port = _address(f.url)
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
                reply = await _read_reply(stream, conn)
            assert reply.status == 200


# ----------------------------------------------------------------------------- hostile bodies


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


async def test_hostile_bodies_get_a_4xx_in_the_openai_shape_counted_by_status() -> None:
    """Absurd numbers, deep nesting, too many values or inputs, a huge model name: each a 4xx
    naming its bound, none echoing more than a short prefix, and the frontend serves on."""
    huge_name = "m" * (1 << 20)
    many_keys = b",".join(b'"k%d":1' % index for index in range(200_000))
    cases: list[tuple[str, bytes, int, str]] = [
        ("/v1/completions", _json(completion_body(max_tokens=2**64 + 1)), 400, "64-bit"),
        ("/v1/completions", _json(completion_body(seed=-(2**70))), 400, "64-bit"),
        ("/v1/completions", b'{"model": "m", "temperature": 1e999}', 400, "not valid JSON"),
        ("/v1/chat/completions", b'{"model": "m", "x": ' + _nested(1000) + b"}", 400, "deep"),
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
