"""FleetBridge: link news -> load state, with one worker reachable at two addresses."""

from __future__ import annotations

from worker_configs import runtime_config

from frontend_shim._fleet_bridge import FleetBridge
from frontend_shim._load import Fleet
from shim_common import wire


def _load(seq: int, blocks: int) -> wire.LoadEvent:
    rank = wire.RankLoad(
        dp_rank=0, active_decode_blocks=blocks, active_prefill_tokens=0, kv_used_blocks=blocks
    )
    return wire.LoadEvent(seq=seq, ts=0.0, load=rank, engine_requests=0, queued_requests=0)


def test_one_worker_at_two_addresses_is_counted_once_and_survives_losing_one() -> None:
    fleet = Fleet()
    changes: list[None] = []
    bridge = FleetBridge(fleet, on_change=lambda: changes.append(None))
    bridge.worker_up("ws://127.0.0.1:1", runtime_config(), now=0.0)
    bridge.worker_up("ws://[::1]:1", runtime_config(), now=0.0)
    assert fleet.connected_count == 1
    assert bridge.key_of("w-1") == "ws://127.0.0.1:1"
    # The standby's events are not applied twice; the owner's are.
    bridge.worker_events("ws://[::1]:1", [_load(1, 7)], now=0.1)
    assert [g.active_decode_blocks for g in fleet.rank_gauges()] == [0]
    bridge.worker_events("ws://127.0.0.1:1", [_load(1, 5)], now=0.1)
    assert [g.active_decode_blocks for g in fleet.rank_gauges()] == [5]
    # The owner goes down: the standby, still up, takes over at once.
    bridge.worker_down("ws://127.0.0.1:1", now=0.2)
    assert fleet.connected_count == 1
    assert bridge.key_of("w-1") == "ws://[::1]:1"
    bridge.worker_down("ws://[::1]:1", now=0.3)
    assert fleet.connected_count == 0
    assert bridge.key_of("w-1") is None
    assert changes


def test_a_standby_going_down_changes_nothing() -> None:
    fleet = Fleet()
    bridge = FleetBridge(fleet, on_change=lambda: None)
    bridge.worker_up("ws://a:1", runtime_config(), now=0.0)
    bridge.worker_up("ws://b:1", runtime_config(), now=0.0)
    bridge.worker_down("ws://b:1", now=0.1)
    assert fleet.connected_count == 1
    assert bridge.key_of("w-1") == "ws://a:1"
    bridge.worker_down("ws://unknown:1", now=0.2)
    assert fleet.connected_count == 1


def test_the_link_of_a_worker_id_is_its_owners_and_none_once_it_is_down() -> None:
    fleet = Fleet()
    owner, standby = object(), object()
    links = {"ws://a:1": owner, "ws://b:1": standby}
    bridge = FleetBridge(fleet, on_change=lambda: None, links=links)  # type: ignore[arg-type]
    assert bridge.link_of("w-1") is None
    bridge.worker_up("ws://a:1", runtime_config(), now=0.0)
    bridge.worker_up("ws://b:1", runtime_config(), now=0.0)
    assert bridge.link_of("w-1") is owner
    bridge.worker_down("ws://a:1", now=1.0)
    assert bridge.link_of("w-1") is standby
    del links["ws://b:1"]  # the pool stopped the link before its session reported down
    assert bridge.link_of("w-1") is None
