"""The frontend's connections to its workers: discovery, reconnect, request multiplexing, events.

Shape:

- :class:`WorkerPool` turns the ``--worker`` URLs (and the URLs of ``--local-workers``) into one
  :class:`WorkerLink` per resolved address. A host name is looked up with ``getaddrinfo`` at start
  and every ``resolve_interval`` seconds: new addresses get a link, vanished ones are stopped. A
  lookup that fails keeps the addresses that name had before.
- :class:`WorkerLink` owns the two websocket connections to one worker, ``/v1/events`` and
  ``/v1/requests``, opened and lost together (a *session*). It reports the worker to a
  :class:`FleetListener`: ``worker_up`` on each new session's hello, ``worker_events`` for every
  event batch, ``worker_down`` when the session ends. It reconnects forever with capped
  exponential backoff and jitter (:class:`Backoff`).
- :class:`WorkerLink.request` runs one request on the worker's request plane and hands back a
  :class:`RequestStream`.

Rules of a session (the state machine of a link):

1. ``down`` -> connect both planes (bounded by ``connect_timeout``) -> read one :class:`wire.Hello`
   on each; the protocol versions must be :data:`wire.PROTOCOL_VERSION` and the worker ids must
   agree -> ``up`` (``worker_up``, the backoff is reset).
2. While ``up``, four tasks run in one nursery: a tight reader per plane, one sender for the
   request plane, and a keepalive on the request plane (a ping answered within
   ``keepalive_timeout``, every ``keepalive_interval``). The event plane needs no ping: its
   reader ends the session when no event or heartbeat came for three heartbeat intervals (at
   least ``keepalive_timeout``). So a worker that dies silently is noticed too.
3. Any of these ends the session: a closed connection, a failed ping, a message that does not
   decode (logged and counted in :class:`LinkStats`), a second hello. Every request still open on
   the session then ends at once with ``Failed(kind="unavailable")``; nothing is left hanging.
   ``worker_down`` is called, then the link sleeps ``Backoff.next_delay()`` and goes to 1.

Request multiplexing (one request-plane connection per worker; see :class:`_RequestPlane`):

- Request ids come from a counter per session; a table maps each open id to its response buffer.
- The reader never waits on a consumer. Each request has a buffer of ``request_buffer`` messages.
  When a slow HTTP client lets it fill, a further text chunk is merged into the last buffered one
  (the client gets fewer, larger deltas; the total is bounded by the request's ``max_tokens``).
  A message that cannot be merged (an embedding vector) fails that request alone with
  ``Failed(kind="cancelled")`` and a message naming the cause, and ``Cancel`` goes to the worker.
  The terminal message of a request always fits (one place is kept for it).
- Outgoing messages go through one sender task. ``Generate`` waits for room in the outbox
  (``send_queue`` places: backpressure to the caller); ``Cancel`` never waits, so leaving a
  request is cancel-safe and synchronous. A request cancelled before its ``Generate`` was written
  is simply dropped from the outbox.

Times given to the listener (``now``) are ``trio.current_time()``, the monotonic Trio clock.

Later: several request-plane connections per worker (round-robin by request) would lift the one
connection's limit of about 20k messages/s each way; the table would then live per connection.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import logging
import math
import random
import socket
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final, Protocol, TypeAlias, TypeVar

import msgspec
import trio
import trio_websocket

from shim_common import wire
from shim_common._net import Backoff, host_for_url

__all__ = [
    "FirstReply",
    "FleetListener",
    "LinkSettings",
    "LinkStats",
    "RequestStream",
    "Resolver",
    "StreamReply",
    "WorkerKey",
    "WorkerLink",
    "WorkerPool",
    "WorkerUrl",
    "parse_worker_url",
    "resolve_addresses",
]

logger = logging.getLogger(__name__)

#: A worker's stable identity in the frontend: its websocket URL with the host resolved to an IP
#: address, e.g. ``"ws://127.0.0.1:9100"`` or ``"ws://[::1]:9100"``.
WorkerKey: TypeAlias = str

#: What :meth:`RequestStream.first` returns: the worker's first word on a request.
FirstReply: TypeAlias = wire.Rejected | wire.Started | wire.Failed
#: What iterating a :class:`RequestStream` yields after ``Started``.
StreamReply: TypeAlias = wire.Chunk | wire.End | wire.Failed

#: Receives a host name and a port, returns IP address strings (first preferred).
Resolver: TypeAlias = Callable[[str, int], Awaitable[list[str]]]

EVENTS_PATH: Final = "/v1/events"
REQUESTS_PATH: Final = "/v1/requests"


# ----------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkSettings:
    """Timeouts and sizes of a worker link. The defaults suit a LAN or loopback fleet."""

    #: Seconds to open both websockets and read both hellos.
    connect_timeout: float = 5.0
    #: Seconds to wait for the closing handshake when a session ends.
    disconnect_timeout: float = 1.0
    #: Seconds between keepalive pings on each connection.
    keepalive_interval: float = 1.0
    #: Seconds a ping may wait for its pong before the session is declared dead.
    keepalive_timeout: float = 5.0
    #: First reconnect delay (seconds); it doubles per failed attempt ...
    backoff_initial: float = 0.05
    #: ... up to this cap (seconds).
    backoff_cap: float = 2.0
    #: Each delay is drawn uniformly from ``[(1 - jitter) * d, d]``.
    backoff_jitter: float = 0.5
    #: Messages buffered per request before text chunks are merged (see the module docstring).
    request_buffer: int = 256
    #: ``Generate`` messages waiting for the sender before ``request()`` waits.
    send_queue: int = 256

    def __post_init__(self) -> None:
        if self.request_buffer < 1 or self.send_queue < 1:
            raise ValueError("request_buffer and send_queue must be at least 1")
        if not 0.0 <= self.backoff_jitter <= 1.0:
            raise ValueError(f"backoff_jitter must be in [0, 1], got {self.backoff_jitter}")
        if not 0.0 < self.backoff_initial <= self.backoff_cap:
            raise ValueError("backoff needs 0 < backoff_initial <= backoff_cap")


@dataclasses.dataclass
class LinkStats:
    """Counters of one link, for logs and metrics (read them; only the link writes them)."""

    #: Sessions that reached ``up``.
    sessions: int = 0
    #: Connection attempts that failed before ``up``.
    connect_failures: int = 0
    #: Messages that did not decode, or arrived out of protocol (each one ended its session).
    protocol_errors: int = 0
    #: Sessions ended because a ping went unanswered.
    keepalive_timeouts: int = 0
    #: Requests ended with ``unavailable`` because their session ended.
    requests_failed_by_disconnect: int = 0
    #: Text chunks merged into an earlier one because the consumer was behind.
    chunks_merged: int = 0
    #: Requests failed because their consumer was too far behind to buffer any more.
    requests_overflowed: int = 0
    #: Replies for request ids no longer open (after a local cancel): dropped.
    late_replies: int = 0


# ----------------------------------------------------------------------------- addresses


@dataclasses.dataclass(frozen=True)
class WorkerUrl:
    """A parsed ``--worker`` URL: ``ws://host:port`` with an optional path prefix."""

    host: str
    port: int
    #: Path prefix before ``/v1/events`` and ``/v1/requests``; ``""`` or ``"/prefix"``.
    path: str = ""

    def key_for(self, address: str) -> WorkerKey:
        """The key (and base URL) of the worker at ``address`` (an IP address string)."""
        return f"ws://{host_for_url(address)}:{self.port}{self.path}"


