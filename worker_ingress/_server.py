"""The worker's network side: both websocket planes on one port, the system port, and drain.

Access: with a token set (``DYN_WORKER_TOKEN``), a handshake on any path without
``Authorization: Bearer <token>`` is refused with HTTP 401 before anything else is looked at, and
counted (``dynamo_worker_unauthorized_total``); the comparison is constant-time and the token is
never logged. With ``--tls-cert-path``/``--tls-key-path`` the port speaks TLS (``wss://``); each
handshake runs in its connection's task, bounded, and a failure is counted and closes that
connection only.

Paths on the websocket port (anything else: the handshake is rejected with HTTP 404):

- ``/v1/events``: the worker sends a :class:`~wire.Hello`, then one :class:`~wire.EventBatch` per
  websocket message, from a latest-wins, rate-bounded
  :class:`~worker_ingress._events.Subscription`. A subscriber may send :class:`~wire.Subscribe`
  (its thresholds, for busy/free edges sent at once); anything else closes the connection.
- ``/v1/requests``: the worker sends a :class:`~wire.Hello`; the client multiplexes
  :class:`~wire.Generate` and :class:`~wire.Cancel` by request id.

Rules of a request-plane connection:

1. One receive loop does nothing but decode and dispatch, so trio-websocket's reader never stalls
   (a full receive queue would stop it answering pings). Each ``Generate`` runs in its own task in
   the connection's nursery, under its own cancel scope.
2. One sender task writes the frames of running requests; request tasks hand it encoded frames
   through a bounded channel, so a slow client slows only its own requests (backpressure reaches
   the engine's stream through the channel). A certain rejection is written by the receive loop
   itself (its only frame, so no order is at stake): shedding stays as cheap as an echo.
3. Per request: ``engine.prepare`` (bad input: ``Failed(bad_request)``, no slot used), then
   ``gate.slot()`` (full or draining: ``Rejected(reason)``), then ``Started(prompt_tokens)``,
   the chunks, and ``End``. An engine exception: ``Failed(engine)``. A client ``Cancel``:
   ``Failed(cancelled)``. Drain grace expired: ``Failed(unavailable)``. Exactly one final frame
   per request id; the slot or queue place is freed before or as it is sent.
4. When the connection ends for any reason, its nursery is cancelled: every request of the
   connection is cancelled and its slot or queue place freed.
5. Close codes sent by the worker: 1001 on drain, 1003 for a text message (the protocol is
   binary), 1007 for bytes that do not decode as a known message, 1008 for a ``Generate`` that
   reuses a request id still in flight, 1009 (by trio-websocket) for a message over the size cap.
   A peer that does not answer a keepalive ping in time is dropped without a close handshake.
6. Any exception escaping a connection is logged and counted
   (:meth:`WorkerMetrics.count_connection_error`); it never reaches the listener, because
   ``serve_websocket`` would crash entirely.

Drain (:meth:`Worker.drain`, or SIGTERM/SIGINT in :func:`run_worker`): the gate rejects new
requests with ``Server unavailable: draining``, ``/health`` answers 503 ``draining`` and heartbeats
carry ``status="draining"``; running and queued requests get ``settings.drain_grace`` seconds to
finish, after which they are cancelled with ``Failed(unavailable)``; then every connection is
closed with 1001 and :meth:`Worker.serve` returns.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import ssl
import sys
import time
from collections.abc import Callable
from typing import Final, Literal, NamedTuple, cast

import msgspec
import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    WebSocketServer,
)

from shim_common._access import HandshakeFirstListener, bearer_matches, server_context
from shim_common._net import base_url
from shim_common.wire import (
    CLOSE_DRAINING,
    CLOSE_DUPLICATE_REQUEST_ID,
    CLOSE_TEXT_MESSAGE,
    CLOSE_UNDECODABLE,
    EVENTS_PATH,
    FEATURE_BUSY_EDGES,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    REQUESTS_PATH,
    Cancel,
    Chunk,
    End,
    EventBatch,
    Failed,
    Generate,
    Hello,
    Rejected,
    RuntimeConfig,
    Started,
    decode_client_message,
    decode_subscriber_message,
    encode,
    merge_text_chunks,
)
from worker_ingress._admission import AdmissionGate, Rejection
from worker_ingress._admission import Rejected as GateRejected
from worker_ingress._config import WorkerSettings
from worker_ingress._events import EventPublisher, Subscription
from worker_ingress._metrics import WorkerMetrics
from worker_ingress._system import serve_system
from worker_ingress.engines._base import Engine, EngineInputError, PreparedRequest

__all__ = [
    "HealthStatus",
    "Worker",
    "WorkerAddress",
    "run_worker",
]

logger = logging.getLogger(__name__)

#: Frames waiting for a connection's sender. Small: it only smooths bursts; beyond it the
#: request tasks wait, which is the backpressure we want.
SEND_QUEUE_FRAMES: Final = 256
#: Messages trio-websocket buffers per connection before its reader pauses (memory bound:
#: this many times the message size cap).
RECEIVE_QUEUE_MESSAGES: Final = 4
#: Longest a connection gets to flush its last frames and close once the drain is over.
CLOSE_FLUSH_SECONDS: Final = 5.0
#: Seconds a new connection gets for its TLS handshake and its websocket opening handshake.
OPEN_TIMEOUT: Final = 10.0
#: Seconds between two log lines about refused handshakes (each one is counted).
REFUSAL_LOG_INTERVAL: Final = 10.0

HealthStatus = Literal["starting", "ready", "draining"]


class WorkerAddress(NamedTuple):
    """Where a running worker can be reached."""

    ws_url: str
    system_url: str


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
    """The only writer of one websocket: drains a bounded queue of frames, merging text chunks
    that piled up (see :func:`coalesce_chunks`)."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self._ws = ws
        self._send_tx, self._send_rx = trio.open_memory_channel[msgspec.Struct](SEND_QUEUE_FRAMES)

    async def send(self, message: msgspec.Struct) -> None:
        """Queue a message; waits while the queue is full; drops it once the sender has closed."""
        # Closed: the connection is going away; its peer learns that from the close.
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            await self._send_tx.send(message)

    def close(self) -> None:
        """Accept no more frames; the sender sends what is queued, then returns."""
        self._send_tx.close()

    async def run(self) -> None:
        """Send queued frames until :meth:`close`.

        Raises:
            ConnectionClosed: The websocket closed under it.
        """
        receive = self._send_rx
        async with receive:
            async for first in receive:
                batch = [first]
                # Whatever queued meanwhile, bounded by the queue's size.
                while len(batch) < SEND_QUEUE_FRAMES:
                    try:
                        batch.append(receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                for message in coalesce_chunks(batch) if len(batch) > 1 else batch:
                    await self._ws.send_message(encode(message))


class _PongTimeout(Exception):
    """A peer did not answer a keepalive ping in time."""


async def _keepalive(ws: WebSocketConnection, interval: float, pong_deadline: float) -> None:
    """Ping every ``interval`` seconds; return when a pong is late or the connection closed."""
    while True:
        await trio.sleep(interval)
        with trio.move_on_after(pong_deadline) as ping_scope:
            try:
                await ws.ping()
            except ConnectionClosed:
                return
        if ping_scope.cancelled_caught:
            logger.info("peer %s missed a keepalive pong; dropping it", ws.remote)
            raise _PongTimeout


async def _keepalive_then_stop(
    worker: Worker, ws: WebSocketConnection, stop: trio.CancelScope
) -> None:
    """Keep ``ws`` alive; when a pong is late (counted) or the peer left, cancel ``stop``."""
    try:
        await _keepalive(ws, worker.ping_interval, worker.ping_timeout)
    except _PongTimeout:
        worker.metrics.count_connection_error()
    stop.cancel()


class _RequestConnection:
    """One request-plane connection (see rules 1-5 of the module docstring)."""

    def __init__(self, worker: Worker, ws: WebSocketConnection) -> None:
        self._worker = worker
        self._ws = ws
        self._sender = _FrameSender(ws)
        self._requests: dict[int, trio.CancelScope] = {}
        self._no_requests = trio.Event()
        self._no_requests.set()
        self._scope = trio.CancelScope()
        #: The close code and reason to send once the connection's tasks have stopped.
        self._close: tuple[int, str] | None = None
        self._finished = trio.Event()

    async def serve(self) -> None:
        """Serve the connection until it closes or the worker shuts it."""
        try:
            await self._serve()
        finally:
            self._finished.set()

    async def _serve(self) -> None:
        with self._scope:
            await self._ws.send_message(encode(self._worker.hello))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_then_stop, nursery.cancel_scope)
                nursery.start_soon(
                    _keepalive_then_stop, self._worker, self._ws, nursery.cancel_scope
                )
                await self._receive_loop(nursery)
                nursery.cancel_scope.cancel()
            # Closed only now that no other task can write: a send cut short by a cancel
            # would leave the close frame half written and the peer would see 1006.
            if self._close is not None:
                await self._ws.aclose(*self._close)

    async def _send_then_stop(self, stop: trio.CancelScope) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self._sender.run()
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
                    self._worker.metrics.count_connection_error()
                return
            if isinstance(data, str):
                await self._protocol_error(CLOSE_TEXT_MESSAGE, "binary msgpack messages only")
                return
            try:
                message = decode_client_message(data)
            except msgspec.DecodeError as error:
                await self._protocol_error(CLOSE_UNDECODABLE, f"undecodable message: {error}")
                return
            if isinstance(message, Cancel):
                scope = self._requests.get(message.request_id)
                if scope is not None:
                    scope.cancel()
                continue
            if message.request_id in self._requests:
                await self._protocol_error(
                    CLOSE_DUPLICATE_REQUEST_ID, "request id already in flight"
                )
                return
            try:
                prepared = await self._prepare(message)
            except ConnectionClosed:
                return
            if prepared is None:
                continue
            scope = trio.CancelScope()
            self._requests[message.request_id] = scope
            if self._no_requests.is_set():
                self._no_requests = trio.Event()
            nursery.start_soon(self._run_request, message, prepared, scope)

    async def _prepare(self, generate: Generate) -> PreparedRequest | None:
        """Validate a request; answer it here when that needs no task (bad input, certain
        rejection), else return the prepared request."""
        worker = self._worker
        request_id = generate.request_id
        try:
            prepared = worker.engine.prepare(generate.endpoint, generate.body)
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
        gate = worker.gate
        if gate.draining or gate.queued >= gate.queue_limit:
            # The gate will reject this one for sure (draining, or N running and Q waiting):
            # ask it here, synchronously, so shedding costs no task (it must stay cheap).
            decision = gate.state.arrive()
            if not isinstance(decision, GateRejected):
                raise RuntimeError(f"the gate admitted a request at its cap: {decision!r}")
            # Written here rather than through the sender: a rejection is the request's only
            # frame, so no ordering is at stake, and the hop through the channel is half the
            # cost of shedding. A ConnectionClosed ends the receive loop like a failed read.
            await self._ws.send_message(
                encode(Rejected(request_id=request_id, reason=decision.reason))
            )
            return None
        return prepared

    async def _protocol_error(self, code: int, reason: str) -> None:
        logger.info("closing %s with %d: %s", self._ws.remote, code, reason)
        self._worker.metrics.count_connection_error()
        # A close reason must fit a control frame (125 bytes, code included).
        self._close = (code, reason[:120])
        await trio.lowlevel.checkpoint()

    async def _run_request(
        self, generate: Generate, prepared: PreparedRequest, scope: trio.CancelScope
    ) -> None:
        worker = self._worker
        request_id = generate.request_id
        worker.request_scopes.add(scope)
        try:
            final: msgspec.Struct = Failed(
                request_id=request_id, kind="cancelled", message="cancelled by the client"
            )
            with scope:
                final = await self._execute(request_id, prepared)
            if scope.cancelled_caught and worker.abandoning:
                final = Failed(
                    request_id=request_id,
                    kind="unavailable",
                    message="Server unavailable: drain grace period expired",
                )
            await self._sender.send(final)
        finally:
            worker.request_scopes.discard(scope)
            del self._requests[request_id]
            if not self._requests:
                self._no_requests.set()

    async def _execute(self, request_id: int, prepared: PreparedRequest) -> msgspec.Struct:
        """Run one admitted-to-try request up to its final frame; return that frame (rule 3)."""
        worker = self._worker
        completion_tokens = 0
        try:
            async with worker.gate.slot():
                await self._sender.send(
                    Started(request_id=request_id, prompt_tokens=prepared.prompt_tokens)
                )
                async with contextlib.aclosing(worker.engine.generate(prepared)) as outputs:
                    async for output in outputs:
                        completion_tokens += output.tokens
                        await self._sender.send(
                            Chunk(
                                request_id=request_id,
                                text=output.text,
                                tokens=output.tokens,
                                finish_reason=output.finish_reason,
                                embedding=output.embedding,
                                index=output.index,
                            )
                        )
        except Rejection as rejection:
            return Rejected(request_id=request_id, reason=rejection.reason)
        except Exception as error:
            logger.exception("engine failed on request %d", request_id)
            return Failed(request_id=request_id, kind="engine", message=f"engine error: {error}")
        return End(
            request_id=request_id,
            prompt_tokens=prepared.prompt_tokens,
            completion_tokens=completion_tokens,
        )

    async def close(self) -> None:
        """Let the requests send their final frames, flush, close with 1001, and return after."""
        await self._no_requests.wait()
        self._sender.close()
        await self._finished.wait()

    def abort(self) -> None:
        """Stop serving at once (every request is cancelled)."""
        self._scope.cancel()


