"""The frontend's HTTP handler: routes every request, and runs completions.

Routes: the OpenAI API here (completions, embeddings, ``/v1/models``); ``/busy_threshold`` in
:mod:`frontend_shim._admin`; ``/metrics``, ``/health`` and ``/live`` in
:mod:`shim_common._status`. How the answer of a started request is shaped is in
:mod:`frontend_shim._responses`, what it is counted as in :mod:`frontend_shim._accounting`, and
what is read of its body in :mod:`frontend_shim._request_body`.

Life of a completion request (``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``):

1. Fast shed: when every known model is busy and no worker is held back by an overload mark
   alone (O(1) on the load state: a marked worker that is not busy may still take a better
   class, and the class may be in the body), answer the overload status from the request head,
   before the body is read: no JSON parse, and the server drops
   a small body unread and keeps the connection (a large one closes it). The answer cannot
   depend on the body, so under a fully busy fleet a request for an unknown model or with a
   malformed body also gets the overload answer instead of its 404 or 400. With
   ``--busy-exempt-priority P`` only a request whose ``x-dynamo-priority`` header says it is
   worse than P is shed here (without the header, its body may make it exempt).
2. Read the body (413 over the cap), parse it once within the bounds of
   :mod:`frontend_shim._request_body` (413 past its value bound, 400 when malformed, too deep or
   out of range), check the few fields the frontend itself needs (``model``, ``stream``, ``n``,
   the number of embedding inputs) and its admission class (:mod:`frontend_shim._request_class`:
   priority and tenant, 400 naming the header or field). Every refusal is counted by status.
3. Frontend queue (``--router-queue-threshold``): park while every free worker is saturated
   (:mod:`frontend_shim._waiting`); a busy-exempt request does not park.
4. Route (:class:`~frontend_shim._router.Router`): 529 all busy, 503 no worker, 404 unknown model.
   A busy-exempt request that finds no free worker goes to the least loaded unmarked one.
   With no free (or, exempt, unmarked) worker, a request may still go to a marked worker whose
   mark its class beats (rule 5 of :mod:`frontend_shim._router`): a better priority, or the
   same priority and another tenant, may displace a waiting request there. A refusal marks the
   worker for the refused request's class.
   Every 529 and 503 says why in ``x-dynamo-reject-reason`` (``busy``, ``marked``,
   ``no_workers``, ``draining``, or the worker's ``queue_full``, ``displaced``,
   ``queue_timeout``, ``slo``, and ``other`` for a refusal whose text has neither prefix),
   counted in ``dynamo_frontend_rejection_by_reason_total``.
5. Send to the worker and wait for its first answer. ``Rejected`` (its text read once, into a
   :class:`~shim_common.wire.RejectReason`) marks the worker and, within ``--migration-limit``,
   tries another free worker; otherwise 529 (``Server overloaded:``) or 503 (``Server
   unavailable:``, or ``other``: not retried). ``Failed(unavailable)`` before the start (the
   worker is going away) is handled as a ``Server unavailable:`` refusal; any other ``Failed``
   before the start is a 400 (bad input) or a 5xx.
6. ``Started``: only now may a status line go out. Streaming requests get SSE chunks and end with
   ``data: [DONE]``; a failure after the start ends the stream with an ``event: error`` and no
   ``[DONE]``. Other requests get one JSON body when the worker ends the request. Either way the
   head carries ``x-dynamo-queue-wait-ms`` (the wait the worker reported in ``Started``).

A client that disconnects cancels the handler (the HTTP server watches for EOF); leaving the
worker request's context then sends ``Cancel``, which frees the slot or queue place at once.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

import msgspec
import trio

from frontend_shim._accounting import Exchange
from frontend_shim._admin import AdminRoutes
from frontend_shim._dispatch import Action, Answer, Dispatch, Fail, Pick, Send, Serve
from frontend_shim._host_client import RemotePicture
from frontend_shim._links import WorkerLink
from frontend_shim._loop_guard import LoopGuard
from frontend_shim._metrics import UNKNOWN_MODEL_LABEL, FrontendMetrics
from frontend_shim._picture import LocalPicture, NoRoute, PickQuery, Ticket
from frontend_shim._request_body import BadRequest, parse_completion_body
from frontend_shim._request_class import (
    OPEN_POLICY,
    ClassPolicy,
    header_priority,
    request_class,
)
from frontend_shim._responses import (
    REJECT_REASON_HEADER,
    overload_body,
    send_failure,
    send_unavailable,
    serve_started,
)
from frontend_shim._retry_advice import RetryAdvice
from frontend_shim._router import CompletionRate, RejectionKind
from frontend_shim._waiting import WaitingRoom
from shim_common import wire
from shim_common._client_text import no_such_endpoint, not_allowed, shorten
from shim_common._httpserver import (
    BodyTooLarge,
    HTTPRequest,
    HTTPResponder,
    complete_response,
    error_body,
    json_headers,
)
from shim_common._status import READY, STATUS_PATHS, HealthReport, RenderMetrics, StatusRoutes

__all__ = ["FleetView", "FrontendAPI", "WorkerLinks"]

_ENDPOINTS: Final[dict[str, wire.Endpoint]] = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
_json_encode = msgspec.json.Encoder().encode
#: The reason of a request shed because this process's own loop is behind.
_FRONTEND_OVERLOADED: Final = "frontend_overloaded"


class WorkerLinks(Protocol):
    """Where the link of a routed worker is found (a ``FleetBridge``)."""

    def link_of(self, worker_id: str) -> WorkerLink | None:
        """The link of a registered worker, or ``None`` (it went away)."""
        ...


def _is_retry(request: HTTPRequest) -> bool:
    """Whether the client says this is a retry (``x-stainless-retry-count`` above 0, as
    OpenAI's SDKs send it): frontend_shim._retry_advice, rule 3."""
    count = request.header(b"x-stainless-retry-count")
    return count is not None and count.strip() not in (b"", b"0")


class FleetView(Protocol):
    """What the API reads of the fleet without a pick: a :class:`~frontend_shim._load.Fleet`,
    or in an HTTP process of several, the host's word on it
    (:class:`~frontend_shim._host_client.HostView`)."""

    def may_shed_unread(self, now: float) -> bool:
        """No model has a free worker, and no mark alone holds one back (the fast shed)."""
        ...

    def every_worker_marked(self, model: str | None = None) -> bool:
        """Every available worker (of ``model``) is marked overloaded."""
        ...

    def is_known_model(self, model: str) -> bool:
        """Some worker announced ``model``."""
        ...

    def models(self) -> list[str]:
        """The models known."""
        ...

    def available_count(self, model: str, now: float) -> int:
        """Workers of ``model`` that may be routed to (busy or marked included)."""
        ...

    @property
    def connected_count(self) -> int:
        """Workers connected."""
        ...

    def slot_share(self) -> float:
        """The fleet's effective limits over what it runs (``Retry-After``)."""
        ...


class FrontendAPI:
    """The request handler of the frontend's HTTP server.

    Args:
        overload_status: the status of an overload answer (529 unless configured).
        fleet: what the API reads of the fleet without a pick.
        picture: where picks come from: this process's own
            (:class:`~frontend_shim._picture.LocalPicture`), or its host's
            (:class:`~frontend_shim._host_client.RemotePicture`).
        migration_limit: times a refused request may be tried on another worker.
        links: the link of each routed worker.
        admin: the ``/busy_threshold`` handlers.
        waiting: where requests park with ``--router-queue-threshold`` (``None``: they park
            at the picture, a host's).
        metrics: where requests are counted.
        render_metrics: renders ``/metrics`` (default: this process's registry).
        busy_exempt_priority: requests of this priority or better are not shed by the busy
            thresholds (``--busy-exempt-priority``); ``None``: every request may be.
        class_policy: who may claim which class (``--max-client-priority``,
            ``DYN_GATEWAY_TOKEN``); the default takes every claim as it is.
        guard: what sheds when this process's own loop falls behind (judged from a request's
            head, in :meth:`answer_at_once`); ``None``: nothing does.
    """

    def __init__(
        self,
        *,
        overload_status: int,
        fleet: FleetView,
        picture: LocalPicture | RemotePicture,
        migration_limit: int,
        links: WorkerLinks,
        admin: AdminRoutes,
        waiting: WaitingRoom | None,
        metrics: FrontendMetrics,
        render_metrics: RenderMetrics | None = None,
        busy_exempt_priority: int | None = None,
        class_policy: ClassPolicy = OPEN_POLICY,
        guard: LoopGuard | None = None,
    ) -> None:
        self._fleet = fleet
        self._guard = guard
        self._links = links
        self._waiting = waiting
        self._metrics = metrics
        self._overload_status = overload_status
        self._overload_body = overload_body(overload_status)
        self._busy_exempt = busy_exempt_priority
        self._class_policy = class_policy
        self._picture = picture
        self._migration_limit = migration_limit
        self._completions = CompletionRate()
        self._retries = RetryAdvice()
        self._in_flight = 0
        # Of those, the requests still uploading their body: the fleet holds nothing of them,
        # so Retry-After leaves them out (a thousand slow uploads must not tell every shed
        # client to wait 30 s).
        self._uploading = 0
        #: Set by :meth:`begin_drain`; then set again each time the last request ends.
        self._draining = False
        self._idle = trio.Event()
        self._status = StatusRoutes(render_metrics or metrics.render_off_loop, self._health)
        self._routes: dict[tuple[str, str], Callable[[HTTPRequest, HTTPResponder], Awaitable[None]]]
        self._routes = {
            ("GET", "/v1/models"): self._models,
            ("GET", "/busy_threshold"): admin.get,
            ("POST", "/busy_threshold"): admin.post,
        }

    # ------------------------------------------------------------------ dispatch

    async def handle(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        """Answer one HTTP request (the :data:`~shim_common._httpserver.Handler`)."""
        endpoint = _ENDPOINTS.get(request.path)
        try:
            if endpoint is not None:
                if request.method != "POST":
                    self._metrics.count_request(UNKNOWN_MODEL_LABEL, endpoint, 405)
                    raise BadRequest(405, not_allowed(request.method, request.path), allow="POST")
                await self._completion(request, responder, endpoint)
                return
            if request.path in STATUS_PATHS:
                await self._status(request, responder)
                return
            route = self._routes.get((request.method, request.path))
            if route is None:
                allowed = [method for method, path in self._routes if path == request.path]
                if allowed:
                    message = not_allowed(request.method, request.path)
                    raise BadRequest(405, message, allow=", ".join(allowed))
                raise BadRequest(404, no_such_endpoint(request.path))
            await route(request, responder)
        except BadRequest as exc:
            if responder.started:
                raise
            body = (
                _json_encode({"error": str(exc)})
                if exc.admin
                else error_body(str(exc), exc.status)
            )
            headers = json_headers()
            if exc.allow is not None:
                headers.append((b"allow", exc.allow.encode("ascii")))
            await responder.send(exc.status, headers, body)

    def answer_at_once(self, request: HTTPRequest) -> bytes | None:
        """The whole answer to a request that needs neither its body nor an await, the same as
        :meth:`handle` gives (an :data:`~shim_common._httpserver.AnswerAtOnce`): ``GET /live``
        and ``/health``, and a completion shed before its body is read; ``None`` for the rest.
        """
        endpoint = _ENDPOINTS.get(request.path)
        if endpoint is None:
            return self._status.answer_at_once(request) if request.path in STATUS_PATHS else None
        if request.method != "POST" or self._draining:
            return None
        arrival = trio.current_time()
        guard = self._guard
        if guard is not None and not guard.admit(arrival):
            # This process's own loop is behind (frontend_shim._loop_guard): shed at the head.
            exchange = Exchange(endpoint, self._shed_label(), arrival)
            try:
                headers = self._overloaded(exchange, _FRONTEND_OVERLOADED)
                return complete_response(self._overload_status, headers, self._overload_body)
            finally:
                self._count(exchange)
        if not self._fleet.may_shed_unread(arrival) or self._may_be_exempt(request):
            return None
        exchange = Exchange(endpoint, self._shed_label(), arrival)
        try:
            reason = "marked" if self._fleet.every_worker_marked() else "busy"
            return complete_response(
                self._overload_status, self._overloaded(exchange, reason), self._overload_body
            )
        finally:
            self._count(exchange)

    def begin_drain(self) -> None:
        """Stop taking completions (503, ``Connection: close``); requests in flight go on.

        Parked requests are released at once: each is routed now or answered.
        """
        self._draining = True
        if self._waiting is not None:
            self._waiting.release_all()
        if self._in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no completion is in flight (meant for after :meth:`begin_drain`)."""
        while self._in_flight:
            await self._idle.wait()
            self._idle = trio.Event()

    # ------------------------------------------------------------------ completions

    async def _completion(
        self, request: HTTPRequest, responder: HTTPResponder, endpoint: wire.Endpoint
    ) -> None:
        arrival = trio.current_time()
        if self._draining:
            exchange = Exchange(endpoint, self._shed_label(), arrival)
            try:
                await self._send_unavailable(responder, exchange, "draining", close=True)
            finally:
                self._count(exchange)
            return
        if self._fleet.may_shed_unread(arrival) and not self._may_be_exempt(request):
            # Fast shed: nothing is free for any model and no mark alone holds a worker back
            # (a better class could pass that), so the body cannot change the answer.
            exchange = Exchange(endpoint, self._shed_label(), arrival)
            try:
                reason = "marked" if self._fleet.every_worker_marked() else "busy"
                await self._send_overloaded(responder, exchange, reason)
            finally:
                self._count(exchange)
            return
        # Counted from here, before the body is read: a drain must wait for a request that is
        # still uploading its prompt, not cut it off.
        self._in_flight += 1
        try:
            try:
                self._uploading += 1
                try:
                    raw = await request.read_body()
                finally:
                    self._uploading -= 1
                body = parse_completion_body(raw, endpoint)
                priority, tenant = request_class(request.headers, body, self._class_policy)
            except BadRequest as exc:
                self._metrics.count_request(UNKNOWN_MODEL_LABEL, endpoint, exc.status)
                raise
            except BodyTooLarge:
                self._metrics.count_request(UNKNOWN_MODEL_LABEL, endpoint, 413)
                raise
            model: str = body["model"]
            label = model if self._fleet.is_known_model(model) else UNKNOWN_MODEL_LABEL
            exchange = Exchange(endpoint, label, arrival)
            inflight = self._metrics.inflight(label)
            inflight.inc()
            try:
                retry = _is_retry(request)
                await self._route(responder, exchange, model, body, priority, tenant, retry)
            finally:
                inflight.dec()
                self._count(exchange)
        finally:
            self._in_flight -= 1
            if self._waiting is not None:
                self._waiting.release()
            if self._in_flight == 0:
                self._idle.set()

    def _may_be_exempt(self, request: HTTPRequest) -> bool:
        # Whether a request may be busy-exempt, judged from its head: without the header its
        # body decides, so it is read; a malformed header is answered 400 after the read.
        if self._busy_exempt is None:
            return False
        floor = self._class_policy.priority_floor(request.headers)
        if floor is not None and floor > self._busy_exempt:
            return False  # it may not claim a priority that exempts it
        try:
            priority = header_priority(request.headers, self._class_policy)
        except BadRequest:
            return True
        return priority is None or priority <= self._busy_exempt

    def _shed_label(self) -> str:
        models = self._fleet.models()
        return models[0] if len(models) == 1 else UNKNOWN_MODEL_LABEL

    async def _route(
        self,
        responder: HTTPResponder,
        exchange: Exchange,
        model: str,
        body: dict[str, Any],
        priority: int,
        tenant: str,
        retry: bool = False,
    ) -> None:
        exempt = self._busy_exempt is not None and priority <= self._busy_exempt
        waiting = self._waiting
        if (
            not exempt
            and waiting is not None
            and waiting.should_park(model, trio.current_time())
            and not await waiting.wait(model)
        ):
            await self._send_overloaded(responder, exchange, "busy")
            return
        picture = self._picture
        query = PickQuery(model, priority, tenant, exempt, picture.prompt(exchange.endpoint, body))
        query.retry = retry
        dispatch = Dispatch(query, self._migration_limit, exchange, self._metrics)
        try:
            action: Action | None = dispatch.start()
            while action is not None:
                if isinstance(action, Pick):
                    if isinstance(picture, LocalPicture):
                        pick: Ticket | NoRoute = picture.pick(action.query, trio.current_time())
                    else:
                        pick = await picture.pick(action.query)
                    action = dispatch.picked(pick, trio.current_time())
                elif isinstance(action, Send):
                    action = await self._send(responder, exchange, body, dispatch, action)
                elif isinstance(action, Answer):
                    await self._answer(responder, exchange, model, action)
                    return
                else:
                    raise AssertionError(f"unexpected action {action!r}")
        finally:
            dispatch.close(trio.current_time())

    async def _send(
        self,
        responder: HTTPResponder,
        exchange: Exchange,
        body: dict[str, Any],
        dispatch: Dispatch,
        send: Send,
    ) -> Action | None:
        # One request on one worker: what to do next (a pick or an answer), or ``None`` once it
        # is answered from the worker's replies.
        link = self._links.link_of(send.worker_id)
        if link is None:  # the worker went away between the pick and now
            return dispatch.unreachable(trio.current_time())
        query = dispatch.query
        request = link.request(
            exchange.endpoint, body, query.priority, query.tenant, send.dp_rank, exchange.arrival
        )
        async with request as stream:
            first = await stream.first()
            action = dispatch.first(first, trio.current_time())
            if isinstance(action, Serve):
                try:
                    await serve_started(
                        responder, exchange.endpoint, stream, body, dispatch, action.queue_wait_ms
                    )
                finally:
                    dispatch.close(trio.current_time())
                    self._completions.record(trio.current_time())
                    self._retries.completed()
                return None
            if isinstance(action, Fail):
                await send_failure(responder, exchange, action.failed)
                return None
            # The events the worker sent before it refused are applied already: the link
            # applies them before it hands a refusal over (frontend_shim._links, rule 6).
            return action

    async def _answer(
        self, responder: HTTPResponder, exchange: Exchange, model: str, answer: Answer
    ) -> None:
        if answer.kind is None:
            exchange.status = 404
            message = f"The model `{shorten(model)}` does not exist."
            await responder.send(404, json_headers(), error_body(message, 404))
        elif answer.kind is RejectionKind.OVERLOADED:
            await self._send_overloaded(responder, exchange, answer.reason)
        else:
            await self._send_unavailable(responder, exchange, answer.reason)

    async def _send_overloaded(
        self, responder: HTTPResponder, exchange: Exchange, reason: str
    ) -> None:
        headers = self._overloaded(exchange, reason)
        await responder.send(self._overload_status, headers, self._overload_body)

    def _overloaded(self, exchange: Exchange, reason: str) -> list[tuple[bytes, bytes]]:
        # Counts the refusal; the headers of its answer.
        exchange.status = self._overload_status
        self._metrics.count_rejection(exchange.label, exchange.endpoint)
        self._metrics.count_rejection_reason(exchange.label, reason)
        advice = self._retries.advise(
            self._in_flight - self._uploading,
            self._completions.rate(trio.current_time()),
            self._fleet.slot_share(),
        )
        return json_headers(
            (b"retry-after", b"%d" % advice.retry_after_s),
            (b"retry-after-ms", b"%d" % advice.retry_after_ms),
            (b"x-should-retry", b"true" if advice.should_retry else b"false"),
            (REJECT_REASON_HEADER, reason.encode()),
        )

    async def _send_unavailable(
        self, responder: HTTPResponder, exchange: Exchange, reason: str, *, close: bool = False
    ) -> None:
        self._metrics.count_rejection_reason(exchange.label, reason)
        await send_unavailable(responder, exchange, reason, close=close)

    def _count(self, exchange: Exchange) -> None:
        self._metrics.count_request(exchange.label, exchange.endpoint, exchange.status)

    # ------------------------------------------------------------------ other endpoints

    async def _models(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        now = int(time.time())
        data = [
            {"id": model, "object": "model", "created": now, "owned_by": "dynamo-shim"}
            for model in self._fleet.models()
            if self._fleet.available_count(model, trio.current_time()) > 0
        ]
        await responder.send(200, json_headers(), _json_encode({"object": "list", "data": data}))

    def _health(self) -> HealthReport:
        details = {"workers_connected": self._fleet.connected_count, "models": self._fleet.models()}
        return HealthReport("draining" if self._draining else READY, details)
