"""The KV-event additions of the wire: they round-trip, read as plain msgpack, and leave the bytes
an older peer sends and reads as they were."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim_common import wire
from shim_common.prefix import MAX_BLOCK_NAME
from shim_common.wire import (
    BusyThresholds,
    End,
    Generate,
    KvBatch,
    KvCleared,
    KvRemoved,
    KvSnapshot,
    KvStored,
    Subscribe,
)

names = st.lists(st.integers(0, MAX_BLOCK_NAME), max_size=8)
kv_events = st.one_of(
    st.builds(
        KvStored,
        seq=st.integers(1, 2**63 - 1),
        dp_rank=st.integers(0, 255),
        parent=st.none() | st.integers(0, MAX_BLOCK_NAME),
        blocks=names,
    ),
    st.builds(KvRemoved, seq=st.integers(1, 2**63 - 1), dp_rank=st.integers(0, 255), blocks=names),
    st.builds(KvCleared, seq=st.integers(1, 2**63 - 1), dp_rank=st.integers(0, 255)),
    st.builds(KvSnapshot, seq=st.integers(0, 2**63 - 1), ranks=st.lists(names, max_size=4)),
)


@given(events=st.lists(kv_events, max_size=6))
def test_kv_batches_round_trip_and_are_plain_msgpack(events: list[wire.KvEvent]) -> None:
    batch = KvBatch(events=events)
    data = wire.encode(batch)
    assert wire.decode_event_message(data) == batch
    plain = msgpack.unpackb(data)
    assert plain == msgspec.to_builtins(batch)
    assert plain["type"] == "kv"
    assert wire.decode_event_message(msgpack.packb(plain)) == batch


def test_each_kv_event_is_tagged_by_its_type() -> None:
    batch = KvBatch(
        events=[
            KvSnapshot(seq=0, ranks=[[], [5]]),
            KvStored(seq=1, dp_rank=0, parent=None, blocks=[1, 2]),
            KvStored(seq=2, dp_rank=1, parent=2, blocks=[3]),
            KvRemoved(seq=3, dp_rank=0, blocks=[2]),
            KvCleared(seq=4, dp_rank=1),
        ]
    )
    plain = msgpack.unpackb(wire.encode(batch))
    assert [event["type"] for event in plain["events"]] == [
        "kv-snapshot",
        "kv-stored",
        "kv-stored",
        "kv-removed",
        "kv-cleared",
    ]
    assert plain["events"][1] == {
        "type": "kv-stored",
        "seq": 1,
        "dp_rank": 0,
        "parent": None,
        "blocks": [1, 2],
    }


def test_a_block_name_above_63_bits_still_decodes_as_a_number() -> None:
    # Names are 63-bit by rule; a decoder does not police it, a value is a value.
    data = msgpack.packb(
        {
            "type": "kv",
            "events": [{"type": "kv-removed", "seq": 1, "dp_rank": 0, "blocks": [2**64 - 1]}],
        }
    )
    batch = wire.decode_event_message(data)
    assert isinstance(batch, KvBatch)
    assert batch.events == [KvRemoved(seq=1, dp_rank=0, blocks=[2**64 - 1])]


@pytest.mark.parametrize(
    "event",
    [
        {"type": "kv-stored", "seq": 1, "dp_rank": 0, "blocks": [1]},  # no parent
        {"type": "kv-stored", "seq": 1, "dp_rank": 0, "parent": None, "blocks": ["x"]},
        {"type": "kv-removed", "seq": "one", "dp_rank": 0, "blocks": []},
        {"type": "kv-cleared", "seq": 1},
        {"type": "kv-snapshot", "seq": 1, "ranks": [1, 2]},
        {"type": "kv-unknown", "seq": 1},
    ],
)
def test_bad_kv_events_are_decode_errors(event: dict[str, object]) -> None:
    with pytest.raises(msgspec.DecodeError):
        wire.decode_event_message(msgpack.packb({"type": "kv", "events": [event]}))


def test_subscribe_asks_for_kv_events_and_an_older_subscribe_does_not() -> None:
    thresholds = BusyThresholds()
    old = msgpack.packb({"type": "subscribe", "thresholds": msgspec.to_builtins(thresholds)})
    decoded = wire.decode_subscriber_message(old)
    assert decoded.kv_events is False
    assert decoded.kv_snapshot is False
    asking = Subscribe(thresholds=thresholds, kv_events=True, kv_snapshot=True)
    assert wire.decode_subscriber_message(wire.encode(asking)) == asking


def test_older_peers_read_a_snapshot_as_before_and_a_part_says_more() -> None:
    # Feature kv-parts: an older frontend's decoder (no `more`) reads a snapshot as before; one
    # an older worker sends (no `more`) is whole; a part says so.
    class OlderSnapshot(msgspec.Struct, kw_only=True, tag="kv-snapshot", tag_field="type"):
        seq: int
        ranks: list[list[int]]

    whole = wire.KvSnapshot(seq=3, ranks=[[1, 2], []])
    older = msgspec.msgpack.decode(wire.encode(whole), type=OlderSnapshot)
    assert (older.seq, older.ranks) == (3, [[1, 2], []])
    snapshot = {"type": "kv-snapshot", "seq": 3, "ranks": [[1, 2], []]}
    sent_before = msgpack.packb({"type": "kv", "events": [snapshot]})
    assert wire.decode_event_message(sent_before) == wire.KvBatch(events=[whole])
    part = wire.KvSnapshot(seq=3, ranks=[[1]], more=True)
    assert msgpack.unpackb(wire.encode(part))["more"] is True
    # A subscribe asks for parts only when it says so; an older one never does.
    thresholds = BusyThresholds()
    old = msgpack.packb({"type": "subscribe", "thresholds": msgspec.to_builtins(thresholds)})
    assert wire.decode_subscriber_message(old).kv_parts is False
    asking = Subscribe(thresholds=thresholds, kv_events=True, kv_parts=True)
    assert wire.decode_subscriber_message(wire.encode(asking)) == asking


def test_generate_without_a_rank_is_the_bytes_an_older_peer_sends() -> None:
    plain = Generate(request_id=1, endpoint="completions", body={"prompt": "a"})
    assert "dp_rank" not in msgpack.unpackb(wire.encode(plain))
    ranked = Generate(request_id=1, endpoint="completions", body={"prompt": "a"}, dp_rank=3)
    assert msgpack.unpackb(wire.encode(ranked))["dp_rank"] == 3
    assert wire.decode_client_message(wire.encode(ranked)) == ranked


def test_end_carries_cached_tokens_and_an_older_end_reads_as_none_cached() -> None:
    old = msgpack.packb(
        {"type": "end", "request_id": 1, "prompt_tokens": 9, "completion_tokens": 2}
    )
    assert wire.decode_worker_message(old) == End(
        request_id=1, prompt_tokens=9, completion_tokens=2, cached_tokens=0
    )
    end = End(request_id=1, prompt_tokens=9, completion_tokens=2, cached_tokens=8)
    assert wire.decode_worker_message(wire.encode(end)) == end
