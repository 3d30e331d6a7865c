"""The wire protocol of record between frontends and workers.

Both planes speak plain msgpack over binary websocket messages. Every message is a msgpack map
with a ``"type"`` field naming it (msgspec tagged structs), so any msgpack library can read and
write them; docs/protocol.md describes each field.

Rules:

1. The worker speaks first on both paths: a :class:`Hello` with :data:`PROTOCOL_VERSION` and its
   :class:`RuntimeConfig`. A peer that does not know the version closes the connection.
2. Event plane (``/v1/events``): after the hello, every websocket message is one
   :class:`EventBatch`. A batch holds the :class:`LoadEvent` items that piled up since the last
   send; a :class:`Heartbeat` is sent at a fixed interval and repeats the latest load of every
   rank, so a subscriber that missed anything is whole again after one heartbeat, and a
   subscriber that hears nothing for a few intervals knows the worker is gone or wedged.
3. Request plane (``/v1/requests``): the client sends :class:`Generate` and :class:`Cancel`; the
   worker answers each request id with exactly one of :class:`Rejected` or :class:`Failed`
   (before the request started) or :class:`Started` followed by any number of :class:`Chunk`
   and then one :class:`End` or :class:`Failed`. Many requests share one connection. To a
   client that offered :data:`SUBPROTOCOL_BATCH` the worker may send several of these in one
   :class:`Batch`; to a worker that lists :data:`FEATURE_REQUEST_BATCH` the client may send
   several ``generate`` and ``cancel`` messages in one :class:`RequestBatch`, which the worker
   takes exactly as if they had come one by one, in order.
4. Fields are only ever added, never renamed or repurposed; decoders ignore unknown fields, so
   an older peer reads a newer one's messages. A breaking change bumps :data:`PROTOCOL_VERSION`.
   An addition that needs both sides to agree is a *feature*: the worker lists the features it
   speaks in its hello (:attr:`Hello.features`) and a client uses one only when it is listed, so
   a new frontend works with an old worker and the other way round.
5. Event-plane publishing is bounded per subscriber: at most one batch every
   :attr:`RuntimeConfig.load_publish_interval` seconds, each holding the latest load of the ranks
   that changed. With the :data:`FEATURE_BUSY_EDGES` feature a subscriber sends a
   :class:`Subscribe` with the thresholds it routes by; a change that turns one of the worker's
   ranks busy or free under them is then sent at once instead of waiting out the interval.
   With :data:`FEATURE_PUBLISH_INTERVAL` the subscriber may also ask for a longer interval of
   its own (:attr:`Subscribe.publish_interval`): the worker sends it at most one batch every
   ``max(load_publish_interval, publish_interval)`` seconds, edges still at once.
6. KV events (:data:`FEATURE_KV_EVENTS`, listed by a worker with a prefix cache): a subscriber
   that sends a :class:`Subscribe` with ``kv_events=True`` is sent a :class:`KvSnapshot` first,
   then every :class:`KvStored`, :class:`KvRemoved` and :class:`KvCleared` in order, in
   :class:`KvBatch` messages, never coalesced. KV events are numbered per worker, consecutive from
   1 across all its ranks (a snapshot carries the number of the last event it covers); a
   subscriber that sees a jump sends a later :class:`Subscribe` with ``kv_snapshot=True`` and is
   sent a fresh snapshot. A worker whose subscriber cannot keep up sends it a fresh snapshot
   rather than an unbounded backlog. :attr:`Generate.dp_rank` names the rank the router chose.
   In parts (:data:`FEATURE_KV_PARTS`): ``kv`` messages of :data:`KV_PART_NAMES` names at most,
   at :data:`KV_BYTES_PER_SECOND`, a snapshot as :class:`KvSnapshot` parts, whatever the cache.
7. Disaggregated serving (:data:`FEATURE_DISAGG`, :mod:`shim_common._disagg`): a ``prefill_only``
   hop's :class:`End` carries a :class:`Handoff`; a ``generate`` carrying it decodes from its KV.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec

from shim_common._busy import BusyThresholds
from shim_common._disagg import Handoff, WorkerType
from shim_common._numbers import PRIORITY, Priority

__all__ = [
    "Mailbox",
    "CANCEL_REASON_CLIENT",
    "CLOSE_DRAINING",
    "CLOSE_DUPLICATE_REQUEST_ID",
    "CLOSE_PROTOCOL_ERROR",
    "CLOSE_TEXT_MESSAGE",
    "CLOSE_TOO_BIG",
    "CLOSE_UNDECODABLE",
    "EVENTS_PATH",
    "FEATURE_BUSY_EDGES",
    "FEATURE_DISAGG",
    "FEATURE_KV_EVENTS",
    "FEATURE_REQUEST_BATCH",
    "FEATURE_PUBLISH_INTERVAL",
    "MAX_SUBSCRIBER_INTERVAL",
    "REQUESTS_PATH",
    "SUBPROTOCOL_BATCH",
    "REQUEST_BATCH_BYTES",
    "REQUEST_BATCH_MESSAGES",
    "MAX_KV_BLOCKS",
    "MAX_MESSAGE_BYTES",
    "MESSAGE_FRAMES",
    "MESSAGE_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "FEATURE_CLASSES",
    "FEATURE_FRONTEND_TIME",
    "FRONTEND_MS_ROOM",
    "MAX_FRONTEND_MS",
    "MAX_QUEUE_BANDS",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "RejectReason",
    "RejectionKind",
    "TENANT_MAX_CHARS",
    "BusyThresholds",
    "Batch",
    "Cancel",
    "Chunk",
    "ClientMessage",
    "End",
    "Endpoint",
    "EventBatch",
    "Failed",
    "FailureKind",
    "Generate",
    "Handoff",
    "Heartbeat",
    "Hello",
    "FEATURE_KV_PARTS",
    "KV_BYTES_PER_SECOND",
    "KV_PART_NAMES",
    "KvBatch",
    "KvCleared",
    "KvEvent",
    "KvRemoved",
    "KvSnapshot",
    "KvStored",
    "LoadEvent",
    "QueueAhead",
    "QueueBand",
    "RankLoad",
    "Reply",
    "Rejected",
    "RequestBatch",
    "RuntimeConfig",
    "Started",
    "Subscribe",
    "WorkerEvent",
    "WorkerMessage",
    "WorkerType",
    "decode_client_message",
    "decode_event_message",
    "decode_subscriber_message",
    "decode_worker_message",
    "encode",
    "merge_text_chunks",
    "request_batches",
    "with_frontend_ms",
]

PROTOCOL_VERSION: Final = 1

#: Websocket paths of the two planes on a worker's port.
EVENTS_PATH: Final = "/v1/events"
REQUESTS_PATH: Final = "/v1/requests"

#: Close codes a worker sends (RFC 6455 numbers, with the meaning this protocol gives them).
CLOSE_DRAINING: Final = 1001
CLOSE_PROTOCOL_ERROR: Final = 1002
CLOSE_TEXT_MESSAGE: Final = 1003
CLOSE_UNDECODABLE: Final = 1007
CLOSE_DUPLICATE_REQUEST_ID: Final = 1008
CLOSE_TOO_BIG: Final = 1009

#: Hello feature: the worker reads :class:`Subscribe` and pushes busy/free edges at once.
FEATURE_BUSY_EDGES: Final = "busy-edges"
#: Hello feature: the worker reads :attr:`Generate.priority` and :attr:`Generate.tenant` and
#: orders its queue by them (an older worker ignores both, so a client sends them only to a
#: worker that lists this), and :attr:`Started.queue_wait_ms` says how long the request waited.
FEATURE_CLASSES: Final = "classes"

#: The range of a request's priority (lower is served first) and the longest tenant name.
PRIORITY_MIN: Final = PRIORITY.low
PRIORITY_MAX: Final = PRIORITY.high
TENANT_MAX_CHARS: Final = 256

#: Hello feature: the worker reads :attr:`Generate.frontend_ms` and counts it against its
#: time-to-first-token objective (an older worker ignores the field; it is sent only to a worker
#: that lists this).
FEATURE_FRONTEND_TIME: Final = "frontend-time"
#: The largest :attr:`Generate.frontend_ms` (an hour): far beyond any objective.
MAX_FRONTEND_MS: Final = 3_600_000
#: The most priorities a :attr:`LoadEvent.queue_ahead` lists (the best ones queued).
MAX_QUEUE_BANDS: Final = 8

#: Hello feature: the worker honours :attr:`Subscribe.publish_interval` (it reads
#: :class:`Subscribe` even without :data:`FEATURE_BUSY_EDGES`).
FEATURE_PUBLISH_INTERVAL: Final = "publish-interval"
#: Hello feature: the worker has a prefix cache and publishes KV events to a subscriber that asks
#: for them (:attr:`Subscribe.kv_events`), and honours :attr:`Generate.dp_rank`.
FEATURE_KV_EVENTS: Final = "kv-events"
#: The longest :attr:`Subscribe.publish_interval` a subscriber may ask for (seconds).
MAX_SUBSCRIBER_INTERVAL: Final = 60.0

#: The most KV blocks a rank's cache may be announced to hold
#: (:attr:`RuntimeConfig.kv_total_blocks`, 64 Mi): more than any engine's; a frontend refuses a
#: hello past it.
MAX_KV_BLOCKS: Final = 2**26

#: Hello feature: the worker reads :class:`RequestBatch` on the request plane.
FEATURE_REQUEST_BATCH: Final = "request-batch"
#: The most bytes of messages, and the most messages, a client puts in one
#: :class:`RequestBatch` (a worker closes the connection with 1007 on more messages); a message
#: of more bytes goes on its own. Far under the size cap of one message a worker sets by default
#: (:data:`MAX_MESSAGE_BYTES`); a worker that lists the feature takes batches of this size.
REQUEST_BATCH_BYTES: Final = 32 * 1024
REQUEST_BATCH_MESSAGES: Final = 256

#: Websocket subprotocol a client offers on the request plane to say it reads :class:`Batch`.
#: A worker that accepts it may put several replies in one message; one that does not (an older
#: worker) answers without a subprotocol and sends one reply per message, as before.
SUBPROTOCOL_BATCH: Final = "dynamo-shim.batch"

#: Largest websocket message either side accepts (bytes). A request body travels in one message.
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024 + 64 * 1024
#: The most websocket frames a message may come in, on either plane and either way ...
MESSAGE_FRAMES: Final = 1024
#: ... and one more for every this many bytes of it received before. Both sides send every
#: message in one frame; a receiver holds each fragment until its message ends, so the frame past
#: this bound ends the connection (a worker closes it with :data:`CLOSE_PROTOCOL_ERROR`).
MESSAGE_FRAME_BYTES: Final = 256


class RejectionKind(enum.Enum):
    """What a rejection means for whoever routed the request."""

    #: ``Server overloaded:``: the worker is full; mark it and try another.
    OVERLOADED = "overloaded"
    #: ``Server unavailable:``: the worker is going away; stop routing to it.
    UNAVAILABLE = "unavailable"
    #: Anything else: not a capacity problem; not retried elsewhere.
    OTHER = "other"


_OVERLOADED_PREFIX: Final = "Server overloaded:"
_UNAVAILABLE_PREFIX: Final = "Server unavailable:"


class RejectReason(enum.StrEnum):
    """Why a worker turned a request away before it started.

    The value of each reason a worker gives is its text on the wire (:attr:`Rejected.reason`,
    byte for byte what every version of the protocol sends), and this class is the one place
    that text is spelled, read back (:meth:`parse`) and classified (:attr:`kind`, :attr:`key`).
    Frontends classify a text they do not know by the prefix before its colon:
    ``Server overloaded:`` means "this worker is full, try another one";
    ``Server unavailable:`` means "this worker is going away".
    """

    OVERLOADED = "Server overloaded: worker at capacity"
    QUEUE_TIMEOUT = "Server overloaded: queue timeout"
    DISPLACED_PRIORITY = "Server overloaded: displaced by a higher-priority request"
    DISPLACED_SHARE = "Server overloaded: displaced by a fairer share"
    SLO = "Server overloaded: would miss the TTFT objective"
    DRAINING = "Server unavailable: draining"
    #: How a frontend reads an overload text it does not know (a newer worker's); never sent.
    OTHER_OVERLOAD = _OVERLOADED_PREFIX
    #: How a frontend reads an unavailability text it does not know, or a worker's ``Failed``
    #: of kind ``unavailable`` before a start; never sent.
    OTHER_UNAVAILABLE = _UNAVAILABLE_PREFIX
    #: A text with neither prefix: not a capacity problem; never sent.
    OTHER = ""

    @classmethod
    def parse(cls, text: str) -> RejectReason:
        """The reason a :attr:`Rejected.reason` text gives (an unknown text by its prefix)."""
        known = _REASON_OF_TEXT.get(text)
        if known is not None:
            return known
        if text.startswith(_OVERLOADED_PREFIX):
            return cls.OTHER_OVERLOAD
        if text.startswith(_UNAVAILABLE_PREFIX):
            return cls.OTHER_UNAVAILABLE
        return cls.OTHER

    @property
    def kind(self) -> RejectionKind:
        """What the rejection means for routing."""
        return _KIND_OF_REASON[self]

    @property
    def key(self) -> str:
        """The short name, as metrics label it and the frontend's ``x-dynamo-reject-reason``
        header spells it: ``queue_full``, ``queue_timeout``, ``displaced``, ``slo`` or
        ``draining``. An unknown overload is ``queue_full`` (the general overload), an unknown
        unavailability ``draining``, and a text with neither prefix ``other``."""
        return _KEY_OF_REASON[self]


_REASON_OF_TEXT: Final = {reason.value: reason for reason in RejectReason}
_KIND_OF_REASON: Final = {
    reason: (
        RejectionKind.OVERLOADED
        if reason.value.startswith(_OVERLOADED_PREFIX)
        else RejectionKind.UNAVAILABLE
        if reason.value.startswith(_UNAVAILABLE_PREFIX)
        else RejectionKind.OTHER
    )
    for reason in RejectReason
}
_KEY_OF_REASON: Final = {
    RejectReason.OVERLOADED: "queue_full",
    RejectReason.QUEUE_TIMEOUT: "queue_timeout",
    RejectReason.DISPLACED_PRIORITY: "displaced",
    RejectReason.DISPLACED_SHARE: "displaced",
    RejectReason.SLO: "slo",
    RejectReason.DRAINING: "draining",
    RejectReason.OTHER_OVERLOAD: "queue_full",
    RejectReason.OTHER_UNAVAILABLE: "draining",
    RejectReason.OTHER: "other",
}

CANCEL_REASON_CLIENT: Final = "client cancelled"

Endpoint = Literal["chat_completions", "completions", "embeddings"]
FailureKind = Literal["bad_request", "engine", "cancelled", "unavailable"]


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker announces about itself in its hello."""

    worker_id: str
    model: str
    kv_total_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    data_parallel_size: int
    #: N as configured; ``None`` when unset (the gate then has 10000 slots).
    engine_request_limit: int | None
    #: Q in force: as configured (16 by default) when N or W is set, 40000 when neither is.
    request_queue_limit: int
    #: Seconds between heartbeats on the event plane.
    heartbeat_interval: float
    #: Seconds between two event batches to one subscriber at most (0: a worker from before
    #: the bound, which publishes on every change).
    load_publish_interval: float = 0.0
    #: ``--disaggregation-mode``; ``agg`` from older workers, and to a frontend that ignores it.
    worker_type: WorkerType = "agg"


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag="hello", tag_field="type"):
    protocol_version: int
    config: RuntimeConfig
    #: Optional protocol additions this worker speaks (``FEATURE_*``); empty for older workers.
    features: list[str] = []


