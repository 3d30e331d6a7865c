"""The lean simulator's workers (``lean_sim.py`` rules 2 and 3): the features a simulated worker
lists, the limits it announces and the real worker's defaults it keeps, its hello, the busy rule
compiled once, and each worker's state. A worker holds
its event-plane subscribers as :class:`Subscriber` (``lean_planes.EventPlane`` is the one), so
that this module needs nothing of the planes.
"""

from __future__ import annotations

import socket
import typing
from typing import Final

from bench.fleet.lean_frames import OP_BINARY, server_frame
from bench.fleet.model import CURRENT_FEATURES, KV_TOTAL_BLOCKS, MODEL, Protocol
from shim_common._busy import rank_busy
from shim_common.wire import (
    FEATURE_BUSY_EDGES,
    FEATURE_CLASSES,
    FEATURE_FRONTEND_TIME,
    FEATURE_KV_EVENTS,
    FEATURE_PUBLISH_INTERVAL,
    FEATURE_REQUEST_BATCH,
    PROTOCOL_VERSION,
    BusyThresholds,
    Heartbeat,
    Hello,
    KvEvent,
    RankLoad,
    RuntimeConfig,
    encode,
)

#: What the real worker lists in its hello now (``Worker.hello``; a test keeps them equal).
NEW_FEATURES: Final = (
    FEATURE_BUSY_EDGES,
    FEATURE_CLASSES,
    FEATURE_FRONTEND_TIME,
    FEATURE_PUBLISH_INTERVAL,
    FEATURE_REQUEST_BATCH,
)
# The announced limits: those of bench/fleet_sim.py.
BLOCK_SIZE: Final = 16
MAX_NUM_BATCHED_TOKENS: Final = 8192
MAX_NUM_SEQS: Final = 256
#: Q in force on a worker whose N is unset, and its engine slots.
UNLIMITED_QUEUE_LIMIT: Final = 40_000
UNLIMITED_ENGINE_SLOTS: Final = 10_000
#: Requests one request plane holds at most (every slot and queue place); more are rejected.
MAX_IN_FLIGHT: Final = UNLIMITED_ENGINE_SLOTS + UNLIMITED_QUEUE_LIMIT

# The real worker's defaults.
HEARTBEAT_INTERVAL: Final = 1.0
PUBLISH_INTERVAL: Final = 0.1
EDGE_GAP_SHARE: Final = 1 / 20
PING_INTERVAL: Final = 10.0
PING_TIMEOUT: Final = 20.0
DEFAULT_MAX_TOKENS: Final = 16
EMBEDDING_SIZE: Final = 8

#: Heartbeats are produced in this many slots of the interval (spread, like the ticks).
HEARTBEAT_SLOTS: Final = 20
#: Seconds between two passes over the connections for keepalive pings and stale handshakes.
KEEPALIVE_SWEEP: Final = 1.0
#: An upgrade request head larger than this, or not complete within HANDSHAKE_SECONDS, is dropped.
MAX_HEAD_BYTES: Final = 16 * 1024
HANDSHAKE_SECONDS: Final = 10.0
#: Tokens one request makes per pass of the loop (so a long one can still be cancelled).
TOKENS_PER_PASS: Final = 64
#: Bytes waiting in a request connection's output before its requests pause (backpressure).
MAX_PENDING_OUTPUT: Final = 1 << 20
RECEIVE_BYTES: Final = 64 * 1024


class Subscriber(typing.Protocol):
    """What a worker asks of an event-plane subscriber it holds."""

    #: The subscriber asked for KV events (rule 6).
    kv_on: bool

    def changed(self, now: float) -> None:
        """The worker's loads changed: send or schedule a batch."""

    def schedule(self, now: float) -> None:
        """Something is pending (a heartbeat, say): send it if due, else note when."""

    def kv_event(self, event: KvEvent, names: int) -> None:
        """Queue a KV event of ``names`` block names."""


# ----------------------------------------------------------------------------- the workers


def hello_of(worker_id: str, ranks: int, protocol: Protocol, kv_events: bool = False) -> Hello:
    """The hello a simulated worker sends on both planes (rules 2 and 6)."""
    features = {"new": list(NEW_FEATURES), "current": list(CURRENT_FEATURES), "v1": []}[protocol]
    if kv_events and protocol == "new":
        features.append(FEATURE_KV_EVENTS)
    return Hello(
        protocol_version=PROTOCOL_VERSION,
        config=RuntimeConfig(
            worker_id=worker_id,
            model=MODEL,
            kv_total_blocks=KV_TOTAL_BLOCKS,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=MAX_NUM_SEQS,
            data_parallel_size=ranks,
            engine_request_limit=None,
            request_queue_limit=UNLIMITED_QUEUE_LIMIT,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            load_publish_interval=0.0 if protocol == "v1" else PUBLISH_INTERVAL,
        ),
        features=features,
    )


def busy_from(thresholds: BusyThresholds) -> int:
    """The fewest blocks that make a rank of this fleet busy under ``thresholds`` (the shared
    busy rule, found once: prefill tokens are always 0 here, so only blocks vary, and the rule
    is monotonic in them). One more than the total when no block count is busy."""
    low, high = 0, KV_TOTAL_BLOCKS + 1
    while low < high:
        middle = (low + high) // 2
        busy = rank_busy(
            thresholds,
            blocks=middle,
            prefill_tokens=0,
            kv_total_blocks=KV_TOTAL_BLOCKS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        )
        if busy:
            high = middle
        else:
            low = middle + 1
    return low


class SimWorker:
    """One simulated worker: its listener, its load, its sequence counter and subscribers."""

    __slots__ = (
        "heartbeat",
        "hello_frame",
        "index",
        "kv_chains",
        "kv_seq",
        "listener",
        "load_seq",
        "load_ts",
        "loads",
        "seq",
        "step",
        "subscribers",
    )

    def __init__(self, index: int, listener: socket.socket, hello: Hello, ranks: int) -> None:
        self.index = index
        self.listener = listener
        self.hello_frame = server_frame(OP_BINARY, encode(hello))
        #: The last ``seq`` given out.
        self.seq = 0
        #: The latest load of every rank, and the ``seq`` of rank 0's (0: never changed; rank r's
        #: is ``load_seq + r``, every rank changing at once) and its wall-clock time.
        self.loads = [
            RankLoad(
                dp_rank=rank, active_decode_blocks=0, active_prefill_tokens=0, kv_used_blocks=0
            )
            for rank in range(ranks)
        ]
        self.load_seq = 0
        self.load_ts = 0.0
        self.step = index * 37
        #: KV events (rule 6): the last ``seq`` given out, and per rank the chains cached, as
        #: ``[oldest, next)``: chain ``k`` holds names ``base + k * B`` to ``base + (k + 1) * B``.
        self.kv_seq = 0
        self.kv_chains = [[0, 0] for _ in range(ranks)]
        #: The newest heartbeat published to every subscriber.
        self.heartbeat: Heartbeat | None = None
        self.subscribers: list[Subscriber] = []

    def new_heartbeat(self, wall: float) -> Heartbeat:
        self.seq += 1
        return Heartbeat(
            seq=self.seq, ts=wall, loads=self.loads, engine_requests=0, queued_requests=0
        )
