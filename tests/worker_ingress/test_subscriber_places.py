"""Squatters on a worker's event plane never lock a frontend out (without a worker token).

A real worker with a small subscriber cap, its places taken by event-plane clients played by the
test, then a real frontend: it links all the same, whether the squatters never subscribe (the
oldest past the grace gives its place up), subscribe as a frontend does, or are all younger than
the grace (the oldest of the address holding the most places gives it up). Then the rules of the
places themselves (``worker_ingress._subscriber_places``, pure): per address, at the cap, with
squatters coming back, and with a fleet of several frontends on one host.
"""

from __future__ import annotations

import contextlib
import logging
import random

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from test_peers import client_frame
from worker_harness import make_settings, new_worker, port_of, running, upgrade_request

from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from shim_common import wire
from worker_ingress._server import WorkerAddress, _is_loopback
from worker_ingress._subscriber_places import Place, SubscriberPlaces

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
            # Said plainly at start-up: without a token, anyone who reaches the port may use it
            # (at INFO on loopback, at WARNING on any other address).
            (line,) = [r for r in caplog.records if "no worker token" in r.getMessage()]
            assert "(DYN_WORKER_TOKEN unset)" in line.getMessage()
            assert line.levelno == logging.INFO
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
            assert "closed 1 event-plane subscriber(s) to serve new handshakes" in caplog.text


@pytest.mark.parametrize("subscribed", [True, False], ids=["subscribed-not-reading", "young"])
async def test_squatters_that_stop_reading_or_are_young_do_not_lock_a_frontend_out(
    subscribed: bool,
) -> None:
    # Every place held by clients that subscribed as a frontend does but read nothing (a ping
    # of the worker waits on each), or that are younger than the grace and not subscribed yet
    # (one that reconnects every 4.9 s always is): before the bound per address, the frontend
    # got 503 forever. Neither is a reader, so it takes one of their places.
    worker = new_worker(
        make_settings(),
        max_event_subscribers=CAP,
        squatter_grace=0.5 if subscribed else 60.0,
        ping_interval=0.1,
        ping_timeout=30.0,
        close_timeout=0.5,
    )
    subscribe = wire.encode(wire.Subscribe(thresholds=wire.BusyThresholds()))
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, contextlib.AsyncExitStack() as stack:
            squatters = await _squat(stack, address, CAP)
            if subscribed:
                for stream in squatters:
                    await stream.send_all(client_frame(subscribe))
            async with trio.open_nursery() as nursery:
                settings = FrontendSettings(http_port=0, workers=(address.ws_url,))
                url: str = await nursery.start(run_frontend, settings)
                async with httpx.AsyncClient(base_url=url) as client:
                    for _ in range(400):
                        if (await client.get("/health")).json()["workers_connected"] == 1:
                            break
                        await trio.sleep(0.02)
                    body = {"model": "mock-model", "prompt": "a b", "max_tokens": 2}
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
                nursery.cancel_scope.cancel()
            assert await _closed_by_worker(squatters[0])


async def test_a_frontend_that_reads_keeps_its_place_against_newcomers_of_its_address() -> None:
    # The attack: clients of the frontend's own address come and go without subscribing.
    # Before, each newcomer past the bound per address took the address's oldest place, the
    # frontend's, and its session ended. Now the frontend, subscribed and reading, keeps it:
    # the newcomers take one another's places.
    per_address = 4
    worker = new_worker(
        make_settings(),
        max_subscribers_per_address=per_address,
        squatter_grace=60.0,
        close_timeout=0.2,
    )
    samples = worker.metrics.registry.get_sample_value
    with trio.fail_after(TIMEOUT):
        async with running(worker) as address, trio.open_nursery() as nursery:
            settings = FrontendSettings(http_port=0, workers=(address.ws_url,))
            url: str = await nursery.start(run_frontend, settings)
            async with httpx.AsyncClient(base_url=url) as client:
                for _ in range(400):
                    if (await client.get("/health")).json()["workers_connected"] == 1:
                        break
                    await trio.sleep(0.02)
                places = worker._places
                for _ in range(200):
                    (frontend,) = places._places["127.0.0.1"]
                    if frontend.connection is not None and frontend.connection.reading(
                        trio.current_time(), 1.0
                    ):
                        break
                    await trio.sleep(0.02)
                async with contextlib.AsyncExitStack() as stack:
                    for _ in range(3 * per_address):
                        await _squat(stack, address, 1)
                    assert places.held_by("127.0.0.1") == per_address
                assert not frontend.taken
                body = {"model": "mock-model", "prompt": "a b", "max_tokens": 2}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            nursery.cancel_scope.cancel()
    assert samples("dynamo_worker_event_subscribers_refused_total") == 0


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("worker.example", False),
    ],
)
def test_the_open_planes_are_announced_at_warning_off_loopback(host: str, loopback: bool) -> None:
    assert _is_loopback(host) is loopback


# ----------------------------------------------------------------------------- the rules