# ----------------------------------------------------------------------------- event plane


class RankLoad(msgspec.Struct, frozen=True, kw_only=True):
    """The load of one data-parallel rank, as the engine sees it."""

    dp_rank: int
    active_decode_blocks: int
    active_prefill_tokens: int
    #: KV blocks in use on this rank (what the decode threshold compares with the total).
    kv_used_blocks: int


#: For one priority queued at a worker: ``(priority, requests queued ahead)``, how many queued
#: requests an arrival of that priority would start behind (the one about to start, whatever its
#: priority, and those of that priority or a better one).
QueueBand = tuple[Priority, Annotated[int, msgspec.Meta(ge=0)]]
#: :attr:`LoadEvent.queue_ahead`: one band per priority queued, best first, at most
#: :data:`MAX_QUEUE_BANDS` (an empty list: nothing queued).
QueueAhead = Annotated[list[QueueBand], msgspec.Meta(max_length=MAX_QUEUE_BANDS)]


class LoadEvent(msgspec.Struct, frozen=True, kw_only=True, tag="load", tag_field="type"):
    """One rank's load changed. ``seq`` increases by one per event or heartbeat of a worker."""

    seq: int
    #: Wall-clock seconds since the epoch when the worker produced the event.
    ts: float
    load: RankLoad
    #: Ingress gauges of the whole worker at that moment.
    engine_requests: int
    queued_requests: int
    #: L, the engine limit in force, sent only by a worker with a time-to-first-token objective
    #: (``None`` from any other worker, and from workers that predate the field).
    effective_limit: int | None = None
    #: The queue by priority (:data:`QueueAhead`), sent only by a worker that refuses by the
    #: time a request would wait (a time-to-first-token objective or a queue timeout), which
    #: compares the figure of a request's priority with its bound; ``None`` from any other
    #: worker, and from workers that predate the field.
    queue_ahead: QueueAhead | None = None


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="heartbeat", tag_field="type"):
    """Sent every ``heartbeat_interval`` seconds; repeats the latest load of every rank."""

    seq: int
    ts: float
    loads: list[RankLoad]
    engine_requests: int
    queued_requests: int
    #: ``ready`` or ``draining``.
    status: str = "ready"
    #: As in :class:`LoadEvent`.
    effective_limit: int | None = None
    queue_ahead: QueueAhead | None = None


