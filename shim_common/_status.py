"""The status routes both processes serve: ``/metrics``, ``/health`` and ``/live``.

The worker serves them alone on its system port; the frontend serves them beside its API. Each
side says what its health is (a :class:`HealthReport`) and how to render its metrics; the HTTP
rules are the same on both:

- ``GET /metrics``: 200, the Prometheus exposition with the content type the renderer chose for
  the request's ``Accept`` header (so a scraper asking for OpenMetrics gets it).
- ``GET /health``: ``{"status": <status>, <details>...}``; 200 when the status is ``ready``, 503
  for any other (``starting``, ``draining``), and then the status is also the
  ``x-dynamo-reject-reason`` header, as on every other 503 of the frontend.
- ``GET /live``: 200 ``{"status": "live"}`` for as long as the process serves at all.
- ``HEAD`` is accepted wherever ``GET`` is (the server sends the head without the body).
  Another method on one of these paths is 405 with ``Allow: GET, HEAD``; a path that is not
  one of them is 404 (when :class:`StatusRoutes` is the whole handler); both in the OpenAI
  error shape.
- ``/health`` and ``/live`` carry ``Cache-Control: no-store``: a cached answer would hide the
  very change a probe looks for.
- A ``GET /live`` or ``GET /health`` needs no await: :meth:`StatusRoutes.answer_at_once` gives the
  same answer as the handler, for the server to send without a task hand-off.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from shim_common._client_text import no_such_endpoint, not_allowed
from shim_common._httpserver import (
    HTTPRequest,
    HTTPResponder,
    complete_response,
    error_body,
    json_headers,
)

__all__ = [
    "READY",
    "REJECT_REASON_HEADER",
    "STATUS_PATHS",
    "HealthReport",
    "RenderMetrics",
    "StatusRoutes",
    "render_registry",
]

#: The one health status answered 200.
READY: Final = "ready"
#: The header that says why a request got a 529 or a 503.
REJECT_REASON_HEADER: Final = b"x-dynamo-reject-reason"
#: The paths :class:`StatusRoutes` answers.
STATUS_PATHS: Final = frozenset({"/metrics", "/health", "/live"})

#: Returns the metrics body and its content type for an ``Accept`` header (``None``: absent),
#: or an awaitable of them (a renderer that formats a large exposition off the event loop).
RenderMetrics = Callable[[str | None], tuple[bytes, str] | Awaitable[tuple[bytes, str]]]

_LIVE_BODY: Final = b'{"status":"live"}'
_ALLOW: Final = (b"allow", b"GET, HEAD")
_NO_STORE: Final = (b"cache-control", b"no-store")
_json_encode = msgspec.json.Encoder().encode
# The whole answer to a GET /live, written once.
_LIVE_RESPONSE: Final = complete_response(200, json_headers(_NO_STORE), _LIVE_BODY)


@dataclasses.dataclass(frozen=True, slots=True)
class HealthReport:
    """What ``/health`` says.

    Attributes:
        status: ``ready`` (answered 200) or anything else (answered 503), e.g. ``draining``.
        details: further fields of the body, after ``status``.
    """

    status: str
    details: Mapping[str, object] = dataclasses.field(default_factory=dict)


def render_registry(registry: CollectorRegistry, accept_header: str | None) -> tuple[bytes, str]:
    """The exposition of ``registry`` in the format the ``Accept`` header asks for.

    Returns:
        The body and its content type (Prometheus text unless OpenMetrics is accepted).
    """
    encoder, content_type = choose_encoder(accept_header or "")
    return encoder(registry), content_type


class StatusRoutes:
    """The handler of the status paths (a :data:`~shim_common._httpserver.Handler`).

    Args:
        render_metrics: renders the metrics for an ``Accept`` header, e.g.
            ``functools.partial(render_registry, registry)``.
        health: returns the health as of now.
    """

    __slots__ = ("_health", "_render_metrics")

    def __init__(self, render_metrics: RenderMetrics, health: Callable[[], HealthReport]) -> None:
        self._render_metrics = render_metrics
        self._health = health

    def answer_at_once(self, request: HTTPRequest) -> bytes | None:
        """The whole answer to a ``GET /live`` or ``GET /health``, the same as the handler's (an
        :data:`~shim_common._httpserver.AnswerAtOnce`); ``None`` for any other request."""
        if request.method != "GET":
            return None
        if request.path == "/live":
            return _LIVE_RESPONSE
        if request.path == "/health":
            return complete_response(*self._health_answer())
        return None

    def _health_answer(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        report = self._health()
        body = _json_encode({"status": report.status, **report.details})
        if report.status == READY:
            return 200, json_headers(_NO_STORE), body
        reason = (REJECT_REASON_HEADER, report.status.encode("latin-1", "replace"))
        return 503, json_headers(_NO_STORE, reason), body

    async def __call__(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        """Answer one request; see the rules at the top of the module."""
        path = request.path
        if path not in STATUS_PATHS:
            await responder.send(404, json_headers(), error_body(no_such_endpoint(path), 404))
            return
        if request.method not in ("GET", "HEAD"):
            body = error_body(not_allowed(request.method, path), 405)
            await responder.send(405, json_headers(_ALLOW), body)
            return
        if path == "/live":
            await responder.send(200, json_headers(_NO_STORE), _LIVE_BODY)
        elif path == "/health":
            await responder.send(*self._health_answer())
        else:
            accept = request.header(b"accept")
            rendered = self._render_metrics(None if accept is None else accept.decode("latin-1"))
            if inspect.isawaitable(rendered):
                rendered = await rendered
            metrics, content_type = rendered
            await responder.send(200, [(b"content-type", content_type.encode("latin-1"))], metrics)
