"""Following a fleet: the lag meter, lagging workers out of routing, thresholds sent to workers,
the connect limiter, the request plane's batches, and connecting out of descriptors, against
real workers on loopback."""

from __future__ import annotations

import dataclasses
import errno
import os
import random
from typing import Any

import trio
import trio.lowlevel
import trio.testing
from test_workers import FAST, PROMPT, RecordingListener, _settings

from frontend_shim import _connection, _links
from frontend_shim._lag import LagMeter
from frontend_shim._links import LinkSettings, WorkerLink
from frontend_shim._load import Fleet
from shim_common import wire
from shim_common.wire import BusyThresholds
from worker_ingress._server import Worker
from worker_ingress.engines._instant import InstantEngine, create

TIMEOUT = 10.0


# ----------------------------------------------------------------------------- lag meter


def test_a_constant_clock_skew_is_no_lag() -> None:
    meter = LagMeter(window=60.0, bound=1.0)
    # The worker's clock is 40 s ahead; transit takes 1 ms every time.
    for step in range(100):
        now = step * 0.1
        meter.observe(arrival=1000.0 + now, sent=1040.0 + now - 0.001, now=now)
        assert abs(meter.lag) < 1e-9
    assert meter.max_lag < 1e-9
    assert not meter.lagging


def test_a_growing_backlog_shows_as_growing_lag() -> None:
    meter = LagMeter(window=60.0, bound=100.0)
    lags = []
    for s in range(50):
        meter.observe(arrival=s * 0.2, sent=s * 0.1, now=s * 0.2)
        lags.append(meter.lag)
    assert lags == sorted(lags)
    assert 4.8 < meter.max_lag < 5.0  # 49 * 0.1 s behind at the end


def test_a_clock_step_back_on_the_worker_is_forgotten_after_two_windows() -> None:
    meter = LagMeter(window=10.0, bound=1.0)
    for step in range(10):
        meter.observe(arrival=step, sent=step, now=step)
    # The worker's clock steps back 5 s: every batch now looks 5 s late ...
    assert meter.observe(arrival=10.0, sent=5.0, now=10.0)  # turned lagging
    assert meter.lag == 5.0
    assert meter.lagging
    # ... until the smallest gap of the windows before the step has aged out.
    for step in range(11, 40):
        meter.observe(arrival=step, sent=step - 5.0, now=step)
    assert meter.lag == 0.0
    assert not meter.lagging


def test_lagging_turns_on_past_the_bound_and_off_under_half_of_it() -> None:
    meter = LagMeter(window=60.0, bound=1.0)
    assert not meter.observe(arrival=0.0, sent=0.0, now=0.0)
    turns = [
        meter.observe(arrival=step, sent=0.0, now=0.0) for step in (0.9, 1.1, 1.5, 0.6, 0.4, 0.9)
    ]
    # 1.1 s behind: lagging; 0.6 is not under half the bound, 0.4 is; 0.9 is not over it.
    assert turns == [False, True, False, False, True, False]
    assert not meter.lagging


# ----------------------------------------------------------------------------- fleet


def _config(worker_id: str) -> wire.RuntimeConfig:
    return wire.RuntimeConfig(
        worker_id=worker_id,
        model="m",
        kv_total_blocks=100,
        block_size=16,
        max_num_batched_tokens=1000,
        max_num_seqs=8,
        data_parallel_size=1,
        engine_request_limit=None,
        request_queue_limit=40000,
        heartbeat_interval=1.0,
    )


def test_a_lagging_worker_is_not_routed_to_until_it_catches_up() -> None:
    fleet = Fleet(default_thresholds=BusyThresholds())
    fleet.register(_config("a"), 0.0)
    fleet.register(_config("b"), 0.0)
    assert fleet.available_count("m", 0.0) == 2
    assert fleet.set_lagging("a", True)
    free = fleet.free_workers("m", 0.0)
    assert free is not None
    assert [w.worker_id for w in free] == ["b"]
    assert fleet.available_count("m", 0.0) == 1
    fleet.set_lagging("a", False)
    assert fleet.available_count("m", 0.0) == 2
    assert not fleet.set_lagging("unknown", True)


# ----------------------------------------------------------------------------- loopback


