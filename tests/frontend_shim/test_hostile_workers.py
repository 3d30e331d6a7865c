"""A peer that claims to be a worker and then misbehaves, played by hand against a real frontend.

After a valid hello on both planes the peer breaks the protocol on its event plane: a message
that does not decode, one far over the size its hello implies (whatever cache it claims), a
flood of pings, a message in endless empty fragments; or it closes cleanly just after its hello;
or its hello itself is far too large. Each time the frontend ends the session (without reading
what is too large), keeps serving, and redials at a doubling delay (one warning line for the
streak), not every 50 ms.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable

import httpx
import pytest
import trio
import trio.lowlevel
from client_frames import client_frames
from test_peers import accept_upgrade, frame
from worker_configs import runtime_config

from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from frontend_shim._connection import CONTROL_BURST
from frontend_shim._worker_hello import MAX_HELLO_BYTES, event_message_bound
from shim_common import wire

#: Seconds the frontend is watched redialling the peer.
WATCH = 3.0
HELLO = wire.Hello(protocol_version=wire.PROTOCOL_VERSION, config=runtime_config())
#: A hello listing KV events with a cache of 262,144 blocks: 64 bytes a block would allow a
#: 16 MiB message, but a frontend that did not ask for KV events (round-robin) allows none.
KV_HELLO = wire.Hello(
    protocol_version=wire.PROTOCOL_VERSION,
    config=runtime_config(kv_total_blocks=1 << 18),
    features=[wire.FEATURE_KV_EVENTS],
)
#: 14 MiB: under the protocol's general cap, far over what a one-rank worker's events need.
HUGE = 14 * 1024 * 1024

Behaviour = Callable[[trio.SocketStream], Awaitable[None]]


async def undecodable(stream: trio.SocketStream) -> None:
    await stream.send_all(frame(b"\xc1"))  # a byte msgpack never uses
    await trio.sleep_forever()


async def huge_batch(stream: trio.SocketStream) -> None:
    # The header announces 14 MiB; the frontend must close without reading (or holding) it.
    beat = wire.Heartbeat(seq=1, ts=0.0, loads=[], engine_requests=0, queued_requests=0)
    body = wire.encode(wire.EventBatch(events=[beat] * (HUGE // len(wire.encode(beat)))))
    assert HUGE - 1024 < len(body) <= HUGE < wire.MAX_MESSAGE_BYTES
    await stream.send_all(bytes([0x82, 127]) + struct.pack("!Q", len(body)))
    with contextlib.suppress(trio.BrokenResourceError):
        for start in range(0, len(body), 1 << 20):
            await stream.send_all(body[start : start + (1 << 20)])
        raise AssertionError("the frontend read all 14 MiB")
    await trio.sleep_forever()


async def huge_hello(stream: trio.SocketStream) -> None:
    # A first message of 1 MiB: the frontend must close from its header, under the hello's cap.
    size = 1 << 20
    await stream.send_all(bytes([0x82, 127]) + struct.pack("!Q", size))
    with contextlib.suppress(trio.BrokenResourceError):
        for _ in range(size >> 16):
            await stream.send_all(b"x" * (1 << 16))
        raise AssertionError("the frontend read a 1 MiB hello")
    await trio.sleep_forever()


async def empty_fragments(stream: trio.SocketStream) -> None:
    # A message opened, then continued by empty fragments forever: each is under every size cap
    # and no control frame, and before, every one was held (59 MB sent grew the frontend by
    # 239 MB). The frontend must end the session within its bound of frames per message.
    await stream.send_all(bytes([0x02, 0]))
    with contextlib.suppress(trio.BrokenResourceError):
        for _ in range(1000):
            await stream.send_all(bytes([0x00, 0]) * 1000)
        raise AssertionError("a million empty fragments taken")
    await trio.sleep_forever()


async def close_soon(stream: trio.SocketStream) -> None:
    # A clean close 50 ms after the hello: no rule broken, but no session that lasts either.
    await trio.sleep(0.05)
    await stream.send_all(bytes([0x88, 2]) + (1000).to_bytes(2, "big"))
    await trio.sleep_forever()


async def ping_flood(stream: trio.SocketStream) -> None:
    with contextlib.suppress(trio.BrokenResourceError):
        for seq in range(10_000):
            await stream.send_all(bytes([0x89, 4]) + seq.to_bytes(4, "big"))
            if seq % 16 == 0:
                await trio.lowlevel.checkpoint()
        raise AssertionError("10,000 pings taken")
    await trio.sleep_forever()


#: Each case: what the peer does on its event plane, what the log must say, and the hello it
#: sends first on both planes (``None``: its behaviour stands in for the event plane's hello).
CASES: dict[str, tuple[Behaviour, str, wire.Hello | None]] = {
    "undecodable": (undecodable, "undecodable message", HELLO),
    "huge-batch": (huge_batch, f"a message over {event_message_bound(HELLO.config)} bytes", HELLO),
    "kv-claim-huge-batch": (
        huge_batch,
        f"a message over {event_message_bound(KV_HELLO.config)} bytes",
        KV_HELLO,
    ),
    "huge-hello": (huge_hello, f"a message over {MAX_HELLO_BYTES} bytes", None),
    "empty-fragments": (empty_fragments, f"more than {wire.MESSAGE_FRAMES + 8} frames", HELLO),
    "close-soon": (close_soon, "connection closed (1000", HELLO),
    "ping-flood": (ping_flood, "control frames past", HELLO),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_worker_breaking_the_protocol_after_its_hello_is_closed_and_backed_off(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    behaviour, logged, hello = CASES[case]
    sessions = 0
    pongs = 0

    async def plane(stream: trio.SocketStream) -> None:
        nonlocal sessions, pongs
        received = bytearray()

        async def record() -> None:
            with contextlib.suppress(trio.BrokenResourceError):
                while data := await stream.receive_some(65536):
                    received.extend(data)

        with contextlib.suppress(trio.BrokenResourceError):
            path = await accept_upgrade(stream)
            if hello is not None or path != wire.EVENTS_PATH:
                await stream.send_all(frame(wire.encode(hello or HELLO)))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(record)
                if path == wire.EVENTS_PATH:
                    sessions += 1
                    try:
                        await behaviour(stream)
                    finally:
                        pongs += [op for op, _ in client_frames(received)].count(0xA)
                else:
                    await trio.sleep_forever()

    caplog.set_level(logging.DEBUG, logger="frontend_shim")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(trio.serve_listeners, plane, listeners)
            port = listeners[0].socket.getsockname()[1]
            settings = FrontendSettings(http_port=0, workers=(f"ws://127.0.0.1:{port}",))
            url: str = await nursery.start(run_frontend, settings)
            async with httpx.AsyncClient(base_url=url) as client:
                with trio.move_on_after(WATCH):
                    while True:  # the frontend serves on meanwhile
                        assert (await client.get("/live")).status_code == 200
                        await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    assert logged in caplog.text
    # A doubling delay from 50 ms (half of it drawn at random): at most 7 redials in 3 s;
    # before, one every 50 ms (about 50).
    assert 2 <= sessions <= 10
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "reconnecting" in r.message
    ]
    assert len(warnings) == 1  # the streak's first; its repeats at DEBUG
    if case == "ping-flood":
        assert pongs <= sessions * (CONTROL_BURST + 8)


async def test_a_worker_announcing_a_new_model_each_session_leaves_one_known() -> None:
    # One address, a new model in every hello (once 378 of them in 90 s grew /busy_threshold to
    # 126 KB): the frontend knows at most the latest, however many went before.
    announced = 0

    async def plane(stream: trio.SocketStream) -> None:
        nonlocal announced
        with contextlib.suppress(trio.BrokenResourceError):
            path = await accept_upgrade(stream)
            if path == wire.EVENTS_PATH:
                await stream.send_all(frame(wire.encode(HELLO)))
                await trio.sleep_forever()
            announced += 1
            config = runtime_config(model=f"model-{announced}")
            hello = wire.Hello(protocol_version=wire.PROTOCOL_VERSION, config=config)
            await stream.send_all(frame(wire.encode(hello)))
            await trio.sleep(0.05)  # then the session ends: a clean close

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(trio.serve_listeners, plane, listeners)
            port = listeners[0].socket.getsockname()[1]
            settings = FrontendSettings(http_port=0, workers=(f"ws://127.0.0.1:{port}",))
            url: str = await nursery.start(run_frontend, settings)
            async with httpx.AsyncClient(base_url=url) as client:
                # Sessions this short back off as failed ones: six take about a second.
                for _ in range(300):
                    if announced >= 6:
                        break
                    await trio.sleep(0.05)
                assert announced >= 6
                models = [
                    entry["model"]
                    for entry in (await client.get("/busy_threshold")).json()["thresholds"]
                ]
                assert len(models) <= 1
                assert set(models) <= {f"model-{announced}", f"model-{announced - 1}"}
                assert len((await client.get("/health")).json()["models"]) <= 1
            nursery.cancel_scope.cancel()
