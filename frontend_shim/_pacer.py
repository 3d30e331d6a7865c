"""The pacer: when the frontend reads its workers' event planes, and in whose task.

Following a fleet of thousands of workers is thousands of small reads a second; what they cost
is mostly not the decoding but the waking (a Trio deadline costs tens of microseconds to expire,
a task switch about as much), so the reads are scheduled here, away from the links that own
the sockets. Rules:

1. One :class:`ReadPacer` per pool keeps one timer: a tick every ``tick`` seconds. At each tick
   it wakes the tasks parked on it whose time has come (:meth:`ReadPacer.wait_until`: the links'
   watchdogs, and the reads made in a link's task), makes the *timed calls* whose time has come
   (:meth:`ReadPacer.call_at`), and the calls of the *watched descriptors* that are readable
   (:meth:`ReadPacer.watch`: an epoll set of the pacer's own, level-triggered, polled without
   waiting once per tick). A wake-up or a call is late by at most one tick, and never sooner
   than it was asked for.
2. Calls run in the pacer's own task, one after another, at most ``per_slice`` of them in one
   pass of the scheduler; between two slices the pacer lets one pass go by (HTTP requests,
   ``/live``, ``/health`` and the set-up of links run in it), counted in
   :attr:`ReadPacer.yields`. A call must be quick and must not raise. A call that did more than
   a read's usual work says so (:meth:`ReadPacer.spend`: the KV block names it applied), and a
   slice also ends once ``names_per_slice`` of them were spent, so a slice of reads that bring
   KV events in parts is bounded in work, not only in reads.
3. A link on plain TCP has its event plane read *in place* (:class:`InPlaceReads`): the read is a
   call of the pacer that takes what the socket holds without waiting
   (:meth:`~frontend_shim._connection.PlaneConnection.messages_now`) and applies it, so a read
   costs a syscall and a decode instead of three task switches (park, the receive's checkpoint,
   the turn). Two ways, fixed for the session: *paced* (a worker that does not negotiate its
   interval) is a timed call once per budget interval, which asks for the next one an interval
   on whether or not it found anything (the reads a second stay the budget's, and an edge waits
   at most one interval); *watched* (any other worker) is called on each tick at which its
   socket holds bytes (an edge waits at most a tick).
4. The link's task sleeps while the pacer reads for it, and wakes only when a read needs a task:
   a pong or close reply is owed (no read is made until it is written), or the read failed (the
   task raises the failure, which ends the session). No read is made once the session is over.
5. :meth:`InPlaceReads.catch_up` reads out of turn: what the socket holds now is applied at
   once, and the pacing goes on as before. The link calls it before it hands over a refusal its
   worker sent (:mod:`frontend_shim._links`, rule 6), so the events the worker sent before the
   refusal are applied before the refusal is acted on, as they would have been had the plane been
   read at once.
6. A link whose event plane is not read in place (TLS, no pacer, no epoll) reads in its own task,
   and each read takes a turn of the pool's :class:`EventSlices` before it is applied: at most
   ``per_slice`` turns in one pass of the scheduler, then the readers left wait for the next pass
   (rule 2 by other means); :meth:`EventSlices.spend` counts a read's KV names against the
   slice's turns the same way.
7. What the reads in place cost is timed where they run: the thread's CPU time around each
   slice of calls, and around each read out of turn (:attr:`ReadPacer.event_cpu` over
   :attr:`ReadPacer.event_reads`), two clock reads per slice of up to ``per_slice`` reads. It
   is what the event budget is measured by (:mod:`frontend_shim._event_cost`): nothing else
   runs in a slice, so nothing else is charged to it.

All three classes are Trio shells; what a read applies is decided by the link
(:mod:`frontend_shim._links`) and the budget (:mod:`frontend_shim._event_budget`, sans-IO).
"""

from __future__ import annotations

import math
import select
import time
from collections.abc import Callable
from typing import Final

import trio

from frontend_shim._connection import PlaneConnection
from frontend_shim._event_budget import EventBudget
from frontend_shim._lag import LagMeter
from frontend_shim._request_plane import LinkStats