WorkerEvent = LoadEvent | Heartbeat


class Mailbox:
    """Pending events of one worker, latest-wins (sans-IO): at most one load event per rank and
    at most one heartbeat.

    The rule both sides coalesce by: a newer load event replaces an older one of the same rank,
    and a heartbeat (which repeats every rank) makes every older load event, and an older
    heartbeat, redundant. What :meth:`take` returns, applied alone, leaves a receiver where
    applying every event put in, in order, would. A worker keeps one per subscriber; a frontend
    folds what one read brought through one.
    """

    __slots__ = ("_heartbeat", "_loads")

    def __init__(self) -> None:
        self._loads: dict[int, LoadEvent] = {}
        self._heartbeat: Heartbeat | None = None

    def __len__(self) -> int:
        return len(self._loads) + (self._heartbeat is not None)

    def put(self, event: WorkerEvent) -> None:
        """Add an event, replacing what it supersedes.

        Args:
            event: A load event or a heartbeat, in increasing ``seq`` order.
        """
        if isinstance(event, Heartbeat):
            self._heartbeat = event
            self._loads.clear()
        else:
            self._loads[event.load.dp_rank] = event

    def take(self) -> list[WorkerEvent]:
        """Remove and return everything pending, oldest first.

        Returns:
            The pending events ordered by ``seq``; empty when nothing is pending.
        """
        events: list[WorkerEvent] = list(self._loads.values())
        if self._heartbeat is not None:
            events.append(self._heartbeat)
        self._loads.clear()
        self._heartbeat = None
        events.sort(key=_seq_of)
        return events