class Client:
    """A subscriber as the places see it: accepted at a time, subscribed or not, and stalled
    (what is sent to it waiting on it) since a time or not."""

    def __init__(self, accepted_at: float, subscribed: bool = True) -> None:
        self.accepted_at = accepted_at
        self.subscribed = subscribed
        self.stalled_since: float | None = None

    def squatting(self, now: float, grace: float) -> bool:
        return not self.subscribed and now - self.accepted_at >= grace

    def reading(self, now: float, grace: float) -> bool:
        stalled = self.stalled_since is not None and now - self.stalled_since >= grace
        return self.subscribed and not stalled


def join(
    places: SubscriberPlaces[Client], address: str, now: float, subscribed: bool = True
) -> tuple[Place[Client] | None, Place[Client] | None]:
    """A handshake from ``address``, answered at once when it gets a place."""
    place, taken = places.claim(address, now)
    if place is not None:
        place.connection = Client(now, subscribed)
    return place, taken


def test_one_address_holds_at_most_its_share_and_its_newcomers_take_its_oldest() -> None:
    places: SubscriberPlaces[Client] = SubscriberPlaces(cap=8, per_address=3, grace=5.0)
    held = [join(places, "a", now=n, subscribed=False)[0] for n in range(3)]
    frontend, _ = join(places, "f", now=3)
    for n in range(4, 20):
        place, taken = join(places, "a", now=n, subscribed=False)
        assert place is not None
        assert taken is held[0]  # its own oldest, whatever its age, never the frontend's
        held = [*held[1:], place]
    assert places.held_by("a") == 3
    assert places.held == 4
    assert frontend is not None
    assert not frontend.taken


def test_a_reader_is_never_taken_by_a_newcomer_of_its_own_address() -> None:
    # The attack: clients of the frontends' own host (loopback) that come back as fast as they
    # can, never subscribing. Before, each newcomer took the address's oldest place, a
    # frontend's. Now the newcomers take one another's places, and when every place of the
    # address is a reader's, a newcomer is refused.
    rng = random.Random(3)
    places: SubscriberPlaces[Client] = SubscriberPlaces(cap=128, per_address=8, grace=5.0)
    frontends = [join(places, "host", now=n)[0] for n in range(3)]
    squatters: list[Place[Client]] = []
    now = 10.0
    for _ in range(5000):
        now += rng.choice([0.001, 0.01, 0.5])
        if squatters and rng.random() < 0.3:
            places.release(squatters.pop(rng.randrange(len(squatters))))
        place, taken = join(places, "host", now, subscribed=False)
        assert place is not None  # there is always a squatter to take
        assert taken is None or taken in squatters
        squatters = [p for p in squatters if not p.taken] + [place]
        assert places.held_by("host") <= 8
    assert all(f is not None and not f.taken for f in frontends)
    # Every place a reader's: nothing to take from its own address.
    for place in squatters:
        assert place.connection is not None
        place.connection.subscribed = True
    assert places.claim("host", now) == (None, None)


def test_a_reader_that_stops_reading_gives_its_place_up() -> None:
    places: SubscriberPlaces[Client] = SubscriberPlaces(cap=128, per_address=2, grace=5.0)
    first, _ = join(places, "host", now=0)
    second, _ = join(places, "host", now=1)
    assert places.claim("host", now=2) == (None, None)
    assert second is not None
    assert second.connection is not None
    second.connection.stalled_since = 3.0
    assert places.claim("host", now=7.9) == (None, None)  # stalled less than the grace
    place, taken = join(places, "host", now=8.0)
    assert place is not None
    assert taken is second  # the one that stalled, not the older reader
    assert first is not None
    assert not first.taken


def test_at_the_cap_a_squatter_goes_first_then_the_oldest_of_the_largest_address() -> None:
    places: SubscriberPlaces[Client] = SubscriberPlaces(cap=4, per_address=4, grace=5.0)
    join(places, "a", now=0)
    join(places, "a", now=1)
    idle, _ = join(places, "b", now=2, subscribed=False)
    join(places, "c", now=3)
    # The one that sent no subscribe within the grace goes first, wherever it is.
    assert join(places, "d", now=10)[1] is idle
    # With no squatter: the oldest of the address holding the most ("a", two places), a reader
    # taken by a newcomer of another address.
    oldest_of_a = places._places["a"][0]
    assert join(places, "e", now=11)[1] is oldest_of_a
    # A newcomer counts with its own address: "d" then holds two ("d" and it) against one of
    # every other, so its own address is chosen; its one place is a reader's, so it is refused.
    assert places.claim("d", now=12) == (None, None)
    # A new address counts one, as many as each holds: of those, the oldest subscriber's.
    place, taken = join(places, "f", now=13)
    assert place is not None
    assert taken is not None
    assert taken.address == "a"
    assert places.held == 4


