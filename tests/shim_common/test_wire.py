"""The wire protocol: every message round-trips, and the bytes are plain msgpack both ways."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim_common import wire
from shim_common._disagg import MAX_HANDOFF_BLOCKS, MAX_HANDOFF_ID_CHARS
from shim_common.wire import (
    PROTOCOL_VERSION,
    Cancel,
    Chunk,
    End,
    EventBatch,
    Failed,
    Generate,
    Heartbeat,
    Hello,
    LoadEvent,
    RankLoad,
    Rejected,
    RuntimeConfig,
    Started,
)

CONFIG = RuntimeConfig(
    worker_id="w-1",
    model="mock-model",
    kv_total_blocks=16384,
    block_size=16,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    data_parallel_size=2,
    engine_request_limit=4,
    request_queue_limit=16,
    heartbeat_interval=1.0,
)
LOAD = RankLoad(dp_rank=1, active_decode_blocks=7, active_prefill_tokens=300, kv_used_blocks=9)

WORKER_MESSAGES: list[wire.WorkerMessage] = [
    Hello(protocol_version=PROTOCOL_VERSION, config=CONFIG),
    Hello(
        protocol_version=PROTOCOL_VERSION,
        config=msgspec.structs.replace(CONFIG, engine_request_limit=None),
    ),
    Rejected(request_id=1, reason=wire.RejectReason.OVERLOADED),
    Rejected(request_id=2, reason=wire.RejectReason.DRAINING),
    Started(request_id=3, prompt_tokens=12),
    Chunk(request_id=3, text=" hello", tokens=1),
    Chunk(request_id=3, text="", tokens=1, finish_reason="length"),
    Chunk(request_id=4, embedding=[0.5, -1.25], index=2),
    End(request_id=3, prompt_tokens=12, completion_tokens=2),
    Failed(request_id=5, kind="engine", message="boom"),
    Failed(request_id=6, kind="bad_request", message="'prompt' is required"),
    Cancel(request_id=7, reason="worker going away"),
]
CLIENT_MESSAGES: list[wire.ClientMessage] = [
    Generate(request_id=1, endpoint="completions", body={"prompt": "a b c", "max_tokens": 3}),
    Generate(
        request_id=2**40,
        endpoint="chat_completions",
        body={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    ),
    Generate(request_id=3, endpoint="embeddings", body={"input": ["x", "y"]}),
    Cancel(request_id=1),
]
EVENT_MESSAGES: list[Hello | EventBatch] = [
    Hello(protocol_version=PROTOCOL_VERSION, config=CONFIG),
    EventBatch(events=[]),
    EventBatch(
        events=[
            LoadEvent(seq=1, ts=1.5, load=LOAD, engine_requests=3, queued_requests=1),
            Heartbeat(
                seq=2, ts=2.5, loads=[LOAD], engine_requests=3, queued_requests=1, status="draining"
            ),
        ]
    ),
]


@pytest.mark.parametrize("message", WORKER_MESSAGES, ids=repr)
def test_worker_messages_round_trip(message: wire.WorkerMessage) -> None:
    assert wire.decode_worker_message(wire.encode(message)) == message


@pytest.mark.parametrize("message", CLIENT_MESSAGES, ids=repr)
def test_client_messages_round_trip(message: wire.ClientMessage) -> None:
    assert wire.decode_client_message(wire.encode(message)) == message


@pytest.mark.parametrize("message", EVENT_MESSAGES, ids=repr)
def test_event_messages_round_trip(message: Hello | EventBatch) -> None:
    assert wire.decode_event_message(wire.encode(message)) == message


ALL_MESSAGES: list[msgspec.Struct] = [*WORKER_MESSAGES, *CLIENT_MESSAGES, *EVENT_MESSAGES]


@pytest.mark.parametrize("message", ALL_MESSAGES, ids=repr)
def test_our_bytes_are_plain_msgpack_maps(message: msgspec.Struct) -> None:
    decoded = msgpack.unpackb(wire.encode(message))
    assert isinstance(decoded, dict)
    assert decoded == msgspec.to_builtins(message)
    assert isinstance(decoded["type"], str)


def test_plain_msgpack_generate_decodes() -> None:
    data = msgpack.packb(
        {"type": "generate", "request_id": 9, "endpoint": "completions", "body": {"prompt": "x"}}
    )
    assert wire.decode_client_message(data) == Generate(
        request_id=9, endpoint="completions", body={"prompt": "x"}
    )


def test_plain_msgpack_cancel_takes_the_default_reason() -> None:
    data = msgpack.packb({"type": "cancel", "request_id": 4})
    assert wire.decode_client_message(data) == Cancel(
        request_id=4, reason=wire.CANCEL_REASON_CLIENT
    )


def test_plain_msgpack_event_batch_decodes() -> None:
    load = {
        "dp_rank": 0,
        "active_decode_blocks": 1,
        "active_prefill_tokens": 2,
        "kv_used_blocks": 3,
    }
    data = msgpack.packb(
        {
            "type": "events",
            "events": [
                {
                    "type": "load",
                    "seq": 1,
                    "ts": 0.5,
                    "load": load,
                    "engine_requests": 1,
                    "queued_requests": 0,
                },
                {
                    "type": "heartbeat",
                    "seq": 2,
                    "ts": 1.0,
                    "loads": [load],
                    "engine_requests": 1,
                    "queued_requests": 0,
                },
            ],
        }
    )
    batch = wire.decode_event_message(data)
    assert isinstance(batch, EventBatch)
    assert [event.seq for event in batch.events] == [1, 2]
    heartbeat = batch.events[1]
    assert isinstance(heartbeat, Heartbeat)
    assert heartbeat.status == "ready"


def test_effective_limit_is_optional_on_load_events_and_heartbeats() -> None:
    # A worker without an objective (or from before the field) sends no L: it decodes as None;
    # one with an objective sends it, and a plain msgpack peer reads it as a plain field.
    load = {
        "dp_rank": 0,
        "active_decode_blocks": 1,
        "active_prefill_tokens": 2,
        "kv_used_blocks": 3,
    }
    old = {"type": "load", "seq": 1, "ts": 0.5, "load": load, "engine_requests": 1}
    batch = wire.decode_event_message(
        msgpack.packb({"type": "events", "events": [{**old, "queued_requests": 0}]})
    )
    assert isinstance(batch, EventBatch)
    assert batch.events[0].effective_limit is None
    event = LoadEvent(
        seq=2, ts=1.0, load=LOAD, engine_requests=3, queued_requests=1, effective_limit=7
    )
    beat = Heartbeat(
        seq=3, ts=1.0, loads=[LOAD], engine_requests=3, queued_requests=1, effective_limit=7
    )
    for message in (event, beat):
        assert msgpack.unpackb(wire.encode(message))["effective_limit"] == 7
    decoded = wire.decode_event_message(wire.encode(EventBatch(events=[event, beat])))
    assert isinstance(decoded, EventBatch)
    assert [e.effective_limit for e in decoded.events] == [7, 7]


def test_the_queue_by_priority_is_optional_and_bounded() -> None:
    # From an older worker, or one that refuses by no wait: None. Past MAX_QUEUE_BANDS
    # priorities, or a negative count, the message does not decode.
    event = LoadEvent(seq=1, ts=1.0, load=LOAD, engine_requests=1, queued_requests=3)
    assert event.queue_ahead is None
    listed = msgspec.structs.replace(event, queue_ahead=[(-2, 1), (0, 3)])
    assert msgpack.unpackb(wire.encode(listed))["queue_ahead"] == [[-2, 1], [0, 3]]
    decoded = wire.decode_event_message(wire.encode(EventBatch(events=[listed])))
    assert isinstance(decoded, EventBatch)
    assert decoded.events[0].queue_ahead == [(-2, 1), (0, 3)]
    for bad in ([(p, 1) for p in range(wire.MAX_QUEUE_BANDS + 1)], [(0, -1)], [(5000, 1)]):
        raw = msgpack.unpackb(wire.encode(EventBatch(events=[event])))
        raw["events"][0]["queue_ahead"] = bad
        with pytest.raises(msgspec.ValidationError):
            wire.decode_event_message(msgpack.packb(raw))


@given(
    priority=st.integers(-1000, 1000),
    tenant=st.sampled_from(["", "a", "frontend_ms"]),
    dp_rank=st.none() | st.integers(0, 7),
    frontend_ms=st.integers(0, wire.MAX_FRONTEND_MS),
)
def test_a_generate_stamped_with_its_frontend_time_reads_as_one_encoded_with_it(
    priority: int, tenant: str, dp_rank: int | None, frontend_ms: int
) -> None:
    fields: dict[str, Any] = {"request_id": 3, "endpoint": "completions", "body": {"p": "x"}}
    plain = Generate(**fields, priority=priority, tenant=tenant, dp_rank=dp_rank)
    stamped = wire.with_frontend_ms(wire.encode(plain), frontend_ms)
    assert len(stamped) <= len(wire.encode(plain)) + wire.FRONTEND_MS_ROOM
    assert wire.decode_client_message(stamped) == msgspec.structs.replace(
        plain, frontend_ms=frontend_ms
    )
    assert msgpack.unpackb(stamped)["request_id"] == 3  # plain msgpack too


def test_only_a_generate_without_its_frontend_time_is_stamped() -> None:
    with pytest.raises(ValueError, match="range"):
        wire.with_frontend_ms(b"\x80", wire.MAX_FRONTEND_MS + 1)
    with pytest.raises(ValueError, match="Generate"):
        wire.with_frontend_ms(msgpack.packb([1, 2]), 5)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    data = msgpack.packb({"type": "started", "request_id": 1, "prompt_tokens": 5, "future": [1]})
    assert wire.decode_worker_message(data) == Started(request_id=1, prompt_tokens=5)


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never used in msgpack
        b"not msgpack at all",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"type": "nonsense", "request_id": 1}),
        msgpack.packb({"type": "generate", "request_id": "one", "endpoint": "x", "body": {}}),
        msgpack.packb({"type": "generate", "request_id": 1, "endpoint": "images", "body": {}}),
        msgpack.packb({"type": "started", "request_id": 1, "prompt_tokens": 1}),
    ],
)
def test_client_decoder_rejects_what_is_not_a_client_message(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        wire.decode_client_message(data)


#: A map nested 200,000 deep, and the same inside a message's free-form fields.
DEEP_MAP = b"\x81\xa1a" * 200_000 + b"\xc0"
DEEP_MESSAGES = [
    DEEP_MAP,
    b"\x84\xa4type\xa8generate\xaarequest_id\x01\xa8endpoint\xabcompletions\xa4body" + DEEP_MAP,
    b"\x82\xa4type\xa9subscribe\xaathresholds" + DEEP_MAP,
    b"\x82\xa4type\xa5batch\xa6events" + b"\x91" * 200_000 + b"\xc0",
]


@pytest.mark.parametrize("data", DEEP_MESSAGES)
@pytest.mark.parametrize(
    "decode",
    [
        wire.decode_client_message,
        wire.decode_worker_message,
        wire.decode_event_message,
        wire.decode_subscriber_message,
    ],
)
def test_nesting_too_deep_to_decode_is_a_decode_error(decode: Any, data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@given(
    request_id=st.integers(0, 2**64 - 1),
    endpoint=st.sampled_from(["chat_completions", "completions", "embeddings"]),
    body=st.dictionaries(st.text(max_size=10), json_values, max_size=5),
)
def test_generate_round_trips_through_plain_msgpack(
    request_id: int, endpoint: wire.Endpoint, body: dict[str, Any]
) -> None:
    message = Generate(request_id=request_id, endpoint=endpoint, body=body)
    reference = msgpack.packb(msgspec.to_builtins(message))
    assert wire.decode_client_message(reference) == message
    assert msgpack.unpackb(wire.encode(message)) == msgspec.to_builtins(message)


@given(
    seq=st.integers(0, 2**63 - 1),
    ts=st.floats(allow_nan=False, allow_infinity=False),
    counts=st.lists(st.integers(0, 2**31), min_size=4, max_size=4),
)
def test_load_events_round_trip(seq: int, ts: float, counts: list[int]) -> None:
    load = RankLoad(
        dp_rank=counts[0],
        active_decode_blocks=counts[1],
        active_prefill_tokens=counts[2],
        kv_used_blocks=counts[3],
    )
    batch = EventBatch(
        events=[LoadEvent(seq=seq, ts=ts, load=load, engine_requests=1, queued_requests=2)]
    )
    assert wire.decode_event_message(msgpack.packb(msgspec.to_builtins(batch))) == batch


def test_rejection_reasons_keep_their_wire_texts_and_classify_in_one_place() -> None:
    texts = {
        wire.RejectReason.OVERLOADED: "Server overloaded: worker at capacity",
        wire.RejectReason.QUEUE_TIMEOUT: "Server overloaded: queue timeout",
        wire.RejectReason.DISPLACED_PRIORITY: (
            "Server overloaded: displaced by a higher-priority request"
        ),
        wire.RejectReason.DISPLACED_SHARE: "Server overloaded: displaced by a fairer share",
        wire.RejectReason.SLO: "Server overloaded: would miss the TTFT objective",
        wire.RejectReason.DRAINING: "Server unavailable: draining",
    }
    for reason, text in texts.items():
        message = wire.Rejected.of(7, reason)
        assert message.reason == text
        assert type(message.reason) is str
        assert wire.RejectReason.parse(text) is reason
    keys = [reason.key for reason in texts]
    assert keys == ["queue_full", "queue_timeout", "displaced", "displaced", "slo", "draining"]
    # A text this version does not know, by its prefix.
    newer = wire.RejectReason.parse("Server overloaded: something new")
    assert (newer.kind, newer.key) == (wire.RejectionKind.OVERLOADED, "queue_full")
    going = wire.RejectReason.parse("Server unavailable: rebooting")
    assert (going.kind, going.key) == (wire.RejectionKind.UNAVAILABLE, "draining")
    neither = wire.RejectReason.parse("Unknown endpoint: x")
    assert (neither.kind, neither.key) == (wire.RejectionKind.OTHER, "other")


# ----------------------------------------------------------------------------- disaggregation

HANDOFF = wire.Handoff(
    handle="9f2c-17",
    worker_id="prefill-0",
    dp_rank=1,
    block_size=4,
    prompt_tokens=10,
    cached_tokens=4,
    block_names=[11, 22],
    kv_bytes=10 * 131072,
)


class _GenerateBefore(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="generate", tag_field="type"
):
    """``generate`` as the protocol had it before disaggregation."""

    request_id: int
    endpoint: str
    body: dict[str, Any]
    priority: int = 0
    tenant: str = ""
    dp_rank: int | None = None
    frontend_ms: int = 0


class _EndBefore(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="end", tag_field="type"
):
    """``end`` as the protocol had it before disaggregation."""

    request_id: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    started_seq: int | None = None
    first_output_seq: int | None = None
    ended_seq: int | None = None


class _ConfigBefore(msgspec.Struct, frozen=True, kw_only=True):
    """An older frontend's hello config: it knows no ``worker_type``."""

    worker_id: str
    block_size: int


