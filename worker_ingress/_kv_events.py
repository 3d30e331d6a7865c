"""KV events: what enters and leaves a worker's prefix cache, for the subscribers that ask.

A cache-aware frontend keeps an index of which rank holds which block; these events keep it true.
They are a stream, not state: unlike load events they are never coalesced latest-wins, so each
subscriber gets every event, in order, or a snapshot that replaces them.

Rules:

1. One :class:`KvEventLog` per worker numbers the events: ``seq`` is consecutive from 1 across
   all ranks of the worker (stored, removed and cleared alike). The engine records what its
   ranks' pools report right after each change, synchronously, so between two awaits the log and
   the caches agree, and a snapshot taken then is exact for the log's ``seq``. A chain of more
   than :data:`EVENT_NAMES` names is recorded as several events, each continuing the one before,
   so that every event fits a part (rule 6).
2. A subscriber (:class:`KvSubscription`) first gets a :class:`~wire.KvSnapshot`: every rank's
   cached names as of ``seq``, the last event it covers. Every event recorded after it follows in
   order. Asking again (:meth:`KvSubscription.ask_snapshot`, a frontend that saw a gap) drops
   what was pending and sends a fresh snapshot, from which the events continue.
3. Bounded: a subscriber's pending events are counted in block names (an event costs its names
   plus one). Past ``backlog_limit``, what is pending is dropped and a fresh snapshot is sent
   instead (at most the whole cache), so a subscriber that cannot keep up costs the worker at
   most one snapshot's worth, never an unbounded backlog.
4. Paced: a subscriber is sent at most one :class:`~wire.KvBatch` of events every ``interval``
   seconds (its load-event interval): events recorded meanwhile travel together, in order.
5. Recording never blocks: delivery appends to each subscriber's queue and wakes its sender.
6. Parts (``wire.FEATURE_KV_PARTS``, to a subscriber that asked for them): no message holds
   more than :data:`~shim_common.wire.KV_PART_NAMES` (an event counting its names plus
   :data:`EVENT_COST`, a snapshot its names). A snapshot is taken whole when it is due, then
   sent as parts back to back (each but the last with ``more``); the events recorded meanwhile
   wait behind the last part (rule 3 still bounds them), and a snapshot asked for meanwhile comes
   after it: a snapshot under way is never cut. After a message of B bytes the next one waits
   B / :data:`~shim_common.wire.KV_BYTES_PER_SECOND` seconds.
7. A subscriber is sent at most one snapshot every :data:`KV_SNAPSHOT_GAP`
   seconds (the first at once): asking again sooner, or falling behind again sooner (rule 3),
   gets the next one when the gap is over, so a subscriber asking for snapshots in a loop costs
   the worker one snapshot a gap.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Final

import trio

from shim_common.wire import (
    KV_BYTES_PER_SECOND,
    KV_PART_NAMES,
    KvCleared,
    KvEvent,
    KvRemoved,
    KvSnapshot,
    KvStored,
)
from worker_ingress._watch import ChangeSignal
from worker_ingress.engines._kv_pool import STORED, PoolEvent

__all__ = [
    "EVENT_COST",
    "KV_SNAPSHOT_GAP",
    "EVENT_NAMES",
    "MIN_BACKLOG_LIMIT",
    "KvEventLog",
    "KvSubscription",
    "snapshot_parts",
]

#: The smallest backlog a subscriber may pile up before it is sent a snapshot instead (names).
MIN_BACKLOG_LIMIT: Final = 1024
#: Seconds between two snapshots to one subscriber at least, the first one aside (rule 7).
KV_SNAPSHOT_GAP: Final = 1.0
#: What an event costs a part besides its names (rule 6): its tags and numbers, about as many
#: bytes as 8 names.
EVENT_COST: Final = 8
#: The most names one event holds (rule 1): an event fits a part whole.
EVENT_NAMES: Final = KV_PART_NAMES - EVENT_COST


def snapshot_parts(snapshot: KvSnapshot, limit: int = KV_PART_NAMES) -> list[KvSnapshot]:
    """``snapshot`` cut into parts of at most ``limit`` names (rule 6), in rank order: every
    part but the last says ``more``; a part's ``ranks`` stops at the last rank it has names of."""
    parts: list[list[list[int]]] = []
    current: list[list[int]] = []
    room = limit
    for index, names in enumerate(snapshot.ranks):
        start = 0
        while True:
            while len(current) <= index:
                current.append([])
            taken = names[start : start + room]
            current[index].extend(taken)
            room -= len(taken)
            start += len(taken)
            if start >= len(names):
                break
            parts.append(current)
            current = []
            room = limit
    parts.append(current)
    last = len(parts) - 1
    return [
        KvSnapshot(seq=snapshot.seq, ranks=ranks, more=number < last)
        for number, ranks in enumerate(parts)
    ]