def _seq_of(event: WorkerEvent) -> int:
    return event.seq


class EventBatch(msgspec.Struct, frozen=True, kw_only=True, tag="events", tag_field="type"):
    """Everything that piled up since the last websocket message, oldest first."""

    events: list[WorkerEvent]
    #: Wall-clock seconds since the epoch when the worker wrote the batch (0.0 from older
    #: workers). A subscriber compares it with its own clock to see how far behind it reads.
    sent: float = 0.0


class Subscribe(msgspec.Struct, frozen=True, kw_only=True, tag="subscribe", tag_field="type"):
    """Sent by a subscriber on the event plane, to a worker that lists
    :data:`FEATURE_BUSY_EDGES` or :data:`FEATURE_PUBLISH_INTERVAL`; a later one replaces the
    earlier. ``thresholds`` is the one thresholds type of both sides (:class:`BusyThresholds`,
    defined in ``shim_common._busy``, which says what each field means and checks its range on
    decode)."""

    thresholds: BusyThresholds
    #: Seconds between two batches this subscriber asks for at most (0: the worker's own
    #: interval). Honoured by workers listing :data:`FEATURE_PUBLISH_INTERVAL`, bounded below by
    #: their own ``load_publish_interval``; older workers ignore it.
    publish_interval: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SUBSCRIBER_INTERVAL)] = 0.0
    #: Send this subscriber KV events (a worker listing :data:`FEATURE_KV_EVENTS`; older
    #: workers ignore it): a :class:`KvSnapshot` first, then every event in order.
    kv_events: bool = False
    #: On a later Subscribe with ``kv_events``: the subscriber saw a gap in the KV events' ``seq``
    #: and asks for a fresh :class:`KvSnapshot`, from which the events continue.
    kv_snapshot: bool = False
    #: With ``kv_events``: send them in parts (rule 6; older workers ignore it).
    kv_parts: bool = False


