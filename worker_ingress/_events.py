"""The event plane's publisher: load events on change, heartbeats, latest-wins per subscriber.

Rules:

1. One :class:`LoadTracker` per worker owns the sequence counter. Every :class:`~wire.LoadEvent`
   and every :class:`~wire.Heartbeat` takes the next ``seq``; ``ts`` is wall-clock seconds.
2. A load event is produced for a rank when its load or the ingress gauges (running, queued, L,
   the queue by priority) differ from what was last published; the gauges belong to the whole
   worker, so a gauge change produces one event per rank. Publishing the same state twice
   produces nothing.
3. A heartbeat is produced every ``heartbeat_interval`` seconds whatever happens, and at once
   when the worker's status changes (``ready`` -> ``draining``). It repeats the latest load of
   every rank.
4. Each subscriber has a :class:`~shim_common.wire.Mailbox` that holds at most one pending load
   event per rank and at most one pending heartbeat. A newer event replaces an older one of the
   same rank; a pending heartbeat makes every older pending load event redundant (it repeats them
   all), so they are dropped. A slow subscriber therefore sees gaps in ``seq`` but always the
   latest state, and its memory is bounded by ``data_parallel_size + 1`` events.
5. Whatever sits in a mailbox when its subscriber's sender is ready is sent as one
   :class:`~wire.EventBatch`, oldest first: that is the coalescing.
6. Publishing never blocks: producers write into mailboxes synchronously, so a slow subscriber
   slows neither the engine nor the other subscribers. A subscription costs nothing while its
   sender writes a batch (it leaves the publisher when it takes the batch, and when its sender
   asks for the next one it rejoins and gets, latest-wins, what it missed), so a subscriber that
   never reads costs nothing once its socket is full. Delivering wakes a subscriber's sender only
   when that sender is waiting for it: for a first pending event, or for the first urgent one.
7. A subscriber gets at most one batch every ``publish_interval`` seconds, however fast the
   engine steps: what changes in between waits in its mailbox, latest-wins, so a change waits at
   most one interval. Two kinds of events do not wait: a status heartbeat (``draining``), and,
   for a subscriber that sent its thresholds (:meth:`Subscription.set_thresholds`), a load event
   that turns a rank busy or free under them compared with what the subscriber was last sent.
   Those still keep ``publish_interval / 20`` apart, so a load flapping around a threshold
   costs at most ``21 / publish_interval`` batches a second.
8. A subscriber may ask for a longer interval of its own
   (:meth:`Subscription.set_publish_interval`, a frontend keeping to its event budget): its
   batches then keep ``max(publish_interval, asked)`` apart. The worker's own interval bounds it
   below, and the edges and status heartbeats of rule 7 keep their own, shorter gap.
9. A subscriber that has sent a ``Subscribe`` is :attr:`Subscription.subscribed`: a frontend
   sends one as soon as it has read the hello of a worker that takes one. The worker's
   subscriber places are kept for those: at the cap, a new event-plane connection takes the
   place of the oldest one that has not subscribed within a grace period (a squatter),
   instead of being refused (:mod:`worker_ingress._server`).

:class:`LoadTracker` (rules 1 to 3) is sans-IO. :class:`Subscription` keeps a subscriber's
mailbox and decides synchronously what a delivery does (rules 4, 6 to 9), but its
:meth:`~Subscription.next_batch` waits on Trio (the subscriber's sender sleeps out the interval
in it). :class:`EventPublisher` is the Trio shell that watches the engine's
:class:`~worker_ingress._watch.ChangeSignal`, ticks the heartbeat and wakes subscribers.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Final, Literal

import trio

from shim_common._busy import rank_busy
from shim_common.wire import (
    BusyThresholds,
    Heartbeat,
    LoadEvent,
    Mailbox,
    QueueAhead,
    RankLoad,
    WorkerEvent,
)
from worker_ingress._watch import ChangeSignal

__all__ = [
    "DEFAULT_COALESCE_INTERVAL",
    "DEFAULT_PUBLISH_INTERVAL",
    "RankLimits",
    "EventPublisher",
    "LoadTracker",
    "Subscription",
    "WorkerStatus",
]

WorkerStatus = Literal["ready", "draining"]

#: After publishing a change the publisher waits this long before looking again, so a burst of
#: changes (every admission moves a gauge) becomes one event per rank instead of hundreds.
DEFAULT_COALESCE_INTERVAL: Final = 0.001
#: Seconds between two batches to one subscriber at most (``--load-publish-interval``).
DEFAULT_PUBLISH_INTERVAL: Final = 0.1
#: Urgent batches (busy/free edges) keep this share of the publish interval apart.
EDGE_GAP_SHARE: Final = 1 / 20

#: ``(kv_total_blocks, max_num_batched_tokens)`` of one rank, what the busy rule needs.
RankLimits = tuple[int, int]


class LoadTracker:
    """Turns load snapshots into load events and heartbeats (sans-IO).

    Args:
        wall_clock: Returns the timestamp stamped on each event (seconds since the epoch).
    """

    def __init__(self, *, wall_clock: Callable[[], float] = time.time) -> None:
        self._wall_clock = wall_clock
        self._seq = 0
        self._loads: list[RankLoad] = []
        self._engine_requests = 0
        self._queued_requests = 0
        self._effective_limit: int | None = None
        self._queue_ahead: QueueAhead | None = None
        # What was last published per rank, loads and gauges together.
        self._published: dict[int, tuple[RankLoad, int, int, int | None, QueueAhead | None]] = {}

    @property
    def seq(self) -> int:
        """The sequence number of the last event or heartbeat produced (0: none yet)."""
        return self._seq

    def observe(
        self,
        loads: list[RankLoad],
        engine_requests: int,
        queued_requests: int,
        effective_limit: int | None = None,
        queue_ahead: QueueAhead | None = None,
    ) -> list[LoadEvent]:
        """Record the current state and return a load event for every rank that changed.

        Args:
            loads: The load of every data-parallel rank.
            engine_requests: Requests running in the engine now.
            queued_requests: Requests waiting in the ingress now.
            effective_limit: L in force, with a TTFT objective; ``None`` without one.
            queue_ahead: The queue by priority (:attr:`~shim_common.wire.LoadEvent.queue_ahead`),
                from a gate that refuses by the time a request would wait; ``None`` otherwise.

        Returns:
            The new events, in rank order; empty when nothing changed.
        """
        self._loads = list(loads)
        self._engine_requests = engine_requests
        self._queued_requests = queued_requests
        self._effective_limit = effective_limit
        self._queue_ahead = queue_ahead
        events: list[LoadEvent] = []
        now = self._wall_clock()
        for load in loads:
            state = (load, engine_requests, queued_requests, effective_limit, queue_ahead)
            if self._published.get(load.dp_rank) == state:
                continue
            self._published[load.dp_rank] = state
            self._seq += 1
            events.append(
                LoadEvent(
                    seq=self._seq,
                    ts=now,
                    load=load,
                    engine_requests=engine_requests,
                    queued_requests=queued_requests,
                    effective_limit=effective_limit,
                    queue_ahead=queue_ahead,
                )
            )
        return events

    def heartbeat(self, status: WorkerStatus) -> Heartbeat:
        """Return a heartbeat repeating the latest observed state.

        Args:
            status: What the worker is doing: ``ready`` or ``draining``.

        Returns:
            A heartbeat with the next sequence number.
        """
        self._seq += 1
        return Heartbeat(
            seq=self._seq,
            ts=self._wall_clock(),
            loads=list(self._loads),
            engine_requests=self._engine_requests,
            queued_requests=self._queued_requests,
            status=status,
            effective_limit=self._effective_limit,
            queue_ahead=self._queue_ahead,
        )


class Subscription:
    """A subscriber's handle: wait for the next batch of events (rule 7 bounds their rate).

    Args:
        publish_interval: Seconds between two batches at most; 0 sends every change at once.
        limits: The rank limits the busy rule needs, for edge detection.
        clock: The monotonic clock the interval is measured on (``trio.current_time``).
        leave: Called when the sender takes a batch: the publisher stops delivering to it.
        rejoin: Called when the sender asks for the next batch: the publisher delivers again,
            latest-wins, what was published meanwhile (rule 6).
    """

    def __init__(
        self,
        *,
        publish_interval: float = 0.0,
        limits: RankLimits = (0, 0),
        clock: Callable[[], float] = trio.current_time,
        leave: Callable[[Subscription], None] = lambda _subscription: None,
        rejoin: Callable[[Subscription], None] = lambda _subscription: None,
    ) -> None:
        self._leave = leave
        self._rejoin = rejoin
        #: True from a batch's take until the sender asks for the next one (rule 6).
        self._away = False
        #: The ``seq`` of the newest event taken (0: none yet).
        self.last_seq = 0
        #: Whether the subscriber has sent a ``Subscribe`` (rule 9): what a frontend does first.
        self.subscribed = False
        self._mailbox = Mailbox()
        self._signal = ChangeSignal()
        self._seen = 0
        self._own_interval = publish_interval
        self._interval = publish_interval
        self._edge_gap = publish_interval * EDGE_GAP_SHARE
        self._limits = limits
        self._clock = clock
        self._last_sent = -math.inf
        self._urgent = False
        self._thresholds: BusyThresholds | None = None
        # The load of each rank as of the last batch taken (what the subscriber knows).
        self._sent_loads: dict[int, RankLoad] = {}

    def set_thresholds(self, thresholds: BusyThresholds | None) -> None:
        """Route-relevant edges under ``thresholds`` skip the interval from now on.

        Called for every ``Subscribe`` the subscriber sends, so it also marks the subscriber as
        :attr:`subscribed` (rule 9)."""
        self._thresholds = thresholds
        self.subscribed = True

    def set_publish_interval(self, asked: float) -> None:
        """Send at most one batch every ``asked`` seconds, never more often than the worker's
        own interval (rule 8); 0 goes back to the worker's own. A batch already waiting out
        the old interval keeps it; the next one waits out the new."""
        self._interval = max(self._own_interval, asked)

    @property
    def publish_interval(self) -> float:
        """The interval in force for this subscriber (seconds)."""
        return self._interval

    def deliver(self, event: WorkerEvent, *, urgent: bool = False) -> None:
        """Put an event in the mailbox and wake the subscriber (synchronous, never blocks).

        Args:
            event: The event.
            urgent: Send it without waiting out the publish interval.
        """
        waiting_for_any = not len(self._mailbox)
        self._mailbox.put(event)
        if not self._urgent and (
            urgent or (isinstance(event, LoadEvent) and self._is_edge(event.load))
        ):
            self._urgent = True
            waiting_for_any = True  # or sleeping out the interval: this ends the sleep
        if waiting_for_any:
            self._signal.bump()

    @property
    def pending(self) -> int:
        """Events waiting to be taken (at most ``data_parallel_size + 1``)."""
        return len(self._mailbox)

    async def next_batch(self) -> list[WorkerEvent]:
        """Wait until something is pending and may be sent (rule 7), and take all of it.

        Returns:
            A non-empty list of events, oldest first.
        """
        if self._away:
            self._away = False
            self._rejoin(self)
        while True:
            if len(self._mailbox):
                gap = self._edge_gap if self._urgent else self._interval
                send_at = self._last_sent + gap
                if self._clock() >= send_at:
                    return self._take()
                # Sleep out the interval, unless an urgent event comes first.
                with trio.move_on_at(send_at):
                    while not self._urgent:
                        self._seen = await self._signal.wait_past(self._seen)
                    await trio.sleep_until(self._last_sent + self._edge_gap)
                continue
            self._seen = await self._signal.wait_past(self._seen)

    def _take(self) -> list[WorkerEvent]:
        events = self._mailbox.take()
        self._last_sent = self._clock()
        self._urgent = False
        self.last_seq = events[-1].seq
        self._away = True
        self._leave(self)
        for event in events:
            if isinstance(event, Heartbeat):
                for load in event.loads:
                    self._sent_loads[load.dp_rank] = load
            else:
                self._sent_loads[event.load.dp_rank] = event.load
        return events

    def _is_edge(self, load: RankLoad) -> bool:
        if self._thresholds is None:
            return False
        before = self._sent_loads.get(load.dp_rank)
        return before is not None and self._busy(before) != self._busy(load)

    def _busy(self, load: RankLoad) -> bool:
        assert self._thresholds is not None
        kv_total_blocks, max_num_batched_tokens = self._limits
        return rank_busy(
            self._thresholds,
            blocks=max(load.kv_used_blocks, load.active_decode_blocks),
            prefill_tokens=load.active_prefill_tokens,
            kv_total_blocks=kv_total_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
        )


class EventPublisher:
    """Publishes the worker's load to any number of subscribers (the Trio shell).

    Args:
        load: Returns the current load of every rank (the engine's ``load``).
        load_changed: Bumped by the engine when ``load()`` changes.
        gauges: Returns ``(engine_requests, queued_requests)`` of the ingress now.
        effective_limit: Returns L in force when the worker has a TTFT objective (``None``
            without one: the events then do not carry it).
        queue_ahead: Returns the queue by priority when the gate refuses by the time a request
            would wait (``None`` otherwise: the events then do not carry it).
        heartbeat_interval: Seconds between heartbeats.
        publish_interval: Seconds between two batches to one subscriber at most (rule 7).
        limits: Returns the rank limits for busy/free edge detection (read at each subscribe,
            so an engine that learns its limits at start-up is read after it has).
        coalesce_interval: Seconds to wait after publishing before looking for the next change.
        wall_clock: Timestamps of the events.
    """

    def __init__(
        self,
        *,
        load: Callable[[], list[RankLoad]],
        load_changed: ChangeSignal,
        gauges: Callable[[], tuple[int, int]],
        heartbeat_interval: float,
        effective_limit: Callable[[], int | None] = lambda: None,
        queue_ahead: Callable[[], QueueAhead | None] = lambda: None,
        publish_interval: float = DEFAULT_PUBLISH_INTERVAL,
        limits: Callable[[], RankLimits] = lambda: (0, 0),
        coalesce_interval: float = DEFAULT_COALESCE_INTERVAL,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval!r}")
        self._load = load
        self._engine_changed = load_changed
        self._gauges = gauges
        self._effective_limit = effective_limit
        self._queue_ahead = queue_ahead
        if publish_interval < 0:
            raise ValueError(f"publish_interval must be >= 0, got {publish_interval!r}")
        self._heartbeat_interval = heartbeat_interval
        self._publish_interval = publish_interval
        self._limits = limits
        self._coalesce_interval = coalesce_interval
        self._tracker = LoadTracker(wall_clock=wall_clock)
        self._changed = ChangeSignal()
        self._status: WorkerStatus = "ready"
        self._status_changed = trio.Event()
        #: Subscriptions that events are delivered to (rule 6: not those whose sender writes).
        self._subscribers: set[Subscription] = set()
        self._subscription_count = 0
        # What a rejoining subscription may have missed: the newest heartbeat (and whether it
        # was urgent), and the newest load event of each rank since it.
        self._latest_heartbeat: tuple[Heartbeat, bool] | None = None
        self._latest_loads: dict[int, LoadEvent] = {}

    @property
    def status(self) -> WorkerStatus:
        """What heartbeats say the worker is doing."""
        return self._status

    @property
    def seq(self) -> int:
        """The ``seq`` of the last event or heartbeat produced (0: none yet)."""
        return self._tracker.seq

    @property
    def subscriber_count(self) -> int:
        """Subscribers connected now."""
        return self._subscription_count

    def notify(self) -> None:
        """Tell the publisher that the ingress gauges changed (synchronous; O(1))."""
        self._changed.bump()

    def set_status(self, status: WorkerStatus) -> None:
        """Change the status heartbeats carry; a heartbeat goes out at once."""
        if status != self._status:
            self._status = status
            self._status_changed.set()

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[Subscription]:
        """Register a subscriber for as long as the ``with`` block runs.

        The subscription starts with a heartbeat holding the current state, so a new subscriber
        is whole at once.

        Yields:
            The subscription to take batches from.
        """
        subscription = Subscription(
            publish_interval=self._publish_interval,
            limits=self._limits(),
            leave=self._subscribers.discard,
            rejoin=self._rejoin,
        )
        subscription.deliver(self._tracker.heartbeat(self._status), urgent=True)
        self._subscribers.add(subscription)
        self._subscription_count += 1
        try:
            yield subscription
        finally:
            self._subscription_count -= 1
            self._subscribers.discard(subscription)

    def _rejoin(self, subscription: Subscription) -> None:
        # Back from writing a batch: what was published meanwhile, latest-wins, in seq order.
        self._subscribers.add(subscription)
        seen = subscription.last_seq
        if self._latest_heartbeat is not None and self._latest_heartbeat[0].seq > seen:
            heartbeat, urgent = self._latest_heartbeat
            subscription.deliver(heartbeat, urgent=urgent)
        for event in self._latest_loads.values():
            if event.seq > seen:
                subscription.deliver(event)

    def _publish(self, event: WorkerEvent, *, urgent: bool = False) -> None:
        if isinstance(event, Heartbeat):
            self._latest_heartbeat = (event, urgent)
            self._latest_loads.clear()
        else:
            self._latest_loads[event.load.dp_rank] = event
        for subscription in self._subscribers:
            subscription.deliver(event, urgent=urgent)

    def _observe(self) -> None:
        engine_requests, queued_requests = self._gauges()
        limit = self._effective_limit()
        ahead = self._queue_ahead()
        tracker = self._tracker
        for event in tracker.observe(self._load(), engine_requests, queued_requests, limit, ahead):
            self._publish(event)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish changes and heartbeats until cancelled.

        Args:
            task_status: Started once the initial state has been observed.
        """
        self._observe()
        # The engine and the gate signal separately; one signal is simpler to wait on.
        self._engine_changed.forward_to(self._changed)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats)
            task_status.started()
            seen = self._changed.version
            while True:
                seen = await self._changed.wait_past(seen)
                self._observe()
                await trio.sleep(self._coalesce_interval)

    async def _heartbeats(self) -> None:
        while True:
            status_changed = False
            with trio.move_on_after(self._heartbeat_interval):
                await self._status_changed.wait()
                self._status_changed = trio.Event()
                status_changed = True
            # Observe first, so the heartbeat never repeats a state older than the last event.
            self._observe()
            self._publish(self._tracker.heartbeat(self._status), urgent=status_changed)
