"""The worker's two websocket planes: one object per connection, and what they share.

A connection sees its worker only through :class:`PlaneHost`: the hello, the engine, the gate,
the event publisher's subscriptions, the keepalive timings and one error counter. Which path
serves which plane, access, and the drain that closes the connections are in
:mod:`worker_ingress._server`.

- Event plane (:class:`EventConnection`): the worker sends a :class:`~wire.Hello`, then one
  :class:`~wire.EventBatch` per websocket message, from a latest-wins, rate-bounded
  :class:`~worker_ingress._events.Subscription`. A subscriber may send :class:`~wire.Subscribe`
  (its thresholds, for busy/free edges sent at once; with ``kv_events`` it asks for the KV
  events, sent as :class:`~wire.KvBatch` messages by a sender of their own, see
  :mod:`worker_ingress._kv_events`); anything else closes the connection.
- Request plane (:class:`RequestConnection`): the worker sends a :class:`~wire.Hello`; the
  client multiplexes :class:`~wire.Generate` and :class:`~wire.Cancel` by request id, alone or
  several in one :class:`~wire.RequestBatch`.

Rules of a request-plane connection:

1. One receive loop decodes and dispatches, and nothing slow, so trio-websocket's reader never
   stalls (a full receive queue would stop it answering pings): for a ``Generate`` it asks the
   gate for a certain refusal, has the engine prepare the request and has it meet the gate
   (:meth:`~worker_ingress._admission.SlotLease.arrive`: a slot, a queue place or a refusal;
   all three synchronous, rule 3), and answers there what needs no task (a rejection, bad
   input); it waits only to hand over that answer. Every other ``Generate`` runs in its own
   task in the connection's nursery, under its own cancel scope, which waits for its slot when
   it was queued. The requests of a message over :data:`PREPARE_ON_LOOP_BYTES` are prepared in
   a worker thread, which the receive loop waits for (their order kept): tokenising a prompt of
   megabytes no longer holds the worker's other connections, the interpreter handing the loop
   its turn every 5 ms (save in one long call in C: the decode stays one). The messages of a
   :class:`~wire.RequestBatch` are taken one after the other exactly as if each had come
   alone, so its requests meet the gate in the order they came (their tasks run, in no set
   order, once the receive loop next waits). A ``Cancel`` gives back at once the place of a
   request that has not begun to run (:meth:`~worker_ingress._admission.SlotLease.cancel`),
   so the next message finds it free.
2. One sender task writes the frames of running requests; request tasks hand it their frames
   through a bounded queue, so a slow client slows only its own requests (backpressure reaches
   the engine's stream through the queue). A frame handed over while there is room costs no
   checkpoint; the sender wakes once for whatever queued meanwhile. A certain rejection (the gate's
   :meth:`~worker_ingress._admission.AdmissionGate.reject_now`) is written by the receive loop
   itself (its only frame, so no order is at stake): shedding stays as cheap as an echo.
3. Per request: the gate's certain refusal first (``reject_now``: ``Rejected(reason)``, the
   prompt never prepared), then ``engine.prepare`` and the request's hop
   (:func:`~worker_ingress._hops.prepare_hop`; bad input, or a hop this worker cannot run:
   ``Failed(bad_request)``, no slot used), then ``gate.slot(priority, tenant, prompt_tokens)``
   (queue full, displaced, queue timeout, the objective's refusal with its queue bound, or
   draining: ``Rejected(reason)``, written by the receive loop when the arrival itself is
   refused), then ``Started(prompt_tokens, queue_wait_ms)``, the chunks, and ``End``. A chunk
   is made from an engine's output by :meth:`~worker_ingress.engines._base.EngineOutput.chunk`
   alone: a copy, because the wire's chunk carries the request id an engine never sees, and an
   output carries what is not sent (``cached_tokens`` and a hand-off, reported in ``End``;
   :data:`FIRST_OUTPUT`, not forwarded). A prefill hop sends no chunk: its ``End`` carries the
   engine's hand-off (none: ``Failed(engine)``). An engine exception: ``Failed(engine)``. A
   client ``Cancel``: ``Failed(cancelled)``. Drain grace expired
   (:meth:`RequestConnection.abandon`): ``Failed(unavailable)``. Exactly one final frame per
   request id; the slot or queue place is freed before or as it is sent.
4. A connection the worker closes writes every reply frame it holds before its close frame, the
   last frames of every request included (a chunk that finishes a choice waits for the next
   frame of its request, so a request's last frames leave together, after its slot is freed).
   On drain (:meth:`RequestConnection.close`) that is after every request of the connection
   has ended, within the drain's grace period; on a protocol error every request is cancelled
   at once and ends with ``Failed(unavailable)``. Either flush gets at most
   :data:`CLOSE_FLUSH_SECONDS` once the close is due. When the peer goes away (closed, or a
   keepalive pong missed), nothing can be written: every request of the connection is
   cancelled. In all cases its nursery is then cancelled and every slot or queue place freed.
5. Close codes sent by the worker: 1001 on drain, 1002 (by the frame bound in front of
   trio-websocket, :mod:`worker_ingress._frame_bound`) for a message past its bound of frames or
   pings past their rate, 1003 for a text message (the protocol is binary), 1007 for bytes that
   do not decode as a known message, 1008 for a ``Generate`` that reuses a request id still in
   flight, 1009 (by trio-websocket) for a message over the size cap. A peer that does not answer
   a keepalive ping in time is dropped without a close handshake.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from contextlib import AbstractContextManager
from typing import Final, Protocol, cast

import msgspec
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from shim_common._client_text import CLOSE_REASON_BYTES, cut_utf8
from shim_common.wire import (
    CLOSE_DRAINING,
    CLOSE_DUPLICATE_REQUEST_ID,
    CLOSE_TEXT_MESSAGE,
    CLOSE_UNDECODABLE,
    MAX_MESSAGE_BYTES,
    SUBPROTOCOL_BATCH,
    Batch,
    Cancel,
    Chunk,
    End,
    EventBatch,
    Failed,
    Generate,
    Handoff,
    Hello,
    KvBatch,
    Rejected,
    RejectReason,
    Reply,
    RequestBatch,
    Started,
    decode_client_message,
    decode_subscriber_message,
    encode,
    merge_text_chunks,
)
from worker_ingress._admission import AdmissionGate, Rejection, SlotLease
from worker_ingress._events import Subscription
from worker_ingress._hops import gate_prompt_tokens, prepare_hop
from worker_ingress._kv_events import KvEventLog, KvSubscription
from worker_ingress._subscriber_places import PeerWaits
from worker_ingress.engines._base import (
    FIRST_OUTPUT,
    Engine,
    EngineInputError,
    PreparedRequest,
    hands_off_kv,
)

__all__ = [
    "EventConnection",
    "PlaneHost",
    "RequestConnection",
    "WorkerPlaneConnection",
    "coalesce_chunks",
]

logger = logging.getLogger(__name__)

#: Longest a connection the worker closes gets to write the reply frames it holds (rule 4).
CLOSE_FLUSH_SECONDS: Final = 5.0
#: Frame groups (the frames one request task hands over together, usually one) waiting for a
#: connection's sender. Small: it only smooths bursts; beyond it the request tasks wait, which
#: is the backpressure we want.
SEND_QUEUE_FRAMES: Final = 256
#: A request-plane message larger than this has its requests prepared in a worker thread (rule
#: 1): on the event loop, the mocker took a second or more for a 7.7 MB prompt of short words.
PREPARE_ON_LOOP_BYTES: Final = 64 * 1024


class PlaneHost(Protocol):
    """What a plane connection may use of its worker, and nothing more."""

    @property
    def hello(self) -> Hello:
        """The first message on both planes."""
        ...

    @property
    def engine(self) -> Engine:
        """The engine: ``prepare`` and ``generate`` for the request plane."""
        ...

    @property
    def gate(self) -> AdmissionGate:
        """The admission gate every request goes through."""
        ...

    @property
    def ping_interval(self) -> float:
        """Seconds between keepalive pings."""
        ...

    @property
    def ping_timeout(self) -> float:
        """Seconds a pong may take before the peer is dropped."""
        ...

    def subscribe(self) -> AbstractContextManager[Subscription]:
        """An event-plane subscription for as long as the ``with`` block runs."""
        ...

    @property
    def kv_events(self) -> KvEventLog | None:
        """The engine's KV events (``None``: no prefix cache, the hello does not list them)."""
        ...

    def count_connection_error(self) -> None:
        """Count a connection that failed or broke the protocol."""
        ...

    @property
    def event_seq(self) -> int:
        """The ``seq`` of the last event or heartbeat the event plane produced (``End`` and
        ``Failed`` carry it, so a frontend knows which events still count the request)."""
        ...


