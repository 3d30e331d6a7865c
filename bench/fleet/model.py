"""The simulated fleet, as both simulators (``bench/fleet_sim.py``: real workers;
``bench/lean_sim.py``: one cheap loop) run it and ``bench/bench_fleet.py`` asks for it: the
protocols a simulated worker speaks, the limits it announces and the load its engines change.

Protocols (``--protocol``), fleet-wide: ``new`` (the worker as it is, every feature it lists in
its hello), ``current`` (the protocol of the fleet work: busy edges and a publish interval of its
own, :data:`CURRENT_FEATURES`, and nothing added since) and ``v1`` (a worker of protocol version
1 as first released: no features, no ``load_publish_interval``, every change sent at once).

Load: two modes, fleet-wide: ``free`` (decode blocks in :data:`FREE_RANGE` of the total on every
rank) and ``busy`` (in :data:`BUSY_RANGE`); every rank changes ``--rate`` times a second, the
workers spread over :data:`SLOTS` slots of the period.
"""

from __future__ import annotations

from typing import Final, Literal

from shim_common.wire import FEATURE_BUSY_EDGES

__all__ = [
    "BUSY_RANGE",
    "CURRENT_FEATURES",
    "FREE_RANGE",
    "KV_TOTAL_BLOCKS",
    "MODEL",
    "PROTOCOLS",
    "SLOTS",
    "Protocol",
]

Protocol = Literal["new", "current", "v1"]
PROTOCOLS: Final = ("new", "current", "v1")
#: The features a worker of the fleet work's protocol lists.
CURRENT_FEATURES: Final = (FEATURE_BUSY_EDGES,)
MODEL: Final = "mock-model"
KV_TOTAL_BLOCKS: Final = 1000
#: Decode-block fractions of each mode, as [low, high): busy is above a 0.5 threshold, free is
#: well below it.
FREE_RANGE: Final = (0.0, 0.2)
BUSY_RANGE: Final = (0.6, 0.9)
#: The tick period is split into this many slots; each slot ticks its share of the workers, so
#: the fleet's changes are spread over the period instead of arriving in one burst.
SLOTS: Final = 10
