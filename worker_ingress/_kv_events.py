"""KV events: what enters and leaves a worker's prefix cache, for the subscribers that ask.

A cache-aware frontend keeps an index of which rank holds which block; these events keep it true.
They are a stream, not state: unlike load events they are never coalesced latest-wins, so each
subscriber gets every event, in order, or a snapshot that replaces them.

Rules:

1. One :class:`KvEventLog` per worker numbers the events: ``seq`` is consecutive from 1 across
   all ranks of the worker (stored, removed and cleared alike). The engine records what its
   ranks' pools report right after each change, synchronously, so between two awaits the log and
   the caches agree, and a snapshot taken then is exact for the log's ``seq``.
2. A subscriber (:class:`KvSubscription`) first gets a :class:`~wire.KvSnapshot`: every rank's
   cached names as of ``seq``, the last event it covers. Every event recorded after it follows in
   order. Asking again (:meth:`KvSubscription.ask_snapshot`, a frontend that saw a gap) drops
   what was pending and sends a fresh snapshot, from which the events continue.
3. Bounded: a subscriber's pending events are counted in block names (an event costs its names
   plus one). Past ``backlog_limit``, what is pending is dropped and a fresh snapshot is sent
   instead (at most the whole cache), so a subscriber that cannot keep up costs the worker at
   most one snapshot's worth, never an unbounded backlog.
4. Paced: a subscriber is sent at most one :class:`~wire.KvBatch` every ``interval`` seconds
   (its load-event interval): events recorded meanwhile travel together, in order.
5. Recording never blocks: delivery appends to each subscriber's queue and wakes its sender.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Final

import trio

from shim_common.wire import KvCleared, KvEvent, KvRemoved, KvSnapshot, KvStored
from worker_ingress._watch import ChangeSignal
from worker_ingress.engines._kv_pool import STORED, PoolEvent

__all__ = ["MIN_BACKLOG_LIMIT", "KvEventLog", "KvSubscription"]

#: The smallest backlog a subscriber may pile up before it is sent a snapshot instead (names).
MIN_BACKLOG_LIMIT: Final = 1024


class KvSubscription:
    """One subscriber's queue of KV events (rules 2-4).

    Args:
        log: The worker's log (for the snapshots).
        backlog_limit: Pending block names past which a snapshot replaces the backlog.
        clock: The monotonic clock the pacing is measured on.
    """

    def __init__(
        self,
        log: KvEventLog,
        *,
        backlog_limit: int,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._log = log
        self._backlog_limit = backlog_limit
        self._clock = clock
        self._pending: deque[KvEvent] = deque()
        self._pending_names = 0
        self._snapshot_due = True
        self._signal = ChangeSignal()
        self._seen = 0
        self._last_sent = -math.inf
        #: Snapshots sent because the backlog overflowed (rule 3).
        self.overflows = 0

    @property
    def pending(self) -> int:
        """Events waiting to be sent (a due snapshot counts one)."""
        return len(self._pending) + self._snapshot_due

    def deliver(self, event: KvEvent, names: int) -> None:
        """Queue an event of ``names`` block names (synchronous, never blocks)."""
        if self._snapshot_due:
            return  # the snapshot, taken when sent, will cover it
        self._pending.append(event)
        self._pending_names += names + 1
        if self._pending_names > self._backlog_limit:
            self.overflows += 1
            self._snapshot_due = True
            self._pending.clear()
            self._pending_names = 0
        self._signal.bump()

    def ask_snapshot(self) -> None:
        """Send a fresh snapshot next, instead of what is pending (a subscriber saw a gap)."""
        self._snapshot_due = True
        self._pending.clear()
        self._pending_names = 0
        self._signal.bump()

    def take(self) -> list[KvEvent]:
        """Everything pending, in order: a snapshot alone when one is due."""
        if self._snapshot_due:
            self._snapshot_due = False
            return [self._log.snapshot()]
        events = list(self._pending)
        self._pending.clear()
        self._pending_names = 0
        return events

    async def next_batch(self, interval: float) -> list[KvEvent]:
        """Wait until something is pending and ``interval`` seconds have passed since the last
        batch (rule 4), then take it all.

        Returns:
            A non-empty list of events, oldest first.
        """
        while not self.pending:
            self._seen = await self._signal.wait_past(self._seen)
        send_at = self._last_sent + interval
        if self._clock() < send_at:
            await trio.sleep_until(send_at)
        self._last_sent = self._clock()
        return self.take()


class KvEventLog:
    """Numbers a worker's KV events and fans them out (rule 1).

    Args:
        snapshot: Returns the cached block names of every rank, rank 0 first.
        backlog_limit: Pending block names per subscriber past which it is sent a snapshot
            instead (rule 3); at least :data:`MIN_BACKLOG_LIMIT`.
    """

    def __init__(self, snapshot: Callable[[], list[list[int]]], *, backlog_limit: int) -> None:
        self._snapshot = snapshot
        self._backlog_limit = max(backlog_limit, MIN_BACKLOG_LIMIT)
        self._subscribers: set[KvSubscription] = set()
        #: The number of the last event recorded (0: none yet).
        self.seq = 0

    @property
    def subscriber_count(self) -> int:
        """Subscribers of the KV events now."""
        return len(self._subscribers)

    def snapshot(self) -> KvSnapshot:
        """Every rank's cached names as of the last event recorded."""
        return KvSnapshot(seq=self.seq, ranks=self._snapshot())

    def record(self, dp_rank: int, events: list[PoolEvent]) -> None:
        """Number and deliver what rank ``dp_rank``'s pool reported, in order."""
        for kind, parent, names in events:
            self.seq += 1
            event: KvEvent
            if kind == STORED:
                event = KvStored(seq=self.seq, dp_rank=dp_rank, parent=parent, blocks=names)
            else:
                event = KvRemoved(seq=self.seq, dp_rank=dp_rank, blocks=names)
            self._deliver(event, len(names))

    def cleared(self, dp_rank: int) -> None:
        """Number and deliver that rank ``dp_rank``'s cache was emptied."""
        self.seq += 1
        self._deliver(KvCleared(seq=self.seq, dp_rank=dp_rank), 0)

    @contextlib.contextmanager
    def subscribe(
        self, *, clock: Callable[[], float] = trio.current_time
    ) -> Iterator[KvSubscription]:
        """A subscription, a snapshot due first, for as long as the ``with`` block runs."""
        subscription = KvSubscription(self, backlog_limit=self._backlog_limit, clock=clock)
        self._subscribers.add(subscription)
        try:
            yield subscription
        finally:
            self._subscribers.discard(subscription)

    def _deliver(self, event: KvEvent, names: int) -> None:
        for subscription in self._subscribers:
            subscription.deliver(event, names)
