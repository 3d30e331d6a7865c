"""The worker's network side: both websocket planes on one port, the system port, and drain.

Access: with a token set (``DYN_WORKER_TOKEN``), a handshake on any path without
``Authorization: Bearer <token>`` is refused with HTTP 401 before anything else is looked at, and
counted (``dynamo_worker_unauthorized_total``); the comparison is constant-time and the token is
never logged. Without a token (the default, meant for loopback) any client that reaches the port
may use both planes: the worker says so at start-up, at WARNING when it listens on an address
other than loopback (INFO on loopback).
With ``--tls-cert-path``/``--tls-key-path`` the port speaks TLS (``wss://``); each
handshake runs in its connection's task, bounded, and a failure is counted and closes that
connection only.

Paths on the websocket port (anything else: the handshake is rejected with HTTP 404):
``/v1/events``, the event plane, and ``/v1/requests``, the request plane. What each plane sends
and the rules of its connections are in :mod:`worker_ingress._planes`; a connection sees the
worker only through :class:`~worker_ingress._planes.PlaneHost`, which :class:`Worker` is. Any
exception escaping a connection is logged and counted
(:meth:`~worker_ingress._metrics.WorkerMetrics.count_connection_error`); it never reaches the
listener, because ``serve_websocket`` would crash entirely.

Event-plane places: at most ``max_event_subscribers`` subscribers are served at once, at most
``max_subscribers_per_address`` of one client address. Past either bound a new handshake takes
the place of another subscriber by the rules of :mod:`worker_ingress._subscriber_places`: a
squatter that sent no ``Subscribe`` within ``squatter_grace`` seconds (what a frontend sends
first, rule 9 of :mod:`worker_ingress._events`), else one that does not read what it is sent,
else, from another address only, the oldest subscriber of the address holding the most places.
That connection is closed and the new one served. So a frontend that subscribed and reads is
never put out by clients of its own address, and squatters of another address never lock it
out as long as their address holds more places than the frontend's. With nothing to take the
handshake gets 503 (counted). Only a token keeps out clients of the frontend's own address that
speak the protocol as a frontend does (they can then hold the places a new frontend of that
address would take).

Frames: every connection's stream goes through
:class:`~worker_ingress._frame_bound.FrameBoundStream`, which closes a client with 1002 once one
message passes its bound of frames, or its pings their bound of rate (counted, logged).

Drain (:meth:`Worker.drain`: in :func:`run_worker` on SIGTERM/SIGINT, and on EOF of stdin with
``--stop-on-stdin-eof``): the gate rejects new requests with ``Server unavailable: draining``,
``/health`` answers 503 ``draining`` and heartbeats carry ``status="draining"``; running and
queued requests get ``settings.drain_grace`` seconds to finish and have every reply frame
written, after which what is left is cancelled with
``Failed(unavailable)`` (and gets :data:`~worker_ingress._planes.CLOSE_FLUSH_SECONDS` to write
that). The request-plane connections close with 1001 only once they have written everything they
hold (rule 4 of :mod:`worker_ingress._planes`), and the event-plane connections only after every
request-plane connection has closed: a frontend ends its session with a worker, failing the
requests still open on it, when either plane closes. Then :meth:`Worker.serve` returns.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import math
import os
import ssl
import sys
from collections.abc import Callable, Sequence
from typing import Final, Literal, NamedTuple, cast

import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    WebSocketServer,
)

from shim_common._access import HandshakeFirstListener, bearer_matches, server_context
from shim_common._httpserver import header_value
from shim_common._net import base_url
from shim_common.wire import (
    EVENTS_PATH,
    FEATURE_BUSY_EDGES,
    FEATURE_CLASSES,
    FEATURE_DISAGG,
    FEATURE_FRONTEND_TIME,
    FEATURE_KV_EVENTS,
    FEATURE_KV_PARTS,
    FEATURE_PUBLISH_INTERVAL,
    FEATURE_REQUEST_BATCH,
    MAX_MESSAGE_BYTES,
    MAX_QUEUE_BANDS,
    PROTOCOL_VERSION,
    REQUESTS_PATH,
    SUBPROTOCOL_BATCH,
    Hello,
    RuntimeConfig,
)
from worker_ingress._admission import AdmissionGate
from worker_ingress._config import WorkerSettings
from worker_ingress._events import EventPublisher, Subscription
from worker_ingress._frame_bound import FrameBoundListener, FrameBoundStream
from worker_ingress._kv_events import KvEventLog
from worker_ingress._metrics import WorkerMetrics
from worker_ingress._planes import (
    CLOSE_FLUSH_SECONDS,
    EventConnection,
    PlaneHost,
    RequestConnection,
    WorkerPlaneConnection,
)
from worker_ingress._subscriber_places import Place, SubscriberPlaces
from worker_ingress._system import serve_system
from worker_ingress.engines._base import Engine, hands_off_kv

__all__ = [
    "HealthStatus",
    "Worker",
    "WorkerAddress",
    "run_worker",
]

logger = logging.getLogger(__name__)

#: Messages trio-websocket buffers per connection before its reader pauses (memory bound:
#: this many times the message size cap).
RECEIVE_QUEUE_MESSAGES: Final = 4
#: Seconds a new connection gets for its TLS handshake and its websocket opening handshake.
OPEN_TIMEOUT: Final = 10.0
#: Seconds between two log lines about refused handshakes (each one is counted).
REFUSAL_LOG_INTERVAL: Final = 10.0
#: Event-plane subscribers a worker serves at once; a handshake beyond them gets 503 (counted).
#: Each frontend is one subscriber of each of its workers.
MAX_EVENT_SUBSCRIBERS: Final = 128
#: Event-plane subscribers of one client address: a host may run several frontends, and one
#: address cannot hold more than a quarter of the places.
MAX_SUBSCRIBERS_PER_ADDRESS: Final = 32
#: Seconds a subscriber has to send its ``Subscribe`` before, at the cap, a newcomer may take
#: its place: a frontend sends it as soon as it has read the hello.
SQUATTER_GRACE: Final = 5.0

HealthStatus = Literal["starting", "ready", "draining"]


class WorkerAddress(NamedTuple):
    """Where a running worker can be reached."""

    ws_url: str
    system_url: str


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
        max_event_subscribers: Event-plane connections served at once.
        max_subscribers_per_address: Event-plane connections of one client address.
        squatter_grace: Seconds after which a subscriber that sent no ``Subscribe`` is the
            first to give its place to a new handshake; and how long what is sent to a
            subscriber may wait on it before it no longer counts as reading.
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
        max_event_subscribers: int = MAX_EVENT_SUBSCRIBERS,
        max_subscribers_per_address: int = MAX_SUBSCRIBERS_PER_ADDRESS,
        squatter_grace: float = SQUATTER_GRACE,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.max_message_bytes = max_message_bytes
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.close_timeout = close_timeout
        self._places: SubscriberPlaces[EventConnection] = SubscriberPlaces(
            max_event_subscribers, max_subscribers_per_address, squatter_grace
        )
        # An engine with a prefix cache offers its KV events (the mocker's ``kv_events``). A
        # decode worker publishes none, as Dynamo's do not: a decode pool is routed with no
        # cache overlap credit, so its events would cost every frontend an index for nothing.
        kv_events = getattr(engine, "kv_events", None)
        publishes = isinstance(kv_events, KvEventLog) and settings.disaggregation_mode != "decode"
        self._kv_events = kv_events if publishes else None
        self.gate = AdmissionGate.from_settings(settings, on_change=self._gate_changed)
        self.publisher = EventPublisher(
            load=engine.load,
            load_changed=engine.load_changed,
            gauges=self._gauges,
            effective_limit=self._effective_limit,
            queue_ahead=self._queue_ahead,
            heartbeat_interval=settings.heartbeat_interval,
            publish_interval=settings.load_publish_interval,
            limits=self._rank_limits,
        )
        self.metrics = metrics if metrics is not None else self._default_metrics()
        self._hello: Hello | None = None
        self._status: HealthStatus = "starting"
        self._drain_requested = trio.Event()
        self._connections: set[WorkerPlaneConnection] = set()
        self._token = settings.token.encode("ascii") if settings.token is not None else None
        self._refusals = _RefusalLog("without the right bearer token")
        self._subscriber_refusals = _RefusalLog(
            f"on the event plane: {max_event_subscribers} subscribers, or "
            f"{max_subscribers_per_address} of the client's address, all subscribed and reading"
        )
        self._evictions = _RefusalLog(
            "to serve new handshakes (first those that sent no subscribe within "
            f"{squatter_grace:g} s, then those not reading, else the oldest of the address "
            "holding the most places)",
            what="closed %d event-plane subscriber(s)",
        )

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
                    worker_type=self.settings.disaggregation_mode,
                ),
                features=[
                    FEATURE_BUSY_EDGES,
                    FEATURE_CLASSES,
                    FEATURE_FRONTEND_TIME,
                    FEATURE_PUBLISH_INTERVAL,
                    FEATURE_REQUEST_BATCH,
                    *([FEATURE_KV_EVENTS, FEATURE_KV_PARTS] if self._kv_events is not None else []),
                    *([FEATURE_DISAGG] if hands_off_kv(self.engine) else []),
                ],
            )
        return self._hello

    @property
    def kv_events(self) -> KvEventLog | None:
        """The engine's KV events, when it has a prefix cache."""
        return self._kv_events

    def subscribe(self) -> contextlib.AbstractContextManager[Subscription]:
        """An event-plane subscription for as long as the ``with`` block runs."""
        return self.publisher.subscribe()

    def count_connection_error(self) -> None:
        """Count a connection that failed or broke the protocol."""
        self.metrics.count_connection_error()

    @property
    def event_seq(self) -> int:
        """The ``seq`` of the last event or heartbeat published."""
        return self.publisher.seq

    def _default_metrics(self) -> WorkerMetrics:
        # An engine that knows what its prefix cache found offers prefix_cache_stats().
        stats = getattr(self.engine, "prefix_cache_stats", None)
        return WorkerMetrics(
            self.gate,
            kv_blocks=self._kv_blocks,
            prefix_cache=stats if callable(stats) else None,
        )

    def _kv_blocks(self) -> tuple[int, int]:
        config = self.engine.config
        used = sum(load.kv_used_blocks for load in self.engine.load())
        return config.kv_total_blocks * config.data_parallel_size, used

    def _rank_limits(self) -> tuple[int, int]:
        config = self.engine.config
        return config.kv_total_blocks, config.max_num_batched_tokens

    def _gauges(self) -> tuple[int, int]:
        return self.gate.running, self.gate.queued

    def _effective_limit(self) -> int | None:
        # Carried in the load events only when an objective moves L (an optional field).
        return self.gate.effective_limit if self.gate.slo is not None else None

    def _queue_ahead(self) -> list[tuple[int, int]] | None:
        # What a frontend holds a refusal for a long wait at (slo, queue_timeout): sent only by
        # a gate that gives those refusals (an optional field).
        gate = self.gate
        if gate.slo is None and gate.queue_timeout is None:
            return None
        return gate.state.queue_ahead(MAX_QUEUE_BANDS)

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
            if self._token is None:
                logger.log(
                    logging.INFO if _is_loopback(settings.host) else logging.WARNING,
                    "no worker token (DYN_WORKER_TOKEN unset): any client that reaches %s may "
                    "submit requests and take event-plane places; set one whenever the port is "
                    "reachable from other hosts",
                    address.ws_url,
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
        listeners = [FrameBoundListener(listener, self._too_many_frames) for listener in listeners]
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
            # The gate is idle before the last frames of its last requests are written.
            await _close_all(self._request_connections())
        if still_open := self._request_connections():
            logger.warning(
                "drain grace expired; cancelling %d requests, %d connections still writing",
                self.gate.in_flight,
                len(still_open),
            )
            for request_connection in still_open:
                request_connection.abandon()
            with trio.move_on_after(CLOSE_FLUSH_SECONDS):
                await _close_all(self._request_connections())
        # Only now: a frontend that sees an event plane close fails what is open on the worker.
        # One last heartbeat cycle is not needed: subscribers already saw "draining".
        with trio.move_on_after(CLOSE_FLUSH_SECONDS):
            await _close_all([c for c in self._connections if isinstance(c, EventConnection)])
        for connection in list(self._connections):
            connection.abort()
        logger.info("drained")

    def _request_connections(self) -> list[RequestConnection]:
        return [c for c in self._connections if isinstance(c, RequestConnection)]

    async def _handle(self, request: WebSocketRequest) -> None:
        """Serve one websocket connection; nothing escapes (see the module docstring)."""
        try:
            await self._serve_connection(request)
        except Exception:
            logger.exception("connection from %s failed", request.remote)
            self.metrics.count_connection_error()

    async def _serve_connection(self, request: WebSocketRequest) -> None:
        factory: Callable[[PlaneHost, WebSocketConnection], WorkerPlaneConnection]
        if self._token is not None and not _authorized(request, self._token):
            # Before anything else, the path included: a caller without the token learns
            # nothing about this worker.
            self.metrics.count_unauthorized()
            self._refusals.note(request.remote)
            await _refuse(
                request,
                401,
                b"a bearer token is required (DYN_WORKER_TOKEN)\n",
                extra_headers=[(b"www-authenticate", b"Bearer")],
            )
            return
        if request.path == REQUESTS_PATH:
            factory = RequestConnection
        elif request.path == EVENTS_PATH:
            factory = EventConnection
        else:
            await _refuse(request, 404, b"unknown path; use /v1/events or /v1/requests\n")
            return
        if self._status == "draining":
            await _refuse(request, 503, b"worker draining\n")
            return
        place: Place[EventConnection] | None = None
        if factory is EventConnection:
            # Claimed before the handshake's awaits, so concurrent handshakes cannot overshoot.
            place, taken = self._places.claim(_peer_host(request), trio.current_time())
            if place is None:
                self.metrics.count_subscriber_refused()
                self._subscriber_refusals.note(request.remote)
                await _refuse(request, 503, b"too many event-plane subscribers\n")
                return
            if taken is not None and taken.connection is not None:
                # Its task unwinds at its next checkpoint; its place counts no more already.
                self._connections.discard(taken.connection)
                taken.connection.abort()
                self._evictions.note(taken.connection.remote)
            self.metrics.set_event_subscribers(self._places.held)
        try:
            await self._accept_and_serve(request, factory, place)
        finally:
            if place is not None:
                self._places.release(place)
                self.metrics.set_event_subscribers(self._places.held)

    def _too_many_frames(self, stream: FrameBoundStream, reason: str) -> None:
        """A client passed a bound of the frame counter (frames in one message, or pings): it
        is closed with 1002."""
        logger.info("closing %r with 1002: %s", stream, reason)
        self.metrics.count_connection_error()

    async def _accept_and_serve(
        self,
        request: WebSocketRequest,
        factory: Callable[[PlaneHost, WebSocketConnection], WorkerPlaneConnection],
        place: Place[EventConnection] | None,
    ) -> None:
        # A client that reads batches says so with a subprotocol (request plane only).
        batching = factory is RequestConnection and SUBPROTOCOL_BATCH in (
            request.proposed_subprotocols or ()
        )
        try:
            ws = await request.accept(subprotocol=SUBPROTOCOL_BATCH if batching else None)
        except ConnectionClosed:
            return  # the client left (or was cut off) before its handshake was answered
        connection = factory(self, ws)
        if place is not None:
            assert isinstance(connection, EventConnection)
            place.connection = connection
        self._connections.add(connection)
        try:
            with contextlib.suppress(ConnectionClosed):
                await connection.serve()
        finally:
            self._connections.discard(connection)


async def _refuse(
    request: WebSocketRequest,
    status: int,
    body: bytes,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Answer a handshake with ``status`` and close its connection.

    trio-websocket keeps a refused connection open until the client closes it: a client that
    stays would hold a descriptor and two tasks of the worker for as long as it likes.
    """
    await request.reject(status, extra_headers=extra_headers, body=body)
    await trio.aclose_forcefully(_stream_of(request))


def _stream_of(request: WebSocketRequest) -> trio.abc.Stream:
    """The stream under a handshake (trio-websocket names it only in a private attribute)."""
    return request._connection._stream


def _peer_host(request: WebSocketRequest) -> str:
    """The client's address, as its connection's socket names it."""
    stream = _stream_of(request)
    if isinstance(stream, FrameBoundStream):
        return stream.peer_host
    return str(request.remote)


async def _close_all(connections: Sequence[WorkerPlaneConnection]) -> None:
    async with trio.open_nursery() as nursery:
        for connection in connections:
            nursery.start_soon(connection.close)


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _authorized(request: WebSocketRequest, token: bytes) -> bool:
    return bearer_matches(header_value(request.headers, b"authorization"), token)


class _RefusalLog:
    """Logs refused handshakes at most once per :data:`REFUSAL_LOG_INTERVAL` (a scanner or a
    misconfigured frontend must not flood the log; the counter has every one).

    Args:
        why: What the log line says after "refused N websocket handshake(s)".
    """

    def __init__(self, why: str, *, what: str = "refused %d websocket handshake(s)") -> None:
        self._why = why
        self._what = what
        self._next = -math.inf
        self._since = 0

    def note(self, remote: object) -> None:
        self._since += 1
        now = trio.current_time()
        if now < self._next:
            return
        logger.warning(f"{self._what} %s, latest from %s", self._since, self._why, remote)
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
