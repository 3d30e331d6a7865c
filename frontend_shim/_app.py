"""The frontend process: worker links feeding the load state, and the HTTP API on top.

Task tree of :func:`run_frontend` (one nursery, everything owned)::

    run_frontend
    ├── run_local_workers     child worker processes (--local-workers), stopped last
    ├── WorkerPool.run        one link per worker address; events -> FleetBridge -> Fleet
    ├── serve_http            the OpenAI API, admin and metrics endpoints (FrontendAPI)
    └── _tick                 periodic expiry: staleness, mark leases, frontend-queue release

The worker links speak of workers by address (``ws://host:port``), the load state by the id a
worker announces; :class:`FleetBridge` keeps the map between the two and is the only place that
turns link news into :class:`~frontend_shim._load.Fleet` calls.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence

import prometheus_client
import trio

from frontend_shim._api import FrontendAPI
from frontend_shim._config import FrontendSettings
from frontend_shim._load import Fleet
from frontend_shim._local import run_local_workers
from frontend_shim._metrics import FrontendMetrics, RankLoadSample
from frontend_shim._router import Router, RouterMode
from frontend_shim._thresholds import Thresholds
from frontend_shim._workers import WorkerKey, WorkerPool
from shim_common import wire
from shim_common._httpserver import HTTPLimits, serve_http
from shim_common._net import base_url

__all__ = ["FleetBridge", "run_frontend"]

_log = logging.getLogger(__name__)

#: Seconds between expiry passes (staleness, mark leases) when no event arrives.
TICK_INTERVAL = 0.25


class FleetBridge:
    """Turns what the worker links report into :class:`Fleet` updates (a ``FleetListener``).

    A worker id announced by two addresses at once (one worker reachable twice, e.g. over IPv4
    and IPv6) is counted once: the first address to come up owns it, the others stand by, and
    when the owner goes down a standby that is still up takes over at once.

    Args:
        fleet: the load state to update.
        on_change: called after every change of the fleet (to release parked requests).
    """

    def __init__(self, fleet: Fleet, on_change: Callable[[], None]) -> None:
        self._fleet = fleet
        self._on_change = on_change
        #: Every link that is up, with the config of its latest hello.
        self._up: dict[WorkerKey, wire.RuntimeConfig] = {}
        #: The link that speaks for each registered worker id.
        self._owner: dict[str, WorkerKey] = {}

    def key_of(self, worker_id: str) -> WorkerKey | None:
        """The link address of a registered worker."""
        return self._owner.get(worker_id)

    def worker_up(self, key: WorkerKey, config: wire.RuntimeConfig, now: float) -> None:
        self._up[key] = config
        owner = self._owner.get(config.worker_id)
        if owner is not None and owner != key:
            _log.warning(
                "worker %s at %s is already connected at %s; standing by on the second address",
                config.worker_id,
                key,
                owner,
            )
            return
        self._owner[config.worker_id] = key
        self._fleet.register(config, now)
        _log.info("worker %s up at %s (model %s)", config.worker_id, key, config.model)
        self._on_change()

    def worker_events(self, key: WorkerKey, events: Sequence[wire.WorkerEvent], now: float) -> None:
        config = self._up.get(key)
        if config is None or self._owner.get(config.worker_id) != key:
            return  # a standby link: its owner reports the same worker
        if self._fleet.apply_batch(config.worker_id, events, now):
            self._on_change()

    def worker_down(self, key: WorkerKey, now: float) -> None:
        config = self._up.pop(key, None)
        if config is None or self._owner.get(config.worker_id) != key:
            return
        del self._owner[config.worker_id]
        self._fleet.remove(config.worker_id)
        _log.info("worker %s at %s down", config.worker_id, key)
        standby = next((k for k, c in self._up.items() if c.worker_id == config.worker_id), None)
        if standby is not None:
            self.worker_up(standby, self._up[standby], now)
        else:
            self._on_change()


def _rank_samples(fleet: Fleet) -> Callable[[], list[RankLoadSample]]:
    def samples() -> list[RankLoadSample]:
        return [
            RankLoadSample(
                g.worker_id,
                g.dp_rank,
                g.active_decode_blocks,
                g.active_prefill_tokens,
                g.kv_total_blocks,
            )
            for g in fleet.rank_gauges()
        ]

    return samples


def _log_thresholds(settings: FrontendSettings) -> None:
    given = [
        f"--{name.replace('_', '-')}={value}"
        for name, value in (
            ("active_decode_blocks_threshold", settings.active_decode_blocks_threshold),
            ("active_prefill_tokens_threshold", settings.active_prefill_tokens_threshold),
            ("active_prefill_tokens_threshold_frac", settings.active_prefill_tokens_threshold_frac),
        )
        if value is not None
    ]
    if given:
        _log.info("busy-worker rejection enabled by %s", ", ".join(given))
    else:
        _log.info("busy-worker rejection disabled: no rejection threshold is configured")


async def run_frontend(
    settings: FrontendSettings,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the frontend until SIGTERM/SIGINT (or cancellation).

    Prints ``frontend-shim ready http=http://HOST:PORT`` on stdout once the HTTP port listens
    and reports the same URL through ``task_status``.
    """
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    _log_thresholds(settings)
    fleet = Fleet(
        default_thresholds=Thresholds(
            active_decode_blocks=settings.active_decode_blocks_threshold,
            active_prefill_tokens=settings.active_prefill_tokens_threshold,
            active_prefill_tokens_frac=settings.active_prefill_tokens_threshold_frac,
        ),
        track_output_blocks=settings.router_track_output_blocks,
        queue_threshold=settings.router_queue_threshold,
        stale_after_intervals=settings.stale_after_heartbeats,
        mark_lease=settings.overload_mark_lease,
    )
    router = Router(
        fleet, RouterMode(settings.router_mode), migration_limit=settings.migration_limit
    )
    metrics = FrontendMetrics(_rank_samples(fleet))
    api: FrontendAPI | None = None

    def on_fleet_change() -> None:
        if api is not None:
            api.on_fleet_change()

    bridge = FleetBridge(fleet, on_change=on_fleet_change)
    async with trio.open_nursery() as nursery:
        local_urls: list[str] = []
        if settings.local_workers:
            local_urls = await nursery.start(
                run_local_workers, settings.local_workers, list(settings.local_worker_args)
            )
        elif not settings.workers:
            _log.warning("no --worker and no --local-workers: every request will get 503")
        pool = WorkerPool(
            [*settings.workers, *local_urls], resolve_interval=settings.resolve_interval
        )
        api = FrontendAPI(
            settings=settings, fleet=fleet, router=router, pool=pool, bridge=bridge, metrics=metrics
        )
        await nursery.start(pool.run, bridge)
        handler = api.handle
        port = await nursery.start(
            lambda task_status: serve_http(
                handler,
                settings.http_host,
                settings.http_port,
                limits=HTTPLimits(max_body_bytes=settings.max_body_bytes),
                on_error=lambda _exc: metrics.count_connection_error(),
                task_status=task_status,
            )
        )
        url = base_url("http", settings.http_host, port)
        print(f"frontend-shim ready http={url}", flush=True)
        task_status.started(url)
        nursery.start_soon(_tick, api)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                _log.info(
                    "received %s: draining (%.1f s grace)",
                    signal.Signals(signum).name,
                    settings.drain_grace,
                )
                break
            await _drain(api, settings.drain_grace, signals)
        nursery.cancel_scope.cancel()
    sys.stdout.flush()


async def _drain(api: FrontendAPI, grace: float, signals: AsyncIterator[int]) -> None:
    """Let requests in flight finish, for at most ``grace`` seconds or until a second signal."""
    api.begin_drain()
    with trio.move_on_after(grace) as grace_scope:
        async with trio.open_nursery() as nursery:

            async def until_idle() -> None:
                await api.wait_idle()
                nursery.cancel_scope.cancel()

            async def until_second_signal() -> None:
                async for signum in signals:
                    _log.warning("received %s again: stopping now", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(until_idle)
            nursery.start_soon(until_second_signal)
    if grace_scope.cancelled_caught:
        _log.warning("drain grace expired; cancelling the requests still in flight")
    _log.info("stopping")


async def _tick(api: FrontendAPI) -> None:
    while True:
        await trio.sleep(TICK_INTERVAL)
        api.on_fleet_change()