def coalesce_chunks(messages: list[msgspec.Struct]) -> list[msgspec.Struct]:
    """Merge the text chunks of each request that queued up behind a busy connection.

    When the sender falls behind, a request's tokens wait in the queue as separate frames; one
    frame carrying them all costs the worker and the frontend one websocket message instead of
    many. A chunk merges into the request's latest pending chunk when
    :func:`~shim_common.wire.merge_text_chunks` allows; any other frame of the same request (its
    end, say) closes that chunk, so each request's frames keep their order, and frames of
    different requests keep their relative order otherwise.

    Args:
        messages: frames in queue order.

    Returns:
        The frames to send, in order.
    """
    out: list[msgspec.Struct] = []
    pending: dict[int, int] = {}  # request id -> index in out of its open text chunk
    for message in messages:
        if isinstance(message, Chunk):
            at = pending.get(message.request_id)
            if at is not None:
                earlier = out[at]
                assert isinstance(earlier, Chunk)
                merged = merge_text_chunks(earlier, message)
                if merged is not None:
                    out[at] = merged
                    continue
            pending[message.request_id] = len(out)
            out.append(message)
            continue
        request_id = getattr(message, "request_id", None)
        if request_id is not None:
            pending.pop(request_id, None)
        out.append(message)
    return out


