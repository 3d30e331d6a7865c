"""The frontend's event budget: how many event messages a second it takes from its fleet.

Following a fleet costs the frontend about the same CPU per event message whatever the message
holds (a read, a wake-up, a decode, an update of the fleet), so what it can follow is a number of
messages a second, not of workers. :class:`EventBudget` turns that number into the interval each
worker link gets, and the links keep to it:

1. The budget ``B`` (messages a second, ``--event-budget``) is shared evenly by the ``N`` worker
   links of the pool: each link gets one message every ``N / B`` seconds, never less than 0 and
   never more than ``max_interval`` (past that the fleet is too large for the budget; the
   interval stays at ``max_interval``, so heartbeats still arrive about as often as they are sent
   and no worker looks stale, and the budget is exceeded, which the metrics show).
2. A worker that lists :data:`~shim_common.wire.FEATURE_PUBLISH_INTERVAL` is *asked* for that
   interval in its :class:`~shim_common.wire.Subscribe`; it sends at most one batch per interval
   (at most its own interval: it bounds it below), busy/free edges still at once. Its link reads
   whatever arrives at once.
3. A worker that does not (an older one) is *read* at that interval instead: its link reads one
   socket's worth after each interval and applies only the latest state in it
   (:func:`latest_wins`, the same rule as the worker's mailbox); what the worker sends in between
   waits in the socket, and once the socket is full the worker's own latest-wins mailbox
   replaces what it cannot send. Its busy/free edges therefore wait up to one interval.
4. The interval asked of workers changes only when the wanted one differs from it by more than
   ``resend_share`` (a fleet growing by one worker does not re-subscribe every link), and is
   asked again of each negotiating worker when it does. Without ``--event-budget`` the budget
   itself follows the frontend's measured cost per message (:mod:`frontend_shim._event_cost`,
   which keeps to the same share before it moves it): :meth:`EventBudget.retarget`.
5. The links read at the interval wait for their next read on one :class:`ReadPacer` per pool
   (and so do the links' watchdogs): one timer ticking every ``tick`` seconds wakes every link
   whose time has come, instead of a timer per link per read (a Trio deadline costs tens of
   microseconds to expire, which at thousands of reads a second was a fifth of the frontend's
   core). A link on plain TCP is not even woken: the pacer *calls* its read
   (:meth:`ReadPacer.call_at`), which reads the socket in place and applies what it holds inside
   the pacer's own task, so a read costs a syscall and a decode instead of three task switches
   (park, the receive's checkpoint, the turn); the link's task wakes only when the read needs a
   task (a pong or close reply to write, an error). A link to a worker that does negotiate is
   read as soon as its socket holds bytes, but on the same tick: the pacer *watches* its
   descriptor (:meth:`ReadPacer.watch`, one epoll set of its own, polled without waiting once
   per tick) and calls its read when it is readable, so a busy/free edge waits at most a tick,
   and a read costs no task switch either. The pacer makes at most ``per_slice`` calls per pass
   of the scheduler (rule 6 by other means).
6. Every read of any link takes a turn from the pool's :class:`EventSlices` before the events in
   it are applied: at most ``per_slice`` reads are applied in one pass of the scheduler, then the
   readers left wait for the next pass, so HTTP requests, ``/live``, ``/health`` and the set-up
   of links never wait behind more than one slice of event work.

:class:`EventBudget` and :func:`latest_wins` are sans-IO; :class:`ReadPacer` and
:class:`EventSlices` are the Trio shells of rules 5 and 6.
"""

from __future__ import annotations

import math
import select
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import trio

from shim_common import wire

__all__ = [
    "DEFAULT_EVENT_BUDGET",
    "DEFAULT_EVENTS_PER_SLICE",
    "MAX_BUDGET_INTERVAL",
    "EventBudget",
    "EventSlices",
    "ReadPacer",
    "latest_wins",
]

