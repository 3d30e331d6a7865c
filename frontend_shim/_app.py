"""The frontend process: worker links feeding the load state, and the HTTP API on top.

Task tree of :func:`run_frontend` (one nursery, everything owned)::

    run_frontend
    ├── run_local_workers     child worker processes (--local-workers), stopped last
    ├── serve_http            the OpenAI API, admin and metrics endpoints (FrontendAPI),
    │                         listening before any link starts
    ├── WorkerPool.run        one link per worker address; events -> FleetBridge -> Fleet
    └── _tick                 periodic expiry: staleness, mark leases, frontend-queue release

Construction follows the dependencies, so nothing is wired up after the fact: the fleet, then
the waiting room (the frontend queue), then the links, then the
:class:`~frontend_shim._fleet_bridge.FleetBridge` over both (it releases parked requests on every
fleet change and finds the link of a routed worker), then the API.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import random
import signal
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Final

import prometheus_client
import trio

from frontend_shim._admin import AdminRoutes, FleetThresholds
from frontend_shim._api import FrontendAPI
from frontend_shim._config import DEFAULT_EVENT_BUDGET, FrontendSettings
from frontend_shim._fleet_bridge import FleetBridge
from frontend_shim._kv_cost import CostWeights, KvScorer
from frontend_shim._kv_index import KvIndex
from frontend_shim._kv_routing import KvMetrics, KvRouting
from frontend_shim._links import LinkSettings
from frontend_shim._load import Fleet
from frontend_shim._local import run_local_workers
from frontend_shim._loop_guard import LoopGuard
from frontend_shim._metrics import BudgetSample, FrontendMetrics, LinkSample, RankLoadSample
from frontend_shim._picture import LocalPicture
from frontend_shim._pool import WorkerPool
from frontend_shim._request_class import ClassPolicy
from frontend_shim._router import Router, RouterMode
from frontend_shim._waiting import WaitingRoom
from shim_common._access import client_context, server_context
from shim_common._httpserver import HTTPLimits, IdleConnections, Shutdown, serve_http
from shim_common._net import CLOSE_BATCH, base_url
from shim_common.prefix import FileTokenizer, PromptTokenizer, WordTokenizer

__all__ = [
    "EXIT_ANSWER_SECONDS",
    "PictureParts",
    "budget_sample",
    "drain",
    "link_samples",
    "log_thresholds",
    "loop_guard",
    "picture_parts",
    "run_frontend",
    "tokenizer_of",
    "worker_headers",
    "worker_pool",
    "worker_tls",
]

_log = logging.getLogger(__name__)

#: Seconds between expiry passes (staleness, mark leases) when no event arrives.
TICK_INTERVAL = 0.25


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


class LoopWatch(trio.abc.Instrument):
    """Tells a :class:`~frontend_shim._loop_guard.LoopGuard` how long each pass of this
    process's run loop ran tasks (from the end of one wait for I/O to the start of the next),
    in CPU time of the loop's thread."""

    def __init__(self, guard: LoopGuard) -> None:
        self._guard = guard
        self._started: float | None = None

    def after_io_wait(self, timeout: float) -> None:
        self._started = time.thread_time()

    def before_io_wait(self, timeout: float) -> None:
        started = self._started
        if started is not None:
            self._guard.pass_ran(time.thread_time() - started, trio.current_time())


def loop_guard(settings: FrontendSettings) -> LoopGuard | None:
    """The guard of ``--max-loop-lag``, watching this process's loop (``None``: off)."""
    if not settings.max_loop_lag:
        return None
    guard = LoopGuard(settings.max_loop_lag)
    trio.lowlevel.add_instrument(LoopWatch(guard))
    return guard


def log_thresholds(settings: FrontendSettings) -> None:
    thresholds = settings.thresholds
    given = [
        f"--{name.replace('_', '-')}={value}"
        for name, value in (
            ("active_decode_blocks_threshold", thresholds.active_decode_blocks),
            ("active_prefill_tokens_threshold", thresholds.active_prefill_tokens),
            ("active_prefill_tokens_threshold_frac", thresholds.active_prefill_tokens_frac),
        )
        if value is not None
    ]
    if given:
        _log.info("busy-worker rejection enabled by %s", ", ".join(given))
    else:
        _log.info("busy-worker rejection disabled: no rejection threshold is configured")


@dataclasses.dataclass(frozen=True)
class PictureParts:
    """The pure objects of a frontend's picture of the fleet, built from its settings."""

    fleet: Fleet
    kv_index: KvIndex | None
    router: Router
    metrics: FrontendMetrics
    kv_routing: KvRouting | None
    waiting: WaitingRoom