def test_at_the_cap_a_place_not_yet_subscribed_goes_before_a_reader() -> None:
    places: SubscriberPlaces[Client] = SubscriberPlaces(cap=3, per_address=3, grace=5.0)
    reader, _ = join(places, "a", now=0)
    young, _ = join(places, "a", now=1, subscribed=False)
    join(places, "b", now=2)
    place, taken = join(places, "c", now=3)  # "a" holds the most; its young one goes
    assert place is not None
    assert taken is young
    assert reader is not None
    assert not reader.taken


def test_squatters_coming_back_never_take_a_frontends_place() -> None:
    # 127 places of squatters from three addresses, coming back in a random order, subscribed
    # and young, for a long while: the frontend on an address of its own keeps its place, and
    # a second frontend arriving meanwhile gets one too.
    rng = random.Random(7)
    places: SubscriberPlaces[Client] = SubscriberPlaces(cap=128, per_address=64, grace=5.0)
    squatters: dict[str, list[Place[Client]]] = {"s1": [], "s2": [], "s3": []}
    frontend, _ = join(places, "f1", now=0)
    now = 1.0
    for n in range(127):
        address = f"s{n % 3 + 1}"
        place, _ = join(places, address, now)
        assert place is not None
        squatters[address].append(place)
    second: Place[Client] | None = None
    for step in range(5000):
        now += 0.01
        address = rng.choice(list(squatters))
        if squatters[address] and rng.random() < 0.5:
            places.release(squatters[address].pop(rng.randrange(len(squatters[address]))))
        place, taken = join(places, address, now, subscribed=rng.random() < 0.5)
        if place is None:
            continue  # its own address held the most, every one of them a reader
        assert taken is None or taken.address.startswith("s")
        squatters[address].append(place)
        for held in squatters.values():
            held[:] = [p for p in held if not p.taken]
        if step == 2500:
            second, _ = join(places, "f2", now)
            assert second is not None
    assert frontend is not None
    assert not frontend.taken
    assert second is not None
    assert not second.taken
    assert places.held <= 128


def test_several_frontends_on_one_host_keep_their_places() -> None:
    # Four frontends on one host (one address), a squatting address filling the rest: the
    # squatters' comebacks take their own places; a fifth frontend on the host gets one.
    places: SubscriberPlaces[Client] = SubscriberPlaces(cap=16, per_address=8, grace=5.0)
    fleet = [join(places, "host", now=n)[0] for n in range(4)]
    for n in range(8):
        join(places, "squatter", now=10 + n, subscribed=False)
    for n in range(4):
        join(places, "other", now=20 + n)
    assert places.held == 16
    for n in range(100):
        assert join(places, "squatter", now=30 + n, subscribed=False)[1] is not None
    fifth, taken = join(places, "host", now=200)
    assert fifth is not None
    assert taken is not None
    assert taken.address == "squatter"
    assert all(place is not None and not place.taken for place in fleet)


def test_a_newcomer_finding_nothing_to_take_is_refused_and_a_taken_place_is_released_once() -> None:
    places: SubscriberPlaces[Client] = SubscriberPlaces(cap=2, per_address=2, grace=5.0)
    first, _ = places.claim("a", 0)  # handshakes not answered yet: nothing to take
    places.claim("b", 0)
    assert places.claim("c", 1) == (None, None)
    assert first is not None
    first.connection = Client(0)
    place, taken = places.claim("c", 2)
    assert place is not None
    assert taken is first
    places.release(first)  # its connection ends later: a no-op
    assert places.held == 2
    places.release(place)
    assert places.held == 1


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["join"] * 4 + ["subscribe"] * 2 + ["leave", "stall", "read"]),
            st.sampled_from(["h", "h", "h", "x", "y"]),
            st.integers(0, 63),
            st.sampled_from([0.0, 0.0, 0.01, 1.0, 6.0]),
        ),
        min_size=10,
        max_size=300,
    )
)
def test_the_bounds_hold_and_a_reader_is_never_taken_by_its_own_address(
    operations: list[tuple[str, str, int, float]],
) -> None:
    places: SubscriberPlaces[Client] = SubscriberPlaces(cap=8, per_address=4, grace=5.0)
    held: list[Place[Client]] = []
    now = 1000.0
    for operation, address, pick, step in operations:
        now += step
        if operation == "join":
            readers = {
                id(p)
                for p in held
                if p.address == address
                and p.connection is not None
                and p.connection.reading(now, places.grace)
            }
            place, taken = join(places, address, now, subscribed=False)
            if taken is not None:
                assert id(taken) not in readers
                assert taken in held
            if place is not None:
                held = [p for p in held if not p.taken] + [place]
        elif held:
            place = held[pick % len(held)]
            assert place.connection is not None
            if operation == "leave":
                places.release(place)
                held.remove(place)
            elif operation == "subscribe":
                place.connection.subscribed = True
            elif operation == "stall":
                place.connection.stalled_since = now
            else:
                place.connection.stalled_since = None
        assert places.held == len(held) <= 8
        assert all(places.held_by(a) <= 4 for a in "hxy")