#: Messages a second the frontend takes from its fleet until it has measured its own cost per
#: message (:mod:`frontend_shim._event_cost`). Measured on the benchmark machine
#: (docs/performance.md, fleet scale): about 65 us of frontend CPU per event message, so 6,000 a
#: second is about 40 % of one core, the rest left for HTTP and the request planes.
DEFAULT_EVENT_BUDGET: Final = 6000.0
#: Reads applied in one pass of the scheduler (rules 5, 6): about 0.2 ms of event work at a time
#: at 25 us a read in place. An HTTP request waits up to a slice at each of its hops (its bytes,
#: its worker's reply): at 24 a slice, completions under a 2,048-worker fleet took 5 ms at the
#: median against 3 ms at 8, for a pass of the scheduler (about 10 us) per slice.
DEFAULT_EVENTS_PER_SLICE: Final = 8
#: The longest interval the budget hands out (seconds): the workers' heartbeat interval, so a
#: worker followed at the budget still looks alive.
MAX_BUDGET_INTERVAL: Final = 1.0
#: Seconds of one tick of the read pacer (rule 5): a paced read is late by at most this much.
DEFAULT_PACER_TICK: Final = 0.01
#: Re-ask the workers only when the wanted interval moved by more than this share (rule 4).
RESEND_SHARE: Final = 0.2


class EventBudget:
    """The interval each worker link gets under a budget of messages a second (sans-IO).

    Args:
        messages_per_second: The budget ``B`` (rule 1); must be positive and finite.
        max_interval: The longest interval handed out (seconds).
        resend_share: How far the wanted interval may drift before it is asked again (rule 4).

    Example::

        budget = EventBudget(6000)
        budget.resize(2048)      # True: a new interval to ask the workers for
        budget.interval          # 0.341...
    """

    __slots__ = ("_links", "_max_interval", "_resend_share", "interval", "messages_per_second")

    def __init__(
        self,
        messages_per_second: float = DEFAULT_EVENT_BUDGET,
        *,
        max_interval: float = MAX_BUDGET_INTERVAL,
        resend_share: float = RESEND_SHARE,
    ) -> None:
        if not (messages_per_second > 0 and math.isfinite(messages_per_second)):
            raise ValueError(f"the event budget must be > 0 and finite, got {messages_per_second}")
        if not max_interval > 0:
            raise ValueError(f"max_interval must be > 0, got {max_interval}")
        #: The budget in force (messages a second, over the whole fleet).
        self.messages_per_second = float(messages_per_second)
        self._max_interval = max_interval
        self._resend_share = resend_share
        self._links = 0
        #: The interval in force (seconds): asked of negotiating workers, used to read the others.
        self.interval = 0.0

    @property
    def links(self) -> int:
        """The links the budget is shared by."""
        return self._links

    def wanted(self, links: int) -> float:
        """The interval rule 1 gives each of ``links`` links (seconds)."""
        return min(self._max_interval, max(0, links) / self.messages_per_second)

    def resize(self, links: int) -> bool:
        """The pool now has ``links`` links; returns True when :attr:`interval` changed (rule 4:
        the negotiating workers are to be asked again)."""
        self._links = links
        wanted = self.wanted(links)
        current = self.interval
        if wanted == current:
            return False
        if current > 0 and abs(wanted - current) <= self._resend_share * current:
            return False
        self.interval = wanted
        return True

    def retarget(self, messages_per_second: float) -> bool:
        """Put a new budget in force (a measured one); returns True when :attr:`interval` changed.

        The interval becomes the one rule 1 gives at once, without rule 4's tolerance: the
        caller only retargets when the budget moved by more than that share already.
        """
        if not (messages_per_second > 0 and math.isfinite(messages_per_second)):
            raise ValueError(f"the event budget must be > 0 and finite, got {messages_per_second}")
        self.messages_per_second = float(messages_per_second)
        wanted = self.wanted(self._links)
        if wanted == self.interval:
            return False
        self.interval = wanted
        return True

    def expected_messages_per_second(self, worker_intervals: Iterable[float]) -> float:
        """The messages a second the fleet sends under :attr:`interval` at most (edges aside),
        given each connected worker's own ``load_publish_interval`` (0: every change; counted as
        the interval, the rate the link reads it at)."""
        total = 0.0
        for own in worker_intervals:
            gap = max(own, self.interval)
            total += 1 / gap if gap > 0 else math.inf
        return total


