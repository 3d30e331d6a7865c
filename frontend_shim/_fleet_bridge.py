"""Link news to load state: the worker links speak of addresses, the fleet of worker ids.

The worker links speak of workers by address (``ws://host:port``), the load state by the id a
worker announces; :class:`FleetBridge` keeps the map between the two and is the only place that
turns link news into :class:`~frontend_shim._load.Fleet` calls. The same map answers the other
way: the link of a routed worker id (:meth:`FleetBridge.link_of`).

Models are remembered by address: each link *claims* the model of its latest hello, while it is
up and while it is down (a worker restarting keeps its model known: its requests get 503, not
404). A hello that names another model moves the link's claim, and a link stopped (its address
left the worker list or the name's lookup) gives its claim up. A model no link claims and no
worker serves is forgotten (:meth:`~frontend_shim._load.Fleet.forget_model`), with the
thresholds set for it: so the models known are at most one per worker address, however many
models one worker announces in turn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from frontend_shim._discovery import WorkerKey
from frontend_shim._kv_index import KvIndex
from frontend_shim._links import WorkerLink
from frontend_shim._load import Fleet
from shim_common import wire

__all__ = ["FleetBridge"]

_log = logging.getLogger(__name__)


class FleetBridge:
    """Turns what the worker links report into :class:`Fleet` updates (a ``FleetListener``).

    A worker id announced by two addresses at once (one worker reachable twice, e.g. over IPv4
    and IPv6) is counted once: the first address to come up owns it, the others stand by, and
    when the owner goes down a standby that is still up takes over at once.

    Args:
        fleet: the load state to update.
        on_change: called after every change of the fleet (to release parked requests).
        links: the links now running, by key (a live view, e.g. ``WorkerPool.links``).
        kv_index: where the KV events of the workers go (``--router-mode kv``); ``None``: nowhere.
    """

    def __init__(
        self,
        fleet: Fleet,
        on_change: Callable[[], None],
        links: Mapping[WorkerKey, WorkerLink] | None = None,
        kv_index: KvIndex | None = None,
    ) -> None:
        self._fleet = fleet
        self._kv_index = kv_index
        self._on_change = on_change
        self._links: Mapping[WorkerKey, WorkerLink] = links if links is not None else {}
        #: Every link that is up, with the config of its latest hello.
        self._up: dict[WorkerKey, wire.RuntimeConfig] = {}
        #: The link that speaks for each registered worker id.
        self._owner: dict[str, WorkerKey] = {}
        #: Every link up for each worker id (the owner and its standbys), so that a worker going
        #: down finds its standby without a scan of the fleet (a fleet of thousands going down
        #: at once would otherwise cost the square of its size).
        self._keys: dict[str, dict[WorkerKey, None]] = {}
        #: The model each link claims: that of its latest hello, kept while it is down.
        self._claim: dict[WorkerKey, str] = {}
        #: The links claiming each model.
        self._claimants: dict[str, set[WorkerKey]] = {}

    def key_of(self, worker_id: str) -> WorkerKey | None:
        """The link address of a registered worker."""
        return self._owner.get(worker_id)

    def link_of(self, worker_id: str) -> WorkerLink | None:
        """The link that speaks for a registered worker, or ``None`` (it went away)."""
        key = self._owner.get(worker_id)
        return self._links.get(key) if key is not None else None

    def worker_up(self, key: WorkerKey, config: wire.RuntimeConfig, now: float) -> None:
        self._up[key] = config
        self._move_claim(key, config.model)
        self._keys.setdefault(config.worker_id, {})[key] = None
        owner = self._owner.get(config.worker_id)
        if owner is not None and owner != key:
            _log.warning(
                "worker %s at %s is already connected at %s; standing by on the second address",
                config.worker_id,
                key,
                owner,
            )
            return
        self._owner[config.worker_id] = key
        self._fleet.register(config, now)
        if self._kv_index is not None:
            link = self._links.get(key)
            events = link is not None and link.kv_events
            self._kv_index.add_worker(config, now, events=events)
        _log.info("worker %s up at %s (model %s)", config.worker_id, key, config.model)
        self._on_change()

    def worker_events(self, key: WorkerKey, events: Sequence[wire.WorkerEvent], now: float) -> None:
        config = self._up.get(key)
        if config is None or self._owner.get(config.worker_id) != key:
            return  # a standby link: its owner reports the same worker
        if self._fleet.apply_batch(config.worker_id, events, now):
            self._on_change()

    def worker_lagging(self, key: WorkerKey, lagging: bool, now: float) -> None:
        config = self._up.get(key)
        if config is None or self._owner.get(config.worker_id) != key:
            return
        if self._fleet.set_lagging(config.worker_id, lagging):
            self._on_change()

    def worker_kv_events(
        self, key: WorkerKey, events: Sequence[wire.KvEvent], now: float
    ) -> bool:
        config = self._up.get(key)
        if self._kv_index is None or config is None or self._owner.get(config.worker_id) != key:
            return False
        return self._kv_index.apply(config.worker_id, events, now)

    def thresholds(self, model: str) -> wire.BusyThresholds | None:
        thresholds = self._fleet.thresholds(model)
        return thresholds if thresholds.configured else None

    def worker_down(self, key: WorkerKey, now: float) -> None:
        config = self._up.pop(key, None)
        if config is None:
            return
        keys = self._keys.get(config.worker_id, {})
        keys.pop(key, None)
        if not keys:
            self._keys.pop(config.worker_id, None)
        if self._owner.get(config.worker_id) != key:
            return
        del self._owner[config.worker_id]
        self._fleet.remove(config.worker_id)
        if self._kv_index is not None:
            self._kv_index.remove_worker(config.worker_id)
        _log.info("worker %s at %s down", config.worker_id, key)
        standby = next(iter(keys), None)
        if standby is not None:
            self.worker_up(standby, self._up[standby], now)
        else:
            self._forget_if_unclaimed(config.model)
            self._on_change()

    def link_stopped(self, key: WorkerKey) -> None:
        """The link of ``key`` was stopped (its address is no longer resolved): it gives its
        claim up (its ``worker_down``, if it was up, comes after)."""
        self._move_claim(key, None)

    def _move_claim(self, key: WorkerKey, model: str | None) -> None:
        """Make ``key`` claim ``model`` (``None``: nothing), forgetting what it claimed before
        when nobody else claims or serves it."""
        before = self._claim.pop(key, None)
        if model is not None:
            self._claim[key] = model
            self._claimants.setdefault(model, set()).add(key)
        if before is None or before == model:
            return
        claimants = self._claimants.get(before)
        if claimants is not None:
            claimants.discard(key)
        self._forget_if_unclaimed(before)

    def _forget_if_unclaimed(self, model: str) -> None:
        if self._claimants.get(model):
            return
        self._claimants.pop(model, None)
        if self._fleet.forget_model(model):
            _log.info("model %s forgotten: no worker serves it now", model)
