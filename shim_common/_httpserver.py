"""A small HTTP/1.1 server on Trio and llhttp: the frontend's API and the worker's system port.

The entry points are here: :func:`serve_http` binds and serves, :func:`serve_http_listeners`
serves listeners the caller opened, :func:`serve_connection` serves one stream. Everything runs
over any :class:`trio.abc.Stream`, so tests drive it with ``trio.testing.memory_stream_pair`` as
well as with real loopback sockets, and over TLS (``ssl_context``: each connection's handshake
runs in its own task, bounded by the header timeout; a failure is counted and closes that
connection only). A handler gets an :class:`HTTPRequest` and answers through an
:class:`HTTPResponder` (:mod:`shim_common._http_exchange`); what one connection does, request after
request, and the limits it enforces are the rules of :mod:`shim_common._http_connection`.

At the file-descriptor limit (``accept`` fails with ``EMFILE`` and the like) the server closes
the longest idle connections (those waiting for a request with nothing of it received yet, and
uploads fallen behind the minimum rate: rule 8 of :mod:`shim_common._http_connection`) and
accepts again, so new clients are served while idle keep-alive connections pile up; only with
none idle does it wait 0.1 s before the next try. It logs this at most once every ten seconds
(:class:`~shim_common._net.DescriptorLimitLog`), with the counts since the last line.

A server stops in order with a :class:`Shutdown`: first it stops accepting (the listeners stop
completing new handshakes, what already waits in the listen backlog is accepted, then the
listeners close, so a later connection is refused by the kernel), while every connection answers
the request it has begun, or the first one of a connection that has sent nothing yet, and closes
(rule 9 of :mod:`shim_common._http_connection`). A client arriving at the exit thus gets a
status line or a refused connection, never a connection that closes with no answer. The sweep of
the backlog goes on until nothing has been accepted for ``_BACKLOG_QUIET_SECONDS`` (50 ms), at
most ``_BACKLOG_SWEEP_SECONDS`` (200 ms) in all: a handshake the kernel answered just before it
stopped completing new ones completes when the client's last segment arrives, a round trip later,
and is accepted rather than reset by the close. Stopping new handshakes is Linux only (a socket
filter); elsewhere a client arriving in the last moment may still be reset.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Final

import trio

from shim_common._access import accept_tls
from shim_common._http_connection import Connection
from shim_common._http_exchange import (
    DEFAULT_LIMITS,
    AnswerAtOnce,
    BodyTooLarge,
    ClientDisconnected,
    Handler,
    HTTPLimits,
    HTTPRequest,
    HTTPResponder,
    InvalidResponse,
    MalformedRequest,
    RequestTimeout,
    error_body,
    header_value,
    json_headers,
    openai_error_type,
)
from shim_common._http_head_writer import complete_response
from shim_common._http_idle import IdleConnections
from shim_common._net import (
    CLOSE_BATCH,
    RELEASE_SECONDS,
    DescriptorLimitLog,
    out_of_descriptors,
    stop_completing_handshakes,
)

__all__ = [
    "DEFAULT_LIMITS",
    "AnswerAtOnce",
    "BodyTooLarge",
    "ClientDisconnected",
    "HTTPLimits",
    "HTTPRequest",
    "HTTPResponder",
    "Handler",
    "IdleConnections",
    "InvalidResponse",
    "MalformedRequest",
    "RequestTimeout",
    "complete_response",
    "error_body",
    "header_value",
    "json_headers",
    "openai_error_type",
    "Shutdown",
    "serve_connection",
    "serve_http",
    "serve_http_listeners",
]


class Shutdown:
    """How a server stops in order (see the module's docstring): give one to
    :func:`serve_http` (or :func:`serve_http_listeners`), then call :meth:`close` before
    cancelling the server."""

    def __init__(self) -> None:
        self._closing = False
        self._accepting: list[trio.CancelScope] = []
        self._accept_loops = 0
        # Connections accepted and not yet ended (counted from the accept, before their task
        # runs), and those of them whose Connection exists, to wind down.
        self._open = 0
        self._connections: set[Connection] = set()
        self._changed = trio.lowlevel.ParkingLot()

    async def close(self, answer_seconds: float) -> None:
        """Stop accepting, then let every connection answer what it is owed and close.

        Args:
            answer_seconds: the longest wait for the connections to end (what is still open
                after it is left to the caller's cancellation).
        """
        self._closing = True
        for scope in self._accepting:
            scope.cancel()
        # The connections wind down while the backlog is swept (those the sweep accepts wind
        # down as they start): the sweep's wait for late handshakes costs no time of their own.
        for connection in list(self._connections):
            connection.wind_down()
        with trio.move_on_after(answer_seconds):
            # Bounded: each accept loop ends after a bounded sweep of its backlog.
            while self._accept_loops:
                await self._changed.park()
            while self._open:
                await self._changed.park()

    def _accepted(self) -> None:
        self._open += 1

    def _ended(self) -> None:
        self._open -= 1
        self._changed.unpark_all()

    def _add(self, connection: Connection) -> None:
        self._connections.add(connection)
        if self._closing:
            connection.wind_down()

    def _discard(self, connection: Connection) -> None:
        self._connections.discard(connection)


async def serve_connection(
    stream: trio.abc.Stream,
    handler: Handler,
    *,
    limits: HTTPLimits = DEFAULT_LIMITS,
    on_error: Callable[[BaseException], None] | None = None,
    on_send_stall: Callable[[], None] | None = None,
    idle: IdleConnections | None = None,
    shutdown: Shutdown | None = None,
    answer_at_once: AnswerAtOnce | None = None,
) -> None:
    """Serve HTTP/1.1 on one connection until either side ends it; never raises ``Exception``.

    Args:
        stream: the connection (a socket stream, or a memory stream in tests).
        handler: called once per request.
        limits: the connection's bounds.
        on_error: called with each unexpected exception (a failing handler), e.g. to count it.
        on_send_stall: called when the connection is dropped because a write made no progress
            for ``limits.send_timeout`` (a client that stopped reading).
        idle: where the connection is listed while it is idle (closable at the descriptor
            limit).
        shutdown: the server's :class:`Shutdown`, which winds the connection down.
        answer_at_once: answers the requests the handler can answer from their heads alone,
            without a task hand-off (rule 10 of :mod:`shim_common._http_connection`).
    """
    connection = Connection(stream, handler, limits, on_error, on_send_stall, idle, answer_at_once)
    if shutdown is not None:
        shutdown._add(connection)
    try:
        await connection.run()
    except Exception as exc:
        # Whatever one connection does wrong stays with that connection.
        connection.report(exc)
    finally:
        if shutdown is not None:
            shutdown._discard(connection)
        await trio.aclose_forcefully(stream)


async def serve_http_listeners(
    handler: Handler,
    listeners: list[trio.SocketListener],
    *,
    limits: HTTPLimits = DEFAULT_LIMITS,
    on_error: Callable[[BaseException], None] | None = None,
    on_send_stall: Callable[[], None] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    on_tls_failure: Callable[[BaseException], None] | None = None,
    idle: IdleConnections | None = None,
    shutdown: Shutdown | None = None,
    answer_at_once: AnswerAtOnce | None = None,
) -> None:
    """Serve HTTP on listeners the caller opened, until cancelled.

    Args:
        handler: called once per request.
        listeners: the listening sockets.
        limits: every connection's bounds.
        on_error: called with each unexpected exception, e.g. to count it.
        on_send_stall: called for each connection dropped for a stalled write.
        ssl_context: serve HTTPS: each accepted connection does its TLS handshake in its own
            task, within ``limits.header_timeout``, before its first request head is awaited.
        on_tls_failure: called for each failed or late TLS handshake (the connection is closed;
            nothing else is affected).
        idle: the registry of idle connections to use (e.g. shared with code that also needs
            descriptors, to close some when it runs out); a fresh one by default.
        shutdown: how the server is to stop in order; without one, cancelling it ends every
            connection where it stands.
        answer_at_once: answers the requests the handler can answer from their heads alone
            (see :func:`serve_connection`).
    """

    def tls_failed(exc: BaseException) -> None:
        if on_tls_failure is not None:
            on_tls_failure(exc)

    async def on_connection(stream: trio.SocketStream) -> None:
        try:
            served: trio.abc.Stream = stream
            if ssl_context is not None:
                tls = await accept_tls(stream, ssl_context, limits.header_timeout, tls_failed)
                if tls is None:
                    return
                served = tls
            await serve_connection(
                served,
                handler,
                limits=limits,
                on_error=on_error,
                on_send_stall=on_send_stall,
                idle=idle_connections,
                shutdown=shutdown,
                answer_at_once=answer_at_once,
            )
        finally:
            await trio.aclose_forcefully(stream)
            if shutdown is not None:
                shutdown._ended()

    idle_connections = IdleConnections() if idle is None else idle
    log = DescriptorLimitLog(logger, "accept")
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(
                _accept_forever, listener, nursery, on_connection, idle_connections, log, shutdown
            )


# With nothing idle to close, the wait before accepting again (trio.serve_listeners' too). The
# accept errors that lead here are those of shim_common._net.out_of_descriptors (the same set as
# trio.serve_listeners'): the process is out of a resource, the listener is not broken.
_RETRY_SECONDS: Final = 0.1

logger = logging.getLogger(__name__)


# At a shutdown, the most connections taken from one listener's backlog; how long the sweep goes
# on with nothing accepted (longer than a client's round trip: a handshake answered before the
# listener stopped completing new ones completes one round trip later) and at most in all.
_BACKLOG_SWEEP: Final = 1024
_BACKLOG_QUIET_SECONDS: Final = 0.05
_BACKLOG_SWEEP_SECONDS: Final = 0.2


async def _accept_forever(
    listener: trio.SocketListener,
    nursery: trio.Nursery,
    on_connection: Callable[[trio.SocketStream], Awaitable[None]],
    idle: IdleConnections,
    log: DescriptorLimitLog,
    shutdown: Shutdown | None,
) -> None:
    async with listener:
        accepting = trio.CancelScope()
        if shutdown is not None:
            if shutdown._closing:
                return
            shutdown._accepting.append(accepting)
            shutdown._accept_loops += 1
        try:
            with accepting:
                while True:
                    try:
                        stream = await listener.accept()
                    except OSError as exc:
                        if not out_of_descriptors(exc):
                            raise
                        closed = idle.close_oldest(CLOSE_BATCH)
                        log.note(exc, closed)
                        await trio.sleep(RELEASE_SECONDS if closed else _RETRY_SECONDS)
                        continue
                    if shutdown is not None:
                        shutdown._accepted()
                    nursery.start_soon(on_connection, stream)
            if shutdown is not None:
                # The shutdown began: a connection the kernel has already completed is owed an
                # answer (closing the listener would reset it), so the backlog is taken first,
                # once the kernel completes no more (one completed after the sweep would be
                # reset with no answer).
                stop_completing_handshakes(listener.socket)
                await _sweep_backlog(listener, nursery, on_connection, shutdown)
        finally:
            if shutdown is not None:
                shutdown._accept_loops -= 1
                shutdown._changed.unpark_all()
    # Leaving ``async with listener`` closed it: the kernel refuses later connections.


async def _sweep_backlog(
    listener: trio.SocketListener,
    nursery: trio.Nursery,
    on_connection: Callable[[trio.SocketStream], Awaitable[None]],
    shutdown: Shutdown,
) -> None:
    with trio.move_on_after(_BACKLOG_SWEEP_SECONDS):
        for _ in range(_BACKLOG_SWEEP):
            with trio.move_on_after(_BACKLOG_QUIET_SECONDS):
                try:
                    stream = await listener.accept()
                except OSError:
                    return  # out of descriptors: what is left is reset with the listener
                shutdown._accepted()
                nursery.start_soon(on_connection, stream)
                continue
            return


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    limits: HTTPLimits = DEFAULT_LIMITS,
    on_error: Callable[[BaseException], None] | None = None,
    on_send_stall: Callable[[], None] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    on_tls_failure: Callable[[BaseException], None] | None = None,
    idle: IdleConnections | None = None,
    shutdown: Shutdown | None = None,
    answer_at_once: AnswerAtOnce | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bind ``host:port`` and serve HTTP (HTTPS with ``ssl_context``) until cancelled.

    Args:
        handler: called once per request with the request and its responder.
        host: the address to listen on.
        port: the port; ``0`` picks a free one.
        limits: every connection's bounds.
        on_error: called with each unexpected exception, e.g. to count it.
        on_send_stall: called for each connection dropped for a stalled write.
        ssl_context: serve HTTPS (see :func:`serve_http_listeners`).
        on_tls_failure: called for each failed or late TLS handshake.
        idle: the registry of idle connections (see :func:`serve_http_listeners`).
        shutdown: how the server is to stop in order (see :func:`serve_http_listeners`).
        answer_at_once: answers given from a request's head alone (see
            :func:`serve_connection`).
        task_status: receives the bound port once listening (use with ``nursery.start``).

    Raises:
        OSError: the address could not be bound.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port: int = listeners[0].socket.getsockname()[1]
    task_status.started(bound_port)
    await serve_http_listeners(
        handler,
        listeners,
        limits=limits,
        on_error=on_error,
        on_send_stall=on_send_stall,
        ssl_context=ssl_context,
        on_tls_failure=on_tls_failure,
        idle=idle,
        shutdown=shutdown,
        answer_at_once=answer_at_once,
    )