class _FrameSender:
    """The only writer of one websocket: drains a bounded queue of frame groups, merging text
    chunks that piled up (see :func:`coalesce_chunks`). With ``batching`` (the client offered
    :data:`~shim_common.wire.SUBPROTOCOL_BATCH`), everything drained at once goes out as one
    :class:`~shim_common.wire.Batch` message.

    The queue is a deque and two events rather than a memory channel: a request task hands
    over a token's frame without a checkpoint or a wake-up of its own when there is room (the
    engine's stream it reads checkpoints anyway), and the sender is woken once per batch, not
    once per frame.
    """

    def __init__(self, ws: WebSocketConnection, *, batching: bool = False) -> None:
        self._ws = ws
        self._batching = batching
        self._queue: collections.deque[tuple[msgspec.Struct, ...]] = collections.deque()
        #: Set by the first group queued while the sender waits for one (or by close()).
        self._wakeup: trio.Event | None = None
        #: Set when the sender drained the queue and request tasks wait for room.
        self._room: trio.Event | None = None
        #: No more groups are taken: close() was called, or the sender stopped.
        self._closed = False

    async def send(self, *messages: msgspec.Struct) -> None:
        """Queue messages (kept together, in order); waits while the queue is full; drops them
        once the sender has closed (the connection is going away; its peer learns that from
        the close)."""
        queue = self._queue
        while len(queue) >= SEND_QUEUE_FRAMES and not self._closed:
            if self._room is None:
                self._room = trio.Event()
            await self._room.wait()
        if self._closed:
            return
        queue.append(messages)
        wakeup = self._wakeup
        if wakeup is not None:
            self._wakeup = None
            wakeup.set()

    def close(self) -> None:
        """Accept no more frames; the sender sends what is queued, then returns."""
        self._closed = True
        self._wake_all()

    def _wake_all(self) -> None:
        for event in (self._wakeup, self._room):
            if event is not None:
                event.set()
        self._wakeup = self._room = None

    async def run(self) -> None:
        """Send queued frames until :meth:`close`.

        Raises:
            ConnectionClosed: The websocket closed under it.
        """
        queue = self._queue
        try:
            while True:
                if not queue:
                    if self._closed:
                        return
                    self._wakeup = trio.Event()
                    await self._wakeup.wait()
                    continue
                if self._batching:
                    # One turn for the request tasks that just queued a frame: a short answer's
                    # next frames are usually one step behind, and then share the message.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                batch = [message for _ in range(len(queue)) for message in queue.popleft()]
                room = self._room
                if room is not None:
                    self._room = None
                    room.set()
                if len(batch) > 1:
                    batch = coalesce_chunks(batch)
                if self._batching and len(batch) > 1:
                    data = encode(Batch(messages=cast(list[Reply], batch)))
                    if len(data) <= MAX_MESSAGE_BYTES:
                        await self._ws.send_message(data)
                        continue
                for message in batch:
                    await self._ws.send_message(encode(message))
        finally:
            # Stopped (done, cancelled or the websocket closed): what is queued is dropped, and
            # request tasks waiting for room go on (their frames are dropped too).
            self._closed = True
            queue.clear()
            self._wake_all()


