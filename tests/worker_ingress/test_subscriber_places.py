"""Squatters on a worker's event plane never lock a frontend out (without a worker token).

A real worker with a small subscriber cap, its places taken by event-plane clients played by the
test that never subscribe, then a real frontend: it links all the same (the oldest squatter past
the grace gives its place up). Clients that subscribe as a frontend does keep their places: only
a worker token keeps those out.
"""

from __future__ import annotations

import contextlib
import logging

import httpx
import pytest
import trio
from test_peers import client_frame
from worker_harness import make_settings, new_worker, port_of, running, upgrade_request

from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from shim_common import wire
from worker_ingress._server import WorkerAddress

CAP = 8
GRACE = 0.3
TIMEOUT = 30


async def _squat(
    stack: contextlib.AsyncExitStack[bool | None], address: WorkerAddress, count: int
) -> list[trio.SocketStream]:
    """``count`` raw event-plane clients: the upgrade, then nothing (the hello stays unread)."""
    squatters = []
    for _ in range(count):
        stream = await stack.enter_async_context(
            await trio.open_tcp_stream("127.0.0.1", port_of(address))
        )
        await stream.send_all(upgrade_request(wire.EVENTS_PATH))
        answer = await stream.receive_some(4096)
        if not answer.startswith(b"HTTP/1.1 101 "):
            raise ConnectionRefusedError(answer.split(b"\r\n", 1)[0].decode())
        squatters.append(stream)
    return squatters


async def _closed_by_worker(stream: trio.SocketStream) -> bool:
    """Whether the worker closes ``stream`` within 3 s (its close frame unanswered, it gives
    up after its close timeout; what it sent meanwhile is read)."""
    with trio.move_on_after(3.0):
        with contextlib.suppress(trio.BrokenResourceError):
            while await stream.receive_some(65536):
                pass
        return True
    return False


async def test_idle_squatters_give_their_places_to_a_frontend(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="worker_ingress")
    worker = new_worker(
        make_settings(), max_event_subscribers=CAP, squatter_grace=GRACE, close_timeout=0.5
    )
    samples = worker.metrics.registry.get_sample_value
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, contextlib.AsyncExitStack() as stack:
            # Said plainly at start-up: without a token, anyone who reaches the port may use it.
            assert "no worker token (DYN_WORKER_TOKEN unset)" in caplog.text
            squatters = await _squat(stack, address, CAP)
            assert samples("dynamo_worker_event_subscribers") == CAP
            await trio.sleep(GRACE)
            async with trio.open_nursery() as nursery:
                settings = FrontendSettings(http_port=0, workers=(address.ws_url,))
                url: str = await nursery.start(run_frontend, settings)
                async with httpx.AsyncClient(base_url=url) as client:

                    async def linked() -> bool:
                        health = (await client.get("/health")).json()
                        return bool(health["workers_connected"] == 1)

                    for _ in range(400):
                        if await linked():
                            break
                        await trio.sleep(0.02)
                    assert await linked()
                    body = {"model": "mock-model", "prompt": "a b", "max_tokens": 2}
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
                nursery.cancel_scope.cancel()
            # The oldest squatter was closed for it, and no handshake was refused.
            assert await _closed_by_worker(squatters[0])
            assert samples("dynamo_worker_event_subscribers_refused_total") == 0
            assert "closed 1 event-plane subscriber(s) at the cap" in caplog.text


async def test_subscribed_clients_keep_their_places_and_the_cap_refuses() -> None:
    # Clients that subscribe, as a frontend does, are not squatters: at the cap the newcomer
    # gets 503 as before (a worker token is what keeps out clients that speak the protocol).
    worker = new_worker(make_settings(), max_event_subscribers=CAP, squatter_grace=GRACE)
    samples = worker.metrics.registry.get_sample_value
    subscribe = wire.encode(wire.Subscribe(thresholds=wire.BusyThresholds()))
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, contextlib.AsyncExitStack() as stack:
            clients = await _squat(stack, address, CAP)
            for stream in clients:
                await stream.send_all(client_frame(subscribe))
            await trio.sleep(GRACE + 0.1)
            with pytest.raises(ConnectionRefusedError, match="503"):
                await _squat(stack, address, 1)
            assert samples("dynamo_worker_event_subscribers_refused_total") == 1
            assert samples("dynamo_worker_event_subscribers") == CAP