@pytest.mark.parametrize(
    "message",
    [
        Generate(request_id=1, endpoint="completions", body={"prompt": "a"}, prefill_only=True),
        Generate(request_id=2, endpoint="chat_completions", body={"messages": []}, handoff=HANDOFF),
        Generate(request_id=3, endpoint="completions", body={}, handoff=HANDOFF, dp_rank=0),
    ],
    ids=repr,
)
def test_disaggregated_generates_round_trip_as_plain_msgpack(message: Generate) -> None:
    data = wire.encode(message)
    assert wire.decode_client_message(data) == message
    assert msgpack.unpackb(data) == msgspec.to_builtins(message)


def test_an_end_with_a_handoff_round_trips_and_an_older_client_reads_it() -> None:
    end = End(request_id=4, prompt_tokens=10, completion_tokens=0, cached_tokens=4, handoff=HANDOFF)
    data = wire.encode(end)
    assert wire.decode_worker_message(data) == end
    assert msgspec.msgpack.decode(data, type=_EndBefore) == _EndBefore(
        request_id=4, prompt_tokens=10, completion_tokens=0, cached_tokens=4
    )


@given(
    priority=st.integers(-1000, 1000),
    tenant=st.sampled_from(["", "t"]),
    dp_rank=st.none() | st.integers(0, 7),
    frontend_ms=st.integers(0, 1000),
    cached=st.integers(0, 2**20),
    seqs=st.none() | st.integers(0, 2**40),
)
def test_without_the_new_fields_generate_and_end_are_the_same_bytes_as_before(
    priority: int, tenant: str, dp_rank: int | None, frontend_ms: int, cached: int, seqs: int | None
) -> None:
    # Fields at their defaults are left out: a frontend that never disaggregates, or a worker
    # answering a plain request, sends what an older peer sends, byte for byte.
    fields: dict[str, Any] = {"request_id": 5, "endpoint": "completions", "body": {"p": "x"}}
    classes: dict[str, Any] = {"priority": priority, "tenant": tenant, "dp_rank": dp_rank}
    generate = Generate(**fields, **classes, frontend_ms=frontend_ms)
    before = _GenerateBefore(**fields, **classes, frontend_ms=frontend_ms)
    assert wire.encode(generate) == wire.encode(before)
    frames: dict[str, Any] = {"started_seq": seqs, "first_output_seq": seqs, "ended_seq": seqs}
    end = End(request_id=5, prompt_tokens=3, completion_tokens=2, cached_tokens=cached, **frames)
    end_before = _EndBefore(
        request_id=5, prompt_tokens=3, completion_tokens=2, cached_tokens=cached, **frames
    )
    assert wire.encode(end) == wire.encode(end_before)