def parse_worker_url(url: str) -> WorkerUrl:
    """Parse and check a ``--worker`` value.

    Args:
        url: ``ws://host:port`` (an IPv6 address in brackets); a path prefix is kept.

    Returns:
        The host, port and path prefix.

    Raises:
        ValueError: with a message naming the value, for any other scheme, a missing host or
            port, a query or a fragment.
    """
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"invalid worker URL {url!r}: {exc}") from exc
    if parts.scheme != "ws":
        raise ValueError(f"invalid worker URL {url!r}: the scheme must be ws://")
    if not parts.hostname:
        raise ValueError(f"invalid worker URL {url!r}: no host")
    if port is None:
        raise ValueError(f"invalid worker URL {url!r}: no port (ws://host:port)")
    if parts.query or parts.fragment:
        raise ValueError(f"invalid worker URL {url!r}: no query or fragment allowed")
    return WorkerUrl(host=parts.hostname, port=port, path=parts.path.rstrip("/"))


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every IP address of ``host`` for a TCP connection, in resolver order, without repeats.

    An IP literal is returned as is, without a lookup.

    Raises:
        OSError: the lookup failed (``socket.gaierror`` is one).
    """
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[str] = []
    for family, _type, _proto, _canonname, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = str(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


# ----------------------------------------------------------------------------- listener


class FleetListener(Protocol):
    """What a :class:`WorkerPool` tells about its workers (the frontend's load state glue).

    Calls are synchronous and come from the links' reader tasks: keep them short and
    non-blocking. For one key the order is always ``worker_up``, any number of
    ``worker_events``, ``worker_down``, and so on; ``now`` is ``trio.current_time()``.
    """

    def worker_up(self, key: WorkerKey, config: wire.RuntimeConfig, now: float) -> None:
        """A session to the worker at ``key`` started; ``config`` is from its hello."""

    def worker_events(self, key: WorkerKey, events: Sequence[wire.WorkerEvent], now: float) -> None:
        """One event batch from the worker at ``key``, oldest first."""

    def worker_down(self, key: WorkerKey, now: float) -> None:
        """The session ended (lost, or the link was stopped); its open requests have failed."""


# ----------------------------------------------------------------------------- request plane

_Reply: TypeAlias = wire.Rejected | wire.Started | wire.Chunk | wire.End | wire.Failed


class _ResponseBuffer:
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
            if not (
                isinstance(last, wire.Chunk)
                and isinstance(reply, wire.Chunk)
                and _mergeable(last)
                and reply.embedding is None
            ):
                return "full"
            self._items[-1] = wire.Chunk(
                request_id=reply.request_id,
                text=last.text + reply.text,
                tokens=last.tokens + reply.tokens,
                finish_reason=reply.finish_reason,
                index=reply.index,
            )
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

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None


def _mergeable(reply: _Reply | None) -> bool:
    # A text chunk that is not the last one can take more text after it; embeddings carry
    # vectors and are never merged.
    return isinstance(reply, wire.Chunk) and reply.embedding is None and reply.finish_reason is None


class _RequestPlane:
    """The request table and outbox of one session; synchronous except for two waits.

    The reader calls :meth:`deliver`; the sender awaits :meth:`next_outgoing`; requests call
    :meth:`open` and :meth:`cancel`. After :meth:`close`, every open request has failed and
    everything else is a no-op.
    """

    def __init__(self, settings: LinkSettings, stats: LinkStats) -> None:
        self._settings = settings
        self._stats = stats
        self._next_id = 1
        self._open: dict[int, _ResponseBuffer] = {}
        # (request id, encoded message, is a Generate). Generates are bounded by send_queue;
        # Cancels by the number of open requests (at most one each).
        self._outbox: collections.deque[tuple[int, bytes, bool]] = collections.deque()
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
        self, endpoint: wire.Endpoint, body: dict[str, Any]
    ) -> tuple[int, _ResponseBuffer]:
        """Register a request and queue its ``Generate``; waits while the outbox is full."""
        while self._closed_reason is None and self._generates_queued >= self._settings.send_queue:
            await self._room.wait()
        request_id = self._next_id
        self._next_id += 1
        buffer = _ResponseBuffer(self._settings.request_buffer)
        if self._closed_reason is not None:
            buffer.finish(_unavailable(request_id, self._closed_reason))
            return request_id, buffer
        data = wire.encode(wire.Generate(request_id=request_id, endpoint=endpoint, body=body))
        if len(data) > wire.MAX_MESSAGE_BYTES:
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
        self._outbox.append((request_id, data, True))
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
        self._outbox.append(
            (request_id, wire.encode(wire.Cancel(request_id=request_id, reason=reason)), False)
        )
        self._signal_outbox()

    def deliver(self, message: wire.WorkerMessage) -> None:
        """Route one decoded reply to its request (never blocks).

        Raises:
            ProtocolError: a message that has no place on an established request plane.
        """
        if isinstance(message, wire.Hello):
            raise ProtocolError("a second hello on the request plane")
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
                    message=f"the client read too slowly: {self._settings.request_buffer} "
                    "replies were waiting for it",
                )
            )
            self.cancel(reply.request_id, reason="frontend: client too slow")

    async def next_outgoing(self) -> bytes:
        """The next message for the sender, waiting for one."""
        while True:
            while not self._outbox:
                await self._outbox_changed.wait()
            request_id, data, is_generate = self._outbox.popleft()
            if not is_generate:
                return data
            self._generates_queued -= 1
            self._room.set()
            self._room = trio.Event()
            if request_id in self._unsent:
                self._unsent.discard(request_id)
                return data
            # else: cancelled before it was sent; skip it.

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
            buffer.finish(_unavailable(request_id, reason))
        self._open.clear()
        self._outbox.clear()
        self._unsent.clear()
        self._room.set()
        return failed

    def _signal_outbox(self) -> None:
        self._outbox_changed.set()
        self._outbox_changed = trio.Event()


def _unavailable(request_id: int, reason: str) -> wire.Failed:
    return wire.Failed(request_id=request_id, kind="unavailable", message=f"worker lost: {reason}")


class RequestStream:
    """One request in flight on a worker's request plane (made by :meth:`WorkerLink.request`).

    Read it in two steps: ``await first()`` tells whether the worker started the request, then
    ``async for reply in stream`` yields its ``Chunk`` items and ends after the one ``End`` or
    ``Failed``. Every path ends: if the worker is lost, the stream yields
    ``Failed(kind="unavailable")``.
    """

    __slots__ = ("_buffer", "_done", "_first", "_held", "request_id")

    def __init__(self, request_id: int, buffer: _ResponseBuffer) -> None:
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


# ----------------------------------------------------------------------------- one worker


class ProtocolError(Exception):
    """The worker sent something out of protocol; the session ends and is retried."""


class _KeepaliveTimeout(Exception):
    """A ping went unanswered for ``keepalive_timeout`` seconds."""


# Everything that ends a session in the ordinary course of things (not a bug of ours).
_SESSION_ERRORS: Final = (
    OSError,
    trio.BrokenResourceError,
    trio.TooSlowError,
    trio_websocket.ConnectionClosed,
    trio_websocket.HandshakeError,
    msgspec.DecodeError,
    ProtocolError,
    _KeepaliveTimeout,
)


class WorkerLink:
    """The two websocket connections to one worker, kept up for as long as :meth:`run` runs.

    Attributes:
        key: the worker's stable id and base URL, e.g. ``"ws://127.0.0.1:9100"``.
        config: the worker's runtime configuration from its latest hello; ``None`` before the
            first session. It stays set while the worker is down (the last known one).
        connected: True while a session is up.
        stats: counters (sessions, failures, protocol errors, ...).
    """

    def __init__(
        self,
        key: WorkerKey,
        listener: FleetListener,
        settings: LinkSettings | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.key = key
        self.config: wire.RuntimeConfig | None = None
        self.connected = False
        self.stats = LinkStats()
        self._listener = listener
        self._settings = settings if settings is not None else LinkSettings()
        self._backoff = Backoff(
            initial=self._settings.backoff_initial,
            cap=self._settings.backoff_cap,
            jitter=self._settings.backoff_jitter,
            rng=rng,
        )
        self._plane: _RequestPlane | None = None
        self._up_event = trio.Event()
        self._reached_up = False

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
        self, endpoint: wire.Endpoint, body: dict[str, Any]
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

        Returns:
            An async context manager yielding the :class:`RequestStream`.
        """
        return self._request(endpoint, body)

    @asynccontextmanager
    async def _request(
        self, endpoint: wire.Endpoint, body: dict[str, Any]
    ) -> AsyncIterator[RequestStream]:
        plane = self._plane
        if plane is None:
            buffer = _ResponseBuffer(1)
            buffer.finish(_unavailable(0, f"{self.key} is not connected"))
            yield RequestStream(0, buffer)
            return
        request_id, buffer = await plane.open(endpoint, body)
        try:
            yield RequestStream(request_id, buffer)
        finally:
            # A no-op when the request already ended or the session is gone.
            plane.cancel(request_id)

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
            try:
                await self._session()
            except* _SESSION_ERRORS as group:
                if not self._reached_up:
                    self.stats.connect_failures += 1
                level = logging.DEBUG if quiet and not self._reached_up else logging.WARNING
                logger.log(level, "worker %s: %s; reconnecting", self.key, _describe(group))
            quiet = not self._reached_up
            if self._reached_up:
                self._backoff.reset()
            await trio.sleep(self._backoff.next_delay())

    async def _session(self) -> None:
        """One session: connect, hello, serve until something ends it (always by raising)."""
        settings = self._settings
        self._reached_up = False
        # One deadline for both connections and both hellos, lifted once the session is up.
        with trio.CancelScope(deadline=trio.current_time() + settings.connect_timeout) as connect:
            async with (
                self._open_plane(EVENTS_PATH) as events_ws,
                self._open_plane(REQUESTS_PATH) as requests_ws,
            ):
                events_hello = _check_hello(
                    await events_ws.get_message(), wire.decode_event_message
                )
                requests_hello = _check_hello(
                    await requests_ws.get_message(), wire.decode_worker_message
                )
                if events_hello.config.worker_id != requests_hello.config.worker_id:
                    raise ProtocolError(
                        "the planes answer for different workers: "
                        f"{events_hello.config.worker_id!r} and "
                        f"{requests_hello.config.worker_id!r}"
                    )
                connect.deadline = math.inf
                await self._serve(events_ws, requests_ws, requests_hello.config)
        if connect.cancelled_caught:
            raise trio.TooSlowError(f"no connection and hello within {settings.connect_timeout} s")

    async def _serve(
        self,
        events_ws: trio_websocket.WebSocketConnection,
        requests_ws: trio_websocket.WebSocketConnection,
        config: wire.RuntimeConfig,
    ) -> None:
        plane = _RequestPlane(self._settings, self.stats)
        self._up(config, plane)
        reason = "connection lost"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_events, events_ws, config.heartbeat_interval)
                nursery.start_soon(self._read_replies, requests_ws, plane)
                nursery.start_soon(self._send_requests, requests_ws, plane)
                # The event plane needs no ping: its heartbeats prove the worker alive.
                nursery.start_soon(self._keepalive, requests_ws)
        except BaseException as exc:
            reason = _reason_of(exc)
            raise
        finally:
            # Before the websockets close (which may wait for a dead peer): fail the open
            # requests and tell the listener now.
            self._down(plane, reason)

    @asynccontextmanager
    async def _open_plane(self, path: str) -> AsyncIterator[trio_websocket.WebSocketConnection]:
        """A client websocket on ``path`` whose TCP stream this link owns.

        trio-websocket 0.12's client leaves its socket open when the server closes first
        (``aclose`` returns early once a close reason is set), so the stream is opened and
        closed here, around ``wrap_client_stream``.
        """
        parts = urllib.parse.urlsplit(self.key)
        assert parts.hostname is not None  # keys are made by WorkerUrl.key_for
        assert parts.port is not None
        stream = await trio.open_tcp_stream(parts.hostname, parts.port)
        async with stream, trio.open_nursery() as ws_nursery:
            ws = await trio_websocket.wrap_client_stream(
                ws_nursery,
                stream,
                parts.netloc,
                parts.path + path,
                message_queue_size=1,
                max_message_size=wire.MAX_MESSAGE_BYTES,
            )
            try:
                yield ws
            finally:
                # When the link itself is cancelled (the frontend stops), the websocket's reader
                # task is cancelled too and no close reply can be read: waiting for one would
                # only burn disconnect_timeout per plane. The stream closes below either way.
                if trio.current_effective_deadline() != -math.inf:
                    with trio.CancelScope(shield=True) as closing:
                        closing.deadline = trio.current_time() + self._settings.disconnect_timeout
                        await ws.aclose()
                ws_nursery.cancel_scope.cancel()

    def _up(self, config: wire.RuntimeConfig, plane: _RequestPlane) -> None:
        self.config = config
        self.connected = True
        self._plane = plane
        self._reached_up = True
        self.stats.sessions += 1
        self._up_event.set()
        logger.info("worker %s up: id=%s model=%s", self.key, config.worker_id, config.model)
        self._listener.worker_up(self.key, config, trio.current_time())

    def _down(self, plane: _RequestPlane, reason: str) -> None:
        self.stats.requests_failed_by_disconnect += plane.close(reason)
        self._plane = None
        self.connected = False
        self._up_event = trio.Event()
        self._listener.worker_down(self.key, trio.current_time())

    async def _read_events(
        self, ws: trio_websocket.WebSocketConnection, heartbeat_interval: float
    ) -> None:
        # Tight: decode and hand over, nothing else, so the socket reader keeps answering pings.
        # A worker sends a heartbeat every interval, so silence for several intervals means it
        # is gone or wedged; that replaces a ping on this plane (half the pings of a large fleet).
        silence = max(self._settings.keepalive_timeout, 3 * heartbeat_interval)
        listener = self._listener
        while True:
            with trio.move_on_after(silence) as quiet:
                data = await ws.get_message()
            if quiet.cancelled_caught:
                self.stats.keepalive_timeouts += 1
                raise _KeepaliveTimeout(f"no event or heartbeat within {silence} s on {ws.path}")
            message = self._decode(data, wire.decode_event_message)
            if isinstance(message, wire.Hello):
                self.stats.protocol_errors += 1
                raise ProtocolError("a second hello on the event plane")
            listener.worker_events(self.key, message.events, trio.current_time())

    async def _read_replies(
        self, ws: trio_websocket.WebSocketConnection, plane: _RequestPlane
    ) -> None:
        while True:
            data = await ws.get_message()
            message = self._decode(data, wire.decode_worker_message)
            try:
                plane.deliver(message)
            except ProtocolError:
                self.stats.protocol_errors += 1
                raise

    async def _send_requests(
        self, ws: trio_websocket.WebSocketConnection, plane: _RequestPlane
    ) -> None:
        while True:
            await ws.send_message(await plane.next_outgoing())

    async def _keepalive(self, ws: trio_websocket.WebSocketConnection) -> None:
        while True:
            await trio.sleep(self._settings.keepalive_interval)
            with trio.move_on_after(self._settings.keepalive_timeout) as scope:
                await ws.ping()
            if scope.cancelled_caught:
                self.stats.keepalive_timeouts += 1
                raise _KeepaliveTimeout(
                    f"no pong within {self._settings.keepalive_timeout} s on {ws.path}"
                )

    def _decode(self, data: bytes | str, decode: Callable[[bytes], _M]) -> _M:
        if isinstance(data, str):
            self.stats.protocol_errors += 1
            raise ProtocolError("a text message (the protocol is binary msgpack)")
        try:
            return decode(data)
        except msgspec.DecodeError as exc:
            self.stats.protocol_errors += 1
            raise ProtocolError(f"undecodable message ({len(data)} bytes): {exc}") from exc


