"""Squatters flooding a worker's event plane from the frontends' own address: real processes.

Without a worker token, anything that reaches a worker's port may take an event-plane place.
One address holds at most 32; clients of the frontends' own host (loopback here, as on any
host that runs a frontend) that keep reconnecting used to take the place of the address's
oldest subscriber, a frontend's, each time: the frontend's session ended, and its completions
got 503 ``no_workers`` until it linked again (and was put out again). Now a frontend that
subscribed and reads keeps its place; the newcomers take one another's. Scaled down from the
attack (150 clients, three frontends, 30 s) to two frontends and 48 clients for a few seconds.

Every process gets port 0 and is found through its ready line; every process is stopped in
``finally``; the test runs under ``trio.fail_after``.
"""

from __future__ import annotations

import sys
import urllib.parse
from collections import Counter

import pytest
import trio
from test_fleet_faults import call, completion, started, wait_connected

from shim_common import wire

pytestmark = pytest.mark.e2e

#: More than the 32 places one address may hold, so every newcomer takes someone's place.
SQUATTERS = 48
FRONTENDS = 2
CLIENTS_PER_FRONTEND = 3
ATTACK_SECONDS = 4.0
#: How long a squatter stays before it comes back (if it is not put out first).
STAY_SECONDS = 0.2


def worker_cmd() -> list[str]:
    # Room for every client at once: a 529 here would be load, not the attack.
    return [
        sys.executable, "-m", "worker_ingress", "--port", "0", "--system-port", "0",
        "--engine-request-limit", "16", "--speedup-ratio", "10",
    ]  # fmt: skip


def frontend_cmd(worker: str) -> list[str]:
    return [sys.executable, "-m", "frontend_shim", "--http-port", "0", "--worker", worker]


async def squat(host: str, port: int, stop: trio.Event, counts: Counter[str]) -> None:
    """Come back to the event plane over and over, never subscribing, until ``stop``."""
    upgrade = (
        f"GET {wire.EVENTS_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    while not stop.is_set():
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            counts["connect failed"] += 1
            await trio.sleep(0.01)
            continue
        async with stream:
            try:
                await stream.send_all(upgrade)
                answer = await stream.receive_some(4096)
                counts["accepted" if answer.startswith(b"HTTP/1.1 101 ") else "refused"] += 1
                # Stay a moment, reading what comes (the hello, a close when put out).
                with trio.move_on_after(STAY_SECONDS):
                    while await stream.receive_some(65536):
                        pass
                    counts["put out"] += 1
            except (trio.BrokenResourceError, OSError):
                counts["broken"] += 1


async def complete_until(url: str, stop: trio.Event, statuses: Counter[int]) -> None:
    while not stop.is_set():
        status, _ = await call(url, "POST", "/v1/completions", completion(4))
        statuses[status] += 1


async def test_a_squatter_flood_from_the_frontends_address_leaves_their_completions_200() -> None:
    statuses: Counter[int] = Counter()
    squatters: Counter[str] = Counter()
    with trio.fail_after(90):
        async with started(worker_cmd()) as ((ws, _system), _):
            parts = urllib.parse.urlsplit(ws)
            assert parts.hostname is not None
            assert parts.port is not None
            async with (
                started(frontend_cmd(ws)) as ((first,), _),
                started(frontend_cmd(ws)) as ((second,), _),
            ):
                urls = [first, second]
                for url in urls:
                    await wait_connected(url, 1)
                # Let each frontend's subscribe land: it is what marks its place as a reader's.
                await trio.sleep(0.5)
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    for _ in range(SQUATTERS):
                        nursery.start_soon(squat, parts.hostname, parts.port, stop, squatters)
                    for url in urls:
                        for _ in range(CLIENTS_PER_FRONTEND):
                            nursery.start_soon(complete_until, url, stop, statuses)
                    await trio.sleep(ATTACK_SECONDS)
                    stop.set()
    total = sum(statuses.values())
    # The flood did take places (past the bound per address, from one another).
    assert squatters["accepted"] > SQUATTERS, squatters
    assert total > 0
    assert statuses[200] >= 0.99 * total, (statuses, squatters)
