"""The frontend's link to one worker: a session of two planes, kept up for as long as it runs.

A :class:`WorkerLink` owns the two websocket connections to one worker, ``/v1/events`` and
``/v1/requests``, opened and lost together (a *session*). It reports the worker to a
:class:`~frontend_shim._fleet_listener.FleetListener`: ``worker_up`` on each new session's hello,
``worker_events`` for every event batch, ``worker_lagging`` when its event stream falls behind or
catches up, and ``worker_down`` when the session ends. It reconnects forever with capped
exponential backoff and jitter. :meth:`WorkerLink.request` runs one request on the request plane
(:mod:`frontend_shim._request_plane`).

Rules of a session (the state machine of a link):

1. ``down`` -> take one place of the pool's connect limiter (so a fleet of thousands starts
   without thousands of handshakes at once), then connect both planes and read one
   :class:`wire.Hello` on each within ``connect_timeout`` (counted from when the place is held:
   a link waiting its turn behind 2,000 others has not been slow); the protocol versions must be
   :data:`wire.PROTOCOL_VERSION`, the announced sizes within the bounds of
   :mod:`frontend_shim._worker_hello`, and the worker ids must agree -> ``up`` (``worker_up``).
   Each hello, and anything before it, is read under
   :data:`~frontend_shim._worker_hello.MAX_HELLO_BYTES`, and nothing after it until it is
   accepted. From then on the worker's event messages may be at most the size its hello implies
   (:func:`~frontend_shim._worker_hello.event_message_bound`), its request-plane messages the
   protocol's cap, and its control frames come at a bounded rate
   (:mod:`frontend_shim._connection`, rule 6). A worker that lists
   :data:`wire.FEATURE_BUSY_EDGES` is sent a :class:`wire.Subscribe` at once (even with no
   thresholds to send: the worker keeps its event-plane places for subscribers that subscribed)
   and the thresholds of its model in it, again whenever they change; one that lists
   :data:`wire.FEATURE_PUBLISH_INTERVAL` is sent the interval of the pool's
   :class:`~frontend_shim._event_budget.EventBudget` in it too, again whenever it changes.
2. While ``up``, four tasks run: a tight reader per plane, the request plane's sender, and a
   watchdog. Nothing runs per message but decoding and handing over (no timeout scope, no task
   hop). The watchdog wakes a few times per keepalive interval and ends the session when the
   event plane has been silent for three heartbeat intervals (at least ``keepalive_timeout``:
   a worker sends a heartbeat every interval, so silence means it is gone or wedged), or when a
   ping on the request plane went unanswered for ``keepalive_timeout``, or when a write to
   either plane has not completed for ``keepalive_timeout`` (the worker stopped reading: its
   socket is full). It pings the request plane only after ``keepalive_interval`` without any
   bytes from it, so a busy link is never pinged and an idle fleet costs one small ping per
   worker per interval; the ping itself may wait at most ``keepalive_timeout`` for the socket,
   so the watchdog never hangs on a worker that does not read. Writes block only this link's
   sender and the requests routed to this worker; other links are untouched.
3. Lag: each event batch carries the worker's wall-clock time of sending. The link keeps the
   smallest ``arrival - sent`` seen in the last two windows of ``lag_window`` seconds (clock skew
   and transit); the excess over it is how far behind this frontend reads that worker. Above
   ``max_event_lag`` the listener hears ``worker_lagging(True)`` (routing skips the worker,
   counted, logged once per episode); back under half of it, ``worker_lagging(False)``. A link
   read at the budget's interval (rule 5) waits up to one interval on purpose: that much is
   allowed on top of the bound.
4. Any of these ends the session: a closed connection, the watchdog, a message that does not
   decode (logged and counted in :class:`LinkStats`), a second hello. Every request still open
   on the session then ends at once with ``Failed(kind="unavailable")``; nothing is left hanging.
   ``worker_down`` is called, then the link sleeps out its backoff and goes to 1. The backoff
   (capped, exponential, with jitter) starts again from its first delay only after a session
   that came up, stayed up ``healthy_session`` seconds, and ended without a breach of the
   protocol by the worker (an undecodable or oversized message, a control-frame flood, a second
   hello, a reply to nothing: the :class:`ProtocolError` family). Any other session counts as a
   failed attempt: a worker that breaks the protocol right after its hello, or closes cleanly
   just after it, is redialled at a doubling delay up to the cap, not every
   ``backoff_initial``, and the log has the first of such a streak at WARNING and the repeats
   at DEBUG (its ``up`` lines too), as for failed connections.
5. The event budget (:mod:`frontend_shim._event_budget`): a worker that does not list
   :data:`wire.FEATURE_PUBLISH_INTERVAL` is read at most once per budget interval; whatever one
   read brings, however many batches, is applied as one batch of its latest state
   (:func:`~frontend_shim._event_budget.latest_wins`), for every link. On plain TCP with the
   pool's pacer, every link's event plane is read *in place* by the pacer
   (:class:`~frontend_shim._pacer.InPlaceReads`, its rules 3 to 5): paced at the budget's
   interval, or on each tick at which the socket holds bytes; the link's task wakes only to
   write an owed pong or close reply, or to end the session on a failed read. Otherwise (TLS,
   no pacer, no epoll) the link's task reads, and each read takes a turn from the pool's
   :class:`~frontend_shim._pacer.EventSlices` before it is applied.
6. A refusal is applied after the events its worker sent before it: the request plane hands a
   ``Rejected`` or a ``Failed(kind="unavailable")`` to its request only after the link has read
   its event plane out of turn and applied what it held (in place; a link whose task reads
   applies what its last read brought). Whoever acts on the refusal (the router's mark of the
   worker as overloaded or draining) therefore never has the mark cleared by an older event.
7. KV events (``LinkSettings.kv_events``, to a worker that lists :data:`wire.FEATURE_KV_EVENTS`):
   the link's :class:`wire.Subscribe` says ``kv_events`` (and ``kv_parts``) when the session
   asks for them, and every :class:`wire.KvBatch` a read brings goes to the link's
   :class:`~frontend_shim._kv_feed.KvFeed`, which applies it in order and charges it to the
   session's KV budget (past it, the session ends with 1008); its rules are at the top of
   :mod:`frontend_shim._kv_feed`. When the index saw a gap, the link asks for a fresh snapshot
   from a task of its own, at most once a period.

8. A link without its event plane (``LinkSettings.event_plane`` off: an HTTP process whose host
   follows the events) opens the request plane alone: a session is that plane's, its liveness
   the request plane's pings (rule 2), and the listener hears ``worker_up`` and ``worker_down``
   only; rules 3, 5, 6 and 7 do not apply. A link without its request plane
   (``LinkSettings.request_plane`` off: that host, which sends no request) opens the event
   plane alone, its liveness the events' (rule 2); its :meth:`WorkerLink.request` fails at
   once as for a worker not connected.

Times given to the listener (``now``) are ``trio.current_time()``, the monotonic Trio clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import random
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final, TypeVar

import msgspec
import trio

from frontend_shim._connection import (
    EVENTS_RECEIVE_BUFFER,
    PlaneClosed,
    PlaneConnection,
    ProtocolError,
    open_plane,
)
from frontend_shim._discovery import WorkerKey
from frontend_shim._event_budget import EventBudget, latest_wins
from frontend_shim._fleet_listener import FleetListener
from frontend_shim._kv_feed import KvFeed
from frontend_shim._lag import LagMeter
from frontend_shim._link_errors import breaks_protocol, explain_failure, session_end_reason
from frontend_shim._pacer import EventSlices, InPlaceReads, ReadPacer
from frontend_shim._request_plane import (
    LinkStats,
    RequestPlane,
    RequestStream,
    ResponseBuffer,
    unavailable,
)
from frontend_shim._websocket import HandshakeError
from frontend_shim._worker_hello import MAX_HELLO_BYTES, event_message_bound, refusal
from shim_common import wire
from shim_common._net import RELEASE_SECONDS, Backoff, DescriptorLimitLog, out_of_descriptors

__all__ = [
    "LinkSettings",
    "WorkerLink",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkSettings:
    """Timeouts, sizes and credentials of a worker link. The defaults suit a LAN or loopback."""

    #: Seconds to open both websockets and read both hellos.
    connect_timeout: float = 5.0
    #: Seconds to wait for the closing handshake when a session ends.
    disconnect_timeout: float = 1.0
    #: Seconds without any bytes on the request plane before it is pinged: longer than the
    #: worker's own 10 s ping, so a link to a worker that pings never has to (2,048 idle request
    #: planes pinged every 5 s cost the frontend several percent of its core).
    keepalive_interval: float = 15.0
    #: Seconds a ping may wait for an answer before the session is declared dead.
    keepalive_timeout: float = 5.0
    #: First reconnect delay (seconds); it doubles per failed attempt ...
    backoff_initial: float = 0.05
    #: ... up to this cap (seconds).
    backoff_cap: float = 2.0
    #: Each delay is drawn uniformly from ``[(1 - jitter) * d, d]``.
    backoff_jitter: float = 0.5
    #: Seconds a session must stay up for the backoff to start again (rule 4): ten heartbeats
    #: of the default interval, so a worker that closes each session soon after its hello is
    #: redialled at the capped delay, not ten times a second.
    healthy_session: float = 10.0
    #: Messages buffered per request before text chunks are merged.
    request_buffer: int = 256
    #: ``Generate`` messages waiting for the sender before ``request()`` waits.
    send_queue: int = 256
    #: Seconds an event stream may lag (rule 3) before its worker is not routed to.
    max_event_lag: float = 1.0
    #: Seconds of each window of the smallest transit time (rule 3).
    lag_window: float = 60.0
    #: Extra headers of every upgrade request (the bearer token of the worker planes).
    headers: tuple[tuple[str, str], ...] = ()
    #: TLS for ``wss://`` worker URLs; ``None``: the system's trust store.
    ssl_context: ssl.SSLContext | None = None
    #: Called when a connection to a worker fails for want of file descriptors: closes idle
    #: connections of this process (the HTTP server's keep-alive ones) and returns how many, so
    #: that the link can try once more at once. ``None``: the failure ends the attempt.
    make_room: Callable[[], int] | None = None
    #: Subscribe to the KV events of a worker that offers them (rule 7).
    kv_events: bool = False
    #: Open the event plane (rule 8): off in an HTTP process of several, whose host follows
    #: the workers' events once for all of them.
    event_plane: bool = True
    #: Open the request plane (rule 8): off in the host of a frontend of several processes,
    #: which follows the events and sends no request itself.
    request_plane: bool = True

    def __post_init__(self) -> None:
        if not (self.event_plane or self.request_plane):
            raise ValueError("a link needs one of its planes at least")
        if self.request_buffer < 1 or self.send_queue < 1:
            raise ValueError("request_buffer and send_queue must be at least 1")
        if not 0.0 <= self.backoff_jitter <= 1.0:
            raise ValueError(f"backoff_jitter must be in [0, 1], got {self.backoff_jitter}")
        if not 0.0 < self.backoff_initial <= self.backoff_cap:
            raise ValueError("backoff needs 0 < backoff_initial <= backoff_cap")
        if not self.max_event_lag > 0:
            raise ValueError(f"max_event_lag must be > 0, got {self.max_event_lag}")
        if not self.healthy_session >= 0:
            raise ValueError(f"healthy_session must be >= 0, got {self.healthy_session}")


# ----------------------------------------------------------------------------- one worker


class _KeepaliveTimeout(Exception):
    """The event plane fell silent, or a ping went unanswered."""


# Everything that ends a session in the ordinary course of things (not a bug of ours).
_SESSION_ERRORS: Final = (
    OSError,
    trio.BrokenResourceError,
    trio.TooSlowError,
    PlaneClosed,
    HandshakeError,
    msgspec.DecodeError,
    ProtocolError,
    _KeepaliveTimeout,
)

_M = TypeVar("_M")

#: Stands for the connect limiter of a link outside a pool.
_NO_LIMIT: Final = contextlib.nullcontext()
#: Connection attempts that ran out of descriptors, logged at a bounded rate for the process.
_descriptor_log = DescriptorLimitLog(logger, "connecting to a worker")


class WorkerLink:
    """The two websocket connections to one worker, kept up for as long as :meth:`run` runs.

    Args:
        key: the worker's key (its base URL with the host resolved).
        listener: who hears about the worker.
        settings: timeouts, sizes and credentials.
        connect_limiter: bounds the connection attempts of a pool in flight at once.
        budget: the pool's event budget (rule 5); ``None``: none, every event read at once.
        slices: the pool's turns for event work (rule 5); ``None``: no turns.
        pacer: the pool's read pacer, which also wakes the watchdog (rules 2 and 5); ``None``:
            each link sleeps on its own timers.
        server_hostname: the name a ``wss://`` worker's certificate must carry.
        rng: the random source of the backoff jitter.

    Attributes:
        key: the worker's stable id and base URL, e.g. ``"ws://127.0.0.1:9100"``.
        config: the worker's runtime configuration from its latest hello; ``None`` before the
            first session. It stays set while the worker is down (the last known one).
        connected: True while a session is up.
        lag: the lag meter of the current session (its ``lagging`` says whether the event
            stream lags more than the bound, rule 3).
        stats: counters (sessions, failures, protocol errors, ...).
    """

    def __init__(
        self,
        key: WorkerKey,
        listener: FleetListener,
        settings: LinkSettings | None = None,
        *,
        connect_limiter: trio.CapacityLimiter | None = None,
        budget: EventBudget | None = None,
        slices: EventSlices | None = None,
        pacer: ReadPacer | None = None,
        server_hostname: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.key = key
        self.config: wire.RuntimeConfig | None = None
        self.connected = False
        self.stats = LinkStats()
        self._listener = listener
        self._settings = settings if settings is not None else LinkSettings()
        self.lag = self._new_lag_meter()
        self._limiter = connect_limiter
        self._budget = budget
        self._slices = slices
        self._pacer = pacer
        self._in_place: InPlaceReads | None = None
        self._wait_until = pacer.wait_until if pacer is not None else trio.sleep_until
        self._server_hostname = server_hostname
        self._backoff = Backoff(
            initial=self._settings.backoff_initial,
            cap=self._settings.backoff_cap,
            jitter=self._settings.backoff_jitter,
            rng=rng,
        )
        parts = urllib.parse.urlsplit(key)
        assert parts.hostname is not None  # keys are made by WorkerUrl.key_for
        assert parts.port is not None
        self._host = parts.hostname
        self._port = parts.port
        self._path_prefix = parts.path
        self._tls = parts.scheme == "wss"
        self._plane: RequestPlane | None = None
        self._events: PlaneConnection | None = None
        self._edges = False
        #: Whether the worker of the current session takes the budget's interval (rule 5).
        self.negotiated = False
        #: The worker's KV events (rule 7).
        self._kv = KvFeed(
            key,
            listener,
            wanted=self._settings.kv_events,
            stats=self.stats,
            pacer=pacer,
            slices=slices,
        )
        self._thresholds: wire.BusyThresholds | None = None
        self._up_event = trio.Event()
        self._reached_up = False
        #: When the current (or last) session came up, and whether the last one failed after
        #: it came up (rule 4: its successor's ``up`` line is then a repeat, at DEBUG).
        self._up_at = -math.inf
        self._flapping = False

    def __repr__(self) -> str:
        state = "up" if self.connected else "down"
        return f"<WorkerLink {self.key} {state}>"

    @property
    def open_requests(self) -> int:
        """Requests in flight on the current session."""
        return self._plane.open_requests if self._plane is not None else 0

    async def wait_connected(self) -> None:
        """Return once a session is up (at once if one is)."""
        await self._up_event.wait()

    def request(
        self,
        endpoint: wire.Endpoint,
        body: dict[str, Any],
        priority: int = 0,
        tenant: str = "",
        dp_rank: int | None = None,
        arrival: float | None = None,
    ) -> AbstractAsyncContextManager[RequestStream]:
        """Run one request on the worker; use as ``async with link.request(...) as stream``.

        Entering sends ``Generate`` (waiting only while the link's outbox is full). If the
        worker is not connected, the stream's :meth:`RequestStream.first` is at once
        ``Failed(kind="unavailable")``.

        Leaving the block before the stream ended (the HTTP client went away, an exception, a
        cancellation) sends ``Cancel`` for the request, so the worker frees its slot or queue
        place. Leaving never waits, so it is safe under cancellation.

        Args:
            endpoint: which OpenAI endpoint the body is for.
            body: the OpenAI request body, as the client sent it.
            priority: the request's priority (lower first), for a worker that reads it.
            tenant: the request's tenant, for a worker that reads it.
            dp_rank: the rank the router chose, for a worker that honours it.
            arrival: when the request reached the frontend (Trio time), so that a worker that
                counts it knows the time already spent.

        Returns:
            An async context manager yielding the :class:`RequestStream`.
        """
        return self._request(endpoint, body, priority, tenant, dp_rank, arrival)

    @asynccontextmanager
    async def _request(
        self,
        endpoint: wire.Endpoint,
        body: dict[str, Any],
        priority: int,
        tenant: str,
        dp_rank: int | None,
        arrival: float | None,
    ) -> AsyncIterator[RequestStream]:
        plane = self._plane
        if plane is None:
            buffer = ResponseBuffer(1)
            buffer.finish(unavailable(0, f"{self.key} is not connected"))
            yield RequestStream(0, buffer)
            return
        request_id, buffer = await plane.open(endpoint, body, priority, tenant, dp_rank, arrival)
        try:
            yield RequestStream(request_id, buffer)
        finally:
            # A no-op when the request already ended or the session is gone.
            plane.cancel(request_id)

    @property
    def kv_events(self) -> bool:
        """Whether the current session asked for the worker's KV events (rule 7)."""
        return self._kv.subscribed

    @property
    def kv_parts(self) -> bool:
        """Whether the worker of the current session sends KV events in parts (rule 7)."""
        return self._kv.parts

    @property
    def paced(self) -> bool:
        """Whether this link reads its worker at the budget's interval (rule 5)."""
        return self.connected and not self.negotiated and self._budget is not None

    async def send_thresholds(self, thresholds: wire.BusyThresholds | None) -> None:
        """Tell the worker the thresholds its model is routed by (if it takes them)."""
        self._thresholds = thresholds
        await self._subscribe()

    async def send_interval(self) -> None:
        """Ask the worker for the budget's interval again (if it takes one)."""
        if self.negotiated:
            await self._subscribe()

    async def _subscribe(self, *, kv_snapshot: bool = False) -> None:
        events = self._events
        thresholds = self._thresholds
        if events is None:
            return
        if self.negotiated and self._budget is not None:
            interval = self._budget.interval
        elif self._edges or self.negotiated or self.kv_events:
            # Sent even with nothing to ask: a worker keeps its places for subscribers that
            # subscribed (its idle squatters give theirs up).
            interval = 0.0
        else:
            return
        message = wire.encode(
            wire.Subscribe(
                thresholds=thresholds if thresholds is not None else wire.BusyThresholds(),
                publish_interval=interval,
                kv_events=self.kv_events,
                kv_snapshot=kv_snapshot and self.kv_events,
                kv_parts=self.kv_events and self.kv_parts,
            )
        )
        # A failure means the session is ending; the next one sends them again.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await events.send_message(message)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep a session to the worker up until cancelled.

        Calls ``task_status.started()`` at once: whether the worker is reachable is reported
        through the listener (and :meth:`wait_connected`), never by blocking here. On
        cancellation an up session ends with ``worker_down`` and its requests fail.
        """
        task_status.started()
        # Log the first failure of a streak at WARNING and the repeats at DEBUG: a worker that is
        # down for an hour must not fill the log with a line every two seconds.
        quiet = False
        while True:
            healthy = False
            try:
                await self._session()
            except* _SESSION_ERRORS as group:
                if not self._reached_up:
                    self.stats.connect_failures += 1
                # Rule 4: only a session that stayed up, and that the worker kept to the
                # protocol, resets the backoff; any other is a failed attempt.
                lasted = trio.current_time() - self._up_at
                healthy = (
                    self._reached_up
                    and lasted >= self._settings.healthy_session
                    and not breaks_protocol(group)
                )
                logger.log(
                    logging.DEBUG if quiet and not healthy else logging.WARNING,
                    "worker %s: %s; reconnecting",
                    self.key,
                    explain_failure(group, tls=self._tls, connecting=not self._reached_up),
                )
            quiet = not healthy
            self._flapping = self._reached_up and not healthy
            if healthy:
                self._backoff.reset()
            await trio.sleep(self._backoff.next_delay())

    async def _session(self) -> None:
        """One session: connect, hello, serve until something ends it (always by raising)."""
        self._reached_up = False
        events: PlaneConnection | None = None
        requests: PlaneConnection | None = None
        try:
            async with self._limiter if self._limiter is not None else _NO_LIMIT:
                with trio.fail_after(self._settings.connect_timeout):
                    if not self._settings.request_plane:
                        events, hello = await self._connect_events()
                    elif self._settings.event_plane:
                        events, requests, hello = await self._connect()
                    else:
                        requests, hello = await self._connect_requests()
            await self._serve(events, requests, hello)
        finally:
            for connection in (requests, events):
                if connection is not None:
                    await connection.aclose(self._settings.disconnect_timeout)

    async def _connect(self) -> tuple[PlaneConnection, PlaneConnection, wire.Hello]:
        events = await self._open(wire.EVENTS_PATH, EVENTS_RECEIVE_BUFFER)
        try:
            requests = await self._open(
                wire.REQUESTS_PATH, None, subprotocols=(wire.SUBPROTOCOL_BATCH,)
            )
            try:
                events_hello = await _read_hello(events, wire.decode_event_message)
                hello = await _read_hello(requests, wire.decode_worker_message)
                if events_hello.config.worker_id != hello.config.worker_id:
                    raise ProtocolError(
                        "the planes answer for different workers: "
                        f"{events_hello.config.worker_id!r} and {hello.config.worker_id!r}"
                    )
            except BaseException:
                await requests.aclose(0)
                raise
        except BaseException:
            await events.aclose(0)
            raise
        return events, requests, hello

    async def _connect_events(self) -> tuple[PlaneConnection, wire.Hello]:
        events = await self._open(wire.EVENTS_PATH, EVENTS_RECEIVE_BUFFER)
        try:
            hello = await _read_hello(events, wire.decode_event_message)
        except BaseException:
            await events.aclose(0)
            raise
        return events, hello

    async def _connect_requests(self) -> tuple[PlaneConnection, wire.Hello]:
        batch = (wire.SUBPROTOCOL_BATCH,)
        requests = await self._open(wire.REQUESTS_PATH, None, subprotocols=batch)
        try:
            hello = await _read_hello(requests, wire.decode_worker_message)
        except BaseException:
            await requests.aclose(0)
            raise
        return requests, hello

    async def _open(
        self, path: str, receive_buffer: int | None, subprotocols: tuple[str, ...] = ()
    ) -> PlaneConnection:
        try:
            return await self._open_once(path, receive_buffer, subprotocols)
        except OSError as exc:
            # Out of descriptors (idle keep-alive clients can hold them all): a worker that
            # comes back must still be reached, so idle HTTP connections make room for it.
            make_room = self._settings.make_room
            if make_room is None or not out_of_descriptors(exc):
                raise
            closed = make_room()
            _descriptor_log.note(exc, closed)
            if not closed:
                raise
        # Their tasks release the descriptors at their next checkpoint.
        await trio.sleep(RELEASE_SECONDS)
        return await self._open_once(path, receive_buffer, subprotocols)

    async def _open_once(
        self, path: str, receive_buffer: int | None, subprotocols: tuple[str, ...]
    ) -> PlaneConnection:
        settings = self._settings
        ssl_context = None
        if self._tls:
            ssl_context = settings.ssl_context or ssl.create_default_context()
        return await open_plane(
            host=self._host,
            port=self._port,
            path=self._path_prefix + path,
            headers=settings.headers,
            subprotocols=subprotocols,
            ssl_context=ssl_context,
            server_hostname=self._server_hostname,
            # Rule 1: the hello under a small cap; _serve raises it once the hello is accepted.
            max_message_bytes=MAX_HELLO_BYTES,
            pause_after_first=True,
            receive_buffer=receive_buffer,
        )

    async def _serve(
        self, events: PlaneConnection | None, requests: PlaneConnection | None, hello: wire.Hello
    ) -> None:
        config = hello.config
        plane = None if requests is None else RequestPlane(
            request_buffer=self._settings.request_buffer,
            send_queue=self._settings.send_queue,
            stats=self.stats,
            classes=wire.FEATURE_CLASSES in hello.features,
            before_refusal=self._catch_up_events,
            ranks=wire.FEATURE_KV_EVENTS in hello.features,
            frontend_time=wire.FEATURE_FRONTEND_TIME in hello.features,
        )
        self._edges = wire.FEATURE_BUSY_EDGES in hello.features
        self.negotiated = wire.FEATURE_PUBLISH_INTERVAL in hello.features
        kv_bytes = self._kv.begin(hello, trio.current_time()) if events is not None else 0
        # Rule 1: the hello bounds the size of the worker's event messages from now on (with
        # room for one message of KV events only when this link asks for them: rule 7).
        if events is not None:
            events.limit_messages(event_message_bound(config, kv_bytes=kv_bytes))
        if requests is not None:
            requests.limit_messages(wire.MAX_MESSAGE_BYTES)
        self._events = events
        self.lag = self._new_lag_meter()
        self._up(config, plane)
        reason = "connection lost"
        try:
            await self.send_thresholds(self._listener.thresholds(config.model))
            async with trio.open_nursery() as nursery:
                if events is not None:
                    nursery.start_soon(self._read_events, events)
                if requests is not None and plane is not None:
                    nursery.start_soon(self._read_replies, requests, plane)
                    batches = wire.FEATURE_REQUEST_BATCH in hello.features
                    nursery.start_soon(self._send_requests, requests, plane, batches)
                nursery.start_soon(self._watch, events, requests, config.heartbeat_interval)
                if self.kv_events:
                    ask = functools.partial(self._subscribe, kv_snapshot=True)
                    nursery.start_soon(self._kv.resync, ask, self._wait_until)
        except BaseException as exc:
            reason = session_end_reason(exc)
            raise
        finally:
            # Before the websockets close (which may wait for a dead peer): fail the open
            # requests and tell the listener now.
            self._down(plane, reason)

    def _up(self, config: wire.RuntimeConfig, plane: RequestPlane | None) -> None:
        self.config = config
        self.connected = True
        self._plane = plane
        self._reached_up = True
        self._up_at = trio.current_time()
        self.stats.sessions += 1
        self._up_event.set()
        logger.log(
            logging.DEBUG if self._flapping else logging.INFO,
            "worker %s up: id=%s model=%s",
            self.key,
            config.worker_id,
            config.model,
        )
        self._listener.worker_up(self.key, config, trio.current_time())

    def _down(self, plane: RequestPlane | None, reason: str) -> None:
        if plane is not None:
            self.stats.requests_failed_by_disconnect += plane.close(reason)
        self._plane = None
        self._events = None
        self.connected = False
        self.lag = self._new_lag_meter()
        self._up_event = trio.Event()
        self._listener.worker_down(self.key, trio.current_time())

    async def _read_events(self, events: PlaneConnection) -> None:
        # Tight: decode and hand over, nothing else (rule 2); paced and sliced (rule 5).
        budget = None if self.negotiated else self._budget
        lag = self.lag
        pacer = self._pacer
        if pacer is not None and events.reads_in_place and (budget is not None or pacer.can_watch):

            def apply(messages: list[bytes]) -> None:
                self._apply_events(messages, lag)

            reads = InPlaceReads(events, apply, self.stats, pacer, paced_by=budget, lag=lag)
            self._in_place = reads
            try:
                await reads.run()
            finally:
                self._in_place = None
            return
        slices = self._slices
        wait_until = self._wait_until
        read_at = -math.inf
        while True:
            if budget is not None and budget.interval > 0:
                lag.allowance = budget.interval
                await wait_until(read_at + budget.interval)
            messages = await events.messages()
            self.stats.event_reads += 1
            read_at = trio.current_time()
            if slices is not None:
                await slices.turn()
            self._apply_events(messages, lag)

    def _catch_up_events(self) -> None:
        """Apply now what the worker's event socket holds, when the pacer reads it in place
        (rule 6): the request plane calls it before it hands over a refusal of the worker's."""
        if self._in_place is not None:
            self._in_place.catch_up()

    def _apply_events(self, messages: list[bytes], lag: LagMeter) -> None:
        """Decode what one read brought and hand its latest state to the listener (rules 3, 5,
        7 and 8)."""
        arrival = time.time()
        now = trio.current_time()
        started = self._kv.clock()  # rule 7: a read's KV work is measured
        batches: list[list[wire.WorkerEvent]] = []
        kv: list[wire.KvEvent] = []
        kv_bytes = 0
        sent = 0.0
        for data in messages:
            message = self._decode(data, wire.decode_event_message)
            if isinstance(message, wire.Hello):
                self.stats.protocol_errors += 1
                raise ProtocolError("a second hello on the event plane")
            if isinstance(message, wire.KvBatch):
                # Rule 7: in order, never coalesced; dropped unless this link subscribed.
                self.stats.kv_batches += 1
                kv.extend(message.events)
                kv_bytes += len(data)
                continue
            batch = message.events
            sent = message.sent or (batch[-1].ts if batch else sent)
            batches.append(batch)
        # The newest batch says how far behind this read is.
        if sent and lag.observe(arrival, sent, now):
            self._lag_edge(lag, now)
        self.stats.event_batches += len(batches)
        if kv_bytes:
            self._kv.take(kv, kv_bytes, started, now, self._events)
        self._listener.worker_events(self.key, latest_wins(batches), now)

    def _new_lag_meter(self) -> LagMeter:
        return LagMeter(self._settings.lag_window, self._settings.max_event_lag)

    def _lag_edge(self, lag: LagMeter, now: float) -> None:
        if lag.lagging:
            self.stats.lag_episodes += 1
            logger.warning(
                "worker %s: reading its events %.2f s behind (bound %.2f s); not routing to it "
                "until this frontend catches up",
                self.key,
                lag.lag,
                self._settings.max_event_lag,
            )
        else:
            logger.info("worker %s: events caught up (%.3f s behind)", self.key, lag.lag)
        self._listener.worker_lagging(self.key, lag.lagging, now)

    async def _read_replies(self, requests: PlaneConnection, plane: RequestPlane) -> None:
        while True:
            for data in await requests.messages():
                message = self._decode(data, wire.decode_worker_message)
                try:
                    plane.deliver(message)
                except ProtocolError:
                    self.stats.protocol_errors += 1
                    raise

    async def _send_requests(
        self, requests: PlaneConnection, plane: RequestPlane, batches: bool
    ) -> None:
        # Whatever queued while the last write was under way goes out in one write; to a worker
        # that reads batches, in as few messages as the batch bounds allow.
        while True:
            first = await plane.next_outgoing()
            rest = plane.take_outgoing()
            if not rest:
                await requests.send_message(first)
            elif batches:
                await requests.send_messages(wire.request_batches([first, *rest]))
            else:
                await requests.send_messages([first, *rest])

    async def _watch(
        self,
        events: PlaneConnection | None,
        requests: PlaneConnection | None,
        heartbeat_interval: float,
    ) -> None:
        """The watchdog of rule 2."""
        settings = self._settings
        silence = max(settings.keepalive_timeout, 3 * heartbeat_interval)
        period = min(settings.keepalive_interval, settings.keepalive_timeout, silence) / 2
        wait_until = self._wait_until
        while True:
            # On the pool's pacer, like paced reads: thousands of watchdogs, one timer.
            await wait_until(trio.current_time() + period)
            now = trio.current_time()
            if events is not None and now - events.last_received > silence:
                raise self._keepalive_failed(f"no event or heartbeat within {silence} s")
            for plane in (requests, events):
                if plane is None:
                    continue
                started = plane.send_started_at
                if started is not None and now - started > settings.keepalive_timeout:
                    raise self._keepalive_failed(
                        f"a write on {plane.path} made no progress for "
                        f"{settings.keepalive_timeout} s: the worker is not reading"
                    )
            if requests is None:
                continue
            if requests.ping_sent_at is not None:
                if now - requests.ping_sent_at > settings.keepalive_timeout:
                    raise self._keepalive_failed(
                        f"no pong within {settings.keepalive_timeout} s on {requests.path}"
                    )
            elif now - requests.last_received >= settings.keepalive_interval:
                with trio.move_on_after(settings.keepalive_timeout) as ping_scope:
                    await requests.send_ping()
                if ping_scope.cancelled_caught:
                    raise self._keepalive_failed(
                        f"could not send a ping on {requests.path} for "
                        f"{settings.keepalive_timeout} s: the worker is not reading"
                    )

    def _keepalive_failed(self, reason: str) -> _KeepaliveTimeout:
        """Count a session the watchdog ends, and the exception that ends it."""
        self.stats.keepalive_timeouts += 1
        return _KeepaliveTimeout(reason)

    def _decode(self, data: bytes, decode: Callable[[bytes], _M]) -> _M:
        try:
            return decode(data)
        except msgspec.DecodeError as exc:
            self.stats.protocol_errors += 1
            raise ProtocolError(f"undecodable message ({len(data)} bytes): {exc}") from exc


async def _read_hello(connection: PlaneConnection, decode: Callable[[bytes], object]) -> wire.Hello:
    # The hello comes alone: what followed it waits in the reader until its cap is raised.
    messages = await connection.messages()
    connection.unread(messages[1:])
    try:
        message = decode(messages[0])
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable hello: {exc}") from exc
    if not isinstance(message, wire.Hello):
        raise ProtocolError(f"expected a hello first, got {type(message).__name__}")
    if message.protocol_version != wire.PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {message.protocol_version}, this frontend speaks "
            f"{wire.PROTOCOL_VERSION}"
        )
    problem = refusal(message.config)
    if problem is not None:
        raise ProtocolError(f"hello refused: {problem}")
    return message