__all__ = [
    "DEFAULT_EVENTS_PER_SLICE",
    "DEFAULT_NAMES_PER_SLICE",
    "DEFAULT_PACER_TICK",
    "EventSlices",
    "InPlaceReads",
    "ReadPacer",
]

#: Reads applied in one pass of the scheduler (rules 2, 6): about 0.2 ms of event work at a time
#: at 25 us a read in place. An HTTP request waits up to a slice at each of its hops (its bytes,
#: its worker's reply): at 24 a slice, completions under a 2,048-worker fleet took 5 ms at the
#: median against 3 ms at 8, for a pass of the scheduler (about 10 us) per slice.
DEFAULT_EVENTS_PER_SLICE: Final = 8
#: Seconds of one tick of the read pacer (rule 1): a paced read is late by at most this much.
DEFAULT_PACER_TICK: Final = 0.01
#: KV block names applied in one pass of the scheduler at most (rule 2), beyond the one read
#: that passes it: two parts of ``wire.KV_PART_NAMES``, about 1-2 ms of work.
DEFAULT_NAMES_PER_SLICE: Final = 4096


class ReadPacer:
    """Wakes readers and makes calls at their time on one shared tick (rules 1, 2).

    Args:
        tick: Seconds between two looks at the clock; a reader wakes up to one tick late.
        per_slice: Calls (:meth:`call_at`, :meth:`watch`) made in one pass of the scheduler; at
            least 1.
        names_per_slice: KV block names spent (:meth:`spend`) in one pass at most.
    """

    def __init__(
        self,
        tick: float = DEFAULT_PACER_TICK,
        per_slice: int = DEFAULT_EVENTS_PER_SLICE,
        names_per_slice: int = DEFAULT_NAMES_PER_SLICE,
    ) -> None:
        if not tick > 0:
            raise ValueError(f"tick must be > 0, got {tick}")
        if per_slice < 1:
            raise ValueError(f"per_slice must be at least 1, got {per_slice}")
        self._tick = tick
        self._per_slice = per_slice
        self._names_per_slice = names_per_slice
        #: KV names spent in the slice under way (rule 2).
        self._spent = 0
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
        #: Reads in place made (calls, and reads out of turn), and the thread's CPU seconds they
        #: took (rule 7).
        self.event_reads = 0
        self.event_cpu = 0.0

    def count_read(self, cpu: float) -> None:
        """Count a read in place made out of turn, which took ``cpu`` seconds (rule 7)."""
        self.event_reads += 1
        self.event_cpu += cpu

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

    def spend(self, names: int) -> None:
        """The call under way applied ``names`` KV block names (rule 2)."""
        self._spent += names

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
        clock = time.thread_time
        made = 0
        self._spent = 0
        began = clock()
        for call in calls:
            if made >= per_slice or self._spent >= self._names_per_slice:
                # Rule 7: nothing but these calls ran since `began`.
                self.event_cpu += clock() - began
                self.event_reads += made
                # HTTP and link set-up run between two slices (rule 2).
                await trio.lowlevel.checkpoint()
                self.yields += 1
                made = 0
                self._spent = 0
                began = clock()
            call()
            made += 1
        self.event_cpu += clock() - began
        self.event_reads += made


