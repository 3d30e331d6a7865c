"""The worker's HTTP system port: ``/metrics``, ``/health`` and ``/live``.

It runs on its own listener because the websocket server answers plain HTTP with a bare 400.
Routes, all answered with JSON unless stated:

- ``GET /metrics``: 200, the Prometheus exposition from ``render_metrics(accept_header)`` with the
  content type it returns (so a scraper asking for OpenMetrics gets it).
- ``GET /health``: 200 ``{"status": "ready"}`` while ``health()`` says ``ready``; otherwise 503 with
  the status it says (``starting`` or ``draining``).
- ``GET /live``: 200 ``{"status": "live"}`` for as long as the process serves at all.
- ``HEAD`` is accepted wherever ``GET`` is. An unknown path is 404, another method on a known
  path 405 with ``Allow``; both in the OpenAI error shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import trio

from shim_common._httpserver import (
    HTTPLimits,
    HTTPRequest,
    HTTPResponder,
    error_body,
    json_headers,
    serve_http,
)

__all__ = ["SYSTEM_LIMITS", "SystemRoutes", "serve_system"]

READY = "ready"

# The system port never takes a request body; keep what a stray client can make it hold small.
SYSTEM_LIMITS = HTTPLimits(max_body_bytes=64 * 1024, keepalive_timeout=30.0)

_LIVE_BODY = b'{"status":"live"}'
_ALLOW = (b"allow", b"GET, HEAD")
_NO_STORE = (b"cache-control", b"no-store")


class SystemRoutes:
    """The request handler of the system port (a callable for :func:`serve_http`).

    Args:
        render_metrics: returns the metrics body and its content type for an ``Accept`` header.
        health: returns ``"starting"``, ``"ready"`` or ``"draining"``.
    """

    def __init__(
        self,
        render_metrics: Callable[[str | None], tuple[bytes, str]],
        health: Callable[[], str],
    ) -> None:
        self._render_metrics = render_metrics
        self._health = health

    async def __call__(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        """Answer one request on the system port."""
        path = request.path
        if path not in ("/metrics", "/health", "/live"):
            body = error_body(f"no route for {path}", 404)
            await responder.send(404, json_headers(), body)
            return
        if request.method not in ("GET", "HEAD"):
            body = error_body(f"method {request.method} not allowed on {path}", 405)
            await responder.send(405, json_headers(_ALLOW), body)
            return
        if path == "/live":
            await responder.send(200, json_headers(_NO_STORE), _LIVE_BODY)
        elif path == "/health":
            status = self._health()
            body = json.dumps({"status": status}, separators=(",", ":")).encode()
            code = 200 if status == READY else 503
            await responder.send(code, json_headers(_NO_STORE), body)
        else:
            accept = request.header(b"accept")
            metrics, content_type = self._render_metrics(
                None if accept is None else accept.decode("latin-1")
            )
            headers = [(b"content-type", content_type.encode("latin-1"))]
            await responder.send(200, headers, metrics)


async def serve_system(
    host: str,
    port: int,
    *,
    render_metrics: Callable[[str | None], tuple[bytes, str]],
    health: Callable[[], str],
    on_error: Callable[[BaseException], None] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the system port until cancelled.

    Args:
        host: the address to listen on.
        port: the port; ``0`` picks a free one.
        render_metrics: returns the metrics body and its content type for an ``Accept`` header
            (e.g. ``prometheus_client.exposition.choose_encoder`` over the component's registry).
        health: returns ``"starting"``, ``"ready"`` or ``"draining"``; anything but ``"ready"``
            makes ``/health`` answer 503.
        on_error: called with each unexpected exception, e.g. a failing metrics renderer.
        task_status: receives the bound port once listening (use with ``nursery.start``).

    Raises:
        OSError: the address could not be bound.
    """
    routes = SystemRoutes(render_metrics, health)
    await serve_http(
        routes,
        host,
        port,
        limits=SYSTEM_LIMITS,
        on_error=on_error,
        task_status=task_status,
    )