def latest_wins(batches: Sequence[Sequence[wire.WorkerEvent]]) -> list[wire.WorkerEvent]:
    """The latest state in several event batches of one worker, oldest first (rule 3).

    The worker's mailbox rule, applied to what one read brought: the latest load event per rank
    is kept; a heartbeat repeats every rank, so it supersedes the load events before it (and an
    older heartbeat). What is returned, applied alone, leaves the fleet as applying every batch in
    order would.

    Args:
        batches: The ``events`` of consecutive batches, oldest first.

    Returns:
        The events to apply, in increasing ``seq``.
    """
    if len(batches) == 1:
        return list(batches[0])
    mailbox = wire.Mailbox()
    for batch in batches:
        for event in batch:
            mailbox.put(event)
    return mailbox.take()


class ReadPacer:
    """Wakes readers at their time on one shared tick (rule 5).

    Args:
        tick: Seconds between two looks at the clock; a reader wakes up to one tick late.
        per_slice: Calls (:meth:`call_at`, :meth:`watch`) made in one pass of the scheduler; at
            least 1.
    """

    def __init__(
        self, tick: float = DEFAULT_PACER_TICK, per_slice: int = DEFAULT_EVENTS_PER_SLICE
    ) -> None:
        if not tick > 0:
            raise ValueError(f"tick must be > 0, got {tick}")
        if per_slice < 1:
            raise ValueError(f"per_slice must be at least 1, got {per_slice}")
        self._tick = tick
        self._per_slice = per_slice
        self._slots: dict[int, trio.lowlevel.ParkingLot] = {}
        self._calls: dict[int, list[Callable[[], object]]] = {}
        # Descriptors watched for bytes (Linux: an epoll set of the pacer's own, level-triggered).
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._watched: dict[int, Callable[[], object]] = {}
        #: The last slot whose readers were woken (none before :meth:`run` starts).
        self._done = -1
        self._waiting = trio.Event()
        #: Passes of the scheduler let by between two slices of calls.
        self.yields = 0

    async def wait_until(self, when: float) -> None:
        """Return at ``when`` (``trio.current_time()``), or up to one tick after.

        Returns at once, without a checkpoint, when that time has come already.
        """
        if when <= self._done * self._tick:  # -inf too: a reader's first read
            return
        slot = math.ceil(when / self._tick)
        if slot <= self._done:
            return
        lot = self._slots.get(slot)
        if lot is None:
            lot = self._slots[slot] = trio.lowlevel.ParkingLot()
            self._waiting.set()
        await lot.park()

    def call_at(self, when: float, call: Callable[[], object]) -> None:
        """Have :meth:`run` call ``call()`` at ``when``, or up to one tick after (never sooner
        than the next tick), in the pacer's own task.

        ``call`` must be quick and must not raise: it runs between other calls, with no
        scheduler pass in between (see ``per_slice``).
        """
        if when <= self._done * self._tick:  # -inf too
            slot = self._done + 1
        else:
            slot = max(math.ceil(when / self._tick), self._done + 1)
        calls = self._calls.get(slot)
        if calls is None:
            self._calls[slot] = [call]
            self._waiting.set()
        else:
            calls.append(call)

    @property
    def can_watch(self) -> bool:
        """Whether :meth:`watch` is available (it needs epoll: Linux)."""
        return self._epoll is not None

    def watch(self, fd: int, call: Callable[[], object]) -> None:
        """Have :meth:`run` call ``call()`` on every tick at which ``fd`` is readable, until
        :meth:`unwatch` (same rules for ``call`` as :meth:`call_at`).

        Raises:
            RuntimeError: the pacer cannot watch (:attr:`can_watch`).
        """
        if self._epoll is None:
            raise RuntimeError("watching descriptors needs epoll")
        self._epoll.register(fd, select.EPOLLIN)
        self._watched[fd] = call
        self._waiting.set()

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd``; call it before the descriptor is closed."""
        epoll = self._epoll
        # After run() ended the set is closed, and with it every registration.
        if self._watched.pop(fd, None) is not None and epoll is not None and not epoll.closed:
            epoll.unregister(fd)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Wake the readers and make the calls whose time has come, once per tick, until
        cancelled."""
        task_status.started()
        try:
            await self._run()
        finally:
            if self._epoll is not None:
                self._epoll.close()

    async def _run(self) -> None:
        slept_to = -1
        while True:
            if not self._slots and not self._calls and not self._watched:
                self._waiting = trio.Event()
                await self._waiting.wait()
            # The slot slept to is due even when the clock's float lands a hair before it.
            due = max(slept_to, math.floor(trio.current_time() / self._tick))
            if due - self._done > len(self._slots) + len(self._calls):
                slots = sorted(slot for slot in {*self._slots, *self._calls} if slot <= due)
            else:
                slots = list(range(self._done + 1, due + 1))
            self._done = due
            calls: list[Callable[[], object]] = []
            for slot in slots:
                lot = self._slots.pop(slot, None)
                if lot is not None:
                    lot.unpark_all()
                calls.extend(self._calls.pop(slot, ()))
            if self._watched:
                assert self._epoll is not None
                watched = self._watched
                for fd, _ in self._epoll.poll(0):
                    call = watched.get(fd)
                    if call is not None:
                        calls.append(call)
            await self._make(calls)
            slept_to = due + 1
            await trio.sleep_until(slept_to * self._tick)

    async def _make(self, calls: list[Callable[[], object]]) -> None:
        per_slice = self._per_slice
        for start in range(0, len(calls), per_slice):
            if start:
                # HTTP and link set-up run between two slices (rule 5).
                await trio.lowlevel.checkpoint()
                self.yields += 1
            for call in calls[start : start + per_slice]:
                call()


