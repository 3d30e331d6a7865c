"""The worker's listener: hello, paths, and the drain that closes every connection."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncGenerator

import trio
from trio_websocket import ConnectionClosed, open_websocket_url
from worker_harness import (
    TIMEOUT,
    HeldEngine,
    closed_code,
    collect_until_final,
    completion,
    event_plane,
    get_message_bytes,
    make_settings,
    new_worker,
    port_of,
    read_events,
    request_plane,
    running,
    send,
    upgrade_request,
    wait_for,
)

from shim_common import wire
from shim_common.wire import (
    EVENTS_PATH,
    REQUESTS_PATH,
    Chunk,
    End,
    Failed,
    Heartbeat,
    Hello,
    Rejected,
)
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress._server import WorkerAddress, run_worker
from worker_ingress.engines._base import EngineOutput, PreparedRequest
from worker_ingress.engines._instant import InstantEngine, create


async def upgrade_status(address: WorkerAddress, path: str) -> bytes:
    """The status line the worker answers a raw upgrade on ``path`` with. The client never
    closes: the worker must, once it has refused (a client that stays holds nothing)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port_of(address))
    async with stream:
        await stream.send_all(upgrade_request(path))
        response = b""
        for _ in range(100):
            data = await stream.receive_some()
            if not data:
                break
            response += data
        else:
            raise AssertionError("the worker never closed the connection")
    return response.split(b"\r\n", 1)[0]


# ----------------------------------------------------------------------------- handshake


async def test_hello_comes_first_on_both_planes() -> None:
    settings = make_settings(engine_request_limit=4, request_queue_limit=8)
    with trio.fail_after(TIMEOUT):
        async with running(new_worker(settings)) as address:
            for path in (REQUESTS_PATH, EVENTS_PATH):
                async with open_websocket_url(address.ws_url + path) as ws:
                    hello = wire.decode_worker_message(await get_message_bytes(ws))
                    assert isinstance(hello, Hello)
                    assert hello.protocol_version == wire.PROTOCOL_VERSION
                    config = hello.config
                    assert (config.worker_id, config.model) == ("w-test", "mock-model")
                    assert config.engine_request_limit == 4
                    assert config.request_queue_limit == 8
                    assert config.kv_total_blocks == MockerSettings().num_gpu_blocks
                    assert config.data_parallel_size == 1


async def test_unknown_path_is_rejected_with_404() -> None:
    with trio.fail_after(TIMEOUT):
        async with running(new_worker(make_settings())) as address:
            status = await upgrade_status(address, "/v2/nothing")
    assert status.startswith(b"HTTP/1.1 404 ")


async def test_event_subscribers_past_the_cap_take_the_oldest_place_of_their_address() -> None:
    # At the cap, a newcomer of the address holding the most places takes the place of its
    # oldest subscriber (the places rules are kept by test_subscriber_places.py); the count
    # stays at the cap, and nothing is refused while there is a place to take.
    worker = new_worker(make_settings(), max_event_subscribers=2)
    samples = worker.metrics.registry.get_sample_value
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address:
            async with event_plane(address) as oldest, event_plane(address):
                assert samples("dynamo_worker_event_subscribers") == 2
                async with await trio.open_tcp_stream("127.0.0.1", port_of(address)) as newcomer:
                    await newcomer.send_all(upgrade_request(EVENTS_PATH))
                    assert (await newcomer.receive_some()).startswith(b"HTTP/1.1 101 ")
                    assert await closed_code(oldest) == 1000
                await wait_for(
                    lambda: samples("dynamo_worker_event_subscribers") == 2, "the place taken"
                )
                assert samples("dynamo_worker_event_subscribers_refused_total") == 0
                # The request plane is not capped by it.
                async with request_plane(address) as ws:
                    await send(ws, completion(1))
                    assert isinstance((await collect_until_final(ws, {1}))[1][-1], End)
            await wait_for(lambda: samples("dynamo_worker_event_subscribers") == 0, "both gone")
            async with event_plane(address) as events:
                assert await read_events(events)


async def test_a_worker_that_refuses_by_the_wait_publishes_its_queue_by_priority() -> None:
    # A frontend holds an slo or queue_timeout refusal at the depth of the refused priority,
    # so a worker that gives those refusals says what each priority would start behind.
    for changes, sent in (({"queue_timeout": 30.0}, True), ({}, False)):
        settings = make_settings(engine_request_limit=1, request_queue_limit=4, **changes)
        engine = HeldEngine(settings)
        worker = new_worker(settings, engine)
        with trio.fail_after(TIMEOUT):
            async with running(worker) as address, request_plane(address) as ws:
                async with event_plane(address) as events:
                    await send(ws, completion(1))
                    await send(ws, completion(2))
                    await wait_for(lambda: worker.gate.queued == 1, "one queued")  # noqa: B023
                    for _ in range(100):
                        last = (await read_events(events))[-1]
                        if last.queued_requests == 1:
                            break
                    else:
                        raise AssertionError("no event with the queued request")
                    assert last.queue_ahead == ([(0, 1)] if sent else None)
                engine.release.set()
                await collect_until_final(ws, {1, 2})


