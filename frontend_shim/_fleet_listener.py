"""Whom a worker link tells about its worker: the listener protocols of :mod:`frontend_shim._links`.

:class:`FleetListener` hears a link's sessions and events (the frontend's load state glue,
:class:`~frontend_shim._fleet_bridge.FleetBridge`); :class:`KvEventsListener` one that also takes
KV events, for which a link subscribes only then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from frontend_shim._discovery import WorkerKey
from shim_common import wire

__all__ = ["FleetListener", "KvEventsListener"]


class FleetListener(Protocol):
    """What a link tells about its worker (the frontend's load state glue).

    Calls are synchronous and come from the links' reader tasks: keep them short and
    non-blocking. For one key the order is always ``worker_up``, any number of
    ``worker_events`` and ``worker_lagging``, ``worker_down``, and so on; ``now`` is
    ``trio.current_time()``.
    """

    def worker_up(self, key: WorkerKey, config: wire.RuntimeConfig, now: float) -> None:
        """A session to the worker at ``key`` started; ``config`` is from its hello."""

    def worker_events(self, key: WorkerKey, events: Sequence[wire.WorkerEvent], now: float) -> None:
        """One event batch from the worker at ``key``, oldest first."""

    def worker_lagging(self, key: WorkerKey, lagging: bool, now: float) -> None:
        """The worker's event stream fell behind by more than the bound, or caught up."""

    def worker_down(self, key: WorkerKey, now: float) -> None:
        """The session ended (lost, or the link was stopped); its open requests have failed."""

    def thresholds(self, model: str) -> wire.BusyThresholds | None:
        """The busy thresholds of ``model`` to send to a worker that takes them."""


@runtime_checkable
class KvEventsListener(Protocol):
    """A :class:`FleetListener` that also takes KV events (rule 7 of
    :mod:`frontend_shim._links`); a link subscribes to them only for a listener that does."""

    def worker_kv_events(self, key: WorkerKey, events: Sequence[wire.KvEvent], now: float) -> bool:
        """KV events of a subscribed worker, in order; ``True`` asks for a fresh snapshot."""