class EventSlices:
    """Turns for event work, at most ``per_slice`` per pass of the scheduler (rule 5).

    A reader calls :meth:`turn` before applying what it read. While turns are left it returns at
    once, without a checkpoint; once the slice is used up, readers wait in order until
    :meth:`run` (one task per pool) has let one pass of the scheduler go by (every other runnable
    task, and the I/O that became ready, runs in it) and hands out the next slice.

    Args:
        per_slice: Turns per slice; at least 1.
    """

    def __init__(self, per_slice: int = DEFAULT_EVENTS_PER_SLICE) -> None:
        if per_slice < 1:
            raise ValueError(f"per_slice must be at least 1, got {per_slice}")
        self._per_slice = per_slice
        self._left = per_slice
        self._waiting = trio.lowlevel.ParkingLot()
        self._used_up = trio.Event()
        #: Slices handed out after a wait (how often event work had to yield to the rest).
        self.yields = 0

    async def turn(self) -> None:
        """Return when this reader may apply one read's events."""
        if self._left > 0:
            self._left -= 1
            if self._left == 0:
                self._used_up.set()
            return
        await self._waiting.park()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hand out slices until cancelled."""
        task_status.started()
        while True:
            await self._used_up.wait()
            self._used_up = trio.Event()
            # One pass of the scheduler: HTTP and link set-up run before the next slice.
            await trio.lowlevel.checkpoint()
            self.yields += 1
            woken = len(self._waiting.unpark(count=self._per_slice))
            self._left = self._per_slice - woken
            if self._left == 0:
                self._used_up.set()