# ----------------------------------------------------------------------------- drain


async def test_drain_rejects_new_finishes_running_then_returns() -> None:
    settings = make_settings(engine_request_limit=1, request_queue_limit=2)
    engine = HeldEngine(settings)
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            address: WorkerAddress = await nursery.start(worker.serve)
            async with event_plane(address) as events, request_plane(address) as ws:
                await send(ws, completion(1))
                await send(ws, completion(2))
                await wait_for(lambda: worker.gate.in_flight == 2, "one running, one queued")
                worker.drain()
                await wait_for(lambda: worker.health() == "draining", "draining")
                await send(ws, completion(3))
                assert (await collect_until_final(ws, {3}))[3] == [
                    Rejected(request_id=3, reason=wire.RejectReason.DRAINING)
                ]
                for _ in range(100):
                    last = (await read_events(events))[-1]
                    if isinstance(last, Heartbeat) and last.status == "draining":
                        break
                else:
                    raise AssertionError("no draining heartbeat")
                engine.release.set()
                frames = await collect_until_final(ws, {1, 2})
                assert all(isinstance(messages[-1], End) for messages in frames.values())
                assert await closed_code(ws) == 1001
                assert await closed_code(events) == 1001
        # serve() returned by itself: the nursery closed without a cancel.


class BulkyEngine(InstantEngine):
    """Answers every request with :data:`BULKY_CHUNKS` chunks of 1 MiB (more than the loopback
    socket buffers hold), alternating two choices so that no two merge, then finishes both."""

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(create(settings).config)
        self.finished = False

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        text = "x" * (1 << 20)
        for number in range(BULKY_CHUNKS):
            yield EngineOutput(text=text, tokens=1, index=number % 2)
        yield EngineOutput(text=" end", tokens=1, index=0, finish_reason="stop")
        yield EngineOutput(text=" end", tokens=1, index=1, finish_reason="stop")
        self.finished = True


BULKY_CHUNKS = 24


async def test_drain_closes_no_plane_before_every_reply_frame_is_written() -> None:
    # The engine is done and the gate idle while the request's last chunks and its End still
    # wait in the worker's sender behind bytes the client has not read. The drain must hold
    # both planes open until those frames are written: a frontend ends a worker's session, and
    # fails its open requests, when either plane closes.
    settings = make_settings()
    engine = BulkyEngine(settings)
    worker = new_worker(settings, engine)
    with trio.fail_after(TIMEOUT * 2):
        async with (
            running(worker) as address,
            event_plane(address) as events,
            open_websocket_url(
                address.ws_url + REQUESTS_PATH,
                max_message_size=wire.MAX_MESSAGE_BYTES,
                message_queue_size=1,
            ) as ws,
        ):
            assert isinstance(wire.decode_worker_message(await get_message_bytes(ws)), Hello)
            await send(ws, completion(1))
            await wait_for(
                lambda: engine.finished and worker.gate.in_flight == 0, "the engine done"
            )
            worker.drain()
            batches_since_draining: int | None = None
            for _ in range(200):
                try:
                    events_read = await read_events(events)
                except ConnectionClosed:
                    raise AssertionError(
                        "the event plane closed while the request plane held reply frames"
                    ) from None
                if batches_since_draining is not None:
                    batches_since_draining += 1
                    if batches_since_draining == 3:
                        break
                elif any(
                    isinstance(event, Heartbeat) and event.status == "draining"
                    for event in events_read
                ):
                    batches_since_draining = 0
            assert batches_since_draining == 3
            frames = await collect_until_final(ws, {1})
            finishes = [m.finish_reason for m in frames[1] if isinstance(m, Chunk)]
            assert finishes.count("stop") == 2
            end = frames[1][-1]
            assert isinstance(end, End)
            assert (end.request_id, end.prompt_tokens, end.completion_tokens) == (1, 3, 26)
            assert await closed_code(ws) == 1001
            assert await closed_code(events) == 1001


async def test_drain_grace_expiry_fails_what_is_left_as_unavailable() -> None:
    settings = make_settings(engine_request_limit=1, request_queue_limit=2, drain_grace=0.2)
    worker = new_worker(settings, HeldEngine(settings))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            address: WorkerAddress = await nursery.start(worker.serve)
            async with request_plane(address) as ws:
                await send(ws, completion(1))
                await send(ws, completion(2))
                await wait_for(lambda: worker.gate.in_flight == 2, "one running, one queued")
                worker.drain()
                frames = await collect_until_final(ws, {1, 2})
                for messages in frames.values():
                    final = messages[-1]
                    assert isinstance(final, Failed)
                    assert final.kind == "unavailable"
                assert await closed_code(ws) == 1001
    assert worker.gate.in_flight == 0


async def test_run_worker_drains_on_sigterm_and_returns() -> None:
    settings = make_settings()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            address: WorkerAddress = await nursery.start(run_worker, settings, create(settings))
            async with request_plane(address) as ws:
                await send(ws, completion(1))
                assert isinstance((await collect_until_final(ws, {1}))[1][-1], End)
                os.kill(os.getpid(), signal.SIGTERM)
                assert await closed_code(ws) == 1001
        # run_worker returned by itself once drained.