# ----------------------------------------------------------------------------- KV events

#: Hello feature: the worker sends KV events in parts to a subscriber that asks (rule 6).
FEATURE_KV_PARTS: Final = "kv-parts"
#: Block names in one ``kv`` message of parts at most, an event counting 8 more (about 19 KB).
KV_PART_NAMES: Final = 2048
#: ``kv`` bytes a second of parts at most: after a message of B bytes, the next waits B / this.
KV_BYTES_PER_SECOND: Final = 256 * 1024


class KvStored(msgspec.Struct, frozen=True, kw_only=True, tag="kv-stored", tag_field="type"):
    """Blocks entered rank ``dp_rank``'s cache: ``blocks`` is a chain of block names
    (:func:`shim_common.prefix.block_names`), the first one's parent ``parent`` (``None``: the
    chain starts a prompt)."""

    seq: int
    dp_rank: int
    parent: int | None
    blocks: list[int]


class KvRemoved(msgspec.Struct, frozen=True, kw_only=True, tag="kv-removed", tag_field="type"):
    """Blocks left rank ``dp_rank``'s cache (evicted)."""

    seq: int
    dp_rank: int
    blocks: list[int]


class KvCleared(msgspec.Struct, frozen=True, kw_only=True, tag="kv-cleared", tag_field="type"):
    """Every block left rank ``dp_rank``'s cache."""

    seq: int
    dp_rank: int


