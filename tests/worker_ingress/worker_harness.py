"""A worker in-process on loopback and a real trio-websocket client, for the plane and server tests.

Every test runs a :class:`Worker` on 127.0.0.1 with port 0, under ``trio.fail_after``. Heartbeats
are fast (50 ms) so the event plane has something to say; no test asserts a duration.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from shim_common import wire
from shim_common.wire import (
    EVENTS_PATH,
    REQUESTS_PATH,
    End,
    EventBatch,
    Failed,
    Generate,
    Hello,
    Rejected,
)
from worker_ingress._config import WorkerSettings
from worker_ingress._server import Worker, WorkerAddress
from worker_ingress.engines._base import EngineOutput, PreparedRequest
from worker_ingress.engines._instant import InstantEngine, create

TIMEOUT = 5.0


class HeldEngine(InstantEngine):
    """Instant, except that every request waits for :attr:`release` before its first chunk."""

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(create(settings).config)
        self.release = trio.Event()
        self.fail = False

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        await self.release.wait()
        if self.fail:
            yield EngineOutput(text=" partial", tokens=1)
            raise RuntimeError("engine exploded")
        async for output in super().generate(request):
            yield output


def make_settings(**changes: Any) -> WorkerSettings:
    base = WorkerSettings(
        worker_id="w-test",
        host="127.0.0.1",
        port=0,
        system_port=0,
        heartbeat_interval=0.05,
        drain_grace=5.0,
    )
    return dataclasses.replace(base, **changes)


@asynccontextmanager
async def running(
    worker: Worker,
) -> AsyncIterator[WorkerAddress]:
    async with trio.open_nursery() as nursery:
        address: WorkerAddress = await nursery.start(worker.serve)
        yield address
        nursery.cancel_scope.cancel()


def new_worker(settings: WorkerSettings, engine: Any = None, **options: Any) -> Worker:
    return Worker(
        settings,
        engine if engine is not None else create(settings),
        max_message_bytes=64 * 1024,
        **options,
    )


async def get_message_bytes(ws: WebSocketConnection) -> bytes:
    message = await ws.get_message()
    assert isinstance(message, bytes)
    return message


@asynccontextmanager
async def request_plane(address: WorkerAddress) -> AsyncIterator[WebSocketConnection]:
    async with open_websocket_url(
        address.ws_url + REQUESTS_PATH, max_message_size=wire.MAX_MESSAGE_BYTES
    ) as ws:
        hello = wire.decode_worker_message(await get_message_bytes(ws))
        assert isinstance(hello, Hello)
        yield ws


async def receive(ws: WebSocketConnection) -> wire.WorkerMessage:
    return wire.decode_worker_message(await get_message_bytes(ws))


async def send(ws: WebSocketConnection, message: msgspec.Struct) -> None:
    await ws.send_message(wire.encode(message))


def completion(request_id: int, prompt: str = "one two three", max_tokens: int = 3) -> Generate:
    return Generate(
        request_id=request_id,
        endpoint="completions",
        body={"prompt": prompt, "max_tokens": max_tokens},
    )


class _Frames:
    """Frames a request-plane client received, per request id, and the ids that ended."""

    def __init__(self) -> None:
        self.by_id: dict[int, list[wire.WorkerMessage]] = collections.defaultdict(list)
        self.ended: set[int] = set()


_received: weakref.WeakKeyDictionary[WebSocketConnection, _Frames] = weakref.WeakKeyDictionary()


async def collect_until_final(
    ws: WebSocketConnection, request_ids: set[int]
) -> dict[int, list[wire.WorkerMessage]]:
    """Read until every id in ``request_ids`` got its final frame; frames of other ids are kept."""
    frames = _received.setdefault(ws, _Frames())
    while not request_ids <= frames.ended:
        message = await receive(ws)
        assert not isinstance(message, Hello | wire.Batch)  # no batches: none were offered
        assert message.request_id not in frames.ended, "a frame after the final frame"
        frames.by_id[message.request_id].append(message)
        if isinstance(message, Rejected | End | Failed):
            frames.ended.add(message.request_id)
    return {request_id: frames.by_id[request_id] for request_id in request_ids}


def port_of(address: WorkerAddress) -> int:
    return int(address.ws_url.rsplit(":", 1)[1])


def upgrade_request(path: str) -> bytes:
    """A websocket opening handshake, as a raw peer would send it."""
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


async def wait_for(condition: Any, what: str) -> None:
    for _ in range(400):
        if condition():
            return
        await trio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def closed_code(ws: WebSocketConnection) -> int:
    """Read until the worker closes the connection; return the close code."""
    reason = None
    for _ in range(1000):
        try:
            await ws.get_message()
        except ConnectionClosed as closed:
            reason = closed.reason
            # trio-websocket's client waits for the server's TCP close and then leaves its own
            # socket open when the server closed first; close it so no socket leaks.
            await ws._stream.aclose()
            break
    assert reason is not None, "the worker never closed the connection"
    return int(reason.code)


async def read_events(ws: WebSocketConnection) -> list[wire.WorkerEvent]:
    message = wire.decode_event_message(await get_message_bytes(ws))
    assert isinstance(message, EventBatch)
    return message.events


@asynccontextmanager
async def event_plane(
    address: WorkerAddress, queue_size: int = 1
) -> AsyncIterator[WebSocketConnection]:
    async with open_websocket_url(
        address.ws_url + EVENTS_PATH, message_queue_size=queue_size
    ) as ws:
        assert isinstance(wire.decode_event_message(await get_message_bytes(ws)), Hello)
        yield ws
