"""What this frontend accepts of a worker's hello (pure): every announced size bounded.

A worker's :class:`~shim_common.wire.RuntimeConfig` sizes what the frontend keeps for it (one
rank state per data-parallel rank, one series per rank on ``/metrics``) and enters its
arithmetic (block counts, the busy rule). A hello outside these bounds is refused: the link ends
the session with the reason (logged, counted as a failed connection) and retries with backoff,
and nothing of the worker reaches the load state.

- ``worker_id``: 1 to :data:`MAX_WORKER_ID_CHARS` characters; ``model``: 1 to
  :data:`MAX_MODEL_CHARS` (both become metric labels).
- ``data_parallel_size``: of the kind :data:`~shim_common._numbers.RANKS` (1 to 1,024), so one
  worker costs at most that many rank states and three per-rank series on ``/metrics``,
  whatever it claims.
- Counts (``kv_total_blocks``, ``block_size``, ``max_num_batched_tokens``, ``max_num_seqs``,
  ``request_queue_limit``, ``engine_request_limit`` when set): of the kind
  :data:`~shim_common._numbers.COUNT` (0 to 2**53), as the worker's own flags are; and
  ``kv_total_blocks`` at most :data:`MAX_KV_BLOCKS` (64 Mi) a rank, more than any engine's
  cache holds: at one token a block (SGLang's pages) that is some 400 GB of the smallest
  models' cache in FP8 (6 KB a token), more than a GPU has. What a worker claims of its cache
  sizes what the frontend keeps for it (its KV index, bounded there too), never what it lets
  it send.
- ``heartbeat_interval``: more than 0 and at most :data:`MAX_HEARTBEAT_INTERVAL` (60 s), the
  range of the worker's own ``--heartbeat-interval``. A hello outside it is refused, not
  clamped: the link judges a worker gone after three heartbeat intervals of silence, and the
  load state judges it stale after a few; a claim of an hour (or of 0, "never stale") would let
  a worker that fell silent keep receiving requests that then hang, and clamping would judge a
  worker by a heartbeat it does not send.
- ``load_publish_interval``: of the kind :data:`~shim_common._numbers.SECONDS`, at most
  :data:`MAX_INTERVAL` (it spaces the worker's batches, not its heartbeats).

The hello itself, and anything a peer sends before it, is read under :data:`MAX_HELLO_BYTES`
(16 KiB; the largest hello these bounds accept is about 3.5 KB, with every name at its longest
in four-byte characters; a typical one is 400 bytes, however many ranks it announces).

Once accepted, the hello also bounds the size of the worker's event messages
(:func:`event_message_bound`): the largest batch of its load (one load event per rank and a
heartbeat repeating every rank, about 310 bytes a rank at the widest integers) with room to
spare, and, when this frontend subscribed to the worker's KV events (it asked for them, in
``kv`` router mode, and the worker lists :data:`~shim_common.wire.FEATURE_KV_EVENTS`), room for
one message of KV events besides (:func:`kv_message_bytes`), which does not grow with the cache
the worker claims:

- a worker that also lists :data:`~shim_common.wire.FEATURE_KV_PARTS` is asked for parts: room
  for one part, :data:`KV_PART_BYTES`, whatever its cache;
- an older one sends its whole cache (or a backlog of an event per block) in one message, so its
  KV events are asked for only when that fits :data:`LEGACY_KV_BYTES` (64 bytes a block of every
  rank, and at least the worker's least backlog); a larger older worker is not subscribed to and
  is routed on the router's own guesses, as with ``--no-router-kv-events``.

A worker sends no KV events to a frontend that did not ask, so listing the feature earns it
nothing there. A message over the bound ends the session from its frame's header (the link backs
off), so a peer that claims to be a worker cannot make the frontend read, hold and decode
megabytes at a time; how many messages it may send is the KV budget's
(:mod:`frontend_shim._kv_budget`).
"""

from __future__ import annotations

from typing import Final

from shim_common import wire
from shim_common._numbers import COUNT, RANKS, SECONDS, Kind, NumberError

__all__ = [
    "MAX_COUNT",
    "MAX_HELLO_BYTES",
    "MAX_KV_BLOCKS",
    "MAX_DATA_PARALLEL_SIZE",
    "MAX_HEARTBEAT_INTERVAL",
    "MAX_INTERVAL",
    "MAX_MODEL_CHARS",
    "MAX_WORKER_ID_CHARS",
    "event_message_bound",
    "kv_message_bytes",
    "refusal",
]

