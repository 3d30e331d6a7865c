"""The request plane of one worker session: request ids, reply buffers, the outbox.

Rules (one request-plane connection per worker session):

- Request ids come from a counter per session; a table maps each open id to its reply buffer.
- The reader never waits on a consumer. Each request has a buffer of ``request_buffer``
  messages. When a slow HTTP client lets it fill, a further text chunk is merged into the last
  buffered one by the protocol's one merging rule (:func:`shim_common.wire.merge_text_chunks`):
  the client gets fewer, larger deltas, the total bounded by the request's ``max_tokens``. A
  message that cannot be merged (an embedding vector) fails that request alone with
  ``Failed(kind="cancelled")`` and a message naming the cause, and ``Cancel`` goes to the worker.
  So an embeddings request's buffer has room for one vector per input besides: its vectors
  arrive in a burst that no HTTP client holds up (the answer is one body, sent once all are in),
  and the number of inputs is bounded before the request is sent.
  The terminal message of a request always fits (one place is kept for it).
- Outgoing messages go through one sender task. ``Generate`` waits for room in the outbox
  (``send_queue`` places: backpressure to the caller); ``Cancel`` never waits, so leaving a
  request is cancel-safe and synchronous. A request cancelled before its ``Generate`` was
  written is simply dropped from the outbox. The time a request spent in the frontend
  (``Generate.frontend_ms``, to a worker that reads it) is taken as the sender takes the
  message to write it, its wait in the outbox included: it is stamped on the encoded message
  (:func:`shim_common.wire.with_frontend_ms`), the body is not encoded again.
- When the session ends, every open request ends at once with ``Failed(kind="unavailable")``.
- A refusal from the worker (``Rejected``, or ``Failed(kind="unavailable")``: it is draining)
  reaches its request only after the plane's ``before_refusal`` has run: the link applies there
  the events its worker sent before the refusal (:mod:`frontend_shim._links`, rule 6), so that
  whoever acts on the refusal (a mark of the worker as overloaded or draining) acts after them,
  whatever path it takes; an event applied after the mark would clear it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeAlias

import trio

from frontend_shim._connection import ProtocolError
from shim_common import wire

__all__ = [
    "FirstReply",
    "LinkStats",
    "RequestPlane",
    "RequestStream",
    "ResponseBuffer",
    "StreamReply",
    "unavailable",
]

#: What :meth:`RequestStream.first` returns: the worker's first word on a request.
FirstReply: TypeAlias = wire.Rejected | wire.Started | wire.Failed
#: What iterating a :class:`RequestStream` yields after ``Started``.
StreamReply: TypeAlias = wire.Chunk | wire.End | wire.Failed


@dataclasses.dataclass
class LinkStats:
    """Counters of one link, for logs and metrics (read them; only the link writes them)."""

    #: Sessions that reached ``up``.
    sessions: int = 0
    #: Connection attempts that failed before ``up``.
    connect_failures: int = 0
    #: Messages that did not decode, or arrived out of protocol (each one ended its session).
    protocol_errors: int = 0
    #: Sessions ended because a ping went unanswered or the event plane fell silent.
    keepalive_timeouts: int = 0
    #: Requests ended with ``unavailable`` because their session ended.
    requests_failed_by_disconnect: int = 0
    #: Text chunks merged into an earlier one because the consumer was behind.
    chunks_merged: int = 0
    #: Requests failed because their consumer was too far behind to buffer any more.
    requests_overflowed: int = 0
    #: Replies for request ids no longer open (after a local cancel): dropped.
    late_replies: int = 0
    #: Event batches applied.
    event_batches: int = 0
    #: KV event batches read (applied only when the link subscribed to them).
    kv_batches: int = 0
    #: Fresh KV snapshots asked for after a gap in the worker's KV events.
    kv_snapshots_asked: int = 0
    #: Sessions ended because the worker's KV events went past the budget.
    kv_budget_closes: int = 0
    #: Reads of the event plane: each took what the socket held (one batch or several), or found
    #: nothing (a paced read). The event budget is spent in reads.
    event_reads: int = 0
    #: Episodes in which the event stream lagged more than the bound.
    lag_episodes: int = 0


_Reply: TypeAlias = wire.Rejected | wire.Started | wire.Chunk | wire.End | wire.Failed


class ResponseBuffer:
    """The replies of one request, between the reader (``push``) and its consumer (``get``).

    Holds at most ``capacity`` messages plus one terminal message; never blocks the pusher.
    """

    __slots__ = ("_capacity", "_finished", "_items", "_wakeup")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: collections.deque[_Reply] = collections.deque()
        self._finished = False
        self._wakeup: trio.Event | None = None

    @property
    def finished(self) -> bool:
        """True once a terminal message was pushed (nothing more will come)."""
        return self._finished

    def push(self, reply: _Reply) -> str:
        """Add a reply.

        Returns:
            ``"ok"``, ``"merged"`` (a text chunk went into the last buffered chunk), or
            ``"full"`` (not taken: the buffer is full and the reply cannot be merged).
        """
        if self._finished:
            return "ok"  # after a terminal nothing counts; the plane never gets here
        terminal = isinstance(reply, wire.Rejected | wire.End | wire.Failed)
        if terminal:
            self._finished = True
        elif len(self._items) >= self._capacity:
            last = self._items[-1] if self._items else None
            merged = (
                wire.merge_text_chunks(last, reply)
                if isinstance(last, wire.Chunk) and isinstance(reply, wire.Chunk)
                else None
            )
            if merged is None:
                return "full"
            self._items[-1] = merged
            return "merged"
        self._items.append(reply)
        self._wake()
        return "ok"

    def finish(self, failure: wire.Failed) -> None:
        """End the buffer with a local failure, after what is already buffered."""
        if not self._finished:
            self._finished = True
            self._items.append(failure)
            self._wake()

    async def get(self) -> _Reply:
        """The next reply, waiting for it. Callers stop after a terminal reply."""
        while not self._items:
            if self._wakeup is None:
                self._wakeup = trio.Event()
            await self._wakeup.wait()
        return self._items.popleft()

    async def get_all(self) -> list[_Reply]:
        """Every buffered reply, waiting for at least one. Callers stop after a terminal one."""
        items = self._items
        while not items:
            if self._wakeup is None:
                self._wakeup = trio.Event()
            await self._wakeup.wait()
        taken = list(items)
        items.clear()
        return taken

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None


class RequestPlane:
    """The request table and outbox of one session; synchronous except for two waits.

    The reader calls :meth:`deliver` (which calls ``before_refusal()`` before it hands over a
    refusal of the worker's); the sender awaits :meth:`next_outgoing`; requests call
    :meth:`open` and :meth:`cancel`. After :meth:`close`, every open request has failed and
    everything else is a no-op.
    """

    def __init__(
        self,
        *,
        request_buffer: int,
        send_queue: int,
        stats: LinkStats,
        classes: bool = False,
        before_refusal: Callable[[], object] | None = None,
        ranks: bool = False,
        frontend_time: bool = False,
    ) -> None:
        self._request_buffer = request_buffer
        # The worker counts Generate.frontend_ms (its hello lists wire.FEATURE_FRONTEND_TIME).
        self._frontend_time = frontend_time
        # The worker honours Generate.dp_rank (its hello lists wire.FEATURE_KV_EVENTS).
        self._ranks = ranks
        self._before_refusal = before_refusal
        # The worker acts on priority and tenant (its hello lists wire.FEATURE_CLASSES).
        self._classes = classes
        self._send_queue = send_queue
        self._stats = stats
        self._next_id = 1
        self._open: dict[int, ResponseBuffer] = {}
        # (request id, encoded message, is a Generate, the request's arrival when its time in
        # the frontend is to be stamped). Generates are bounded by send_queue; Cancels by the
        # number of open requests (at most one each).
        self._outbox: collections.deque[tuple[int, bytes, bool, float | None]] = (
            collections.deque()
        )
        self._generates_queued = 0
        self._unsent: set[int] = set()
        self._outbox_changed: trio.Event = trio.Event()
        self._room: trio.Event = trio.Event()
        self._closed_reason: str | None = None

    @property
    def open_requests(self) -> int:
        """Requests waiting for their terminal reply."""
        return len(self._open)

    @property
    def closed(self) -> bool:
        """True once the session ended."""
        return self._closed_reason is not None

    async def open(
        self,
        endpoint: wire.Endpoint,
        body: dict[str, Any],
        priority: int = 0,
        tenant: str = "",
        dp_rank: int | None = None,
        arrival: float | None = None,
    ) -> tuple[int, ResponseBuffer]:
        """Register a request and queue its ``Generate``; waits while the outbox is full.

        ``priority``, ``tenant`` and ``dp_rank`` are sent only to a worker that speaks them, and
        so is the time since ``arrival`` (the request's arrival at the frontend, Trio time),
        taken when the message is taken to be written.
        """
        while self._closed_reason is None and self._generates_queued >= self._send_queue:
            await self._room.wait()
        request_id = self._next_id
        self._next_id += 1
        buffer = ResponseBuffer(self._request_buffer + _vectors_expected(endpoint, body))
        if self._closed_reason is not None:
            buffer.finish(unavailable(request_id, self._closed_reason))
            return request_id, buffer
        if not self._classes:
            priority, tenant = 0, ""
        if not self._ranks:
            dp_rank = None
        if not self._frontend_time:
            arrival = None
        data = wire.encode(
            wire.Generate(
                request_id=request_id,
                endpoint=endpoint,
                body=body,
                priority=priority,
                tenant=tenant,
                dp_rank=dp_rank,
            )
        )
        room = 0 if arrival is None else wire.FRONTEND_MS_ROOM
        if len(data) + room > wire.MAX_MESSAGE_BYTES:
            buffer.finish(
                wire.Failed(
                    request_id=request_id,
                    kind="bad_request",
                    message=f"request too large for the worker ({len(data)} bytes encoded, "
                    f"at most {wire.MAX_MESSAGE_BYTES})",
                )
            )
            return request_id, buffer
        self._open[request_id] = buffer
        self._unsent.add(request_id)
        self._outbox.append((request_id, data, True, arrival))
        self._generates_queued += 1
        self._signal_outbox()
        return request_id, buffer

    def cancel(self, request_id: int, reason: str = wire.CANCEL_REASON_CLIENT) -> None:
        """Give up on a request: end its stream, forget it and tell the worker, without waiting."""
        buffer = self._open.pop(request_id, None)
        if buffer is None or self._closed_reason is not None:
            return
        buffer.finish(
            wire.Failed(request_id=request_id, kind="cancelled", message=f"cancelled: {reason}")
        )
        if request_id in self._unsent:
            # The worker never heard of it: dropping the Generate is the whole cancel.
            self._unsent.discard(request_id)
            return
        cancel = wire.encode(wire.Cancel(request_id=request_id, reason=reason))
        self._outbox.append((request_id, cancel, False, None))
        self._signal_outbox()

    def deliver(self, message: wire.WorkerMessage) -> None:
        """Route one decoded reply to its request (never blocks).

        Raises:
            ProtocolError: a message that has no place on an established request plane.
        """
        if isinstance(message, wire.Hello):
            raise ProtocolError("a second hello on the request plane")
        if isinstance(message, wire.Batch):
            for item in message.messages:
                self.deliver(item)
            return
        reply: _Reply
        if isinstance(message, wire.Cancel):
            reply = wire.Failed(
                request_id=message.request_id,
                kind="cancelled",
                message=f"the worker cancelled the request: {message.reason}",
            )
        else:
            reply = message
        buffer = self._open.get(reply.request_id)
        if buffer is None:
            self._stats.late_replies += 1
            return
        if reply.request_id in self._unsent:
            raise ProtocolError(f"a reply for request {reply.request_id} before it was sent")
        if self._before_refusal is not None and (
            isinstance(reply, wire.Rejected)
            or (isinstance(reply, wire.Failed) and reply.kind == "unavailable")
        ):
            self._before_refusal()
        outcome = buffer.push(reply)
        if buffer.finished:
            del self._open[reply.request_id]
        elif outcome == "merged":
            self._stats.chunks_merged += 1
        elif outcome == "full":
            self._stats.requests_overflowed += 1
            buffer.finish(
                wire.Failed(
                    request_id=reply.request_id,
                    kind="cancelled",
                    message=f"the client read too slowly: {self._request_buffer} "
                    "replies were waiting for it",
                )
            )
            self.cancel(reply.request_id, reason="frontend: client too slow")

    async def next_outgoing(self) -> bytes:
        """The next message for the sender, waiting for one."""
        while True:
            while not self._outbox:
                await self._outbox_changed.wait()
            data = self._pop_outgoing()
            if data is not None:
                return data

    def take_outgoing(self, limit: int = 64) -> list[bytes]:
        """Up to ``limit`` more messages that are ready now, without waiting."""
        taken: list[bytes] = []
        while self._outbox and len(taken) < limit:
            data = self._pop_outgoing()
            if data is not None:
                taken.append(data)
        return taken

    def _pop_outgoing(self) -> bytes | None:
        request_id, data, is_generate, arrival = self._outbox.popleft()
        if not is_generate:
            return data
        self._generates_queued -= 1
        self._room.set()
        self._room = trio.Event()
        if request_id not in self._unsent:
            return None  # cancelled before it was sent: skipped
        self._unsent.discard(request_id)
        if arrival is not None:
            # Taken now, as the message leaves for the worker: the objective is the client's.
            spent = round((trio.current_time() - arrival) * 1000)
            data = wire.with_frontend_ms(data, min(wire.MAX_FRONTEND_MS, max(0, spent)))
        return data

    def close(self, reason: str) -> int:
        """End the session: every open request fails with ``unavailable``.

        Returns:
            How many requests were failed.
        """
        if self._closed_reason is not None:
            return 0
        self._closed_reason = reason
        failed = len(self._open)
        for request_id, buffer in self._open.items():
            buffer.finish(unavailable(request_id, reason))
        self._open.clear()
        self._outbox.clear()
        self._unsent.clear()
        self._room.set()
        return failed

    def _signal_outbox(self) -> None:
        self._outbox_changed.set()
        self._outbox_changed = trio.Event()


def unavailable(request_id: int, reason: str) -> wire.Failed:
    return wire.Failed(request_id=request_id, kind="unavailable", message=f"worker lost: {reason}")


class RequestStream:
    """One request in flight on a worker's request plane (made by :meth:`WorkerLink.request`).

    Read it in two steps: ``await first()`` tells whether the worker started the request, then
    ``async for reply in stream`` yields its ``Chunk`` items and ends after the one ``End`` or
    ``Failed``. Every path ends: if the worker is lost, the stream yields
    ``Failed(kind="unavailable")``.
    """

    __slots__ = ("_buffer", "_done", "_first", "_held", "request_id")

    def __init__(self, request_id: int, buffer: ResponseBuffer) -> None:
        #: The id on this session's request plane (unique per session only).
        self.request_id = request_id
        self._buffer = buffer
        self._first: FirstReply | None = None
        # A chunk or end that came without a Started before it, handed out by the iterator.
        self._held: StreamReply | None = None
        self._done = False

    async def first(self) -> FirstReply:
        """What the worker said first: ``Rejected``, ``Started``, or ``Failed``.

        Returns the same value when called again. A worker that skips ``Started`` and sends a
        chunk first is taken as having started (``prompt_tokens=0``).
        """
        if self._first is not None:
            return self._first
        reply = await self._buffer.get()
        first: FirstReply
        if isinstance(reply, wire.Chunk | wire.End):
            self._held = reply
            first = wire.Started(request_id=reply.request_id, prompt_tokens=0)
        else:
            first = reply
        if not isinstance(first, wire.Started):
            self._done = True
        self._first = first
        return first

    def __aiter__(self) -> AsyncIterator[StreamReply]:
        return self

    async def __anext__(self) -> StreamReply:
        """The next ``Chunk``, or the final ``End``/``Failed``; then ``StopAsyncIteration``.

        Raises:
            RuntimeError: called before :meth:`first` returned ``Started``.
        """
        if self._first is None:
            raise RuntimeError("call first() before iterating a RequestStream")
        if self._done:
            raise StopAsyncIteration
        if self._held is not None:
            reply: _Reply = self._held
            self._held = None
        else:
            reply = await self._buffer.get()
        return self._after_start(reply)

    async def ready(self) -> list[StreamReply]:
        """Every reply that has arrived, waiting for at least one: ``Chunk`` items, the last
        possibly the final ``End``/``Failed``; empty once the stream ended.

        What one read of the worker brought for this request is handed over at once, so that
        it can leave for the client in one write.

        Raises:
            RuntimeError: called before :meth:`first` returned ``Started``.
        """
        if self._first is None:
            raise RuntimeError("call first() before iterating a RequestStream")
        if self._done:
            return []
        if self._held is not None:
            replies: list[_Reply] = [self._held]
            self._held = None
        else:
            replies = await self._buffer.get_all()
        out: list[StreamReply] = []
        for reply in replies:
            out.append(self._after_start(reply))
            if self._done:
                break
        return out

    def _after_start(self, reply: _Reply) -> StreamReply:
        """A reply after ``Started`` as the stream hands it out (out-of-protocol ones become
        failures); notes the end of the stream."""
        if isinstance(reply, wire.Rejected):
            # Out of protocol after Started; reported as a failure of the request.
            reply = wire.Failed(
                request_id=reply.request_id,
                kind="engine",
                message=f"rejected after start: {reply.reason}",
            )
        elif isinstance(reply, wire.Started):
            reply = wire.Failed(
                request_id=reply.request_id, kind="engine", message="protocol error: a second start"
            )
        if not isinstance(reply, wire.Chunk):
            self._done = True
        return reply


def _vectors_expected(endpoint: wire.Endpoint, body: dict[str, Any]) -> int:
    """How many embedding vectors the answer to this body holds (0 for a completion)."""
    if endpoint != "embeddings":
        return 0
    inputs = body.get("input")
    return len(inputs) if isinstance(inputs, list) else 1
