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
5. How the links read, and when, is the pacer's (:mod:`frontend_shim._pacer`): one timer per
   pool for every paced read and every watchdog, reads made in place in the pacer's task on
   plain TCP, and event work handed out in slices so that HTTP requests, ``/live``,
   ``/health`` and the set-up of links never wait behind more than one slice of it.

:class:`EventBudget` and :func:`latest_wins` are sans-IO.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Final

from shim_common import wire

__all__ = [
    "DEFAULT_EVENT_BUDGET",
    "MAX_BUDGET_INTERVAL",
    "EventBudget",
    "latest_wins",
]

#: Messages a second the frontend takes from its fleet until it has measured its own cost per
#: message (:mod:`frontend_shim._event_cost`). Measured on the benchmark machine
#: (docs/performance.md, fleet scale): about 65 us of frontend CPU per event message, so 6,000 a
#: second is about 40 % of one core, the rest left for HTTP and the request planes.
DEFAULT_EVENT_BUDGET: Final = 6000.0
#: The longest interval the budget hands out (seconds): the workers' heartbeat interval, so a
#: worker followed at the budget still looks alive.
MAX_BUDGET_INTERVAL: Final = 1.0
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
