"""The frontend's worker links: one per resolved address of each ``--worker`` URL.

:class:`WorkerPool` turns the ``--worker`` URLs (and the URLs of ``--local-workers``) into one
:class:`~frontend_shim._links.WorkerLink` per resolved address. A host name is looked up with
``getaddrinfo`` at start and every ``resolve_interval`` seconds: new addresses get a link,
vanished ones are stopped. A lookup that fails keeps the addresses that name had before. The
links share one connect limiter, so a fleet of thousands starts with a bounded number of
handshakes in flight, and every link starts at once (none waits for another to connect).

The pool owns the frontend's event budget (:mod:`frontend_shim._event_budget`): the budget's
interval is recomputed whenever links are added or stopped, and asked again of every connected
worker that takes one when it changes; the links share one read pacer and one set of event
slices (:mod:`frontend_shim._pacer`). Every ``cost_window`` seconds the pool gives its
:class:`~frontend_shim._event_cost.EventCostMeter` the CPU time of the reads made in place (the
pacer times them) and of the whole process, and its links' running totals of messages and
connection attempts; when the budget is measured (no
``--event-budget``), a budget the meter moves is put in force and its interval asked again the
same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final

import trio

from frontend_shim._discovery import (
    Resolver,
    WorkerKey,
    WorkerUrl,
    parse_worker_url,
    resolve_addresses,
)
from frontend_shim._event_budget import DEFAULT_EVENT_BUDGET, EventBudget
from frontend_shim._event_cost import (
    DEFAULT_COST_WINDOW,
    DEFAULT_HOLD,
    DEFAULT_MIN_WINDOW_MESSAGES,
    EventCostMeter,
)
from frontend_shim._fleet_listener import FleetListener
from frontend_shim._links import LinkSettings, WorkerLink
from frontend_shim._pacer import DEFAULT_EVENTS_PER_SLICE, EventSlices, ReadPacer
from shim_common import wire
from shim_common._net import Backoff

__all__ = ["DEFAULT_CONNECT_CONCURRENCY", "WorkerPool"]

logger = logging.getLogger(__name__)

#: Connection attempts (TCP, TLS, upgrade, hellos) in flight at once across the pool.
DEFAULT_CONNECT_CONCURRENCY: Final = 64


class WorkerPool:
    """The worker links of a frontend: one per resolved address of each worker URL.

    Example::

        pool = WorkerPool(["ws://workers.internal:9100"])
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run, listener)
            link = pool.link("ws://10.0.0.7:9100")
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        settings: LinkSettings | None = None,
        resolve_interval: float = 30.0,
        resolver: Resolver = resolve_addresses,
        connect_concurrency: int = DEFAULT_CONNECT_CONCURRENCY,
        event_budget: float | None = DEFAULT_EVENT_BUDGET,
        events_per_slice: int = DEFAULT_EVENTS_PER_SLICE,
        measured_budget: bool = False,
        cost_window: float = DEFAULT_COST_WINDOW,
        cost_min_messages: int = DEFAULT_MIN_WINDOW_MESSAGES,
    ) -> None:
        """Parse the URLs; nothing is resolved or connected before :meth:`run`.

        Args:
            urls: ``ws://host:port`` values (``--worker``, ``DYN_WORKERS``, local workers).
            settings: timeouts and sizes for every link.
            resolve_interval: seconds between lookups of the host names.
            resolver: the lookup (tests replace it); IP literals never reach it.
            connect_concurrency: connection attempts in flight at once across all links.
            event_budget: event messages a second the links take in all; ``None``: no budget
                (every worker at its own pace, every event read at once).
            events_per_slice: reads applied in one pass of the scheduler.
            measured_budget: the budget follows the measured cost per message, starting at
                ``event_budget``; False: ``event_budget`` stays as given. The cost is measured
                (and exported) either way.
            cost_window: seconds between two samples of the cost meter.
            cost_min_messages: messages a window of the meter needs to count.

        Raises:
            ValueError: a URL that :func:`parse_worker_url` refuses, or a measured budget
                without a budget to start from.
        """
        if measured_budget and event_budget is None:
            raise ValueError("a measured event budget needs an initial budget")
        if not cost_window > 0:
            raise ValueError(f"cost_window must be > 0, got {cost_window}")
        self._urls = [parse_worker_url(url) for url in urls]
        self._settings = settings if settings is not None else LinkSettings()
        self._resolve_interval = resolve_interval
        self._resolver = resolver
        self._links: dict[WorkerKey, WorkerLink] = {}
        self._scopes: dict[WorkerKey, trio.CancelScope] = {}
        self._on_link_stopped: Callable[[WorkerKey], object] | None = None
        # The keys each URL resolved to last time, kept when a later lookup fails.
        self._resolved: dict[WorkerUrl, list[WorkerKey]] = {}
        self._limiter = trio.CapacityLimiter(connect_concurrency)
        self._nursery: trio.Nursery | None = None
        #: The event budget shared by the links (``None``: none).
        self.budget = EventBudget(event_budget) if event_budget is not None else None
        #: The turns for event work shared by the links.
        self.slices = EventSlices(events_per_slice)
        self._pacer = ReadPacer(per_slice=events_per_slice)
        #: The cost per event message, measured whether or not the budget follows it.
        self.cost = EventCostMeter(
            initial_budget=event_budget or DEFAULT_EVENT_BUDGET,
            min_messages=cost_min_messages,
            hold=DEFAULT_HOLD / DEFAULT_COST_WINDOW * cost_window,  # the same number of windows
        )
        #: Whether the budget follows :attr:`cost`.
        self.measured_budget = measured_budget
        self._cost_window = cost_window

    @property
    def slice_yields(self) -> int:
        """Times event work stopped for a pass of the scheduler: the slices' and the pacer's."""
        return self.slices.yields + self._pacer.yields

    @property
    def links(self) -> Mapping[WorkerKey, WorkerLink]:
        """The links now running, by key (a read-only view)."""
        return self._links

    def link(self, key: WorkerKey) -> WorkerLink | None:
        """The link of the worker at ``key``, or ``None`` if there is none (any more)."""
        return self._links.get(key)

    async def run(
        self,
        listener: FleetListener,
        *,
        on_link_stopped: Callable[[WorkerKey], object] | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Resolve, start and supervise the links until cancelled.

        Calls ``task_status.started()`` after the first lookup of every URL, once the links of
        the addresses found are running (not yet connected: see the listener). A URL whose
        first lookup fails is retried with backoff, and every ``resolve_interval`` after.
        ``on_link_stopped(key)`` is called when the link of an address no longer resolved is
        stopped (before its ``worker_down``, if it was up).
        """
        self._on_link_stopped = on_link_stopped
        backoff = Backoff(
            initial=min(1.0, self._resolve_interval),
            cap=self._resolve_interval,
            jitter=0.2,
        )
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.slices.run)
            await nursery.start(self._pacer.run)
            nursery.start_soon(self._measure_cost, nursery)
            complete = await self._reconcile(nursery, listener)
            task_status.started()
            while True:
                if complete:
                    backoff.reset()
                    await trio.sleep(self._resolve_interval)
                else:
                    await trio.sleep(backoff.next_delay())
                complete = await self._reconcile(nursery, listener)

    async def _reconcile(self, nursery: trio.Nursery, listener: FleetListener) -> bool:
        """Look every URL up, start links for new addresses, stop the vanished ones.

        Returns:
            True when every lookup succeeded.
        """
        complete = True
        for url in self._urls:
            try:
                addresses = await self._resolver(url.host, url.port)
            except OSError as exc:
                complete = False
                logger.warning(
                    "cannot resolve %s: %s (keeping %s)", url.host, exc, self._resolved.get(url, [])
                )
                continue
            if not addresses:
                complete = False
                logger.warning("%s resolved to no address", url.host)
                continue
            self._resolved[url] = [url.key_for(address) for address in addresses]
        wanted: dict[WorkerKey, str] = {}
        for url, keys in self._resolved.items():
            wanted.update(dict.fromkeys(keys, url.host))
        for key in list(self._links):
            if key not in wanted:
                logger.info("worker %s no longer resolved: stopping its link", key)
                del self._links[key]
                self._scopes.pop(key).cancel()
                if self._on_link_stopped is not None:
                    self._on_link_stopped(key)
        if self.budget is not None and self.budget.resize(len(wanted)):
            self._ask_interval_again(nursery)
        for key, host in wanted.items():
            if key not in self._links:
                link = WorkerLink(
                    key,
                    listener,
                    self._settings,
                    connect_limiter=self._limiter,
                    budget=self.budget,
                    slices=self.slices,
                    pacer=self._pacer,
                    server_hostname=host,
                )
                self._links[key] = link
                await nursery.start(self._run_link, link)
        return complete

    def _ask_interval_again(self, nursery: trio.Nursery) -> None:
        """The budget's interval changed: log it and ask every negotiating worker for it."""
        assert self.budget is not None
        logger.info(
            "event budget %.0f messages/s over %d workers: one every %.3f s per worker",
            self.budget.messages_per_second,
            self.budget.links,
            self.budget.interval,
        )
        for link in self._links.values():
            if link.connected and link.negotiated:
                nursery.start_soon(link.send_interval)

    async def _measure_cost(self, nursery: trio.Nursery) -> None:
        # O(links) every window (a sum over 2,048 links is a fraction of a millisecond), nothing
        # on the read path of any link.
        meter = self.cost
        while True:
            # The budget is spent in reads (a read brings one batch of a negotiating worker, or
            # whatever one paced read finds, or nothing): the cost that sets it is per read.
            reads = connects = 0
            for link in self._links.values():
                stats = link.stats
                reads += stats.event_reads
                connects += stats.sessions + stats.connect_failures
            moved = meter.sample(
                now=trio.current_time(),
                cpu=time.process_time(),
                messages=reads,
                connects=connects,
                links=len(self._links),
                timed_cpu=self._pacer.event_cpu,
                timed_messages=self._pacer.event_reads,
            )
            if moved and self.measured_budget and self.budget is not None:
                logger.info(
                    "measured %.1f us of CPU per event message: event budget %.0f messages/s",
                    meter.cost * 1e6,
                    meter.budget,
                )
                if self.budget.retarget(meter.budget):
                    self._ask_interval_again(nursery)
            await trio.sleep(self._cost_window)

    async def _run_link(
        self, link: WorkerLink, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.CancelScope() as scope:
            self._scopes[link.key] = scope
            await link.run(task_status=task_status)

    def thresholds_changed(self, model: str, thresholds: wire.BusyThresholds) -> None:
        """Send new thresholds to every connected worker of ``model`` that takes them.

        Synchronous (called from the admin API): the sends run in the pool's nursery.
        """
        if self._nursery is None:
            return
        for link in self._links.values():
            if link.connected and link.config is not None and link.config.model == model:
                self._nursery.start_soon(link.send_thresholds, thresholds)
