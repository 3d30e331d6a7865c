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

Worker ids are kept apart by address. Anyone may read a worker's id from its hello, so a
second address announcing an id already held at another address is not believed: it is served
as a worker of its own, registered under ``<id>@<its address>`` (the first id of that form no
address holds), logged at WARNING and counted (``on_collision``). It takes none of the first
address's traffic, whichever of the two came up first, and a worker going down never hands its
place to another address. (Before, the second address stood by and took over when the first
went down, so a peer listed beside a worker, announcing the worker's id and connecting first,
took all of its traffic while the worker stood by.) One worker listed at two addresses (over
IPv4 and IPv6, say) is therefore counted as two: list each worker once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import msgspec

from frontend_shim._discovery import WorkerKey
from frontend_shim._kv_index import KvIndex
from frontend_shim._links import WorkerLink
from frontend_shim._load import Fleet
from shim_common import wire

__all__ = ["FleetBridge"]

_log = logging.getLogger(__name__)


class FleetBridge:
    """Turns what the worker links report into :class:`Fleet` updates (a ``FleetListener``).

    Each address that is up is one worker of the fleet, under the id its hello announces, or
    ``<id>@<address>`` when another address holds that id already (see the module docstring).

    Args:
        fleet: the load state to update.
        on_change: called after every change of the fleet (to release parked requests).
        links: the links now running, by key (a live view, e.g. ``WorkerPool.links``).
        kv_index: where the KV events of the workers go (``--router-mode kv``); ``None``: nowhere.
        on_collision: called when an address announces an id another address holds.
    """

    def __init__(
        self,
        fleet: Fleet,
        on_change: Callable[[], None],
        links: Mapping[WorkerKey, WorkerLink] | None = None,
        kv_index: KvIndex | None = None,
        on_collision: Callable[[], None] | None = None,
    ) -> None:
        self._fleet = fleet
        self._kv_index = kv_index
        self._on_change = on_change
        self._on_collision = on_collision
        self._links: Mapping[WorkerKey, WorkerLink] = links if links is not None else {}
        #: Every link that is up, with the config of its latest hello as registered (its
        #: ``worker_id`` the id the fleet knows it by).
        self._up: dict[WorkerKey, wire.RuntimeConfig] = {}
        #: The link of each registered worker id.
        self._key: dict[str, WorkerKey] = {}
        #: The model each link claims: that of its latest hello, kept while it is down.
        self._claim: dict[WorkerKey, str] = {}
        #: The links claiming each model.
        self._claimants: dict[str, set[WorkerKey]] = {}

    def key_of(self, worker_id: str) -> WorkerKey | None:
        """The link address of a registered worker."""
        return self._key.get(worker_id)

    def link_of(self, worker_id: str) -> WorkerLink | None:
        """The link of a registered worker, or ``None`` (it went away)."""
        key = self._key.get(worker_id)
        return self._links.get(key) if key is not None else None

    def worker_id_of(self, key: WorkerKey) -> str | None:
        """The id the fleet knows the worker at ``key`` by while it is up."""
        config = self._up.get(key)
        return config.worker_id if config is not None else None

    def worker_up(self, key: WorkerKey, config: wire.RuntimeConfig, now: float) -> None:
        self.worker_down(key, now)  # a new hello without a down first: the old one ends here
        self._move_claim(key, config.model)
        announced = config.worker_id
        worker_id = self._unheld_id(announced, key)
        if worker_id != announced:
            _log.warning(
                "worker id %r announced at %s is already held at %s: served apart as %r (anyone "
                "can copy an id; a worker listed at two addresses is counted twice)",
                announced,
                key,
                self._key[announced],
                worker_id,
            )
            if self._on_collision is not None:
                self._on_collision()
            config = msgspec.structs.replace(config, worker_id=worker_id)
        self._up[key] = config
        self._key[worker_id] = key
        self._fleet.register(config, now)
        if self._kv_index is not None:
            link = self._links.get(key)
            events = link is not None and link.kv_events
            self._kv_index.add_worker(config, now, events=events)
        _log.info("worker %s up at %s (model %s)", worker_id, key, config.model)
        self._on_change()

    def _unheld_id(self, announced: str, key: WorkerKey) -> str:
        """``announced``, or, when another address holds it, the first of ``<id>@<key>``,
        ``<id>@<key>#2``, ... that no address holds (a peer may announce those too)."""
        worker_id = announced
        attempt = 1
        while self._key.get(worker_id, key) != key:
            worker_id = f"{announced}@{key}" + (f"#{attempt}" if attempt > 1 else "")
            attempt += 1
        return worker_id

    def worker_events(self, key: WorkerKey, events: Sequence[wire.WorkerEvent], now: float) -> None:
        config = self._up.get(key)
        if config is not None and self._fleet.apply_batch(config.worker_id, events, now):
            self._on_change()

    def worker_lagging(self, key: WorkerKey, lagging: bool, now: float) -> None:
        config = self._up.get(key)
        if config is not None and self._fleet.set_lagging(config.worker_id, lagging):
            self._on_change()

    def worker_kv_events(self, key: WorkerKey, events: Sequence[wire.KvEvent], now: float) -> bool:
        config = self._up.get(key)
        if self._kv_index is None or config is None:
            return False
        return self._kv_index.apply(config.worker_id, events, now)

    def thresholds(self, model: str) -> wire.BusyThresholds | None:
        thresholds = self._fleet.thresholds(model)
        return thresholds if thresholds.configured else None

    def worker_down(self, key: WorkerKey, now: float) -> None:
        config = self._up.pop(key, None)
        if config is None:
            return
        del self._key[config.worker_id]
        self._fleet.remove(config.worker_id)
        if self._kv_index is not None:
            self._kv_index.remove_worker(config.worker_id)
        _log.info("worker %s at %s down", config.worker_id, key)
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
