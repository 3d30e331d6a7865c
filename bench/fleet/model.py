"""The simulated fleet, as both simulators (``bench/fleet_sim.py``: real workers;
``bench/lean_sim.py``: one cheap loop) run it and ``bench/bench_fleet.py`` asks for it: the
protocols a simulated worker speaks, the limits it announces and the load its engines change;
and what the two simulators share besides: their command line and the counters of their
``stats``.

Protocols (``--protocol``), fleet-wide: ``new`` (the worker as it is, every feature it lists in
its hello), ``current`` (the protocol of the fleet work: busy edges and a publish interval of its
own, :data:`CURRENT_FEATURES`, and nothing added since) and ``v1`` (a worker of protocol version
1 as first released: no features, no ``load_publish_interval``, every change sent at once).

Load: two modes, fleet-wide: ``free`` (decode blocks in :data:`FREE_RANGE` of the total on every
rank) and ``busy`` (in :data:`BUSY_RANGE`); every rank changes ``--rate`` times a second, the
workers spread over :data:`SLOTS` slots of the period.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Final, Literal

from bench.kit.processes import pin, raise_fd_limit
from shim_common.wire import FEATURE_BUSY_EDGES

__all__ = [
    "BUSY_RANGE",
    "CURRENT_FEATURES",
    "FREE_RANGE",
    "KV_TOTAL_BLOCKS",
    "MODEL",
    "PROTOCOLS",
    "SLOTS",
    "Counters",
    "Protocol",
    "set_up",
    "simulator_parser",
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


@dataclasses.dataclass
class Counters:
    """What a simulator generated and sent, summed over its workers (its ``stats``)."""

    #: Rank load changes made (each one should become a load event).
    generated: int = 0
    #: Load events taken into batches to send.
    load_events: int = 0
    #: Heartbeats likewise.
    heartbeats: int = 0
    #: Event-plane websocket messages (one per batch).
    batches: int = 0
    #: KV events sent (the lean simulator's ``--kv-blocks``), snapshots included, and the ``kv``
    #: messages that carried them.
    kv_events: int = 0
    kv_messages: int = 0
    kv_snapshots: int = 0


def simulator_parser(description: str) -> argparse.ArgumentParser:
    """The command line both simulators take (the lean one adds ``--kv-blocks``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--ranks", type=int, default=4, help="data-parallel ranks per worker")
    parser.add_argument("--rate", type=float, default=20.0, help="load changes per rank per s")
    parser.add_argument("--id-prefix", default="sim", help="worker ids are PREFIX-0, PREFIX-1...")
    parser.add_argument(
        "--protocol", choices=PROTOCOLS, default="new", help="what the workers announce and do"
    )
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU")
    parser.add_argument(
        "--paused", action="store_true", help="no load changes before the first busy/free"
    )
    return parser


def set_up(options: argparse.Namespace) -> None:
    """Pin the simulator to ``--cpu`` when given, and raise its descriptor limit: each worker
    it runs holds a listener and several connections."""
    if options.cpu is not None:
        pin(options.cpu)
    raise_fd_limit()