def picture_parts(settings: FrontendSettings) -> PictureParts:
    """The fleet, the router over it, the ``kv`` mode's index, the metrics and the queue."""
    fleet = Fleet(
        default_thresholds=settings.thresholds,
        track_output_blocks=settings.router_track_output_blocks,
        queue_threshold=settings.router_queue_threshold,
        stale_after_intervals=settings.stale_after_heartbeats,
        mark_lease=settings.overload_mark_lease,
    )
    kv_index = (
        KvIndex(prediction_ttl=settings.router_ttl_secs, use_events=settings.router_kv_events)
        if settings.router_mode == "kv"
        else None
    )
    weights = CostWeights(
        credit=settings.router_kv_overlap_score_credit,
        prefill_load_scale=settings.router_prefill_load_scale,
        temperature=settings.router_temperature,
    )
    router = Router(
        fleet,
        RouterMode(settings.router_mode),
        migration_limit=settings.migration_limit,
        kv=KvScorer(kv_index, weights) if kv_index is not None else None,
        # Frontends of one fleet start their rotations at different workers (no herd).
        cursor=random.randrange(1 << 20),
    )
    metrics = FrontendMetrics(_rank_samples(fleet))
    kv_routing = (
        KvRouting(kv_index, tokenizer_of(settings), KvMetrics(metrics.registry, kv_index))
        if kv_index is not None
        else None
    )
    capacity = (
        settings.router_queue_capacity if settings.router_queue_threshold is not None else None
    )
    return PictureParts(fleet, kv_index, router, metrics, kv_routing, WaitingRoom(fleet, capacity))


def worker_pool(
    settings: FrontendSettings,
    urls: list[str],
    make_room: Callable[[], int] | None,
    *,
    event_plane: bool = True,
    request_plane: bool = True,
) -> WorkerPool:
    """The links to every worker URL, as the settings say (``event_plane`` off: the request
    planes alone, for an HTTP process whose host follows the events; ``request_plane`` off:
    the event planes alone, for that host, which sends no request)."""
    return WorkerPool(
        urls,
        settings=LinkSettings(
            max_event_lag=settings.max_event_lag,
            headers=worker_headers(settings.worker_token),
            ssl_context=worker_tls(settings),
            make_room=make_room,
            kv_events=event_plane and settings.router_mode == "kv" and settings.router_kv_events,
            event_plane=event_plane,
            request_plane=request_plane,
        ),
        resolve_interval=settings.resolve_interval,
        connect_concurrency=settings.connect_concurrency,
        # Unset: start at the default and follow the measured cost; 0: no budget.
        event_budget=(
            DEFAULT_EVENT_BUDGET if settings.event_budget is None else settings.event_budget
        )
        or None,
        measured_budget=settings.event_budget is None,
        cost_window=settings.event_cost_window,
        cost_min_messages=settings.event_cost_min_messages,
    )


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
    log_thresholds(settings)
    parts = picture_parts(settings)
    fleet, kv_index, router, metrics = parts.fleet, parts.kv_index, parts.router, parts.metrics
    kv_routing, waiting = parts.kv_routing, parts.waiting
    async with trio.open_nursery() as nursery:
        local_urls: list[str] = []
        if settings.local_workers:
            local_urls = await nursery.start(
                run_local_workers, settings.local_workers, list(settings.local_worker_args)
            )
        elif not settings.workers:
            _log.warning("no --worker and no --local-workers: every request will get 503")
        # The HTTP server's idle keep-alive connections, which the links may close to reach a
        # worker when the process is out of file descriptors.
        idle_http = IdleConnections()
        pool = worker_pool(
            settings,
            [*settings.workers, *local_urls],
            lambda: idle_http.close_oldest(CLOSE_BATCH),
        )
        bridge = FleetBridge(
            fleet,
            on_change=waiting.release,
            links=pool.links,
            kv_index=kv_index,
            on_collision=metrics.count_worker_id_collision,
        )
        metrics.watch_links(lambda: link_samples(pool, bridge))
        admin = AdminRoutes(
            FleetThresholds(fleet, on_change=pool.thresholds_changed),
            disabled=settings.admin_api_disabled,
            token=settings.admin_token,
        )
        metrics.watch_event_budget(lambda: budget_sample(pool))
        api = FrontendAPI(
            overload_status=settings.overload_status,
            busy_exempt_priority=settings.busy_exempt_priority,
            class_policy=ClassPolicy(
                max_client_priority=settings.max_client_priority,
                gateway_token=None
                if settings.gateway_token is None
                else settings.gateway_token.encode(),
            ),
            fleet=fleet,
            picture=LocalPicture(fleet, router, kv_routing),
            migration_limit=settings.migration_limit,
            links=bridge,
            admin=admin,
            waiting=waiting,
            metrics=metrics,
            guard=loop_guard(settings),
        )
        handler = api.handle
        tls = (
            server_context(settings.tls_cert_path, settings.tls_key_path)
            if settings.tls_cert_path is not None and settings.tls_key_path is not None
            else None
        )
        # HTTP first: /live and /health answer while the links of a large fleet start.
        http_shutdown = Shutdown()
        port = await nursery.start(
            lambda task_status: serve_http(
                handler,
                settings.http_host,
                settings.http_port,
                limits=HTTPLimits(
                    max_body_bytes=settings.max_body_bytes,
                    send_timeout=settings.http_send_timeout,
                ),
                on_error=lambda _exc: metrics.count_connection_error(),
                on_send_stall=metrics.count_send_stall,
                ssl_context=tls,
                on_tls_failure=metrics.count_tls_failure,
                idle=idle_http,
                shutdown=http_shutdown,
                answer_at_once=api.answer_at_once,
                task_status=task_status,
            )
        )
        # Ready once the HTTP port listens, before any link: /live and /health answer while a
        # large fleet connects.
        url = base_url("https" if tls is not None else "http", settings.http_host, port)
        print(f"frontend-shim ready http={url}", flush=True)
        await nursery.start(
            functools.partial(pool.run, bridge, on_link_stopped=bridge.link_stopped)
        )
        # Everything built so far (the links, the fleet, imported modules) lives as long as the
        # process: out of the collector's sight, full collections stop rescanning it.
        gc.freeze()
        task_status.started(url)
        nursery.start_soon(_tick, waiting)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                _log.info(
                    "received %s: draining (%.1f s grace)",
                    signal.Signals(signum).name,
                    settings.drain_grace,
                )
                break
            await drain(api, settings.drain_grace, signals)
            # The listener closes before the last answers: a client arriving now is refused by
            # the kernel, or was accepted and gets its answer (503 while draining), never a
            # connection closed with no status line.
            await http_shutdown.close(EXIT_ANSWER_SECONDS)
        nursery.cancel_scope.cancel()
    sys.stdout.flush()