class KvSnapshot(msgspec.Struct, frozen=True, kw_only=True, tag="kv-snapshot", tag_field="type"):
    """The whole cache of a worker: ``ranks[r]`` holds the block names cached on rank ``r``, as
    they stand after KV event ``seq`` (0: before any event). It replaces whatever the subscriber
    believed; the events after it continue from ``seq + 1``. In parts (rule 6): ``more`` on every
    part of one ``seq`` but the last, back to back; the cache is the union of their ``ranks``."""

    seq: int
    ranks: list[list[int]]
    more: bool = False


KvEvent = KvStored | KvRemoved | KvCleared | KvSnapshot


class KvBatch(msgspec.Struct, frozen=True, kw_only=True, tag="kv", tag_field="type"):
    """KV events in order, on the event plane; never coalesced."""

    events: list[KvEvent]


# ----------------------------------------------------------------------------- request plane

#: Hello feature: the worker runs ``prefill_only`` and ``handoff`` hops; it honours ``dp_rank``.
FEATURE_DISAGG: Final = "disagg"
class Generate(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="generate", tag_field="type"
):
    """Run one request. ``body`` is the OpenAI request body as the client sent it.

    Fields at their defaults are left out of the encoding, so a request of the default class
    is the same bytes an older peer sends and reads.
    """

    request_id: int
    endpoint: Endpoint
    body: dict[str, Any]
    #: Lower is served first, in [``PRIORITY_MIN``, ``PRIORITY_MAX``]; sent only to a worker
    #: that lists :data:`FEATURE_CLASSES`.
    priority: Priority = 0
    #: Whose request this is, for fair sharing (at most ``TENANT_MAX_CHARS`` characters; ``""``
    #: is the shared tenant); sent only to a worker that lists :data:`FEATURE_CLASSES`.
    tenant: Annotated[str, msgspec.Meta(max_length=TENANT_MAX_CHARS)] = ""
    #: The data-parallel rank the router chose, honoured by a worker that lists
    #: :data:`FEATURE_KV_EVENTS` or :data:`FEATURE_DISAGG` (``None``, or a rank the worker does
    #: not have: its own pick).
    dp_rank: int | None = None
    #: Whole milliseconds the request had already spent in the frontend when this was sent
    #: (parsing, routing, its own queue): the objective is the client's, so a worker that lists
    #: :data:`FEATURE_FRONTEND_TIME` counts it against the room a request has to wait.
    frontend_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_FRONTEND_MS)] = 0
    #: Prefill, keep the KV for a hand-off, generate nothing (``started``, then an ``end`` with
    #: :attr:`End.handoff`). This and ``handoff``: only to a worker listing :data:`FEATURE_DISAGG`.
    prefill_only: bool = False
    #: Decode from a prefill hop's :attr:`End.handoff` (same body) instead of prefilling.
    handoff: Handoff | None = None


class Cancel(msgspec.Struct, frozen=True, kw_only=True, tag="cancel", tag_field="type"):
    """Either side gives up on a request; the worker frees its slot or queue place at once."""

    request_id: int
    reason: str = CANCEL_REASON_CLIENT


class Rejected(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="rejected", tag_field="type"
):
    """The request never started; ``reason`` is a :class:`RejectReason`'s text (a frontend reads
    it back with :meth:`RejectReason.parse`)."""

    request_id: int
    reason: str
    #: With :attr:`RejectReason.SLO`: the queue depth the worker refuses at, B (an arrival
    #: with B or more requests queued ahead of it is refused), so a frontend holds the worker
    #: back only while its queue is that long, not for every later request. ``None`` from a
    #: worker that predates the field, and with every other reason.
    queue_bound: int | None = None

    @classmethod
    def of(cls, request_id: int, reason: RejectReason, queue_bound: int | None = None) -> Rejected:
        """The message for a worker's rejection: where a reason becomes the wire's text."""
        return cls(request_id=request_id, reason=reason.value, queue_bound=queue_bound)