def test_an_older_worker_reads_a_disaggregated_generate_as_a_plain_one() -> None:
    # Sent only to a worker listing the feature; an older one would run the request whole.
    message = Generate(request_id=6, endpoint="completions", body={"prompt": "a"}, handoff=HANDOFF)
    assert msgspec.msgpack.decode(wire.encode(message), type=_GenerateBefore) == _GenerateBefore(
        request_id=6, endpoint="completions", body={"prompt": "a"}
    )


def test_the_role_is_in_the_hello_and_defaults_to_an_aggregated_worker() -> None:
    for role in ("agg", "prefill", "decode"):
        hello = Hello(
            protocol_version=PROTOCOL_VERSION,
            config=msgspec.structs.replace(CONFIG, worker_type=role),
            features=[wire.FEATURE_DISAGG],
        )
        data = wire.encode(hello)
        assert wire.decode_event_message(data) == hello
        # An older frontend ignores the field: to it every role is an aggregated worker.
        config = msgpack.packb(msgpack.unpackb(data)["config"])
        older = msgspec.msgpack.decode(config, type=_ConfigBefore)
        assert older == _ConfigBefore(worker_id="w-1", block_size=16)
    # A worker from before the field is an aggregated one.
    config = msgspec.to_builtins(CONFIG)
    del config["worker_type"]
    data = msgpack.packb({"type": "hello", "protocol_version": PROTOCOL_VERSION, "config": config})
    decoded = wire.decode_event_message(data)
    assert isinstance(decoded, Hello)
    assert decoded.config.worker_type == "agg"