class _PongTimeout(Exception):
    """A peer did not answer a keepalive ping in time."""


async def _keepalive(
    ws: WebSocketConnection,
    interval: float,
    pong_deadline: float,
    waits: PeerWaits | None = None,
) -> None:
    """Ping every ``interval`` seconds; return when a pong is late or the connection closed."""
    while True:
        await trio.sleep(interval)
        with trio.move_on_after(pong_deadline) as ping_scope:
            try:
                if waits is None:
                    await ws.ping()
                else:
                    with waits.waiting("ping", trio.current_time()):
                        await ws.ping()
            except ConnectionClosed:
                return
        if ping_scope.cancelled_caught:
            logger.info("peer %s missed a keepalive pong; dropping it", ws.remote)
            raise _PongTimeout


async def _keepalive_then_stop(
    host: PlaneHost,
    ws: WebSocketConnection,
    stop: trio.CancelScope,
    waits: PeerWaits | None = None,
) -> None:
    """Keep ``ws`` alive; when a pong is late (counted) or the peer left, cancel ``stop``."""
    try:
        await _keepalive(ws, host.ping_interval, host.ping_timeout, waits)
    except _PongTimeout:
        host.count_connection_error()
    stop.cancel()


class RequestConnection:
    """One request-plane connection (see rules 1-5 of the module docstring)."""

    def __init__(self, host: PlaneHost, ws: WebSocketConnection) -> None:
        self._host = host
        self._ws = ws
        self._sender = _FrameSender(ws, batching=ws.subprotocol == SUBPROTOCOL_BATCH)
        #: Per request with a task: its cancel scope and its hold on the gate.
        self._requests: dict[int, tuple[trio.CancelScope, SlotLease]] = {}
        #: Per started request, the event ``seq`` when it took its slot and at its first
        #: output (``None`` before it): its final frame carries them (docs/protocol.md).
        self._seqs: dict[int, tuple[int, int | None]] = {}
        #: Set by _abandon(): cancelled requests end with ``Failed(unavailable)`` and this text.
        self._abandoned: str | None = None
        self._no_requests = trio.Event()
        self._no_requests.set()
        self._scope = trio.CancelScope()
        #: The close code and reason to send once the connection's tasks have stopped.
        self._close: tuple[int, str] | None = None
        #: Set when the sender has written everything after _sender.close().
        self._flushed = trio.Event()
        self._finished = trio.Event()

    async def serve(self) -> None:
        """Serve the connection until it closes or the worker shuts it."""
        try:
            await self._serve()
        finally:
            self._finished.set()

    async def _serve(self) -> None:
        with self._scope:
            await self._ws.send_message(encode(self._host.hello))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_then_stop, nursery.cancel_scope)
                nursery.start_soon(_keepalive_then_stop, self._host, self._ws, nursery.cancel_scope)
                await self._receive_loop(nursery)
                if self._close is not None:
                    # A protocol error, but the peer still reads: a final frame for each of its
                    # requests, and every frame already queued, go out before the close (rule 4).
                    self._abandon(f"Server unavailable: connection closed ({self._close[1]})")
                    with trio.move_on_after(CLOSE_FLUSH_SECONDS):
                        await self._flush()
                nursery.cancel_scope.cancel()
            # Closed only now that no other task can write: a send cut short by a cancel
            # would leave the close frame half written and the peer would see 1006.
            if self._close is not None:
                await self._ws.aclose(*self._close)

    async def _send_then_stop(self, stop: trio.CancelScope) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self._sender.run()
            self._flushed.set()
            if self._close is None:
                # The sender ran dry after close(): the worker is draining.
                self._close = (CLOSE_DRAINING, "worker draining")
        stop.cancel()

    async def _receive_loop(self, nursery: trio.Nursery) -> None:
        ws = self._ws
        while True:
            try:
                data = await ws.get_message()
            except ConnectionClosed as closed:
                if closed.reason is not None and closed.reason.code == 1009:
                    # trio-websocket closed it for a message over the size cap.
                    self._host.count_connection_error()
                return
            if isinstance(data, str):
                await self._protocol_error(CLOSE_TEXT_MESSAGE, "binary msgpack messages only")
                return
            try:
                message = decode_client_message(data)
            except msgspec.DecodeError as error:
                await self._protocol_error(CLOSE_UNDECODABLE, f"undecodable message: {error}")
                return
            # A batch is taken exactly as its messages one by one, in order, without a read
            # (and a wake-up of this task) between them.
            batch = message.messages if isinstance(message, RequestBatch) else (message,)
            off_loop = len(data) > PREPARE_ON_LOOP_BYTES
            for each in batch:
                if not await self._take(each, nursery, off_loop):
                    return

    async def _take(
        self, message: Generate | Cancel, nursery: trio.Nursery, off_loop: bool = False
    ) -> bool:
        """Act on one client message; ``False`` when the connection is to stop reading."""
        if isinstance(message, Cancel):
            request = self._requests.get(message.request_id)
            if request is not None:
                scope, lease = request
                scope.cancel()
                # Its place is free before the next message (of the same batch, maybe) arrives,
                # not only once its task runs.
                lease.cancel()
            return True
        if message.request_id in self._requests:
            await self._protocol_error(CLOSE_DUPLICATE_REQUEST_ID, "request id already in flight")
            return False
        try:
            admitted = await self._admit(message, off_loop)
        except ConnectionClosed:
            return False
        if admitted is None:
            return True
        prepared, lease = admitted
        scope = trio.CancelScope()
        self._requests[message.request_id] = (scope, lease)
        if self._no_requests.is_set():
            self._no_requests = trio.Event()
        nursery.start_soon(self._run_request, message, prepared, lease, scope)
        return True

    def _rejected(self, request_id: int, reason: RejectReason) -> Rejected:
        # An objective's refusal says at which queue depth it refuses (docs/protocol.md).
        slo = self._host.gate.slo
        if reason is RejectReason.SLO and slo is not None:
            return Rejected.of(request_id, reason, slo.queue_bound)
        return Rejected.of(request_id, reason)

    async def _admit(
        self, generate: Generate, off_loop: bool = False
    ) -> tuple[PreparedRequest, SlotLease] | None:
        """Validate a request and have it meet the gate; answer it here when that needs no task
        (bad input, a refusal), else return the prepared request and its hold on the gate.
        With ``off_loop`` (a large message, rule 1) the engine prepares it in a worker thread.

        Raises:
            ConnectionClosed: writing the answer found the connection gone.
        """
        host = self._host
        request_id = generate.request_id
        already_waited = generate.frontend_ms / 1000
        # Asked first, synchronously, so shedding costs no task and no preparation of a prompt
        # that will not run (it must stay cheap).
        reason = host.gate.reject_now(
            generate.priority, generate.tenant, already_waited=already_waited
        )
        if reason is not None:
            await self._write_rejected(request_id, reason)
            return None
        try:
            if off_loop:
                prepared = await trio.to_thread.run_sync(
                    host.engine.prepare, generate.endpoint, generate.body
                )
            else:
                prepared = host.engine.prepare(generate.endpoint, generate.body)
            if generate.prefill_only or generate.handoff is not None:
                prepared = prepare_hop(
                    generate,
                    prepared,
                    hands_off=hands_off_kv(host.engine),
                    block_size=host.engine.config.block_size,
                )
        except EngineInputError as error:
            await self._sender.send(
                Failed(request_id=request_id, kind="bad_request", message=str(error))
            )
            return None
        except Exception as error:
            logger.exception("engine failed to prepare request %d", request_id)
            await self._sender.send(
                Failed(request_id=request_id, kind="engine", message=f"engine error: {error}")
            )
            return None
        if generate.dp_rank is not None or generate.tenant:
            # What the router chose and whose request it is, for the engine (a replace only
            # when either is set: the plain request stays as prepared).
            prepared = msgspec.structs.replace(
                prepared, dp_rank=generate.dp_rank, tenant=generate.tenant
            )

        def took_slot() -> None:
            # Stamped as the slot is taken, before any other task runs: a report published
            # after this seq counts the request (docs/protocol.md, the final frame's seqs).
            self._seqs[request_id] = (host.event_seq, None)

        lease = host.gate.slot(
            generate.priority,
            generate.tenant,
            gate_prompt_tokens(prepared),
            already_waited=already_waited,
            on_start=took_slot,
        )
        try:
            # Here, not in the request's task: the requests of a batch meet the gate in the
            # order they came, and a refusal costs no task (rule 1).
            lease.arrive()
        except Rejection as rejection:
            await self._write_rejected(request_id, rejection.reason)
            return None
        return prepared, lease

    async def _write_rejected(self, request_id: int, reason: RejectReason) -> None:
        # Written here rather than through the sender: a rejection is the request's only
        # frame, so no ordering is at stake, and the hop through the channel is half the
        # cost of shedding. A ConnectionClosed ends the receive loop like a failed read.
        await self._ws.send_message(encode(self._rejected(request_id, reason)))

    async def _protocol_error(self, code: int, reason: str) -> None:
        logger.info("closing %s with %d: %s", self._ws.remote, code, reason)
        self._host.count_connection_error()
        # A close reason must fit a control frame (125 bytes, code included): cut by bytes.
        self._close = (code, cut_utf8(reason, CLOSE_REASON_BYTES))
        await trio.lowlevel.checkpoint()

    async def _run_request(
        self,
        generate: Generate,
        prepared: PreparedRequest,
        lease: SlotLease,
        scope: trio.CancelScope,
    ) -> None:
        request_id = generate.request_id
        try:
            final: list[msgspec.Struct] = [
                Failed(request_id=request_id, kind="cancelled", message="cancelled by the client")
            ]
            with scope:
                final = await self._execute(generate, prepared, lease)
            if scope.cancelled_caught and self._abandoned is not None:
                final = [Failed(request_id=request_id, kind="unavailable", message=self._abandoned)]
            last = final[-1]
            if isinstance(last, End | Failed) and request_id in self._seqs:
                # The slot and the engine's blocks are given back by now: events after this
                # seq no longer count the request.
                started, first = self._seqs[request_id]
                ended = self._host.event_seq
                final[-1] = msgspec.structs.replace(
                    last,
                    started_seq=started,
                    first_output_seq=ended if first is None else first,
                    ended_seq=ended,
                )
            await self._sender.send(*final)
        finally:
            self._seqs.pop(request_id, None)
            del self._requests[request_id]
            if not self._requests:
                self._no_requests.set()

    async def _execute(
        self, generate: Generate, prepared: PreparedRequest, lease: SlotLease
    ) -> list[msgspec.Struct]:
        """Run one admitted-to-try request; return its last frames, the final one last (rule 3).

        ``Started`` goes out at once (the frontend sends its status line on it), and a chunk
        that finishes its choice goes out with whatever follows it (the next chunk, or the
        ``End``), so a short answer's last chunk and end are one message to a client that reads
        batches.
        """
        host = self._host
        request_id = generate.request_id
        completion_tokens = 0
        cached_tokens = 0
        handoff: Handoff | None = None
        output_seen = False
        held: list[msgspec.Struct] = []
        try:
            async with lease:
                started_seq = self._seqs[request_id][0]  # stamped as it took its slot (_admit)
                await self._sender.send(
                    Started(
                        request_id=request_id,
                        prompt_tokens=prepared.prompt_tokens,
                        queue_wait_ms=round(lease.queue_wait * 1000),
                    )
                )
                async with contextlib.aclosing(host.engine.generate(prepared)) as outputs:
                    async for output in outputs:
                        if not output_seen:
                            # The first output (of the mocker after its prefill, of the openai
                            # engine its first upstream chunk) gives the waiting place back.
                            lease.first_output()
                            output_seen = True
                            self._seqs[request_id] = (started_seq, host.event_seq)
                        if output is FIRST_OUTPUT:
                            continue
                        if output.cached_tokens is not None:
                            cached_tokens = output.cached_tokens
                        if output.handoff is not None:
                            handoff = output.handoff
                        if prepared.prefill_only:
                            continue  # a prefill hop sends no chunk: its end says it all
                        lease.charge(output.tokens)
                        completion_tokens += output.tokens
                        chunk = output.chunk(request_id)
                        if chunk.finish_reason is not None:
                            held.append(chunk)
                        elif held:
                            await self._sender.send(*held, chunk)
                            held = []
                        else:
                            await self._sender.send(chunk)
        except Rejection as rejection:
            return [self._rejected(request_id, rejection.reason)]
        except Exception as error:
            logger.exception("engine failed on request %d", request_id)
            failed = Failed(request_id=request_id, kind="engine", message=f"engine error: {error}")
            return [*held, failed]
        if prepared.prefill_only and handoff is None:
            message = "engine error: the prefill ended without a hand-off"
            return [Failed(request_id=request_id, kind="engine", message=message)]
        held.append(
            End(
                request_id=request_id,
                prompt_tokens=prepared.prompt_tokens,
                completion_tokens=completion_tokens,
                cached_tokens=cached_tokens,
                handoff=handoff,
            )
        )
        return held

    def abandon(self) -> None:
        """The drain grace expired: cancel every request; each ends with ``Failed(unavailable)``."""
        self._abandon("Server unavailable: drain grace period expired")

    def _abandon(self, message: str) -> None:
        self._abandoned = message
        for scope, _ in self._requests.values():
            scope.cancel()

    async def _flush(self) -> None:
        # Every request's final frame handed to the sender, then everything written.
        await self._no_requests.wait()
        self._sender.close()
        await self._flushed.wait()

    async def close(self) -> None:
        """Let the requests send their final frames, write every frame, close with 1001, and
        return after (rule 4)."""
        await self._no_requests.wait()
        self._sender.close()
        await self._finished.wait()

    def abort(self) -> None:
        """Stop serving at once (every request is cancelled)."""
        self._scope.cancel()