#: Data-parallel ranks one worker may announce (the kind's bound).
MAX_DATA_PARALLEL_SIZE: Final = RANKS.high
#: Largest announced count (blocks, tokens, sequences, queue places): the kind's bound.
MAX_COUNT: Final = COUNT.high
#: Largest announced cache, in blocks a rank (the protocol's bound).
MAX_KV_BLOCKS: Final = wire.MAX_KV_BLOCKS
#: Largest first message of either plane (the hello), before it is accepted.
MAX_HELLO_BYTES: Final = 16 * 1024
#: Longest announced publish interval, in seconds.
MAX_INTERVAL: Final = 3600.0
#: Longest announced heartbeat interval, in seconds: where the worker's own flag stops.
MAX_HEARTBEAT_INTERVAL: Final = 60.0
MAX_WORKER_ID_CHARS: Final = 256
MAX_MODEL_CHARS: Final = 512
#: Bytes of every event message besides its ranks' share (the batch, its stamps, its tags) ...
EVENT_MESSAGE_BASE_BYTES: Final = 64 * 1024
#: ... bytes per announced rank (a load event and a heartbeat's entry: about 310 at most) ...
EVENT_MESSAGE_RANK_BYTES: Final = 1024
#: ... and, with KV events in parts, room for one part: at most ``wire.KV_PART_NAMES`` names at
#: 9 bytes (and an event's tags counted as 8 names), about 19 KB, whatever the cache.
KV_PART_BYTES: Final = 32 * 1024
#: An older worker's KV events (no parts) are asked for only when the largest message they make
#: fits this: a snapshot costs 9 bytes a block at most, and a backlog of events (one block each,
#: the worst case, at most one per block before the worker sends a snapshot instead) about 45
#: bytes of event per block, so 64 bytes a block of every rank: 4,096 blocks in all at most (the
#: fleet simulator's 4 ranks of 1,000), at most 4 ms of decoding and applying here for any bytes.
LEGACY_KV_BYTES: Final = 256 * 1024
#: Bytes per block of every rank an older worker's KV message may take (see above).
EVENT_MESSAGE_BLOCK_BYTES: Final = 64
#: The least backlog of block names a worker lets pile up before it sends a snapshot instead.
LEGACY_BACKLOG_BLOCKS: Final = 1024


def refusal(config: wire.RuntimeConfig) -> str | None:
    """Why this frontend refuses a worker's announced configuration, or ``None``."""
    for name, text, longest in (
        ("worker_id", config.worker_id, MAX_WORKER_ID_CHARS),
        ("model", config.model, MAX_MODEL_CHARS),
    ):
        if not 1 <= len(text) <= longest:
            return f"{name} of {len(text)} characters (1 to {longest} accepted)"
    if not _of_kind(RANKS, config.data_parallel_size):
        return (
            f"data_parallel_size {config.data_parallel_size} "
            f"(1 to {MAX_DATA_PARALLEL_SIZE} accepted)"
        )
    counts = {
        "kv_total_blocks": config.kv_total_blocks,
        "block_size": config.block_size,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
        "request_queue_limit": config.request_queue_limit,
        "engine_request_limit": config.engine_request_limit,
    }
    for name, count in counts.items():
        if count is not None and not _of_kind(COUNT, count):
            return f"{name} {count} (0 to {MAX_COUNT} accepted)"
    if config.kv_total_blocks > MAX_KV_BLOCKS:
        return f"kv_total_blocks {config.kv_total_blocks} (0 to {MAX_KV_BLOCKS} accepted)"
    heartbeat = config.heartbeat_interval
    if not (_of_kind(SECONDS, heartbeat) and 0 < heartbeat <= MAX_HEARTBEAT_INTERVAL):
        return (
            f"heartbeat_interval {heartbeat} "
            f"(more than 0, at most {MAX_HEARTBEAT_INTERVAL:g} seconds accepted)"
        )
    publish = config.load_publish_interval
    if not (_of_kind(SECONDS, publish) and publish <= MAX_INTERVAL):
        return f"load_publish_interval {publish} (0 to {MAX_INTERVAL:g} seconds accepted)"
    return None


def _of_kind(kind: Kind[int] | Kind[float], value: object) -> bool:
    try:
        kind.check(value)
    except NumberError:
        return False
    return True


def kv_message_bytes(config: wire.RuntimeConfig, *, parts: bool) -> int | None:
    """Room for KV events in one event message of a worker whose accepted hello is ``config``
    (bytes); ``parts``: it lists :data:`~shim_common.wire.FEATURE_KV_PARTS`. ``None``: an older
    worker whose largest KV message would not fit :data:`LEGACY_KV_BYTES`, whose KV events are
    not to be asked for."""
    if parts:
        return KV_PART_BYTES
    blocks = max(LEGACY_BACKLOG_BLOCKS, config.kv_total_blocks * config.data_parallel_size)
    legacy = EVENT_MESSAGE_BLOCK_BYTES * blocks
    return legacy if legacy <= LEGACY_KV_BYTES else None


def event_message_bound(config: wire.RuntimeConfig, *, kv_bytes: int = 0) -> int:
    """The largest event message accepted from a worker whose accepted hello is ``config``
    (bytes, at most :data:`~shim_common.wire.MAX_MESSAGE_BYTES`); ``kv_bytes``: room for KV
    events, when this frontend subscribed to them (:func:`kv_message_bytes`)."""
    ranks = config.data_parallel_size
    bound = EVENT_MESSAGE_BASE_BYTES + EVENT_MESSAGE_RANK_BYTES * ranks + kv_bytes
    return min(bound, wire.MAX_MESSAGE_BYTES)
