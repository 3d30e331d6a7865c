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


def test_a_worker_announcing_model_after_model_leaves_only_its_latest_known() -> None:
    fleet = Fleet()
    bridge = FleetBridge(fleet, on_change=lambda: None)
    bridge.worker_up("ws://b:1", runtime_config("w-b", model="shared"), now=0.0)
    for n in range(378):
        bridge.worker_up("ws://a:1", runtime_config(model=f"m-{n}"), now=float(n))
        bridge.worker_down("ws://a:1", now=n + 0.5)
        # While its worker restarts, a model stays known (503 for it, not 404) ...
        assert fleet.models() == ["shared", f"m-{n}"]
    # ... and the one a worker announced before its latest is forgotten, thresholds too.
    assert [model for model, _ in fleet.all_thresholds()] == ["shared", "m-377"]
    assert not fleet.is_known_model("m-0")


def test_a_model_is_kept_while_another_worker_serves_it_and_forgotten_with_its_last_link() -> None:
    fleet = Fleet()
    bridge = FleetBridge(fleet, on_change=lambda: None)
    bridge.worker_up("ws://a:1", runtime_config("w-a", model="m"), now=0.0)
    bridge.worker_up("ws://b:1", runtime_config("w-b", model="m"), now=0.0)
    # a's worker now serves another model: m is still b's.
    bridge.worker_down("ws://a:1", now=1.0)
    bridge.worker_up("ws://a:1", runtime_config("w-a", model="n"), now=1.0)
    assert fleet.models() == ["m", "n"]
    # b's address is no longer resolved: its link is stopped, then goes down.
    bridge.link_stopped("ws://b:1")
    assert fleet.is_known_model("m")  # its worker is still registered until the down
    bridge.worker_down("ws://b:1", now=2.0)
    assert fleet.models() == ["n"]
    # A link stopped while down gives its claim up at once.
    bridge.worker_down("ws://a:1", now=3.0)
    assert fleet.models() == ["n"]
    bridge.link_stopped("ws://a:1")
    assert fleet.models() == []