#: At the exit, the longest wait for the connections accepted to get their answers and close.
EXIT_ANSWER_SECONDS: Final = 1.0


async def drain(api: FrontendAPI, grace: float, signals: AsyncIterator[int]) -> None:
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


def tokenizer_of(settings: FrontendSettings) -> PromptTokenizer:
    """The tokeniser ``kv`` cuts prompts with: the workers' own (one tokenisation for both)."""
    if settings.tokenizer is not None:
        return FileTokenizer(settings.tokenizer)
    return WordTokenizer()


def worker_headers(token: str | None) -> tuple[tuple[str, str], ...]:
    """The upgrade headers of every worker link: the worker planes' bearer token, if set."""
    return (("Authorization", f"Bearer {token}"),) if token is not None else ()


def worker_tls(settings: FrontendSettings) -> ssl.SSLContext | None:
    """How ``wss://`` workers are verified: ``--tls-ca-path``, else the system's trust store.

    ``--local-workers`` children serve the frontend's own certificate, so it is trusted as it
    is, with or without a CA bundle. ``None`` leaves the default to the links.
    """
    local_cert = settings.tls_cert_path if settings.local_workers else None
    if settings.tls_ca_path is None and local_cert is None:
        return None
    return client_context(settings.tls_ca_path, also_trust=local_cert)


def link_samples(pool: WorkerPool, bridge: FleetBridge) -> list[LinkSample]:
    return [
        LinkSample(
            # The id the fleet knows it by (apart from another address's, rule of the bridge).
            worker_id=bridge.worker_id_of(link.key)
            or (link.config.worker_id if link.config is not None else link.key),
            connected=link.connected,
            lagging=link.lag.lagging,
            lag=link.lag.lag,
            max_lag=link.lag.max_lag,
            event_batches=link.stats.event_batches,
            lag_episodes=link.stats.lag_episodes,
            kv_budget_closes=link.stats.kv_budget_closes,
        )
        for link in list(pool.links.values())
    ]


def budget_sample(pool: WorkerPool) -> BudgetSample:
    budget = pool.budget
    paced = negotiated = 0
    for link in list(pool.links.values()):
        paced += link.paced
        negotiated += link.connected and link.negotiated
    return BudgetSample(
        messages_per_second=budget.messages_per_second if budget is not None else 0.0,
        interval=budget.interval if budget is not None else 0.0,
        negotiated=negotiated,
        paced=paced,
        slice_yields=pool.slice_yields,
        cost_per_message=pool.cost.cost,
        measured=budget is not None and pool.measured_budget,
    )


async def _tick(waiting: WaitingRoom) -> None:
    # Time alone frees room too (staleness, mark leases): look again now and then.
    while True:
        await trio.sleep(TICK_INTERVAL)
        waiting.release()