class _EventConnection:
    """One event-plane connection: hello, then batches from a latest-wins subscription."""

    def __init__(self, worker: Worker, ws: WebSocketConnection) -> None:
        self._worker = worker
        self._ws = ws
        self._scope = trio.CancelScope()
        self._send_scope = trio.CancelScope()
        self._finished = trio.Event()

    async def serve(self) -> None:
        """Serve the subscriber until it leaves or the worker shuts it."""
        try:
            await self._serve()
        finally:
            self._finished.set()

    async def _serve(self) -> None:
        with self._scope:
            await self._ws.send_message(encode(self._worker.hello))
            with self._worker.publisher.subscribe() as subscription:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read_subscriber, subscription, nursery.cancel_scope)
                    nursery.start_soon(
                        _keepalive_then_stop, self._worker, self._ws, nursery.cancel_scope
                    )
                    with contextlib.suppress(ConnectionClosed), self._send_scope:
                        while True:
                            events = await subscription.next_batch()
                            batch = EventBatch(events=events, sent=time.time())
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
                    await self._ws.aclose(CLOSE_UNDECODABLE, f"undecodable message: {exc}"[:120])
                    break
                subscription.set_thresholds(message.thresholds)
        stop.cancel()

    async def close(self) -> None:
        """Stop sending batches, close with 1001, and return after."""
        self._send_scope.cancel()
        await self._finished.wait()

    def abort(self) -> None:
        """Stop serving at once."""
        self._scope.cancel()