_M = TypeVar("_M")


def _check_hello(data: bytes | str, decode: Callable[[bytes], object]) -> wire.Hello:
    if isinstance(data, str):
        raise ProtocolError("a text message instead of the hello")
    try:
        message = decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable hello: {exc}") from exc
    if not isinstance(message, wire.Hello):
        raise ProtocolError(f"expected a hello first, got {type(message).__name__}")
    if message.protocol_version != wire.PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {message.protocol_version}, this frontend speaks "
            f"{wire.PROTOCOL_VERSION}"
        )
    return message


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _describe(exc: BaseException) -> str:
    parts = []
    for leaf in _leaves(exc):
        text = str(leaf) or type(leaf).__name__
        if isinstance(leaf, trio_websocket.ConnectionClosed) and leaf.reason is not None:
            text = f"connection closed ({leaf.reason.code} {leaf.reason.name})"
        if text not in parts:
            parts.append(text)
    return "; ".join(parts)


def _reason_of(exc: BaseException) -> str:
    leaves = [leaf for leaf in _leaves(exc) if not isinstance(leaf, trio.Cancelled)]
    if not leaves:
        return "link stopped"
    return (
        _describe(BaseExceptionGroup("session", leaves))
        if len(leaves) > 1
        else _describe(leaves[0])
    )