class EventConnection:
    """One event-plane connection: hello, then batches from a latest-wins subscription."""

    def __init__(self, host: PlaneHost, ws: WebSocketConnection) -> None:
        self._host = host
        self._ws = ws
        self._scope = trio.CancelScope()
        self._send_scope = trio.CancelScope()
        self._finished = trio.Event()
        #: Set by a Subscribe asking for KV events; the KV sender then starts (rule 6 of
        #: shim_common.wire).
        self._kv_wanted = trio.Event()
        self._kv: KvSubscription | None = None
        #: The subscriber asked for its KV events in parts (``wire.FEATURE_KV_PARTS``).
        self._kv_parts = False
        #: When the connection was accepted (``trio.current_time()``), and from where.
        self.opened_at = trio.current_time()
        self.remote = ws.remote
        self._subscription: Subscription | None = None
        #: What this connection sends that waits on the subscriber (batches, pings).
        self._waits = PeerWaits()

    @property
    def _subscribed(self) -> bool:
        subscription = self._subscription
        return subscription is not None and subscription.subscribed

    def squatting(self, now: float, grace: float) -> bool:
        """Whether the subscriber has sent no ``Subscribe`` in the ``grace`` seconds since it
        was accepted (what a frontend sends first: ``_events`` rule 9)."""
        return not self._subscribed and now - self.opened_at >= grace

    def reading(self, now: float, grace: float) -> bool:
        """Whether the subscriber has sent a ``Subscribe`` and reads what it is sent: no batch
        being written to it, nor a keepalive ping, has waited ``grace`` seconds on it. Such a
        subscriber is a frontend's, as far as the worker can tell, and keeps its place
        (:mod:`worker_ingress._subscriber_places`)."""
        return self._subscribed and self._waits.longest(now) < grace

    async def serve(self) -> None:
        """Serve the subscriber until it leaves or the worker shuts it."""
        try:
            await self._serve()
        finally:
            self._finished.set()

    async def _serve(self) -> None:
        with self._scope:
            await self._ws.send_message(encode(self._host.hello))
            with self._host.subscribe() as subscription:
                self._subscription = subscription
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read_subscriber, subscription, nursery.cancel_scope)
                    nursery.start_soon(
                        _keepalive_then_stop,
                        self._host,
                        self._ws,
                        nursery.cancel_scope,
                        self._waits,
                    )
                    kv_events = self._host.kv_events
                    if kv_events is not None:
                        nursery.start_soon(self._send_kv_events, kv_events, subscription)
                    with contextlib.suppress(ConnectionClosed), self._send_scope:
                        while True:
                            events = await subscription.next_batch()
                            batch = EventBatch(events=events, sent=time.time())
                            with self._waits.waiting("events", trio.current_time()):
                                await self._ws.send_message(encode(batch))
                    nursery.cancel_scope.cancel()
            if self._send_scope.cancelled_caught:
                # close() stopped the sender: the worker is draining.
                await self._ws.aclose(CLOSE_DRAINING, "worker draining")

    async def _read_subscriber(self, subscription: Subscription, stop: trio.CancelScope) -> None:
        # Reading also keeps trio-websocket's reader going (pongs, close frames). A subscriber
        # sends only its thresholds; anything else ends the connection with the usual codes.
        with contextlib.suppress(ConnectionClosed):
            while True:
                data = await self._ws.get_message()
                if isinstance(data, str):
                    await self._ws.aclose(CLOSE_TEXT_MESSAGE, "the protocol is binary msgpack")
                    break
                try:
                    message = decode_subscriber_message(data)
                except msgspec.DecodeError as exc:
                    await self._ws.aclose(
                        CLOSE_UNDECODABLE,
                        cut_utf8(f"undecodable message: {exc}", CLOSE_REASON_BYTES),
                    )
                    break
                subscription.set_thresholds(message.thresholds)
                subscription.set_publish_interval(message.publish_interval)
                if message.kv_events:
                    if self._kv is not None and message.kv_snapshot:
                        self._kv.ask_snapshot()
                    if not self._kv_wanted.is_set():
                        self._kv_parts = message.kv_parts  # fixed by the first ask
                    self._kv_wanted.set()
        stop.cancel()

    async def _send_kv_events(self, log: KvEventLog, subscription: Subscription) -> None:
        # KV events, once asked for: a snapshot, then every event in order, paced like the
        # load events (worker_ingress/_kv_events.py). Never from a worker that does not list
        # the feature, never to a subscriber that did not ask.
        await self._kv_wanted.wait()
        with contextlib.suppress(ConnectionClosed), log.subscribe(parts=self._kv_parts) as kv:
            self._kv = kv
            while True:
                events = await kv.next_batch(subscription.publish_interval)
                data = encode(KvBatch(events=events))
                with self._waits.waiting("kv", trio.current_time()):
                    await self._ws.send_message(data)
                kv.sent(len(data))

    async def close(self) -> None:
        """Stop sending batches, close with 1001, and return after."""
        self._send_scope.cancel()
        await self._finished.wait()

    def abort(self) -> None:
        """Stop serving at once."""
        self._scope.cancel()


WorkerPlaneConnection = RequestConnection | EventConnection