class Started(msgspec.Struct, frozen=True, kw_only=True, tag="started", tag_field="type"):
    """The request holds an engine slot now; the frontend may send its HTTP status line."""

    request_id: int
    prompt_tokens: int
    #: Whole milliseconds the request waited in the worker's queue before it started (0 from a
    #: worker without :data:`FEATURE_CLASSES`, or when it started at once).
    queue_wait_ms: int = 0


class Chunk(msgspec.Struct, frozen=True, kw_only=True, tag="chunk", tag_field="type"):
    """A piece of output: generated text (and its token count) or an embedding."""

    request_id: int
    text: str = ""
    tokens: int = 0
    #: For ``chat_completions``/``completions``: ``None`` until the last chunk.
    finish_reason: str | None = None
    embedding: list[float] | None = None
    #: Which choice this text belongs to (a request with ``n`` > 1), or for embeddings with
    #: several inputs which input this vector belongs to.
    index: int = 0


class End(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="end", tag_field="type"
):
    """The request completed normally."""

    request_id: int
    prompt_tokens: int
    completion_tokens: int
    #: Of the prompt tokens, those found in the engine's prefix cache (0 when none, or unknown,
    #: or from an older worker).
    cached_tokens: int = 0
    #: Where the request's life falls among the worker's events, as the ``seq`` of its last
    #: event or heartbeat at three moments (``None`` from a worker that predates the fields):
    #: when the request took its slot (events after it count the request), when its first
    #: output came (events after it no longer count its prompt as waiting for prefill), and
    #: when it had given its slot and blocks back (events after it no longer count it). A
    #: frontend takes a finished request out of the reports it holds from within that window.
    started_seq: int | None = None
    first_output_seq: int | None = None
    ended_seq: int | None = None
    #: The prompt's KV held for a decode worker, on a ``prefill_only`` hop's end only.
    handoff: Handoff | None = None


class Failed(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="failed", tag_field="type"
):
    """The request ended in error, before or after it started."""

    request_id: int
    kind: FailureKind
    message: str
    #: As in :class:`End`, for a request that had started.
    started_seq: int | None = None
    first_output_seq: int | None = None
    ended_seq: int | None = None


Reply = Rejected | Started | Chunk | End | Failed | Cancel


class Batch(msgspec.Struct, frozen=True, kw_only=True, tag="batch", tag_field="type"):
    """Several replies in one message, in order, to a client that offered
    :data:`SUBPROTOCOL_BATCH`: a short request's start, chunks and end cost one websocket
    message instead of three or more."""

    messages: list[Reply]


class RequestBatch(msgspec.Struct, frozen=True, kw_only=True, tag="batch", tag_field="type"):
    """Several client messages in one, in order, to a worker that lists
    :data:`FEATURE_REQUEST_BATCH`: the requests that queued up in a frontend during one write
    cost the worker one websocket message to read and decode instead of one each."""

    messages: Annotated[list[Generate | Cancel], msgspec.Meta(max_length=REQUEST_BATCH_MESSAGES)]


ClientMessage = Generate | Cancel | RequestBatch
WorkerMessage = Hello | Rejected | Started | Chunk | End | Failed | Cancel | Batch

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_worker_decoder = msgspec.msgpack.Decoder(WorkerMessage)
_event_decoder: msgspec.msgpack.Decoder[Hello | EventBatch | KvBatch] = msgspec.msgpack.Decoder(
    Hello | EventBatch | KvBatch
)
_subscriber_decoder = msgspec.msgpack.Decoder(Subscribe)


def encode(message: msgspec.Struct) -> bytes:
    """Encode any message of this module as msgpack bytes."""
    return _encoder.encode(message)


#: The ``frontend_ms`` key as msgpack, and the most bytes :func:`with_frontend_ms` adds.
_FRONTEND_MS_KEY: Final = _encoder.encode("frontend_ms")
FRONTEND_MS_ROOM: Final = len(_FRONTEND_MS_KEY) + 5


