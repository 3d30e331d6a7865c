"""Which link speaks for which worker id, in an HTTP process whose host keeps the fleet.

The host answers a pick with a worker id; the process sends the request on its own link to
that worker. :class:`LinkDirectory` is the listener of such a process's request-plane links
(:mod:`frontend_shim._links`, rule 8): it keeps, per worker id, the link that came up first
for it, and another link up for the same id takes over when that one goes down (a worker
reachable at two addresses). The host says which address it picked (with each pick), since it
knows two addresses announcing one id as two workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from frontend_shim._discovery import WorkerKey
from frontend_shim._links import WorkerLink
from shim_common import wire

__all__ = ["LinkDirectory"]


class LinkDirectory:
    """The link of each worker id (a ``FleetListener`` for request-plane links).

    Args:
        key_of: the link address the host gave for a worker id (the host may know a worker by
            its announced id with ``@<address>`` added: two addresses announced one id); a
            worker id it gave none for is looked up by the id the worker announced.
    """

    def __init__(self, key_of: Callable[[str], str | None] = lambda _worker_id: None) -> None:
        self._key_of = key_of
        self._links: Mapping[WorkerKey, WorkerLink] = {}
        self._ids: dict[WorkerKey, str] = {}
        #: Per worker id, the keys up for it, the first one speaking.
        self._keys: dict[str, dict[WorkerKey, None]] = {}

    def watch(self, links: Mapping[WorkerKey, WorkerLink]) -> None:
        """Find the links by key in ``links`` (a live view of the pool's)."""
        self._links = links

    def link_of(self, worker_id: str) -> WorkerLink | None:
        key = self._key_of(worker_id)
        if key is not None:
            link = self._links.get(key)
            return link if link is not None and link.connected else None
        keys = self._keys.get(worker_id)
        if not keys:
            return None
        return self._links.get(next(iter(keys)))

    def worker_up(self, key: WorkerKey, config: wire.RuntimeConfig, now: float) -> None:
        self.worker_down(key, now)
        self._ids[key] = config.worker_id
        self._keys.setdefault(config.worker_id, {})[key] = None

    def worker_down(self, key: WorkerKey, now: float) -> None:
        worker_id = self._ids.pop(key, None)
        if worker_id is None:
            return
        keys = self._keys.get(worker_id, {})
        keys.pop(key, None)
        if not keys:
            self._keys.pop(worker_id, None)

    def worker_events(self, key: WorkerKey, events: Sequence[wire.WorkerEvent], now: float) -> None:
        """No event plane here."""

    def worker_lagging(self, key: WorkerKey, lagging: bool, now: float) -> None:
        """No event plane here."""

    def thresholds(self, model: str) -> wire.BusyThresholds | None:
        return None
