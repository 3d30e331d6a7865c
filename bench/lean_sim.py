"""A lean simulated fleet for ``bench/bench_fleet.py``: K workers' wire behaviour in one cheap loop.

Run: ``python bench/lean_sim.py --workers 2048 [--ranks 4] [--rate 20] [--protocol current]``.
The command line, the control protocol on stdin/stdout and the load model are those of
``bench/fleet_sim.py``; what differs is the cost. ``fleet_sim.py`` runs K real workers in one Trio
process and, at 2,048 workers, spends its whole core (and 120-280 ms per flip) before the
frontend has seen anything, so a benchmark measures the simulator. Here one ``selectors`` loop
over non-blocking sockets does only what reaches the wire: no Trio, no ``worker_ingress``, one
listener per worker on ``127.0.0.1`` (port 0), every message built from the
:mod:`shim_common.wire` types and encoded by :func:`shim_common.wire.encode`, so the bytes cannot
drift from the protocol; hellos and busy rules are computed once.

Rules, per simulated worker (the real worker's, ``worker_ingress/_events.py`` and
``docs/protocol.md``):

1. Websocket (RFC 6455, written by hand): an upgrade on ``/v1/events`` or ``/v1/requests`` is
   answered ``101`` (the request plane picks :data:`~shim_common.wire.SUBPROTOCOL_BATCH` when it
   is offered), any other path ``404``. Client frames must be masked, without reserved bits;
   fragmented messages are joined, several frames per read are taken in order; ping -> pong,
   close -> close back, a text message -> close 1003, an undecodable one -> 1007, a message over
   :data:`~shim_common.wire.MAX_MESSAGE_BYTES` -> 1009, bad framing -> 1002. Every connection is
   pinged every ``PING_INTERVAL`` s and dropped when a pong is ``PING_TIMEOUT`` s late.
2. Hello on both planes, by ``--protocol``: ``new`` lists what the real worker lists now
   (:data:`NEW_FEATURES`), ``current`` only :data:`~shim_common.wire.FEATURE_BUSY_EDGES`, ``v1``
   nothing and ``load_publish_interval`` 0. The engine's limits are fleet_sim's (1,000 KV blocks,
   block size 16, 8,192 batched tokens, 256 sequences, N unset so Q is 40,000).
3. Load: every rank changes ``--rate`` times a second, the workers spread over :data:`SLOTS` slots
   of the period (slots missed while the process was busy are ticked late, at most one period's
   worth, as in fleet_sim), each rank's blocks drawn from :data:`FREE_RANGE` or
   :data:`BUSY_RANGE` of the fleet's mode. A change takes the worker's next ``seq`` per rank.
   ``busy``/``free`` ticks every worker at once. The ingress gauges stay 0: a zero-work request
   starts and ends within one pass of the loop, before a publisher could see it.
4. Events, per subscriber (the :class:`~shim_common.wire.Mailbox` rule, latest wins): a batch
   holds the newest heartbeat and the newest load of each rank not yet taken, in ``seq`` order
   (a heartbeat newer than a rank's load makes it redundant). Subscribing sends the hello and a
   fresh heartbeat at once. A heartbeat every ``HEARTBEAT_INTERVAL`` s per worker. At most one
   batch every publish interval (0.1 s; ``new``: ``max(own, Subscribe.publish_interval)``;
   ``v1``: 0, so every change and heartbeat goes out at once, one batch each); with busy edges
   (``new``, ``current``) a change that turns a rank busy or free under the ``Subscribe``
   thresholds, compared with what that subscriber was last sent, waits only the edge gap
   (1/20 of the own interval). While a socket does not take a batch whole, nothing more is
   taken for it: what changes meanwhile is latest-wins, as the worker's blocked sender makes it.
5. Requests, like the zero-work instant engine behind an ungated worker: a bad body is
   ``Failed(bad_request)``; otherwise ``Started``, then the tokens (``max_tokens``, 16 when
   absent; for embeddings one 8-float vector per input), then ``End``. A pass of the loop makes
   at most :data:`TOKENS_PER_PASS` tokens of each request, as one chunk (the worker merges text
   chunks that queue up together); a request's last chunk leaves with its ``End``. A ``Cancel``
   read before a request ended (in the same read as its ``Generate`` included) ends it with
   ``Failed(cancelled)``; a reused id in flight closes with 1008; past the ungated worker's
   slots and queue places (50,000 in flight on one connection), ``Rejected(overloaded)``. With
   the batch subprotocol a pass's replies on one connection are one
   :class:`~shim_common.wire.Batch` message.
6. KV events (``--kv-blocks B``, protocol ``new`` only; docs/protocol.md, "KV events"): the hello
   also lists :data:`~shim_common.wire.FEATURE_KV_EVENTS`, and each rank's tick also stores one
   chain of ``B`` new block names (parent nil), evicting its oldest chain first once the rank
   holds ``KV_TOTAL_BLOCKS`` blocks: the steady churn of a full cache, one or two KV events per
   rank per tick, numbered per worker. A subscriber that sends ``Subscribe.kv_events`` gets a
   :class:`~shim_common.wire.KvSnapshot` (the worker's whole cache), then every event, in
   :class:`~shim_common.wire.KvBatch` messages that go out with its load batches (same
   interval, edges included); ``kv_snapshot`` asks for a fresh snapshot. Past max(1024, the
   worker's blocks) pending names, a subscriber's backlog is replaced by a snapshot, as the real
   worker does. Names are ``(worker * ranks + rank) << 32 | n``: distinct across the fleet.

Control, one command per line on stdin, one answer line per command on stdout (fleet_sim's):

- start-up: ``fleet-sim ready workers=K ports=P1,P2,...`` once every worker listens;
- ``busy`` / ``free``: flip the mode; answer ``ok busy T`` / ``ok free T``. ``T`` is the
  ``time.monotonic()`` at which every worker had its new load *and* every batch due at once
  (edges, ``v1``'s every change) had been written to its socket, so the simulator's whole share
  of a flip is before ``T`` (fleet_sim stamps before its workers send). With ``--paused`` the
  first one also starts the ticking. A line on stderr says how long the loads and the writes took.
- ``stats``: answer ``stats {json}``: ``generated`` load changes, ``load_events`` and
  ``heartbeats`` taken into batches, ``batches`` (event-plane messages), ``subscribers``
  connected, ``kv_events`` sent, ``kv_messages`` (``kv`` messages), ``kv_snapshots`` sent (of
  the events), and ``monotonic`` (``time.monotonic()``);
- ``quit`` or end of input: stop.

Left out, as no frontend of a benchmark needs them: the bearer token, TLS, the system port,
draining, the worker's cap on event subscribers.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import gc
import hashlib
import heapq
import itertools
import json
import os
import resource
import selectors
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any, Final, Literal

import msgspec

from shim_common._busy import BusyThresholds, rank_busy
from shim_common.wire import (
    CLOSE_DUPLICATE_REQUEST_ID,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_TEXT_MESSAGE,
    CLOSE_TOO_BIG,
    CLOSE_UNDECODABLE,
    EVENTS_PATH,
    FEATURE_BUSY_EDGES,
    FEATURE_CLASSES,
    FEATURE_FRONTEND_TIME,
    FEATURE_KV_EVENTS,
    FEATURE_PUBLISH_INTERVAL,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    REASON_OVERLOADED,
    REQUESTS_PATH,
    SUBPROTOCOL_BATCH,
    Batch,
    Cancel,
    Chunk,
    End,
    EventBatch,
    Failed,
    Generate,
    Heartbeat,
    Hello,
    KvBatch,
    KvEvent,
    KvRemoved,
    KvSnapshot,
    KvStored,
    LoadEvent,
    RankLoad,
    Rejected,
    Reply,
    RuntimeConfig,
    Started,
    WorkerEvent,
    decode_client_message,
    decode_subscriber_message,
    encode,
)

__all__ = ["NEW_FEATURES", "Counters", "Fleet", "hello_of", "main"]

Protocol = Literal["new", "current", "v1"]
PROTOCOLS: Final = ("new", "current", "v1")
#: What the real worker lists in its hello now (``Worker.hello``; a test keeps them equal).
NEW_FEATURES: Final = (
    FEATURE_BUSY_EDGES,
    FEATURE_CLASSES,
    FEATURE_FRONTEND_TIME,
    FEATURE_PUBLISH_INTERVAL,
)
#: What a worker of the fleet work's protocol lists.
CURRENT_FEATURES: Final = (FEATURE_BUSY_EDGES,)

# The load model and the announced limits: those of bench/fleet_sim.py.
MODEL: Final = "mock-model"
KV_TOTAL_BLOCKS: Final = 1000
BLOCK_SIZE: Final = 16
MAX_NUM_BATCHED_TOKENS: Final = 8192
MAX_NUM_SEQS: Final = 256
#: Q in force on a worker whose N is unset, and its engine slots.
UNLIMITED_QUEUE_LIMIT: Final = 40_000
UNLIMITED_ENGINE_SLOTS: Final = 10_000
#: Requests one request plane holds at most (every slot and queue place); more are rejected.
MAX_IN_FLIGHT: Final = UNLIMITED_ENGINE_SLOTS + UNLIMITED_QUEUE_LIMIT
FREE_RANGE: Final = (0.0, 0.2)
BUSY_RANGE: Final = (0.6, 0.9)
SLOTS: Final = 10

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

_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_HEAD16: Final = struct.Struct("!BBH")
_HEAD64: Final = struct.Struct("!BBQ")
OP_CONTINUATION: Final = 0x0
OP_TEXT: Final = 0x1
OP_BINARY: Final = 0x2
OP_CLOSE: Final = 0x8
OP_PING: Final = 0x9
OP_PONG: Final = 0xA


@dataclasses.dataclass
class Counters:
    """What the simulator generated and sent, summed over its workers (fleet_sim's keys)."""

    #: Rank load changes made (each one should become a load event).
    generated: int = 0
    #: Load events taken into batches.
    load_events: int = 0
    #: Heartbeats likewise.
    heartbeats: int = 0
    #: Event-plane websocket messages (one per batch).
    batches: int = 0
    #: KV events sent (rule 6), snapshots included, and the ``kv`` messages that carried them.
    kv_events: int = 0
    kv_messages: int = 0
    kv_snapshots: int = 0


# ----------------------------------------------------------------------------- websocket framing


def server_frame(opcode: int, payload: bytes) -> bytes:
    """One final, unmasked frame from the server."""
    length = len(payload)
    if length < 126:
        return bytes((0x80 | opcode, length)) + payload
    if length < 1 << 16:
        return _HEAD16.pack(0x80 | opcode, 126, length) + payload
    return _HEAD64.pack(0x80 | opcode, 127, length) + payload


def close_frame(code: int, reason: str = "") -> bytes:
    """A close frame with a code and a reason of at most 123 bytes."""
    return server_frame(OP_CLOSE, code.to_bytes(2, "big") + reason.encode()[:123])


def unmask(data: bytes, key: bytes) -> bytes:
    """XOR ``data`` with the repeated 4-byte ``key`` (one big-integer operation)."""
    length = len(data)
    if not length:
        return b""
    repeated = (key * (length // 4 + 1))[:length]
    value = int.from_bytes(data, "little") ^ int.from_bytes(repeated, "little")
    return value.to_bytes(length, "little")


class FrameError(Exception):
    """The client broke the framing rules; ``code`` is the close code to send."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class FrameParser:
    """Client frames -> whole messages and control frames (sans-IO; rule 1)."""

    __slots__ = ("_buffer", "_fragment_opcode", "_fragments", "_fragments_size")

    def __init__(self) -> None:
        self._buffer = b""
        self._fragments: list[bytes] = []
        self._fragment_opcode = 0
        self._fragments_size = 0

    def receive(self, data: bytes) -> list[tuple[int, bytes]]:
        """Every complete message and control frame in what arrived so far, in order.

        Raises:
            FrameError: an unmasked frame, reserved bits, a bad opcode or sequence, or a
                message over the size cap.
        """
        buffer = self._buffer + data if self._buffer else data
        size = len(buffer)
        position = 0
        out: list[tuple[int, bytes]] = []
        while size - position >= 2:
            first = buffer[position]
            second = buffer[position + 1]
            if first & 0x70:
                raise FrameError(CLOSE_PROTOCOL_ERROR, "reserved bits set")
            if not second & 0x80:
                raise FrameError(CLOSE_PROTOCOL_ERROR, "an unmasked frame from the client")
            length = second & 0x7F
            head = 2
            if length == 126:
                if size - position < 4:
                    break
                length = int.from_bytes(buffer[position + 2 : position + 4], "big")
                head = 4
            elif length == 127:
                if size - position < 10:
                    break
                length = int.from_bytes(buffer[position + 2 : position + 10], "big")
                head = 10
            opcode = first & 0x0F
            if opcode < OP_CLOSE and self._fragments_size + length > MAX_MESSAGE_BYTES:
                raise FrameError(CLOSE_TOO_BIG, "message too big")
            end = position + head + 4 + length
            if end > size:
                break
            key = buffer[position + head : position + head + 4]
            payload = unmask(buffer[position + head + 4 : end], key)
            position = end
            self._frame(bool(first & 0x80), opcode, payload, out)
        self._buffer = buffer[position:]
        return out

    def _frame(self, fin: bool, opcode: int, payload: bytes, out: list[tuple[int, bytes]]) -> None:
        if opcode >= OP_CLOSE:
            if opcode not in (OP_CLOSE, OP_PING, OP_PONG) or not fin or len(payload) > 125:
                raise FrameError(CLOSE_PROTOCOL_ERROR, f"a bad control frame (opcode {opcode})")
            out.append((opcode, payload))
            return
        if opcode == OP_CONTINUATION:
            if not self._fragments:
                raise FrameError(CLOSE_PROTOCOL_ERROR, "a continuation with nothing to continue")
        elif opcode in (OP_BINARY, OP_TEXT):
            if self._fragments:
                raise FrameError(CLOSE_PROTOCOL_ERROR, "a new message inside a fragmented one")
            if fin:
                out.append((opcode, payload))
                return
            self._fragment_opcode = opcode
        else:
            raise FrameError(CLOSE_PROTOCOL_ERROR, f"an unknown opcode {opcode}")
        self._fragments.append(payload)
        self._fragments_size += len(payload)
        if fin:
            out.append((self._fragment_opcode, b"".join(self._fragments)))
            self._fragments = []
            self._fragments_size = 0


def _handshake_answer(head: bytes) -> tuple[bytes, str | None, bool]:
    """The answer to an upgrade request head: ``(bytes, plane path or None, batching)``.

    ``None`` as the path means the answer is a refusal and the connection closes after it.
    """
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    key = headers.get("sec-websocket-key")
    if (
        len(parts) != 3
        or parts[0] != "GET"
        or headers.get("upgrade", "").lower() != "websocket"
        or key is None
    ):
        return _refusal(400, b"not a websocket upgrade\n"), None, False
    path = parts[1]
    if path not in (EVENTS_PATH, REQUESTS_PATH):
        return _refusal(404, b"unknown path; use /v1/events or /v1/requests\n"), None, False
    offered = [name.strip() for name in headers.get("sec-websocket-protocol", "").split(",")]
    batching = path == REQUESTS_PATH and SUBPROTOCOL_BATCH in offered
    accept = base64.b64encode(hashlib.sha1(key.encode("latin-1") + _GUID).digest()).decode()
    answer = [
        "HTTP/1.1 101 Switching Protocols",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Accept: {accept}",
        *([f"Sec-WebSocket-Protocol: {SUBPROTOCOL_BATCH}"] if batching else []),
    ]
    return ("\r\n".join(answer) + "\r\n\r\n").encode("latin-1"), path, batching


def _refusal(status: int, body: bytes) -> bytes:
    reason = {400: "Bad Request", 404: "Not Found"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


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
        self.subscribers: list[EventPlane] = []

    def new_heartbeat(self, wall: float) -> Heartbeat:
        self.seq += 1
        return Heartbeat(
            seq=self.seq, ts=wall, loads=self.loads, engine_requests=0, queued_requests=0
        )


# ----------------------------------------------------------------------------- connections


class Connection:
    """One accepted socket: upgrade, then websocket frames for its plane (rule 1)."""

    def __init__(self, fleet: Fleet, sock: socket.socket, worker: SimWorker, now: float) -> None:
        self.fleet = fleet
        self.sock = sock
        self.worker = worker
        self.closed = False
        self.accepted_at = now
        self.upgraded = False
        self._head = b""
        self._parser = FrameParser()
        self._out = bytearray()
        self._writing = False
        self.ping_at = now + PING_INTERVAL
        self.ping_sent: float | None = None

    def write(self, data: bytes) -> None:
        """Send now what the socket takes; keep the rest for when it is writable."""
        if self.closed:
            return
        if self._out:
            self._out += data
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.close()
            return
        if sent < len(data):
            self._out += data[sent:]
            self._want_write(True)

    def on_writable(self) -> None:
        try:
            sent = self.sock.send(self._out)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        del self._out[:sent]
        if not self._out:
            self._want_write(False)
            self.drained()

    def _want_write(self, want: bool) -> None:
        if want != self._writing:
            self._writing = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self.fleet.selector.modify(self.sock, events, self)

    def on_readable(self) -> None:
        try:
            data = self.sock.recv(RECEIVE_BYTES)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        if not data:
            self.close()
            return
        self.received(data)

    def received(self, data: bytes) -> None:
        """Bytes from the client: the upgrade request (a plane takes over after it), or frames."""
        if self.upgraded:
            try:
                frames = self._parser.receive(data)
            except FrameError as error:
                self.close_with(error.code, error.reason)
                return
            self.frames(frames)
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD_BYTES:
                self.write(_refusal(400, b"request head too large\n"))
                self.close()
            return
        head, rest = self._head[:end], self._head[end + 4 :]
        answer, path, batching = _handshake_answer(head)
        if path is None:
            self.write(answer)
            self.close()
            return
        plane: EventPlane | RequestPlane
        plane = EventPlane(self) if path == EVENTS_PATH else RequestPlane(self, batching)
        self.fleet.replace(self, plane)
        plane.start(answer)
        if rest and not plane.closed:
            plane.received(rest)

    def frames(self, frames: list[tuple[int, bytes]]) -> None:
        """Handle what one read brought (a connection still upgrading takes none)."""

    def on_message(self, data: bytes) -> None:
        """One whole binary message from the client."""

    def start(self, answer: bytes) -> None:
        """The upgrade succeeded: write the answer and the first messages."""

    def drained(self) -> None:
        """Everything written has been taken by the socket."""

    def control(self, opcode: int, payload: bytes) -> bool:
        """Handle a control frame or a text message; False once the connection is closing."""
        if opcode == OP_PING:
            self.write(server_frame(OP_PONG, payload))
        elif opcode == OP_PONG:
            self.ping_sent = None
            self.ping_at = self.fleet.now + PING_INTERVAL
        elif opcode == OP_CLOSE:
            code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1000
            self.write(close_frame(code))
            self.close()
            return False
        elif opcode == OP_TEXT:
            self.close_with(CLOSE_TEXT_MESSAGE, "the protocol is binary msgpack")
            return False
        return True

    def keepalive(self, now: float) -> None:
        """Ping when due; drop a peer whose pong is late, or an upgrade never finished."""
        if not self.upgraded:
            if now - self.accepted_at > HANDSHAKE_SECONDS:
                self.close()
            return
        if self.ping_sent is not None:
            if now - self.ping_sent > PING_TIMEOUT:
                self.close()
        elif now >= self.ping_at:
            self.ping_sent = now
            self.write(server_frame(OP_PING, b""))

    def close_with(self, code: int, reason: str) -> None:
        self.write(close_frame(code, reason[:120]))
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        if self._out:
            # Best effort for a closing frame: one more try, the socket is going anyway.
            with contextlib.suppress(OSError):
                self.sock.send(self._out)
        self.closed = True
        self.fleet.forget(self)
        self.sock.close()


class EventPlane(Connection):
    """An event-plane subscriber (rule 4)."""

    def __init__(self, upgrading: Connection) -> None:
        super().__init__(upgrading.fleet, upgrading.sock, upgrading.worker, upgrading.accepted_at)
        fleet = self.fleet
        self.upgraded = True
        own = fleet.publish_interval
        self.own_interval = own
        self.interval = own
        self.edge_gap = own * EDGE_GAP_SHARE
        self.last_sent = -float("inf")
        #: The ``seq`` of the newest event taken.
        self.taken_seq = 0
        self.urgent = False
        #: The loads as of the last batch taken (what this subscriber knows).
        self.sent_loads: list[RankLoad] = []
        #: The fewest blocks that are busy under this subscriber's thresholds (None: no edges).
        self.busy_from: int | None = None
        #: When a batch is due (``None``: none scheduled).
        self.send_at: float | None = None
        #: KV events (rule 6): asked for; a snapshot due; the events not yet sent, and their
        #: block names.
        self.kv_on = False
        self.kv_snapshot_due = False
        self.kv_pending: list[KvEvent] = []
        self.kv_pending_names = 0

    def start(self, answer: bytes) -> None:
        fleet = self.fleet
        worker = self.worker
        worker.subscribers.append(self)
        # The subscription starts with a heartbeat of the current state, sent at once.
        heartbeat = worker.new_heartbeat(time.time())
        self.write(answer + worker.hello_frame)
        self._send([heartbeat], heartbeats=1, now=fleet.now, loads=worker.loads)

    def frames(self, frames: list[tuple[int, bytes]]) -> None:
        for opcode, payload in frames:
            if opcode == OP_BINARY:
                self.on_message(payload)
            elif not self.control(opcode, payload):
                return
            if self.closed:
                return

    def on_message(self, data: bytes) -> None:
        try:
            subscribe = decode_subscriber_message(data)
        except msgspec.DecodeError as error:
            self.close_with(CLOSE_UNDECODABLE, f"undecodable message: {error}")
            return
        protocol = self.fleet.protocol
        if protocol == "v1":
            return  # no busy edges, no interval: a version-1 worker ignores them
        self.busy_from = busy_from(subscribe.thresholds)
        if protocol == "new":
            self.interval = max(self.own_interval, subscribe.publish_interval)
            if subscribe.kv_events and self.fleet.kv_blocks:
                if not self.kv_on or subscribe.kv_snapshot:
                    self.kv_snapshot_due = True
                    self.kv_pending = []
                    self.kv_pending_names = 0
                self.kv_on = True
                self.schedule(self.fleet.now)

    def pending(self) -> bool:
        worker = self.worker
        heartbeat = worker.heartbeat
        return (
            worker.load_seq > self.taken_seq
            or (heartbeat is not None and heartbeat.seq > self.taken_seq)
            or self.kv_snapshot_due
            or bool(self.kv_pending)
        )

    def kv_event(self, event: KvEvent, names: int) -> None:
        """Queue a KV event (rule 6); past the bound, a snapshot replaces the backlog."""
        if not self.kv_on or self.kv_snapshot_due:
            return
        self.kv_pending.append(event)
        self.kv_pending_names += names + 1
        if self.kv_pending_names > self.fleet.kv_backlog_limit:
            self.kv_snapshot_due = True
            self.kv_pending = []
            self.kv_pending_names = 0

    def changed(self, now: float) -> None:
        """The worker's loads changed: note an edge (rule 4), then send or schedule."""
        bound = self.busy_from
        if bound is not None and not self.urgent and self.sent_loads:
            for load, sent in zip(self.worker.loads, self.sent_loads, strict=True):
                if (load.kv_used_blocks >= bound) != (sent.kv_used_blocks >= bound):
                    self.urgent = True
                    break
        self.schedule(now)

    def schedule(self, now: float) -> None:
        """Send the pending batch if it is due, else note when it will be."""
        if self.closed or self._out or not self.pending():
            return
        due = self.last_sent + (self.edge_gap if self.urgent else self.interval)
        if due <= now:
            waiting = self.fleet.due_now
            if waiting is None:
                self.send_pending(now)
            else:
                waiting.append(self)
        elif self.send_at is None or due < self.send_at:
            self.send_at = due
            self.fleet.at(due, self)

    def drained(self) -> None:
        self.schedule(self.fleet.now)

    def send_pending(self, now: float) -> None:
        """Take everything pending, latest-wins, as one batch (rule 4)."""
        worker = self.worker
        heartbeat = worker.heartbeat
        taken = self.taken_seq
        events: list[WorkerEvent] = []
        heartbeats = 0
        floor = taken
        if heartbeat is not None and heartbeat.seq > taken:
            events.append(heartbeat)
            heartbeats = 1
            floor = heartbeat.seq
        load_seq = worker.load_seq
        if load_seq > floor:
            ts = worker.load_ts
            events += [
                LoadEvent(
                    seq=load_seq + rank, ts=ts, load=load, engine_requests=0, queued_requests=0
                )
                for rank, load in enumerate(worker.loads)
            ]
        if events:
            self._send(events, heartbeats=heartbeats, now=now, loads=worker.loads)
        if self.kv_snapshot_due or self.kv_pending:
            self._send_kv(now)

    def _send_kv(self, now: float) -> None:
        fleet = self.fleet
        counters = fleet.counters
        kv: list[KvEvent]
        if self.kv_snapshot_due:
            kv = [fleet.kv_snapshot(self.worker)]
            counters.kv_snapshots += 1
            self.kv_snapshot_due = False
        else:
            kv = self.kv_pending
        self.kv_pending = []
        self.kv_pending_names = 0
        counters.kv_events += len(kv)
        counters.kv_messages += 1
        self.last_sent = now
        self.send_at = None
        self.write(server_frame(OP_BINARY, encode(KvBatch(events=kv))))

    def _send(
        self, events: list[WorkerEvent], *, heartbeats: int, now: float, loads: list[RankLoad]
    ) -> None:
        counters = self.fleet.counters
        counters.batches += 1
        counters.heartbeats += heartbeats
        counters.load_events += len(events) - heartbeats
        self.taken_seq = events[-1].seq
        self.last_sent = now
        self.urgent = False
        self.send_at = None
        self.sent_loads = loads
        self.write(server_frame(OP_BINARY, encode(EventBatch(events=events, sent=time.time()))))


@dataclasses.dataclass
class _Request:
    """A request in flight on a request plane."""

    request_id: int
    endpoint: str
    prompt_tokens: int
    #: Tokens still to make (completions), or vectors (embeddings).
    remaining: int
    made: int = 0
    started: bool = False


class RequestPlane(Connection):
    """A request-plane connection of a zero-work worker (rule 5)."""

    def __init__(self, upgrading: Connection, batching: bool) -> None:
        super().__init__(upgrading.fleet, upgrading.sock, upgrading.worker, upgrading.accepted_at)
        self.upgraded = True
        self.batching = batching
        self.requests: dict[int, _Request] = {}
        #: Replies of this pass, sent together at its end.
        self.replies: list[msgspec.Struct] = []

    def start(self, answer: bytes) -> None:
        self.write(answer + self.worker.hello_frame)

    def frames(self, frames: list[tuple[int, bytes]]) -> None:
        for opcode, payload in frames:
            if opcode == OP_BINARY:
                self.on_message(payload)
            elif not self.control(opcode, payload):
                break
            if self.closed:
                break
        if not self.closed:
            self.step()

    def on_message(self, data: bytes) -> None:
        try:
            message = decode_client_message(data)
        except msgspec.DecodeError as error:
            self.close_with(CLOSE_UNDECODABLE, f"undecodable message: {error}")
            return
        if isinstance(message, Cancel):
            request = self.requests.pop(message.request_id, None)
            if request is not None:
                self.replies.append(
                    Failed(
                        request_id=request.request_id,
                        kind="cancelled",
                        message="cancelled by the client",
                    )
                )
            return
        if message.request_id in self.requests:
            self.close_with(CLOSE_DUPLICATE_REQUEST_ID, "request id already in flight")
            return
        if len(self.requests) >= MAX_IN_FLIGHT:
            self.replies.append(Rejected(request_id=message.request_id, reason=REASON_OVERLOADED))
            return
        prepared = _prepare(message)
        if isinstance(prepared, Failed):
            self.replies.append(prepared)
        else:
            self.requests[prepared.request_id] = prepared
            self.fleet.stepping.add(self)

    def step(self) -> None:
        """Make the next tokens of every request in flight, then send this pass's replies."""
        if len(self._out) > MAX_PENDING_OUTPUT:
            # The client does not read: its requests wait until the socket drains.
            self.fleet.stepping.discard(self)
            return
        replies = self.replies
        done: list[int] = []
        for request in self.requests.values():
            request_id = request.request_id
            if not request.started:
                request.started = True
                replies.append(Started(request_id=request_id, prompt_tokens=request.prompt_tokens))
            if request.endpoint == "embeddings":
                for index in range(request.made, request.made + request.remaining):
                    replies.append(
                        Chunk(request_id=request_id, embedding=[0.0] * EMBEDDING_SIZE, index=index)
                    )
                request.made += request.remaining
                request.remaining = 0
                replies.append(End(request_id=request_id, prompt_tokens=request.prompt_tokens,
                                   completion_tokens=0))  # fmt: skip
                done.append(request_id)
                continue
            tokens = min(request.remaining, TOKENS_PER_PASS)
            request.remaining -= tokens
            request.made += tokens
            last = request.remaining == 0
            if tokens or last:
                replies.append(
                    Chunk(
                        request_id=request_id,
                        text=" tok" * tokens,
                        tokens=tokens,
                        finish_reason="length" if last else None,
                    )
                )
            if last:
                replies.append(
                    End(
                        request_id=request_id,
                        prompt_tokens=request.prompt_tokens,
                        completion_tokens=request.made,
                    )
                )
                done.append(request_id)
        for request_id in done:
            del self.requests[request_id]
        if not self.requests:
            self.fleet.stepping.discard(self)
        if replies:
            self.replies = []
            self._send_replies(replies)

    def drained(self) -> None:
        if self.requests or self.replies:
            self.fleet.stepping.add(self)

    def _send_replies(self, replies: list[msgspec.Struct]) -> None:
        if self.batching and len(replies) > 1:
            data = encode(Batch(messages=_as_replies(replies)))
            if len(data) <= MAX_MESSAGE_BYTES:
                self.write(server_frame(OP_BINARY, data))
                return
        self.write(b"".join(server_frame(OP_BINARY, encode(reply)) for reply in replies))

    def close(self) -> None:
        self.fleet.stepping.discard(self)
        super().close()


def _as_replies(messages: list[msgspec.Struct]) -> list[Reply]:
    replies: list[Reply] = []
    for message in messages:
        assert isinstance(message, Started | Chunk | End | Failed | Rejected)
        replies.append(message)
    return replies


def _prepare(generate: Generate) -> _Request | Failed:
    """Validate a body as the instant engine does (its prompt, ``n``, ``max_tokens``)."""
    body = generate.body
    request_id = generate.request_id
    endpoint = generate.endpoint
    try:
        choices = body.get("n")
        if endpoint != "embeddings" and choices is not None and choices != 1:
            raise ValueError(f"this engine generates one choice per request: 'n' is {choices!r}")
        texts = _prompt_texts(endpoint, body)
        prompt_tokens = sum(len(text.split()) for text in texts)
        remaining = len(texts) if endpoint == "embeddings" else _max_tokens(endpoint, body)
    except ValueError as error:
        return Failed(request_id=request_id, kind="bad_request", message=str(error))
    return _Request(request_id, endpoint, prompt_tokens, remaining)


def _prompt_texts(endpoint: str, body: dict[str, Any]) -> list[str]:
    if endpoint == "chat_completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of message objects")
        texts: list[str] = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"messages[{index}] must be an object")
            content = message.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(
                    part["text"]
                    for part in content
                    if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
        return texts
    field = "prompt" if endpoint == "completions" else "input"
    value = body.get(field)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return value
    raise ValueError(f"'{field}' must be a string or a non-empty list of strings")


def _max_tokens(endpoint: str, body: dict[str, Any]) -> int:
    fields = (
        ("max_completion_tokens", "max_tokens")
        if endpoint == "chat_completions"
        else ("max_tokens",)
    )
    for field in fields:
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"'{field}' must be a non-negative integer")
        return value
    return DEFAULT_MAX_TOKENS


# ----------------------------------------------------------------------------- the loop


class _Listener:
    """A worker's listening socket: accepts connections for it."""

    def __init__(self, fleet: Fleet, worker: SimWorker) -> None:
        self.fleet = fleet
        self.worker = worker
        self.closed = False

    def on_readable(self) -> None:
        fleet = self.fleet
        for _ in range(64):
            try:
                sock, _address = self.worker.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # out of descriptors, say: the client retries
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = Connection(fleet, sock, self.worker, fleet.now)
            fleet.connections.add(connection)
            fleet.selector.register(sock, selectors.EVENT_READ, connection)

    def on_writable(self) -> None:
        """Never registered for writing."""


class _Control:
    """Standard input: one command per line (see the module docstring)."""

    def __init__(self, fleet: Fleet, fd: int) -> None:
        self.fleet = fleet
        self.fd = fd
        self.closed = False
        self._buffer = b""

    def on_readable(self) -> None:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        if not data:
            self.fleet.running = False
            return
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            self.fleet.command(line.decode().strip())

    def on_writable(self) -> None:
        """Never registered for writing."""


class Fleet:
    """The simulated workers and the one loop that serves them all."""

    def __init__(
        self,
        workers: int,
        ranks: int,
        rate: float,
        prefix: str,
        paused: bool,
        protocol: Protocol,
        answer: Callable[[str], None],
        kv_blocks: int = 0,
    ) -> None:
        self.protocol = protocol
        #: Blocks per stored chain (rule 6; 0: no KV events), chains a rank holds at most, and
        #: the pending names past which a subscriber is sent a snapshot instead.
        self.kv_blocks = kv_blocks if protocol == "new" else 0
        self.kv_chains_per_rank = KV_TOTAL_BLOCKS // kv_blocks if kv_blocks else 0
        self.kv_backlog_limit = max(1024, KV_TOTAL_BLOCKS * ranks)
        self.ranks = ranks
        self.rate = rate
        self.answer = answer
        self.counters = Counters()
        self.publish_interval = 0.0 if protocol == "v1" else PUBLISH_INTERVAL
        self.selector = selectors.DefaultSelector()
        self.connections: set[Connection] = set()
        #: Request planes with requests in flight (stepped every pass).
        self.stepping: set[RequestPlane] = set()
        self.running = True
        self.busy = False
        self.now = time.monotonic()
        #: While a flip sets every load: the subscribers whose batch is due at once.
        self.due_now: list[EventPlane] | None = None
        self._timers: list[tuple[float, int, EventPlane]] = []
        self._timer_order = itertools.count()
        # One RankLoad per (rank, decode blocks): a load is picked, never built, on a tick.
        self._rank_loads = [
            [
                RankLoad(
                    dp_rank=rank,
                    active_decode_blocks=blocks,
                    active_prefill_tokens=0,
                    kv_used_blocks=blocks + 1,
                )
                for blocks in range(KV_TOTAL_BLOCKS)
            ]
            for rank in range(ranks)
        ]
        self.workers: list[SimWorker] = []
        for index in range(workers):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", 0))
            listener.listen(socket.SOMAXCONN)
            listener.setblocking(False)
            hello = hello_of(f"{prefix}-{index}", ranks, protocol, kv_events=bool(self.kv_blocks))
            worker = SimWorker(index, listener, hello, ranks)
            self.workers.append(worker)
            self.selector.register(listener, selectors.EVENT_READ, _Listener(self, worker))
        self._tick_shares = [self.workers[slot::SLOTS] for slot in range(SLOTS)]
        self._tick_seconds = 1.0 / rate / SLOTS if rate > 0 else 0.0
        self._tick_slot = 0
        self._tick_at: float | None = None if paused or rate <= 0 else self.now + self._tick_seconds
        self._heartbeat_shares = [
            self.workers[slot::HEARTBEAT_SLOTS] for slot in range(HEARTBEAT_SLOTS)
        ]
        self._heartbeat_seconds = HEARTBEAT_INTERVAL / HEARTBEAT_SLOTS
        self._heartbeat_slot = 0
        self._heartbeat_at = self.now + self._heartbeat_seconds
        self._keepalive_at = self.now + KEEPALIVE_SWEEP

    @property
    def ports(self) -> list[int]:
        return [worker.listener.getsockname()[1] for worker in self.workers]

    # -- bookkeeping of connections and timers

    def replace(self, old: Connection, new: Connection) -> None:
        """An upgraded connection takes over its socket from the one that read the upgrade."""
        self.connections.discard(old)
        old.closed = True
        self.connections.add(new)
        self.selector.modify(new.sock, selectors.EVENT_READ, new)

    def forget(self, connection: Connection) -> None:
        self.connections.discard(connection)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(connection.sock)
        if isinstance(connection, EventPlane):
            subscribers = connection.worker.subscribers
            if connection in subscribers:
                subscribers.remove(connection)

    def at(self, when: float, subscriber: EventPlane) -> None:
        heapq.heappush(self._timers, (when, next(self._timer_order), subscriber))

    # -- load and heartbeats

    def tick(self, worker: SimWorker, low: int, span: int, wall: float, now: float) -> None:
        """Give every rank of ``worker`` a new load (different from its last) in the range."""
        step = worker.step = worker.step + 1
        ranks = self.ranks
        worker.loads = [self._rank_loads[rank][low + (step + rank) % span] for rank in range(ranks)]
        worker.load_seq = worker.seq + 1
        worker.seq += ranks
        worker.load_ts = wall
        self.counters.generated += ranks
        if self.kv_blocks:
            self._churn(worker)
        for subscriber in worker.subscribers:
            subscriber.changed(now)

    def _churn(self, worker: SimWorker) -> None:
        """Store one chain per rank, evicting the oldest first when the rank is full (rule 6)."""
        size = self.kv_blocks
        subscribers = [s for s in worker.subscribers if s.kv_on]
        for rank, chains in enumerate(worker.kv_chains):
            base = (worker.index * self.ranks + rank) << 32
            events: list[KvEvent] = []
            if chains[1] - chains[0] >= self.kv_chains_per_rank:
                start = base + chains[0] * size
                worker.kv_seq += 1
                events.append(
                    KvRemoved(
                        seq=worker.kv_seq, dp_rank=rank, blocks=list(range(start, start + size))
                    )
                )
                chains[0] += 1
            start = base + chains[1] * size
            worker.kv_seq += 1
            events.append(
                KvStored(
                    seq=worker.kv_seq,
                    dp_rank=rank,
                    parent=None,
                    blocks=list(range(start, start + size)),
                )
            )
            chains[1] += 1
            for subscriber in subscribers:
                for event in events:
                    subscriber.kv_event(event, size)

    def kv_snapshot(self, worker: SimWorker) -> KvSnapshot:
        """The worker's whole cache as of its last KV event (rule 6)."""
        size = self.kv_blocks
        ranks = []
        for rank, (oldest, following) in enumerate(worker.kv_chains):
            base = (worker.index * self.ranks + rank) << 32
            ranks.append(list(range(base + oldest * size, base + following * size)))
        return KvSnapshot(seq=worker.kv_seq, ranks=ranks)

    def _mode_range(self) -> tuple[int, int]:
        low_fraction, high_fraction = BUSY_RANGE if self.busy else FREE_RANGE
        low = int(low_fraction * KV_TOTAL_BLOCKS)
        span = max(2, int(high_fraction * KV_TOTAL_BLOCKS) - low)
        return low, span

    def flip(self, busy: bool) -> float:
        """Change the mode and give every worker a load of it now; return ``time.monotonic()``
        once the loads are set and the batches due at once are written."""
        began = time.monotonic()
        self.busy = busy
        low, span = self._mode_range()
        wall = time.time()
        self.now = began
        # Every load first, then the batches due at once, so the two costs can be told apart.
        self.due_now = []
        for worker in self.workers:
            self.tick(worker, low, span, wall, began)
        loaded = time.monotonic()
        due, self.due_now = self.due_now, None
        for subscriber in due:
            subscriber.send_pending(loaded)
        done = time.monotonic()
        if self._tick_at is None and self.rate > 0:
            self._tick_at = done + self._tick_seconds
        print(
            f"flip {'busy' if busy else 'free'}: {len(self.workers)} workers' loads in "
            f"{(loaded - began) * 1000:.1f} ms, then {len(due)} batches written in "
            f"{(done - loaded) * 1000:.1f} ms",
            file=sys.stderr,
            flush=True,
        )
        return done

    def _run_ticks(self, now: float) -> None:
        at = self._tick_at
        if at is None or now < at:
            return
        seconds = self._tick_seconds
        due = 1 + int((now - at) / seconds)
        self._tick_at = at + due * seconds
        low, span = self._mode_range()
        wall = time.time()
        for offset in range(min(due, SLOTS)):
            for worker in self._tick_shares[(self._tick_slot + offset) % SLOTS]:
                self.tick(worker, low, span, wall, now)
        self._tick_slot = (self._tick_slot + due) % SLOTS

    def _run_heartbeats(self, now: float) -> None:
        if now < self._heartbeat_at:
            return
        seconds = self._heartbeat_seconds
        due = 1 + int((now - self._heartbeat_at) / seconds)
        self._heartbeat_at += due * seconds
        wall = time.time()
        for offset in range(min(due, HEARTBEAT_SLOTS)):
            slot = (self._heartbeat_slot + offset) % HEARTBEAT_SLOTS
            for worker in self._heartbeat_shares[slot]:
                worker.heartbeat = worker.new_heartbeat(wall)
                for subscriber in worker.subscribers:
                    subscriber.schedule(now)
        self._heartbeat_slot = (self._heartbeat_slot + due) % HEARTBEAT_SLOTS

    def _run_timers(self, now: float) -> None:
        timers = self._timers
        while timers and timers[0][0] <= now:
            when, _, subscriber = heapq.heappop(timers)
            if subscriber.closed or subscriber.send_at != when:
                continue  # replaced by an earlier one, or gone
            subscriber.send_at = None
            subscriber.schedule(now)

    def _run_keepalive(self, now: float) -> None:
        if now < self._keepalive_at:
            return
        self._keepalive_at = now + KEEPALIVE_SWEEP
        for connection in list(self.connections):
            connection.keepalive(now)

    # -- control

    def command(self, command: str) -> None:
        if command in ("busy", "free"):
            applied = self.flip(command == "busy")
            self.answer(f"ok {command} {applied}")
        elif command == "stats":
            self.answer("stats " + json.dumps(self.stats()))
        elif command == "quit":
            self.running = False
        elif command:
            self.answer(f"error unknown command {command!r}")

    def stats(self) -> dict[str, float]:
        return {
            **dataclasses.asdict(self.counters),
            "subscribers": sum(len(worker.subscribers) for worker in self.workers),
            "monotonic": time.monotonic(),
        }

    # -- the loop

    def _timeout(self, now: float) -> float:
        if self.stepping:
            return 0.0
        deadline = min(self._heartbeat_at, self._keepalive_at)
        if self._tick_at is not None:
            deadline = min(deadline, self._tick_at)
        if self._timers:
            deadline = min(deadline, self._timers[0][0])
        return max(0.0, deadline - now)

    def serve(self, control_fd: int) -> None:
        """Run until ``quit`` or the end of the control input."""
        os.set_blocking(control_fd, False)
        self.selector.register(control_fd, selectors.EVENT_READ, _Control(self, control_fd))
        select = self.selector.select
        while self.running:
            now = time.monotonic()
            for key, mask in select(self._timeout(now)):
                handler = key.data
                self.now = time.monotonic()
                if mask & selectors.EVENT_READ and not handler.closed:
                    handler.on_readable()
                if mask & selectors.EVENT_WRITE and not handler.closed:
                    handler.on_writable()
            now = self.now = time.monotonic()
            self._run_ticks(now)
            self._run_heartbeats(now)
            self._run_timers(now)
            self._run_keepalive(now)
            for connection in list(self.stepping):
                connection.step()

    def close(self) -> None:
        for connection in list(self.connections):
            connection.close()
        for worker in self.workers:
            worker.listener.close()
        self.selector.close()


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=0,
        help="KV events (protocol new): each rank's tick stores a chain of this many blocks, "
        "evicting the oldest once full (0: no KV events)",
    )
    options = parser.parse_args()
    if options.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {options.cpu})
    _raise_fd_limit()

    def answer(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    fleet = Fleet(
        options.workers,
        options.ranks,
        options.rate,
        options.id_prefix,
        options.paused,
        options.protocol,
        answer,
        kv_blocks=max(options.kv_blocks, 0),
    )
    # Few long-lived objects, but thousands of connections' worth: out of the collector's view.
    gc.freeze()
    answer(f"fleet-sim ready workers={len(fleet.workers)} ports={','.join(map(str, fleet.ports))}")
    try:
        fleet.serve(sys.stdin.fileno())
    finally:
        fleet.close()


if __name__ == "__main__":
    main()