class EventSlices:
    """Turns for event work read in a link's task, at most ``per_slice`` per pass of the
    scheduler (rule 6).

    A reader calls :meth:`turn` before applying what it read. While turns are left it returns at
    once, without a checkpoint; once the slice is used up, readers wait in order until
    :meth:`run` (one task per pool) has let one pass of the scheduler go by (every other runnable
    task, and the I/O that became ready, runs in it) and hands out the next slice.

    Args:
        per_slice: Turns per slice; at least 1.
        names_per_slice: KV block names spent (:meth:`spend`) in one slice at most.
    """

    def __init__(
        self,
        per_slice: int = DEFAULT_EVENTS_PER_SLICE,
        names_per_slice: int = DEFAULT_NAMES_PER_SLICE,
    ) -> None:
        if per_slice < 1:
            raise ValueError(f"per_slice must be at least 1, got {per_slice}")
        self._per_slice = per_slice
        self._names_per_turn = max(1, names_per_slice // per_slice)
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

    def spend(self, names: int) -> None:
        """The reader that took the last turn applied ``names`` KV block names: they use up
        the slice's turns as reads would (rule 6)."""
        turns = names // self._names_per_turn
        if turns and self._left > 0:
            self._left = max(0, self._left - turns)
            if self._left == 0:
                self._used_up.set()

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


class InPlaceReads:
    """The event plane of a link read in place by the pool's pacer (rules 3 to 5).

    Two ways, fixed for the session: *paced* (a worker that does not negotiate the interval), the
    pacer calls :meth:`read` once per budget interval and the read asks for the next call one
    interval on, whether or not it found anything (what arrives meanwhile waits for that read:
    an edge waits at most one interval either way, and the reads a second stay the budget's);
    *watched* (any other worker), the pacer calls :meth:`read` on each tick at which the socket
    holds bytes. Either way the read runs in the pacer's task, takes what the socket holds
    without waiting and applies it. The link's task (:meth:`run`) sleeps meanwhile and is woken
    only when a read needs it: a pong or close reply is owed (no read is made until it is
    written), or the read failed (it raises the failure, which ends the session).
    """

    __slots__ = (
        "_apply",
        "_budget",
        "_error",
        "_events",
        "_lag",
        "_pacer",
        "_stats",
        "_stopped",
        "_wake",
    )

    def __init__(
        self,
        events: PlaneConnection,
        apply: Callable[[list[bytes]], None],
        stats: LinkStats,
        pacer: ReadPacer,
        *,
        paced_by: EventBudget | None,
        lag: LagMeter,
    ) -> None:
        self._events = events
        self._apply = apply
        self._stats = stats
        self._pacer = pacer
        self._budget = paced_by
        self._lag = lag
        self._wake = trio.Event()
        self._error: Exception | None = None
        self._stopped = False

    def _next_after(self, now: float) -> None:
        assert self._budget is not None
        interval = self._budget.interval
        self._lag.allowance = interval
        self._pacer.call_at(now + interval, self.read)

    def read(self) -> None:
        """One read (called by the pacer; never raises, never waits)."""
        if self._take() and self._budget is not None:
            self._next_after(trio.current_time())

    def catch_up(self) -> None:
        """Read what the socket holds now, out of turn (never raises, never waits).

        Before the frontend acts on a reply the worker sent after some events (a rejection
        marks the worker overloaded, and an event applied after the mark clears it), those
        events are applied first, as they would have been had the plane been read at once.
        """
        began = time.thread_time()
        self._take()
        self._pacer.count_read(time.thread_time() - began)

    def _take(self) -> bool:
        """Read and apply what the socket holds; False when the task is to be woken instead
        (or nothing may be read: a reply is owed, the read failed, the session is over)."""
        events = self._events
        if self._stopped or self._error is not None or events.owes_reply:
            return False
        self._stats.event_reads += 1
        try:
            messages = events.messages_now()
            if messages:
                self._apply(messages)
        except Exception as exc:  # the link's task raises it (rule 4)
            self._error = exc
            self._wake.set()
            return False
        if events.owes_reply:
            self._wake.set()
            return False
        return True

    async def run(self) -> None:
        """Serve the reads' needs until one fails (always ends by raising)."""
        events = self._events
        pacer = self._pacer
        paced = self._budget is not None
        if paced:
            pacer.call_at(trio.current_time(), self.read)
        else:
            pacer.watch(events.fileno, self.read)
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                if self._error is not None:
                    raise self._error
                # A close's reply goes out here; the next read then raises PlaneClosed.
                await events.send_owed()
                if paced:
                    self._next_after(trio.current_time())
        finally:
            self._stopped = True
            if not paced:
                pacer.unwatch(events.fileno)
