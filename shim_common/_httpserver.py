"""A small HTTP/1.1 server on Trio and llhttp: the frontend's API and the worker's system port.

The entry points are here: :func:`serve_http` binds and serves, :func:`serve_http_listeners`
serves listeners the caller opened, :func:`serve_connection` serves one stream. Everything runs
over any :class:`trio.abc.Stream`, so tests drive it with ``trio.testing.memory_stream_pair`` as
well as with real loopback sockets, and over TLS (``ssl_context``: each connection's handshake
runs in its own task, bounded by the header timeout; a failure is counted and closes that
connection only). A handler gets an :class:`HTTPRequest` and answers through an
:class:`HTTPResponder` (:mod:`shim_common._http_exchange`); what one connection does, request after
request, and the limits it enforces are the rules of :mod:`shim_common._http_connection`.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

import trio

from shim_common._access import accept_tls
from shim_common._http_connection import Connection
from shim_common._http_exchange import (
    DEFAULT_LIMITS,
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
    json_headers,
)

__all__ = [
    "DEFAULT_LIMITS",
    "BodyTooLarge",
    "ClientDisconnected",
    "HTTPLimits",
    "HTTPRequest",
    "HTTPResponder",
    "Handler",
    "InvalidResponse",
    "MalformedRequest",
    "RequestTimeout",
    "error_body",
    "json_headers",
    "serve_connection",
    "serve_http",
    "serve_http_listeners",
]


async def serve_connection(
    stream: trio.abc.Stream,
    handler: Handler,
    *,
    limits: HTTPLimits = DEFAULT_LIMITS,
    on_error: Callable[[BaseException], None] | None = None,
    on_send_stall: Callable[[], None] | None = None,
) -> None:
    """Serve HTTP/1.1 on one connection until either side ends it; never raises ``Exception``.

    Args:
        stream: the connection (a socket stream, or a memory stream in tests).
        handler: called once per request.
        limits: the connection's bounds.
        on_error: called with each unexpected exception (a failing handler), e.g. to count it.
        on_send_stall: called when the connection is dropped because a write made no progress
            for ``limits.send_timeout`` (a client that stopped reading).
    """
    connection = Connection(stream, handler, limits, on_error, on_send_stall)
    try:
        await connection.run()
    except Exception as exc:
        # Whatever one connection does wrong stays with that connection.
        connection.report(exc)
    finally:
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
    """

    def tls_failed(exc: BaseException) -> None:
        if on_tls_failure is not None:
            on_tls_failure(exc)

    async def on_connection(stream: trio.SocketStream) -> None:
        served: trio.abc.Stream = stream
        if ssl_context is not None:
            tls = await accept_tls(stream, ssl_context, limits.header_timeout, tls_failed)
            if tls is None:
                return
            served = tls
        await serve_connection(
            served, handler, limits=limits, on_error=on_error, on_send_stall=on_send_stall
        )

    await trio.serve_listeners(on_connection, listeners)


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
    )
