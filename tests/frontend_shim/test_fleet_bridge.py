"""FleetBridge: link news -> load state, with worker ids kept apart by address."""

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


def _decode_blocks(fleet: Fleet) -> dict[str, int]:
    return {g.worker_id: g.active_decode_blocks for g in fleet.rank_gauges()}


def test_a_second_address_announcing_a_held_id_is_served_apart() -> None:
    # Anyone can read a worker's id from its hello. Before, a second address announcing it
    # stood by, and took the worker's place when the worker went down (and kept it after).
    fleet = Fleet()
    collisions: list[None] = []
    bridge = FleetBridge(
        fleet, on_change=lambda: None, on_collision=lambda: collisions.append(None)
    )
    bridge.worker_up("ws://a:1", runtime_config(), now=0.0)
    bridge.worker_up("ws://b:1", runtime_config(), now=0.0)
    assert collisions == [None]
    assert fleet.connected_count == 2
    assert bridge.key_of("w-1") == "ws://a:1"
    assert bridge.key_of("w-1@ws://b:1") == "ws://b:1"
    assert bridge.worker_id_of("ws://b:1") == "w-1@ws://b:1"
    # Each address's events move its own worker only.
    bridge.worker_events("ws://b:1", [_load(1, 7)], now=0.1)
    bridge.worker_events("ws://a:1", [_load(1, 5)], now=0.1)
    assert _decode_blocks(fleet) == {"w-1": 5, "w-1@ws://b:1": 7}
    # The first goes down: the second does not take its place, and the first comes back to it.
    bridge.worker_down("ws://a:1", now=0.2)
    assert bridge.key_of("w-1") is None
    assert fleet.connected_count == 1
    bridge.worker_up("ws://a:1", runtime_config(), now=0.3)
    assert bridge.key_of("w-1") == "ws://a:1"
    assert bridge.key_of("w-1@ws://b:1") == "ws://b:1"
    assert collisions == [None]
    bridge.worker_down("ws://b:1", now=0.4)
    bridge.worker_down("ws://a:1", now=0.5)
    assert fleet.connected_count == 0


def test_an_impostor_that_comes_up_first_takes_none_of_the_workers_traffic() -> None:
    fleet = Fleet()
    impostor, worker = object(), object()
    links = {"ws://evil:1": impostor, "ws://real:1": worker}
    bridge = FleetBridge(fleet, on_change=lambda: None, links=links)  # type: ignore[arg-type]
    bridge.worker_up("ws://evil:1", runtime_config(), now=0.0)
    bridge.worker_up("ws://real:1", runtime_config(), now=0.0)
    # Two workers: whatever the router picks for the real one goes to the real one's link.
    assert fleet.connected_count == 2
    assert bridge.link_of("w-1") is impostor
    assert bridge.link_of("w-1@ws://real:1") is worker
    del links["ws://real:1"]  # the pool stopped the link before its session reported down
    assert bridge.link_of("w-1@ws://real:1") is None


def test_an_id_of_the_apart_form_announced_by_a_third_address_is_apart_again() -> None:
    fleet = Fleet()
    bridge = FleetBridge(fleet, on_change=lambda: None)
    bridge.worker_up("ws://c:1", runtime_config("w-1@ws://b:1"), now=0.0)
    bridge.worker_up("ws://a:1", runtime_config(), now=0.0)
    bridge.worker_up("ws://b:1", runtime_config(), now=0.0)
    assert bridge.worker_id_of("ws://b:1") == "w-1@ws://b:1#2"
    assert fleet.connected_count == 3


def test_an_address_going_down_changes_nothing_else() -> None:
    fleet = Fleet()
    bridge = FleetBridge(fleet, on_change=lambda: None)
    bridge.worker_up("ws://a:1", runtime_config(), now=0.0)
    bridge.worker_up("ws://b:1", runtime_config(), now=0.0)
    bridge.worker_down("ws://b:1", now=0.1)
    assert fleet.connected_count == 1
    assert bridge.key_of("w-1") == "ws://a:1"
    bridge.worker_down("ws://unknown:1", now=0.2)
    assert fleet.connected_count == 1


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