_Connection = _RequestConnection | _EventConnection


class Worker:
    """A worker: the engine behind the admission gate, served on the websocket and system ports.

    Args:
        settings: Validated worker settings (addresses, N, Q, drain grace, heartbeat interval).
        engine: The engine to serve.
        metrics: The worker's metrics; built from the gate and engine when omitted.
        max_message_bytes: Size cap of one inbound websocket message (over it: close 1009).
        ping_interval: Seconds between keepalive pings on every connection.
        ping_timeout: Seconds a pong may take before the peer is dropped.
        close_timeout: Seconds a closing handshake may take before the socket is closed anyway.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        *,
        metrics: WorkerMetrics | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        ping_interval: float = 10.0,
        ping_timeout: float = 20.0,
        close_timeout: float = 5.0,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.max_message_bytes = max_message_bytes
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.close_timeout = close_timeout
        self.gate = AdmissionGate.from_settings(settings, on_change=self._gate_changed)
        self.publisher = EventPublisher(
            load=engine.load,
            load_changed=engine.load_changed,
            gauges=self._gauges,
            heartbeat_interval=settings.heartbeat_interval,
            publish_interval=settings.load_publish_interval,
            limits=self._rank_limits,
        )
        self.metrics = metrics if metrics is not None else self._default_metrics()
        self._hello: Hello | None = None
        #: Cancel scopes of every request in flight, for cancelling them when the grace expires.
        self.request_scopes: set[trio.CancelScope] = set()
        #: True once the drain grace expired: cancelled requests end with ``Failed(unavailable)``.
        self.abandoning = False
        self._status: HealthStatus = "starting"
        self._drain_requested = trio.Event()
        self._connections: set[_Connection] = set()
        self._token = settings.token.encode("ascii") if settings.token is not None else None
        self._refusals = _RefusalLog()

    @property
    def hello(self) -> Hello:
        """The first message on both planes, built from the engine's config on first use.

        :meth:`serve` first uses it once the engine's ``run()`` has started, so an engine that
        learns its limits at start-up (the ``openai`` engine asks its upstream) announces them.
        """
        if self._hello is None:
            engine_config = self.engine.config
            self._hello = Hello(
                protocol_version=PROTOCOL_VERSION,
                config=RuntimeConfig(
                    worker_id=self.settings.worker_id,
                    model=self.settings.model,
                    kv_total_blocks=engine_config.kv_total_blocks,
                    block_size=engine_config.block_size,
                    max_num_batched_tokens=engine_config.max_num_batched_tokens,
                    max_num_seqs=engine_config.max_num_seqs,
                    data_parallel_size=engine_config.data_parallel_size,
                    engine_request_limit=self.settings.engine_request_limit,
                    request_queue_limit=self.settings.queue_limit,
                    heartbeat_interval=self.settings.heartbeat_interval,
                    load_publish_interval=self.settings.load_publish_interval,
                ),
                features=[FEATURE_BUSY_EDGES],
            )
        return self._hello

    def _default_metrics(self) -> WorkerMetrics:
        return WorkerMetrics(self.gate, kv_blocks=self._kv_blocks)

    def _kv_blocks(self) -> tuple[int, int]:
        config = self.engine.config
        used = sum(load.kv_used_blocks for load in self.engine.load())
        return config.kv_total_blocks * config.data_parallel_size, used

    def _rank_limits(self) -> tuple[int, int]:
        config = self.engine.config
        return config.kv_total_blocks, config.max_num_batched_tokens

    def _gauges(self) -> tuple[int, int]:
        return self.gate.running, self.gate.queued

    def _gate_changed(self) -> None:
        self.publisher.notify()

    def health(self) -> HealthStatus:
        """``starting`` until both ports listen, ``ready`` while serving, then ``draining``."""
        return self._status

    def drain(self) -> None:
        """Start the graceful drain (idempotent; returns at once)."""
        self._drain_requested.set()

    async def serve(
        self, *, task_status: trio.TaskStatus[WorkerAddress] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the worker until :meth:`drain` has been called and the drain is over.

        Prints one ``worker-ingress ready ws=... system=...`` line to stdout once both ports
        listen.

        Args:
            task_status: Receives the bound addresses once serving.
        """
        settings = self.settings
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run)
            hello = self.hello  # fixed from here on: the engine has read its limits
            await nursery.start(self.publisher.run)
            tls = self._tls_context()
            ws_port = await nursery.start(self._serve_websocket, tls)
            system_port = await nursery.start(
                functools.partial(
                    serve_system,
                    settings.host,
                    settings.system_port,
                    render_metrics=self.metrics.render,
                    health=self.health,
                    on_error=lambda _error: self.metrics.count_connection_error(),
                    ssl_context=tls,
                    on_tls_failure=self.metrics.count_tls_failure,
                )
            )
            address = WorkerAddress(
                ws_url=base_url("wss" if tls else "ws", settings.host, ws_port),
                system_url=base_url("https" if tls else "http", settings.host, system_port),
            )
            self._status = "ready"
            print(
                f"worker-ingress ready ws={address.ws_url} system={address.system_url}", flush=True
            )
            logger.info(
                "serving %s on %s (%d KV blocks of %d tokens)",
                settings.model,
                address.ws_url,
                hello.config.kv_total_blocks,
                hello.config.block_size,
            )
            task_status.started(address)
            await self._drain_requested.wait()
            await self._drain()
            nursery.cancel_scope.cancel()

    def _tls_context(self) -> ssl.SSLContext | None:
        settings = self.settings
        if settings.tls_cert_path is None or settings.tls_key_path is None:
            return None
        return server_context(settings.tls_cert_path, settings.tls_key_path)

    async def _serve_websocket(
        self, tls: ssl.SSLContext | None, *, task_status: trio.TaskStatus[int]
    ) -> None:
        """Serve both planes on the websocket port; reports the bound port."""
        settings = self.settings
        tcp_listeners = await trio.open_tcp_listeners(settings.port, host=settings.host)
        port: int = tcp_listeners[0].socket.getsockname()[1]
        listeners: list[trio.abc.Listener[trio.abc.Stream]] = list(tcp_listeners)
        if tls is not None:
            listeners = [
                HandshakeFirstListener(
                    listener,
                    tls,
                    timeout=OPEN_TIMEOUT,
                    on_failure=self.metrics.count_tls_failure,
                )
                for listener in tcp_listeners
            ]
        server = WebSocketServer(
            self._handle,
            # Typed for trio's own listeners; it only ever calls accept() and aclose().
            cast(list[trio.SocketListener], listeners),
            max_message_size=self.max_message_bytes,
            message_queue_size=RECEIVE_QUEUE_MESSAGES,
            connect_timeout=OPEN_TIMEOUT,
            disconnect_timeout=self.close_timeout,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            task_status.started(port)

    async def _drain(self) -> None:
        grace = self.settings.drain_grace
        logger.info(
            "draining: %d running, %d queued, %.1f s grace",
            self.gate.running,
            self.gate.queued,
            grace,
        )
        self._status = "draining"
        self.gate.drain()
        self.publisher.set_status("draining")
        with trio.move_on_after(grace):
            await self.gate.wait_idle()
        if self.gate.in_flight:
            logger.warning("drain grace expired; cancelling %d requests", self.gate.in_flight)
            self.abandoning = True
            for scope in list(self.request_scopes):
                scope.cancel()
        # One last heartbeat cycle is not needed: subscribers already saw "draining".
        with trio.move_on_after(CLOSE_FLUSH_SECONDS):
            async with trio.open_nursery() as nursery:
                for connection in list(self._connections):
                    nursery.start_soon(connection.close)
        for connection in list(self._connections):
            connection.abort()
        logger.info("drained")

    async def _handle(self, request: WebSocketRequest) -> None:
        """Serve one websocket connection; nothing escapes (rule 6)."""
        try:
            await self._serve_connection(request)
        except Exception:
            logger.exception("connection from %s failed", request.remote)
            self.metrics.count_connection_error()

    async def _serve_connection(self, request: WebSocketRequest) -> None:
        factory: Callable[[Worker, WebSocketConnection], _Connection]
        if self._token is not None and not _authorized(request, self._token):
            # Before anything else, the path included: a caller without the token learns
            # nothing about this worker.
            self.metrics.count_unauthorized()
            self._refusals.note(request.remote)
            await request.reject(
                401,
                extra_headers=[(b"www-authenticate", b"Bearer")],
                body=b"a bearer token is required (DYN_WORKER_TOKEN)\n",
            )
            return
        if request.path == REQUESTS_PATH:
            factory = _RequestConnection
        elif request.path == EVENTS_PATH:
            factory = _EventConnection
        else:
            await request.reject(404, body=b"unknown path; use /v1/events or /v1/requests\n")
            return
        if self._status == "draining":
            await request.reject(503, body=b"worker draining\n")
            return
        ws = await request.accept()
        connection = factory(self, ws)
        self._connections.add(connection)
        try:
            with contextlib.suppress(ConnectionClosed):
                await connection.serve()
        finally:
            self._connections.discard(connection)


def _authorized(request: WebSocketRequest, token: bytes) -> bool:
    authorization = next(
        (value for name, value in request.headers if name.lower() == b"authorization"), None
    )
    return bearer_matches(authorization, token)


class _RefusalLog:
    """Logs refused handshakes at most once per :data:`REFUSAL_LOG_INTERVAL` (a scanner or a
    misconfigured frontend must not flood the log; the counter has every one)."""

    def __init__(self) -> None:
        self._next = -math.inf
        self._since = 0

    def note(self, remote: object) -> None:
        self._since += 1
        now = trio.current_time()
        if now < self._next:
            return
        logger.warning(
            "refused %d websocket handshake(s) without the right bearer token, latest from %s",
            self._since,
            remote,
        )
        self._since = 0
        self._next = now + REFUSAL_LOG_INTERVAL


async def _drain_on_signal(worker: Worker, *, task_status: trio.TaskStatus[None]) -> None:
    import signal

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            logger.info("received %s; draining", signal.Signals(signum).name)
            worker.drain()


async def _drain_on_stdin_eof(worker: Worker) -> None:
    """Drain once standard input ends (``--stop-on-stdin-eof``): its writer, the parent, is gone.

    A pipe closes when its last writer exits, however it exits (SIGKILL included), on every
    POSIX system; what arrives on it is read and dropped.
    """
    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stream:
        while await stream.receive_some(4096):
            pass
    logger.warning("standard input closed: the parent process is gone; draining")
    worker.drain()


async def run_worker(
    settings: WorkerSettings,
    engine: Engine,
    *,
    task_status: trio.TaskStatus[WorkerAddress] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` until SIGTERM or SIGINT, drain, and return.

    Args:
        settings: Validated worker settings.
        engine: The engine to serve.
        task_status: Receives the bound addresses once serving.
    """
    worker = Worker(settings, engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(_drain_on_signal, worker)
        if settings.stop_on_stdin_eof:
            nursery.start_soon(_drain_on_stdin_eof, worker)
        address = await nursery.start(_serve_then_stop, worker, nursery.cancel_scope)
        task_status.started(address)


async def _serve_then_stop(
    worker: Worker, stop: trio.CancelScope, *, task_status: trio.TaskStatus[WorkerAddress]
) -> None:
    await worker.serve(task_status=task_status)
    # The drain is over: the signal watcher has nothing left to do.
    stop.cancel()