def with_frontend_ms(data: bytes, frontend_ms: int) -> bytes:
    """An encoded :class:`Generate` whose ``frontend_ms`` was left at 0, with it set: the map's
    length goes up by one and the pair is appended (a decoder takes the fields in any order),
    so the time can be taken just before the message is written without encoding the body
    again. At most :data:`FRONTEND_MS_ROOM` bytes longer; ``data`` itself when 0.

    Raises:
        ValueError: ``frontend_ms`` out of range, or ``data`` is not such a message.
    """
    if not 0 <= frontend_ms <= MAX_FRONTEND_MS:
        raise ValueError(f"frontend_ms out of range: {frontend_ms}")
    if frontend_ms == 0:
        return data
    head = data[0] if data else 0
    # A Generate is a map of at most 10 fields: always a fixmap (0x80 | length, length < 16).
    if head & 0xF0 != 0x80 or head == 0x8F:
        raise ValueError("not an encoded Generate without frontend_ms")
    return b"".join(
        (bytes((head + 1,)), memoryview(data)[1:], _FRONTEND_MS_KEY, _encoder.encode(frontend_ms))
    )


#: A :class:`RequestBatch` up to its list, whose length follows (msgspec writes the tag first).
_REQUEST_BATCH_HEAD: Final = _encoder.encode(RequestBatch(messages=[]))[:-1]


def request_batches(messages: list[bytes]) -> list[bytes]:
    """Encoded client messages (:class:`Generate`, :class:`Cancel`) packed, in order, into as
    few messages as :data:`REQUEST_BATCH_BYTES` and :data:`REQUEST_BATCH_MESSAGES` allow: each
    run of two or more as one :class:`RequestBatch`, a message left alone (a large one, or the
    last) as it was. Nothing is decoded: a batch is its head and the messages' bytes.
    """
    packed: list[bytes] = []
    run: list[bytes] = []
    run_bytes = 0

    def close_run() -> None:
        if len(run) == 1:
            packed.append(run[0])
        elif run:
            count = len(run)  # at most REQUEST_BATCH_MESSAGES: a fixarray or an array 16
            length = bytes((0x90 | count,)) if count < 16 else b"\xdc" + count.to_bytes(2, "big")
            packed.append(b"".join([_REQUEST_BATCH_HEAD, length, *run]))
        run.clear()

    for data in messages:
        if run and (
            run_bytes + len(data) > REQUEST_BATCH_BYTES or len(run) == REQUEST_BATCH_MESSAGES
        ):
            close_run()
            run_bytes = 0
        run.append(data)
        run_bytes += len(data)
    close_run()
    return packed


_Decoded = TypeVar("_Decoded")


def _decode(decoder: msgspec.msgpack.Decoder[_Decoded], data: bytes) -> _Decoded:
    try:
        return decoder.decode(data)
    except RecursionError:
        # Arrays or maps nested past the interpreter's depth (a body field is free-form):
        # undecodable like any other bad input, never an unexpected exception.
        raise msgspec.DecodeError("msgpack nested too deeply") from None


def decode_client_message(data: bytes) -> ClientMessage:
    """Decode what a frontend sends on the request plane.

    Raises:
        msgspec.DecodeError: the bytes are not msgpack, not a known message (a
            ``msgspec.ValidationError`` for a known type with a bad field), or nested too
            deeply to decode.
    """
    return _decode(_client_decoder, data)


def decode_worker_message(data: bytes) -> WorkerMessage:
    """Decode what a worker sends on the request plane (raises like the above)."""
    return _decode(_worker_decoder, data)


def decode_event_message(data: bytes) -> Hello | EventBatch | KvBatch:
    """Decode what a worker sends on the event plane (raises like the above)."""
    return _decode(_event_decoder, data)


def decode_subscriber_message(data: bytes) -> Subscribe:
    """Decode what a subscriber sends on the event plane (raises like the above)."""
    return _decode(_subscriber_decoder, data)


def merge_text_chunks(earlier: Chunk, later: Chunk) -> Chunk | None:
    """One chunk carrying both, or ``None`` when the two must stay apart.

    The one rule of chunk merging, for whichever side has chunks of a request queued up: only
    text chunks of the same request and the same choice (``index``) merge, an embedding never
    does, and nothing follows a chunk that carries a finish reason. Text is concatenated, token
    counts add up, and the later finish reason is kept.
    """
    if (
        earlier.embedding is not None
        or later.embedding is not None
        or earlier.finish_reason is not None
        or earlier.request_id != later.request_id
        or earlier.index != later.index
    ):
        return None
    return Chunk(
        request_id=later.request_id,
        text=earlier.text + later.text,
        tokens=earlier.tokens + later.tokens,
        finish_reason=later.finish_reason,
        index=later.index,
    )