def _with_handoff(**changes: Any) -> bytes:
    handoff = {**msgspec.to_builtins(HANDOFF), **changes}
    message = {"type": "generate", "request_id": 1, "endpoint": "completions", "body": {}}
    return bytes(msgpack.packb({**message, "handoff": handoff}))


@pytest.mark.parametrize(
    "changes",
    [
        {"handle": ""},
        {"handle": "h" * (MAX_HANDOFF_ID_CHARS + 1)},
        {"worker_id": ""},
        {"dp_rank": -1},
        {"dp_rank": 1024},
        {"block_size": 0},
        {"prompt_tokens": 0},
        {"prompt_tokens": 2**53 + 1},
        {"cached_tokens": -1},
        {"cached_tokens": 11},  # more than the prompt
        {"kv_bytes": -1},
        {"kv_bytes": 2**53 + 1},
        {"block_names": [11]},  # not every full block (10 tokens of 4: two)
        {"block_names": [11, 22, 33]},
        {"block_names": [11, -2]},
        {"block_names": [11, 2**63]},
        {"block_names": "11,22"},
        {"kv_bytes": 1.5},
    ],
    ids=repr,
)
def test_a_handoff_out_of_range_does_not_decode(changes: dict[str, Any]) -> None:
    with pytest.raises(msgspec.DecodeError):
        wire.decode_client_message(_with_handoff(**changes))
    end = msgpack.packb(
        {
            "type": "end",
            "request_id": 1,
            "prompt_tokens": 10,
            "completion_tokens": 0,
            "handoff": {**msgspec.to_builtins(HANDOFF), **changes},
        }
    )
    with pytest.raises(msgspec.DecodeError):
        wire.decode_worker_message(end)


