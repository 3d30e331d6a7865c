"""The worker's HTTP system port: the status routes of :mod:`shim_common._status`, alone.

It runs on its own listener because the websocket server answers plain HTTP with a bare 400.
``/health`` says ``starting`` until the worker serves, then ``ready``, then ``draining``.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

import trio

from shim_common._httpserver import HTTPLimits, serve_http
from shim_common._status import HealthReport, RenderMetrics, StatusRoutes

__all__ = ["SYSTEM_LIMITS", "serve_system"]

# The system port never takes a request body; keep what a stray client can make it hold small.
SYSTEM_LIMITS = HTTPLimits(max_body_bytes=64 * 1024, keepalive_timeout=30.0)


async def serve_system(
    host: str,
    port: int,
    *,
    render_metrics: RenderMetrics,
    health: Callable[[], str],
    on_error: Callable[[BaseException], None] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    on_tls_failure: Callable[[BaseException], None] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the system port until cancelled.

    Args:
        host: the address to listen on.
        port: the port; ``0`` picks a free one.
        render_metrics: returns the metrics body and its content type for an ``Accept`` header
            (e.g. :func:`shim_common._status.render_registry` over the worker's registry).
        health: returns ``"starting"``, ``"ready"`` or ``"draining"``; anything but ``"ready"``
            makes ``/health`` answer 503.
        on_error: called with each unexpected exception, e.g. a failing metrics renderer.
        ssl_context: serve HTTPS with it; ``None``: plain HTTP.
        on_tls_failure: called for each failed or late TLS handshake.
        task_status: receives the bound port once listening (use with ``nursery.start``).

    Raises:
        OSError: the address could not be bound.
    """
    routes = StatusRoutes(render_metrics, lambda: HealthReport(health()))
    await serve_http(
        routes,
        host,
        port,
        limits=SYSTEM_LIMITS,
        on_error=on_error,
        ssl_context=ssl_context,
        on_tls_failure=on_tls_failure,
        answer_at_once=routes.answer_at_once,
        task_status=task_status,
    )
