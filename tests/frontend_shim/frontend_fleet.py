"""A frontend with real in-process workers, and a small h11 client to talk to it.

:func:`fleet` starts :class:`~worker_ingress._server.Worker` instances on loopback (port 0) with a
:class:`ControlledEngine` (the instant engine, plus a switch that holds requests before their
first token, one that fails a stream after its first chunk, and a settable load), then the
frontend itself with :func:`~frontend_shim._app.run_frontend`. Wall-clock time is real (sockets),
so every test that uses it runs under ``trio.fail_after`` and every wait is a bounded poll.
"""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import h11
import trio

from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from shim_common.wire import RankLoad
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


def address_of(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    return parts.hostname, parts.port


async def read_reply(stream: trio.SocketStream, conn: h11.Connection) -> Reply:
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
    host, port = address_of(url)
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
        return await read_reply(stream, conn)


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


async def wait_for_rank_gauge(f: Fleet, name: str, value: float) -> None:
    async def seen() -> bool:
        return metric_value(await f.metrics(), name, worker_id="w-a", dp_rank="0") == value

    await wait_until_async(seen, f"{name} to reach {value}")


def nested_json(depth: int) -> bytes:
    """A JSON array nested ``depth`` deep: past the body parser's depth bound."""
    return b"[" * depth + b"]" * depth