def test_a_handoff_may_name_no_blocks_and_is_bounded_in_names() -> None:
    # A prefill worker without a prefix cache names no blocks; the bound keeps a hand-off, twice
    # over, inside one message.
    assert wire.decode_client_message(_with_handoff(block_names=[])) is not None
    big = MAX_HANDOFF_BLOCKS
    names = list(range(big))
    data = _with_handoff(block_names=names, prompt_tokens=big * 4, cached_tokens=0)
    assert 2 * len(data) < wire.MAX_MESSAGE_BYTES
    assert wire.decode_client_message(data) is not None
    with pytest.raises(msgspec.DecodeError):
        wire.decode_client_message(
            _with_handoff(block_names=[*names, big], prompt_tokens=(big + 1) * 4, cached_tokens=0)
        )


def test_a_generate_with_every_field_is_still_stamped_with_its_frontend_time() -> None:
    full = Generate(
        request_id=7,
        endpoint="completions",
        body={"prompt": "a"},
        priority=3,
        tenant="t",
        dp_rank=1,
        prefill_only=True,
        handoff=HANDOFF,
    )
    stamped = wire.with_frontend_ms(wire.encode(full), 250)
    assert wire.decode_client_message(stamped) == msgspec.structs.replace(full, frontend_ms=250)
