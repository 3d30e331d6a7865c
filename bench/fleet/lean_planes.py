"""The lean simulator's connections (``lean_sim.py`` rules 1, 4, 5 and 6): an accepted socket that
upgrades and then reads and writes websocket frames, the event plane (hellos, latest-wins
batches, busy edges, KV events) and the request plane (the zero-work engine behind an ungated
worker). What a plane needs of the loop that drives it is :class:`Loop`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import selectors
import socket
import time
import typing
from typing import Any

import msgspec

from bench.fleet.lean_frames import (
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    FrameError,
    FrameParser,
    close_frame,
    handshake_answer,
    refusal,
    server_frame,
)
from bench.fleet.lean_workers import (
    DEFAULT_MAX_TOKENS,
    EDGE_GAP_SHARE,
    EMBEDDING_SIZE,
    HANDSHAKE_SECONDS,
    MAX_HEAD_BYTES,
    MAX_IN_FLIGHT,
    MAX_PENDING_OUTPUT,
    PING_INTERVAL,
    PING_TIMEOUT,
    RECEIVE_BYTES,
    TOKENS_PER_PASS,
    SimWorker,
    busy_from,
)
from bench.fleet.model import Counters, Protocol
from shim_common.wire import (
    CLOSE_DUPLICATE_REQUEST_ID,
    CLOSE_TEXT_MESSAGE,
    CLOSE_UNDECODABLE,
    EVENTS_PATH,
    MAX_MESSAGE_BYTES,
    Batch,
    Cancel,
    Chunk,
    End,
    EventBatch,
    Failed,
    Generate,
    KvBatch,
    KvEvent,
    KvSnapshot,
    LoadEvent,
    RankLoad,
    Rejected,
    RejectReason,
    Reply,
    RequestBatch,
    Started,
    WorkerEvent,
    decode_client_message,
    decode_subscriber_message,
    encode,
)


class Loop(typing.Protocol):
    """What a connection needs of the loop that drives it (``lean_sim.Fleet`` is the one)."""

    @property
    def selector(self) -> selectors.BaseSelector:
        """Where the connection's socket is registered."""

    @property
    def now(self) -> float:
        """``time.monotonic()`` as of the loop's current pass."""

    @property
    def protocol(self) -> Protocol:
        """What the simulated workers speak (rule 2)."""

    @property
    def publish_interval(self) -> float:
        """The workers' own publish interval (0 for ``v1``: every change at once; rule 4)."""

    @property
    def kv_blocks(self) -> int:
        """Blocks per stored chain of the KV events (0: none; rule 6)."""

    @property
    def kv_backlog_limit(self) -> int:
        """Pending KV block names past which a subscriber gets a snapshot instead (rule 6)."""

    @property
    def counters(self) -> Counters:
        """What the fleet sent, summed over its workers."""

    @property
    def stepping(self) -> set[RequestPlane]:
        """The request planes with requests to step in the next pass."""

    @property
    def due_now(self) -> list[EventPlane] | None:
        """During a flip, the subscribers whose batch is due at once; None otherwise."""

    def kv_snapshot(self, worker: SimWorker) -> KvSnapshot:
        """The whole cache of ``worker``, as a snapshot to send (rule 6)."""

    def replace(self, old: Connection, new: Connection) -> None:
        """Put ``new`` (the upgraded plane) where ``old`` was registered."""

    def forget(self, connection: Connection) -> None:
        """Drop a closed connection."""

    def at(self, when: float, subscriber: EventPlane) -> None:
        """Wake ``subscriber`` at ``when`` to send its batch."""


# ----------------------------------------------------------------------------- connections


class Connection:
    """One accepted socket: upgrade, then websocket frames for its plane (rule 1)."""

    def __init__(self, fleet: Loop, sock: socket.socket, worker: SimWorker, now: float) -> None:
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
                self.write(refusal(400, b"request head too large\n"))
                self.close()
            return
        head, rest = self._head[:end], self._head[end + 4 :]
        answer, path, batching = handshake_answer(head)
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
        # A batch is its messages one by one, in order (the real worker's rule).
        for each in message.messages if isinstance(message, RequestBatch) else (message,):
            if not self._take(each):
                return

    def _take(self, message: Generate | Cancel) -> bool:
        """Act on one client message; ``False`` once the connection is closing."""
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
            return True
        if message.request_id in self.requests:
            self.close_with(CLOSE_DUPLICATE_REQUEST_ID, "request id already in flight")
            return False
        if len(self.requests) >= MAX_IN_FLIGHT:
            self.replies.append(Rejected.of(message.request_id, RejectReason.OVERLOADED))
            return True
        prepared = _prepare(message)
        if isinstance(prepared, Failed):
            self.replies.append(prepared)
        else:
            self.requests[prepared.request_id] = prepared
            self.fleet.stepping.add(self)
        return True

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
