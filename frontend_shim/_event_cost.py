"""What one event message costs this frontend, and the event budget that follows from it.

Without ``--event-budget`` the frontend sets its budget (:mod:`frontend_shim._event_budget`) to
the messages a second that fit in a share of one core, :data:`DEFAULT_CORE_SHARE`, at the cost
per message it measures on itself. :class:`EventCostMeter` is the sans-IO estimator; the pool
(:mod:`frontend_shim._pool`) feeds it every ``window`` seconds the CPU time of the reads made
in place and of the whole process, and the event messages and connection attempts its links
have counted so far (running totals).

An event message, for the budget, is one *read* of a worker's event plane: a negotiating
worker's batch, read as it comes, or whatever one paced read of a worker that does not
negotiate finds (one batch or several, or none). The budget hands out reads, so the pool
counts reads (``LinkStats.event_reads``), not batches: counting batches let a fleet of paced
workers, whose reads bring more than one, use more of the core than the share.

What is measured, and why: **the CPU the reads themselves take, where they can be timed**.
On plain TCP the pacer reads every event plane in place, in its own task, and times each slice
of reads with the thread's CPU clock (:mod:`frontend_shim._pacer`, rule 7): nothing else runs
inside a slice, so the time is the reads' own (the syscall, the websocket framing, the decode,
latest wins, the update of the fleet). What it leaves out is the pacer's tick (a timer and a
task switch a tick, whatever the fleet sends) and a pass of the scheduler per slice, a few
microseconds against the 20-60 us of a read. A window whose reads were mostly made that way
(:data:`DIRECT_SHARE` of them) is measured by them alone. Otherwise (links that read in their
own task: TLS, or no epoll), where a clock around the synchronous part would miss the wake-up,
the receive and the framing inside an ``await``, the window falls back to **the process's CPU
time divided by the reads** (``time.process_time()``), an upper bound: it also charges the
frontend's other work (HTTP, the request planes, scrapes) to the messages. That charge is what
held the budget at its floor under HTTP load before the reads were timed: 17 % of a core serving
completions over 76 reads a second measured 2.2 ms a read (480 us after the clamp), so the
budget sat at 1,000 a second in every loaded run while a read cost tens of microseconds. Windows
in which many links connected or tried to (TLS, hellos, and the teardown of the session before:
costly, not event work) are not counted.

Rules of :meth:`EventCostMeter.sample` (one call per window, with running totals):

1. A total that went down (a link was stopped and its counters went with it) starts a new
   window; nothing is learned.
2. A window in which connection attempts (sessions that came up and attempts that failed; a
   session that ends is followed by one) exceed ``setup_share`` of the links (at least one) is
   dropped, and a new one starts.
3. A window with fewer than ``min_messages`` messages goes on (the next call extends it) until
   it has them, or until it is ``max_window`` seconds old, when it is dropped: a few messages
   over a long quiet spell would charge the whole idle cost to them.
4. A counted window gives one sample, CPU seconds over messages (the timed reads' own when they
   made :data:`DIRECT_SHARE` of the window's reads, else the process's over all of them),
   clamped to the costs that map inside ``[min_budget, max_budget]``; the estimate
   :attr:`cost` is the median of the last ``samples`` samples, once there are
   ``first_samples`` of them (0 before). A median, not a
   mean: the windows right after start-up and those with a burst of HTTP work are outliers of
   several times the steady cost (measured: 40 to 450 us a message at 2,048 workers, where the
   steady cost was 85-90 us), and one of them must not move the budget; a step in the cost
   is followed once it holds for more than half of the samples.
5. The budget wanted is ``core_share / cost``, clamped to ``[min_budget, max_budget]``;
   :attr:`budget` takes it only when it differs from the budget in force by more than
   ``change_share`` of it, and at most once every ``hold`` seconds (the interval asked of
   every negotiating worker is not re-asked for noise: a burst of HTTP work is charged to the
   messages of its window, the median of rule 4 drops it, and this bounds what is left).

Example::

    meter = EventCostMeter(first_samples=1)
    meter.sample(now=0.0, cpu=1.0, messages=0, connects=0, links=2048)   # the first window opens
    meter.sample(now=2.0, cpu=1.5, messages=10_000, connects=0, links=2048)  # True: 50 us
    meter.budget                                     # 9600.0 (at once): 0.48 of a core / 50 us
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Final

from frontend_shim._event_budget import DEFAULT_EVENT_BUDGET, RESEND_SHARE

__all__ = [
    "DEFAULT_CORE_SHARE",
    "DEFAULT_COST_WINDOW",
    "DEFAULT_HOLD",
    "DEFAULT_MIN_WINDOW_MESSAGES",
    "MAX_MEASURED_BUDGET",
    "MIN_MEASURED_BUDGET",
    "EventCostMeter",
]

#: The share of one core the measured budget gives to following the fleet: to the reads'
#: own CPU where they are timed (whatever the frontend's HTTP work takes besides), to the
#: whole process where the process's CPU is the measure (TLS links, see the top of the module).
#: At 2,048 workers of the previous protocol a read costs about 40 us, and every hundredth of
#: a core is about 250 reads a second, about 4 ms off the interval and so off the busy/free
#: edges of workers read at it.
DEFAULT_CORE_SHARE: Final = 0.48
#: The measured budget never goes below this (messages a second): at 1,000 workers the
#: interval is then 1 s, the most the budget hands out anyway.
MIN_MEASURED_BUDGET: Final = 1000.0
#: Nor above this: 4.5 us a message, well under what a decode alone costs in Python.
MAX_MEASURED_BUDGET: Final = 100_000.0
#: Seconds between two looks at the CPU clock (the pool's period; a window is one or more).
DEFAULT_COST_WINDOW: Final = 2.0
#: Messages a window needs to give a sample (rule 3).
DEFAULT_MIN_WINDOW_MESSAGES: Final = 200
#: Seconds after which a window still short of messages is dropped (rule 3).
MAX_WINDOW: Final = 30.0
#: Samples the median is taken over (rule 4): 10 s of windows.
DEFAULT_SAMPLES: Final = 5
#: Samples needed before the first estimate (rule 4): the median of three drops one outlier.
DEFAULT_FIRST_SAMPLES: Final = 3
#: Seconds a budget stays in force at least (rule 5): five windows of the pool's period.
DEFAULT_HOLD: Final = 5 * DEFAULT_COST_WINDOW
#: Share of the links that may try to connect in a counted window (rule 2).
SETUP_SHARE: Final = 0.01
#: Share of a window's reads that must have been timed for the window to be measured by them
#: (rule 4): reads out of a link's own task are the rest.
DIRECT_SHARE: Final = 0.9


class EventCostMeter:
    """The cost of an event message, estimated from CPU time and messages (sans-IO).

    Args:
        core_share: The share of one core the budget is for (rule 5); in (0, 1].
        initial_budget: The budget in force before the first sample.
        min_budget: The lowest budget handed out (messages a second).
        max_budget: The highest.
        samples: Samples the median is taken over (rule 4); at least 1.
        first_samples: Samples needed for the first estimate (rule 4); 1 to ``samples``.
        min_messages: Messages a window needs (rule 3); at least 1.
        max_window: Seconds a window may wait for them (rule 3).
        setup_share: Share of the links that may try to connect in a window (rule 2).
        change_share: How far the wanted budget may drift before it is taken (rule 5).
        hold: Seconds a budget stays in force at least (rule 5).
    """

    __slots__ = (
        "_change_share",
        "_core_share",
        "_first_samples",
        "_hold",
        "_max_budget",
        "_max_window",
        "_min_budget",
        "_min_messages",
        "_moved_at",
        "_samples",
        "_setup_share",
        "_start",
        "budget",
        "cost",
        "windows",
    )

    def __init__(
        self,
        *,
        core_share: float = DEFAULT_CORE_SHARE,
        initial_budget: float = DEFAULT_EVENT_BUDGET,
        min_budget: float = MIN_MEASURED_BUDGET,
        max_budget: float = MAX_MEASURED_BUDGET,
        samples: int = DEFAULT_SAMPLES,
        first_samples: int = DEFAULT_FIRST_SAMPLES,
        min_messages: int = DEFAULT_MIN_WINDOW_MESSAGES,
        max_window: float = MAX_WINDOW,
        setup_share: float = SETUP_SHARE,
        change_share: float = RESEND_SHARE,
        hold: float = DEFAULT_HOLD,
    ) -> None:
        if not 0 < core_share <= 1:
            raise ValueError(f"core_share must be in (0, 1], got {core_share}")
        if not (0 < min_budget <= max_budget and math.isfinite(max_budget)):
            raise ValueError(
                f"need 0 < min_budget <= max_budget < inf, got {min_budget} and {max_budget}"
            )
        if not 1 <= first_samples <= samples:
            raise ValueError(f"need 1 <= first_samples <= samples, got {first_samples}, {samples}")
        if min_messages < 1:
            raise ValueError(f"min_messages must be at least 1, got {min_messages}")
        if not (initial_budget > 0 and math.isfinite(initial_budget)):
            raise ValueError(f"initial_budget must be > 0 and finite, got {initial_budget}")
        self._core_share = core_share
        self._min_budget = min_budget
        self._max_budget = max_budget
        self._samples: collections.deque[float] = collections.deque(maxlen=samples)
        self._first_samples = first_samples
        self._min_messages = min_messages
        self._max_window = max_window
        self._setup_share = setup_share
        self._change_share = change_share
        self._hold = hold
        # When the budget last moved (-inf: never; the first estimate is taken at once).
        self._moved_at = -math.inf
        # The totals at the start of the window (now, cpu, messages, connects, timed cpu, timed
        # messages); None: none yet.
        self._start: tuple[float, float, int, int, float, int] | None = None
        #: The estimated CPU seconds per event message (0: not measured yet).
        self.cost = 0.0
        #: The budget in force (messages a second).
        self.budget = float(initial_budget)
        #: Windows counted so far.
        self.windows = 0

    def wanted(self) -> float:
        """The budget rule 5 gives at the current estimate (the one in force before any)."""
        if self.cost <= 0:
            return self.budget
        return min(self._max_budget, max(self._min_budget, self._core_share / self.cost))

    def sample(
        self,
        *,
        now: float,
        cpu: float,
        messages: int,
        connects: int,
        links: int,
        timed_cpu: float = 0.0,
        timed_messages: int = 0,
    ) -> bool:
        """Take the running totals at ``now``; returns True when :attr:`budget` changed.

        Args:
            now: A monotonic clock (seconds).
            cpu: The process's CPU time so far (seconds).
            messages: Event messages decoded so far, over all links.
            connects: Connection attempts so far (sessions up and attempts failed), over all
                links.
            links: The links now.
            timed_cpu: The CPU seconds the timed reads (in place) took so far.
            timed_messages: The timed reads so far, part of ``messages``.
        """
        start = self._start
        totals = (now, cpu, messages, connects, timed_cpu, timed_messages)
        if start is None:
            self._start = totals
            return False
        began, cpu0, messages0, connects0, timed_cpu0, timed0 = start
        spent, taken, started = cpu - cpu0, messages - messages0, connects - connects0
        timed_spent, timed = timed_cpu - timed_cpu0, timed_messages - timed0
        if min(spent, taken, started, timed_spent, timed) < 0:  # rule 1
            self._start = totals
            return False
        if started > max(1.0, self._setup_share * links):  # rule 2
            self._start = totals
            return False
        if taken < self._min_messages:  # rule 3
            if now - began >= self._max_window:
                self._start = totals
            return False
        self._start = totals
        # Rule 4: the timed reads' own cost when they are the window's reads; a sample outside
        # the costs the budget range maps to says no more than its edge.
        if timed >= DIRECT_SHARE * taken:
            spent, taken = timed_spent, timed
        lowest = self._core_share / self._max_budget
        highest = self._core_share / self._min_budget
        cost = min(highest, max(lowest, spent / taken))
        self._samples.append(cost)
        self.windows += 1
        if len(self._samples) < self._first_samples:
            return False
        self.cost = statistics.median(self._samples)
        wanted = self.wanted()
        if abs(wanted - self.budget) <= self._change_share * self.budget:  # rule 5
            return False
        if now - self._moved_at < self._hold:
            return False
        self.budget = wanted
        self._moved_at = now
        return True