class KvSubscription:
    """One subscriber's queue of KV events (rules 2-4, 6 and 7).

    Args:
        log: The worker's log (for the snapshots).
        backlog_limit: Pending block names past which a snapshot replaces the backlog.
        parts: The subscriber asked for parts (rule 6).
        clock: The monotonic clock the pacing is measured on.
    """

    def __init__(
        self,
        log: KvEventLog,
        *,
        backlog_limit: int,
        parts: bool = False,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._log = log
        self._backlog_limit = backlog_limit
        self._in_parts = parts
        self._clock = clock
        #: Events waiting, with their names.
        self._pending: deque[tuple[KvEvent, int]] = deque()
        self._pending_names = 0
        self._snapshot_due = True
        #: The parts of the snapshot under way not sent yet (rule 6).
        self._parts: deque[KvSnapshot] = deque()
        self._signal = ChangeSignal()
        self._seen = 0
        self._last_sent = -math.inf
        self._last_snapshot = -math.inf
        #: When the next message may go, at the byte rate (rule 6).
        self._next_send = -math.inf
        #: Snapshots sent because the backlog overflowed (rule 3).
        self.overflows = 0

    @property
    def pending(self) -> int:
        """Messages' worth waiting to be sent (a due snapshot counts one, each part one)."""
        return len(self._pending) + self._snapshot_due + len(self._parts)

    def deliver(self, event: KvEvent, names: int) -> None:
        """Queue an event of ``names`` block names (synchronous, never blocks)."""
        if self._snapshot_due:
            return  # the snapshot, taken when sent, will cover it
        self._pending.append((event, names))
        self._pending_names += names + 1
        if self._pending_names > self._backlog_limit:
            self.overflows += 1
            self._snapshot_due = True
            self._pending.clear()
            self._pending_names = 0
        self._signal.bump()

    def ask_snapshot(self) -> None:
        """Send a fresh snapshot next, instead of what is pending (a subscriber saw a gap); after
        the snapshot under way and the gap of rule 7."""
        self._snapshot_due = True
        self._pending.clear()
        self._pending_names = 0
        self._signal.bump()

    def ready_at(self, interval: float) -> float:
        """When the next message may be taken (rules 4, 6 and 7); ``inf``: nothing is pending."""
        if self._parts:
            return self._next_send
        if self._snapshot_due:
            gap_over = self._last_snapshot + KV_SNAPSHOT_GAP
            return max(self._next_send, self._last_sent + interval, gap_over)
        if self._pending:
            return max(self._next_send, self._last_sent + interval)
        return math.inf

    def take(self) -> list[KvEvent]:
        """The next message's events, in order: the next part of a snapshot under way, else a
        due snapshot (whole, or its first part), else what is pending (to a subscriber of parts,
        as much as one part holds). Whether it is time is :meth:`ready_at`'s to say."""
        if self._parts:
            return [self._parts.popleft()]
        if self._snapshot_due:
            self._snapshot_due = False
            self._last_snapshot = self._clock()
            snapshot = self._log.snapshot()
            if not self._in_parts:
                return [snapshot]
            first, *rest = snapshot_parts(snapshot)
            self._parts.extend(rest)
            return [first]
        pending = self._pending
        if not self._in_parts:
            events = [event for event, _ in pending]
            pending.clear()
            self._pending_names = 0
            return events
        events = []
        room = KV_PART_NAMES
        while pending and (not events or pending[0][1] + EVENT_COST <= room):
            event, names = pending.popleft()
            events.append(event)
            room -= names + EVENT_COST
            self._pending_names -= names + 1
        return events

    def sent(self, size: int) -> None:
        """A message of ``size`` bytes went out: to a subscriber of parts, the next one waits
        for the byte rate (rule 6)."""
        if self._in_parts:
            self._next_send = self._clock() + size / KV_BYTES_PER_SECOND

    async def next_batch(self, interval: float) -> list[KvEvent]:
        """Wait until a message may go (:meth:`ready_at`), then take it.

        Returns:
            A non-empty list of events, oldest first.
        """
        while True:
            ready = self.ready_at(interval)
            if ready == math.inf:
                self._seen = await self._signal.wait_past(self._seen)
            elif self._clock() < ready:
                await trio.sleep_until(ready)
            else:
                break
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
        """Number and deliver what rank ``dp_rank``'s pool reported, in order (a long chain as
        several events: rule 1)."""
        for kind, parent, names in events:
            for start in range(0, max(len(names), 1), EVENT_NAMES):
                chunk = names if len(names) <= EVENT_NAMES else names[start : start + EVENT_NAMES]
                self.seq += 1
                event: KvEvent
                if kind == STORED:
                    first_parent = parent if start == 0 else names[start - 1]
                    event = KvStored(
                        seq=self.seq, dp_rank=dp_rank, parent=first_parent, blocks=chunk
                    )
                else:
                    event = KvRemoved(seq=self.seq, dp_rank=dp_rank, blocks=chunk)
                self._deliver(event, len(chunk))

    def cleared(self, dp_rank: int) -> None:
        """Number and deliver that rank ``dp_rank``'s cache was emptied."""
        self.seq += 1
        self._deliver(KvCleared(seq=self.seq, dp_rank=dp_rank), 0)

    @contextlib.contextmanager
    def subscribe(
        self, *, parts: bool = False, clock: Callable[[], float] = trio.current_time
    ) -> Iterator[KvSubscription]:
        """A subscription, a snapshot due first, for as long as the ``with`` block runs;
        ``parts``: the subscriber asked for parts (rule 6)."""
        subscription = KvSubscription(
            self, backlog_limit=self._backlog_limit, parts=parts, clock=clock
        )
        self._subscribers.add(subscription)
        try:
            yield subscription
        finally:
            self._subscribers.discard(subscription)

    def _deliver(self, event: KvEvent, names: int) -> None:
        for subscription in self._subscribers:
            subscription.deliver(event, names)
