"""A worker link's KV events: whether a session asks for them, and what they may cost it.

The :class:`~frontend_shim._links.WorkerLink` reads the event plane; :class:`KvFeed` decides what
the KV batches it finds become (rules 7 and 8 of :mod:`frontend_shim._links`, in full here):

1. Asking. A session asks for KV events (its ``Subscribe`` says ``kv_events``) when the link is
   set to (``--router-mode kv`` with KV events), its listener takes them, and the worker lists
   :data:`wire.FEATURE_KV_EVENTS`; in parts (``kv_parts``) when the worker also lists
   :data:`wire.FEATURE_KV_PARTS`. An older worker (no parts) sends its whole cache in one
   message, so it is asked only when that fits
   (:func:`~frontend_shim._worker_hello.kv_message_bytes`; the log says so once, at INFO, when
   it does not), and a worker that went past its budget is not asked for
   :data:`~frontend_shim._kv_budget.REFUSAL_SECONDS`. A worker not asked is routed on the
   router's own guesses (rule 2 of :mod:`frontend_shim._kv_index`).
2. Applying. The KV batches one read brings go to the listener's ``worker_kv_events`` in order,
   never coalesced, in the same read as the load events (so within the event budget); batches
   from a worker not asked are dropped. Events out of the protocol's order
   (:class:`~frontend_shim._kv_index.KvStreamError`) end the session as a breach. The block
   names applied are spent on the pool's pacer (or its event slices), so that a slice of reads is
   bounded in KV work too (:mod:`frontend_shim._pacer`, rules 2 and 6).
3. Paying. Every KV batch a read brings, asked for or not, is charged to the session's
   :class:`~frontend_shim._kv_budget.KvBudget`: its bytes, and the CPU its decoding and applying
   took on the thread's clock. Past the budget the session ends: close code 1008 with the reason,
   a warning in the log, ``LinkStats.kv_budget_closes``, and no KV events asked of the worker for
   a while (rule 1).
4. Resyncing. When the listener saw a gap, a ``Subscribe`` with ``kv_snapshot`` goes from a task
   of the link's own (a read never waits), at most one every
   :data:`~frontend_shim._kv_index.SNAPSHOT_RETRY` seconds: gaps seen meanwhile ask once, when
   that time is over, so a worker that makes gaps on purpose gets one ask a period.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable

import trio

from frontend_shim._connection import PlaneConnection, ProtocolError
from frontend_shim._discovery import WorkerKey
from frontend_shim._fleet_listener import FleetListener, KvEventsListener
from frontend_shim._kv_budget import CLOSE_OVER_BUDGET, REFUSAL_SECONDS, KvBudget
from frontend_shim._kv_index import SNAPSHOT_RETRY, KvStreamError
from frontend_shim._pacer import EventSlices, ReadPacer
from frontend_shim._request_plane import LinkStats
from frontend_shim._worker_hello import kv_message_bytes
from shim_common import wire

__all__ = ["KvBudgetExceeded", "KvFeed"]

logger = logging.getLogger(__name__)


class KvBudgetExceeded(ProtocolError):
    """The worker's KV events went past the session's budget (rule 3)."""


class KvFeed:
    """The KV events of one worker link, session after session (rules at the top of the module).

    Args:
        key: the worker's address (for the log and the listener).
        listener: who hears about the worker; it takes KV events if it is a
            :class:`~frontend_shim._fleet_listener.KvEventsListener`.
        wanted: the link is set to ask for KV events (``LinkSettings.kv_events``).
        stats: the link's counters.
        pacer: the pool's pacer, or ``None``.
        slices: the pool's event slices, or ``None``.
    """

    def __init__(
        self,
        key: WorkerKey,
        listener: FleetListener,
        *,
        wanted: bool,
        stats: LinkStats,
        pacer: ReadPacer | None = None,
        slices: EventSlices | None = None,
    ) -> None:
        self._key = key
        self._listener = listener if wanted and isinstance(listener, KvEventsListener) else None
        self._stats = stats
        self._pacer = pacer
        self._slices = slices
        #: Whether the current session asked for the worker's KV events (rule 1).
        self.subscribed = False
        #: Whether the worker of the current session sends them in parts (rule 1).
        self.parts = False
        self._target: KvEventsListener | None = None
        self._budget = KvBudget(-math.inf)
        #: Until when the worker is asked for no KV events (rule 3).
        self._refused_until = -math.inf
        self._too_large_said = False
        self._gap = trio.Event()

    def begin(self, hello: wire.Hello, now: float) -> int:
        """A session came up with ``hello``: decide whether it asks for KV events (rule 1).

        Returns:
            The room one message of KV events takes in the event plane's bound (bytes; 0: none
            are asked for).
        """
        self.parts = wire.FEATURE_KV_PARTS in hello.features
        self._budget = KvBudget(now)
        self._gap = trio.Event()
        self._target = None
        room = None
        if self._listener is not None and wire.FEATURE_KV_EVENTS in hello.features:
            room = kv_message_bytes(hello.config, parts=self.parts)
            if room is None:
                self._say_too_large(hello.config)
            elif now >= self._refused_until:
                self._target = self._listener
        self.subscribed = self._target is not None
        return room if self.subscribed and room is not None else 0

    def _say_too_large(self, config: wire.RuntimeConfig) -> None:
        if self._too_large_said:
            return
        self._too_large_said = True
        logger.info(
            "worker %s sends KV events whole, and its cache of %d blocks by %d ranks would not "
            "fit one message: not asking for them (it is routed on the router's guesses); a "
            "worker of this version sends them in parts",
            self._key,
            config.kv_total_blocks,
            config.data_parallel_size,
        )

    def clock(self) -> float:
        """The thread's CPU clock, when this session's KV work is measured (rule 3), else 0."""
        return time.thread_time() if self.subscribed else 0.0

    def take(
        self,
        events: list[wire.KvEvent],
        size: int,
        started: float,
        now: float,
        plane: PlaneConnection | None,
    ) -> None:
        """Apply the KV events of one read (``size`` bytes of messages, read from ``started`` on
        :meth:`clock`) and charge them (rules 2 and 3).

        Raises:
            ProtocolError: the events break the protocol's order.
            KvBudgetExceeded: past the budget; ``plane`` is set to close with 1008 and why.
        """
        target = self._target
        cpu = 0.0
        if target is not None:
            try:
                if target.worker_kv_events(self._key, events, now):
                    self._gap.set()
            except KvStreamError as exc:
                self._stats.protocol_errors += 1
                raise ProtocolError(f"KV events out of the protocol's order: {exc}") from exc
            names = _block_names(events)
            if self._pacer is not None:
                self._pacer.spend(names)
            elif self._slices is not None:
                self._slices.spend(names)
            cpu = time.thread_time() - started
        over = self._budget.charge(now=now, size=size, cpu=cpu)
        if over is None:
            return
        self._stats.kv_budget_closes += 1
        self._refused_until = now + REFUSAL_SECONDS
        logger.warning(
            "worker %s: %s; closing its session (%d) and asking it for no KV events for %.0f s",
            self._key,
            over,
            CLOSE_OVER_BUDGET,
            REFUSAL_SECONDS,
        )
        if plane is not None:
            plane.close_with(CLOSE_OVER_BUDGET, over)
        raise KvBudgetExceeded(over)

    async def resync(
        self,
        ask: Callable[[], Awaitable[None]],
        wait_until: Callable[[float], Awaitable[None]],
    ) -> None:
        """Ask for a fresh snapshot after each gap, at most one every :data:`SNAPSHOT_RETRY`
        seconds (rule 4); runs for the session."""
        while True:
            await self._gap.wait()
            self._gap = trio.Event()
            self._stats.kv_snapshots_asked += 1
            await ask()
            await wait_until(trio.current_time() + SNAPSHOT_RETRY)


def _block_names(events: list[wire.KvEvent]) -> int:
    """The block names in KV events: the work of applying them (rule 2)."""
    names = 0
    for event in events:
        if isinstance(event, wire.KvSnapshot):
            names += sum(map(len, event.ranks))
        elif not isinstance(event, wire.KvCleared):
            names += len(event.blocks)
    return names