# ----------------------------------------------------------------------------- the fleet


class WorkerPool:
    """The worker links of a frontend: one per resolved address of each worker URL.

    Example::

        pool = WorkerPool(["ws://workers.internal:9100"])
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run, listener)
            link = pool.link("ws://10.0.0.7:9100")
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        settings: LinkSettings | None = None,
        resolve_interval: float = 30.0,
        resolver: Resolver = resolve_addresses,
    ) -> None:
        """Parse the URLs; nothing is resolved or connected before :meth:`run`.

        Args:
            urls: ``ws://host:port`` values (``--worker``, ``DYN_WORKERS``, local workers).
            settings: timeouts and sizes for every link.
            resolve_interval: seconds between lookups of the host names.
            resolver: the lookup (tests replace it); IP literals never reach it.

        Raises:
            ValueError: a URL that :func:`parse_worker_url` refuses.
        """
        self._urls = [parse_worker_url(url) for url in urls]
        self._settings = settings if settings is not None else LinkSettings()
        self._resolve_interval = resolve_interval
        self._resolver = resolver
        self._links: dict[WorkerKey, WorkerLink] = {}
        self._scopes: dict[WorkerKey, trio.CancelScope] = {}
        # The keys each URL resolved to last time, kept when a later lookup fails.
        self._resolved: dict[WorkerUrl, list[WorkerKey]] = {}

    @property
    def links(self) -> Mapping[WorkerKey, WorkerLink]:
        """The links now running, by key (a read-only view)."""
        return self._links

    def link(self, key: WorkerKey) -> WorkerLink | None:
        """The link of the worker at ``key``, or ``None`` if there is none (any more)."""
        return self._links.get(key)

    async def run(
        self,
        listener: FleetListener,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Resolve, start and supervise the links until cancelled.

        Calls ``task_status.started()`` after the first lookup of every URL, once the links of
        the addresses found are running (not yet connected: see the listener). A URL whose
        first lookup fails is retried with backoff, and every ``resolve_interval`` after.
        """
        backoff = Backoff(
            initial=min(1.0, self._resolve_interval),
            cap=self._resolve_interval,
            jitter=0.2,
        )
        async with trio.open_nursery() as nursery:
            complete = await self._reconcile(nursery, listener)
            task_status.started()
            while True:
                if complete:
                    backoff.reset()
                    await trio.sleep(self._resolve_interval)
                else:
                    await trio.sleep(backoff.next_delay())
                complete = await self._reconcile(nursery, listener)

    async def _reconcile(self, nursery: trio.Nursery, listener: FleetListener) -> bool:
        """Look every URL up, start links for new addresses, stop the vanished ones.

        Returns:
            True when every lookup succeeded.
        """
        complete = True
        for url in self._urls:
            try:
                addresses = await self._resolver(url.host, url.port)
            except OSError as exc:
                complete = False
                logger.warning(
                    "cannot resolve %s: %s (keeping %s)", url.host, exc, self._resolved.get(url, [])
                )
                continue
            if not addresses:
                complete = False
                logger.warning("%s resolved to no address", url.host)
                continue
            self._resolved[url] = [url.key_for(address) for address in addresses]
        wanted: dict[WorkerKey, None] = {}
        for keys in self._resolved.values():
            wanted.update(dict.fromkeys(keys))
        for key in list(self._links):
            if key not in wanted:
                logger.info("worker %s no longer resolved: stopping its link", key)
                del self._links[key]
                self._scopes.pop(key).cancel()
        for key in wanted:
            if key not in self._links:
                link = WorkerLink(key, listener, self._settings)
                self._links[key] = link
                await nursery.start(self._run_link, link)
        return complete

    async def _run_link(
        self, link: WorkerLink, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.CancelScope() as scope:
            self._scopes[link.key] = scope
            await link.run(task_status=task_status)