class SteerableEngine(InstantEngine):
    """The instant engine with a load the test sets."""

    def set_decode_blocks(self, blocks: int) -> None:
        self._loads = [
            wire.RankLoad(
                dp_rank=0, active_decode_blocks=blocks, active_prefill_tokens=0, kv_used_blocks=0
            )
        ]
        self._load_changed.bump()


async def _worker(nursery: trio.Nursery, **overrides: Any) -> tuple[Worker, str, SteerableEngine]:
    settings = _settings(**overrides)
    engine = SteerableEngine(create(settings).config)
    worker = Worker(settings, engine)
    address = await nursery.start(worker.serve)
    return worker, address.ws_url, engine


async def test_a_busy_edge_skips_the_publish_interval_once_thresholds_are_sent(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(TIMEOUT):
        # Heartbeats and load batches every 30 s at most: only an edge can arrive quickly.
        _, url, engine = await _worker(nursery, heartbeat_interval=30.0, load_publish_interval=30.0)
        listener = RecordingListener()
        listener.busy_thresholds = wire.BusyThresholds(active_decode_blocks=0.5)
        link = WorkerLink(url, listener, FAST, rng=random.Random(1))
        await nursery.start(link.run)
        await link.wait_connected()
        await listener.wait_until(lambda: len(listener.events) >= 1)  # the first heartbeat
        total = link.config.kv_total_blocks if link.config else 0
        engine.set_decode_blocks(total)  # busy: every block of the rank
        with trio.fail_after(2.0):  # far less than the 30 s interval
            await listener.wait_until(
                lambda: any(
                    isinstance(e, wire.LoadEvent) and e.load.active_decode_blocks == total
                    for e in listener.events
                )
            )


async def test_the_request_plane_speaks_batches_with_a_worker_that_accepts_them(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(TIMEOUT):
        _, url, _ = await _worker(nursery)
        listener = RecordingListener()
        link = WorkerLink(url, listener, FAST, rng=random.Random(1))
        await nursery.start(link.run)
        await link.wait_connected()
        for _ in range(3):
            async with link.request("completions", PROMPT) as stream:
                assert isinstance(await stream.first(), wire.Started)
                replies = [reply async for reply in stream]
            assert isinstance(replies[-1], wire.End)
            assert sum(r.tokens for r in replies if isinstance(r, wire.Chunk)) == 5


async def test_the_connect_limiter_bounds_attempts_and_every_link_comes_up(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(TIMEOUT):
        urls = [(await _worker(nursery, worker_id=f"w-{i}"))[1] for i in range(6)]
        limiter = trio.CapacityLimiter(2)
        listener = RecordingListener()
        links = [
            WorkerLink(url, listener, FAST, connect_limiter=limiter, rng=random.Random(i))
            for i, url in enumerate(urls)
        ]
        most = 0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, limiter.borrowed_tokens)
                await trio.lowlevel.checkpoint()

        nursery.start_soon(watch)
        for link in links:
            await nursery.start(link.run)
        for link in links:
            await link.wait_connected()
        assert most <= 2
        assert listener.count("up") == 6


async def test_an_idle_request_plane_is_pinged_and_a_busy_one_is_not(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(TIMEOUT):
        _, url, _ = await _worker(nursery)
        settings = LinkSettings(
            connect_timeout=2.0,
            disconnect_timeout=0.1,
            keepalive_interval=0.2,
            keepalive_timeout=1.0,
        )
        link = WorkerLink(url, RecordingListener(), settings, rng=random.Random(1))
        await nursery.start(link.run)
        await link.wait_connected()
        await trio.sleep(1.0)  # idle: pinged, answered, still up
        assert link.connected
        assert link.stats.keepalive_timeouts == 0
        assert link.stats.sessions == 1


async def test_metrics_formatted_off_the_event_loop_match_the_live_rendering() -> None:
    from frontend_shim._metrics import FrontendMetrics, LinkSample, RankLoadSample

    ranks = [RankLoadSample(f"w-{w}", r, 3, 4, 100) for w in range(50) for r in range(4)]
    links = [LinkSample(f"w-{w}", True, w == 7, 0.25, 0.5, 10, 1) for w in range(50)]
    metrics = FrontendMetrics(lambda: ranks)
    metrics.watch_links(lambda: links)
    with trio.fail_after(TIMEOUT):
        body, content_type = await metrics.render_off_loop(None)
    assert (body, content_type) == metrics.render(None)
    text = body.decode()
    assert "dynamo_frontend_workers_connected 50.0" in text
    assert "dynamo_frontend_workers_lagging 1.0" in text
    assert 'dynamo_frontend_worker_active_decode_blocks{dp_rank="3",worker_id="w-49"} 3.0' in text


# ----------------------------------------------------------------------------- descriptor limit


def _connects_failing_with(monkeypatch: Any, failures: int, code: int) -> list[str]:
    """Make the next ``failures`` plane connections fail as connect(2) does out of descriptors;
    returns the log of attempts ("failed" or "opened")."""
    attempts: list[str] = []
    real_open_plane = _connection.open_plane

    async def open_plane(**kwargs: Any) -> Any:
        if attempts.count("failed") < failures:
            attempts.append("failed")
            raise OSError(code, os.strerror(code))
        attempts.append("opened")
        return await real_open_plane(**kwargs)

    monkeypatch.setattr(_links, "open_plane", open_plane)
    return attempts


async def test_out_of_descriptors_a_link_makes_room_and_connects_at_once(
    nursery: trio.Nursery, monkeypatch: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        _, url, _ = await _worker(nursery)
        attempts = _connects_failing_with(monkeypatch, 1, errno.EMFILE)
        made_room: list[int] = []

        def make_room() -> int:
            made_room.append(16)
            return 16

        # A backoff far longer than the test: only the retry after making room can connect.
        settings = dataclasses.replace(
            FAST, make_room=make_room, backoff_initial=60.0, backoff_cap=60.0
        )
        listener = RecordingListener()
        link = WorkerLink(url, listener, settings, rng=random.Random(1))
        await nursery.start(link.run)
        await link.wait_connected()
        assert made_room == [16]
        assert attempts == ["failed", "opened", "opened"]  # the events plane twice, then requests


async def test_with_nothing_to_close_the_failure_ends_the_attempt(
    nursery: trio.Nursery, monkeypatch: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        _, url, _ = await _worker(nursery)
        attempts = _connects_failing_with(monkeypatch, 1, errno.EMFILE)
        settings = dataclasses.replace(FAST, make_room=lambda: 0)
        link = WorkerLink(url, RecordingListener(), settings, rng=random.Random(1))
        await nursery.start(link.run)
        await link.wait_connected()
        # No second try at once: the next attempt came after the backoff, as for any failure.
        assert attempts[:2] == ["failed", "opened"]
        assert link.stats.connect_failures >= 1


async def test_other_connect_errors_never_close_idle_connections(
    nursery: trio.Nursery, monkeypatch: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        _, url, _ = await _worker(nursery)
        _connects_failing_with(monkeypatch, 1, errno.ECONNREFUSED)
        made_room: list[int] = []
        def make_room() -> int:
            made_room.append(1)
            return 1

        settings = dataclasses.replace(FAST, make_room=make_room)
        link = WorkerLink(url, RecordingListener(), settings, rng=random.Random(1))
        await nursery.start(link.run)
        await link.wait_connected()
        assert made_room == []


async def test_a_link_of_one_plane_serves_that_plane_alone(nursery: trio.Nursery) -> None:
    """The host of several processes follows events alone; its processes send requests alone."""
    with trio.fail_after(TIMEOUT):
        _, url, _ = await _worker(nursery)
        events_only = RecordingListener()
        follower = WorkerLink(
            url, events_only, dataclasses.replace(FAST, request_plane=False), rng=random.Random(1)
        )
        requests_only = RecordingListener()
        sender = WorkerLink(
            url, requests_only, dataclasses.replace(FAST, event_plane=False), rng=random.Random(2)
        )
        await nursery.start(follower.run)
        await nursery.start(sender.run)
        await follower.wait_connected()
        await sender.wait_connected()
        # The sender's request runs; the follower hears the load it makes, the sender nothing.
        async with sender.request("completions", PROMPT) as stream:
            assert isinstance(await stream.first(), wire.Started)
            replies = [reply async for reply in stream]
        assert isinstance(replies[-1], wire.End)
        version = 0
        while not events_only.events:
            version = await events_only.changed.wait_past(version)
        assert not requests_only.events
        # The follower sends nothing: its requests fail at once, as to a worker not connected.
        async with follower.request("completions", PROMPT) as stream:
            first = await stream.first()
        assert isinstance(first, wire.Failed)
        assert first.kind == "unavailable"
        assert follower.connected
