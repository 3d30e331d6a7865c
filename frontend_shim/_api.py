"""The frontend's HTTP endpoints: the OpenAI API, ``/busy_threshold``, metrics and health.

Life of a completion request (``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``):

1. Fast shed: when every known model is busy (O(1) on the load state), answer the overload
   status from the request head, before the body is read: no JSON parse, and the server drops
   a small body unread and keeps the connection (a large one closes it). The answer cannot
   depend on the body, so under a fully busy fleet a request for an unknown model or with a
   malformed body also gets the overload answer instead of its 404 or 400.
2. Read the body (413 over the cap), parse it once with msgspec (400 when malformed), check the
   few fields the frontend itself needs (``model``, ``stream``).
3. Frontend queue (``--router-queue-threshold``): park while every free worker is saturated.
4. Route (:class:`~frontend_shim._router.Router`): 529 all busy, 503 no worker, 404 unknown model.
5. Send to the worker and wait for its first answer. ``Rejected`` marks the worker and, within
   ``--migration-limit``, tries another free worker; otherwise 529 (``Server overloaded:``) or 503
   (``Server unavailable:``). ``Failed`` before the start is a 400 (bad input) or a 5xx.
6. ``Started``: only now may a status line go out. Streaming requests get SSE chunks and end with
   ``data: [DONE]``; a failure after the start ends the stream with an ``event: error`` and no
   ``[DONE]``. Other requests get one JSON body when the worker ends the request.

A client that disconnects cancels the handler (the HTTP server watches for EOF); leaving the
worker request's context then sends ``Cancel``, which frees the slot or queue place at once.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

import msgspec
import trio

from frontend_shim._config import FrontendSettings
from frontend_shim._free_sets import InFlight
from frontend_shim._load import Fleet
from frontend_shim._metrics import UNKNOWN_MODEL_LABEL, FrontendMetrics
from frontend_shim._router import (
    AllBusy,
    CompletionRate,
    FrontendQueue,
    NoWorkers,
    RejectionKind,
    Router,
    UnknownModel,
    classify_rejection,
    retry_after_seconds,
)
from frontend_shim._thresholds import ThresholdError, Thresholds
from frontend_shim._workers import RequestStream, WorkerKey, WorkerPool
from shim_common import wire
from shim_common._httpserver import (
    BodyTooLarge,
    HTTPRequest,
    HTTPResponder,
    error_body,
    json_headers,
)
from shim_common._status import READY, STATUS_PATHS, HealthReport, StatusRoutes

__all__ = ["FrontendAPI", "overload_body", "UNAVAILABLE_BODY"]

_log = logging.getLogger(__name__)

UNAVAILABLE_BODY: Final = (
    b'{"message":"Service temporarily unavailable","type":"Service Unavailable","code":503}'
)
_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]
_DONE: Final = b"data: [DONE]\n\n"
#: Status counted for a request whose client left before an answer (nginx's convention).
CLIENT_CLOSED: Final = 499

_ENDPOINTS: Final[dict[str, wire.Endpoint]] = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
_THRESHOLD_FIELDS: Final = (
    "active_decode_blocks_threshold",
    "active_prefill_tokens_threshold",
    "active_prefill_tokens_threshold_frac",
)
_json_encode = msgspec.json.Encoder().encode


def overload_body(status: int) -> bytes:
    """The overload answer's body, byte for byte; ``code`` follows the configured status."""
    return b'{"message":"Service temporarily overloaded","type":"Overloaded","code":%d}' % status


class WorkerDirectory(Protocol):
    """Where a routed worker id is found among the links (the app's ``FleetBridge``)."""

    def key_of(self, worker_id: str) -> WorkerKey | None:
        """The link address of a registered worker, or ``None``."""
        ...


class BadRequest(Exception):
    """Client input the frontend refuses; ``status`` is 400, 404, 413 or 422."""

    def __init__(
        self, status: int, message: str, *, admin: bool = False, allow: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        #: The admin API answers ``{"error": "..."}``, the OpenAI API its nested error object.
        self.admin = admin
        #: The ``Allow`` header of a 405: the methods the path accepts.
        self.allow = allow


class _Exchange:
    """Book-keeping of one completion request for metrics."""

    __slots__ = ("arrival", "endpoint", "label", "status")

    def __init__(self, endpoint: wire.Endpoint, label: str, arrival: float) -> None:
        self.endpoint = endpoint
        self.label = label
        self.arrival = arrival
        self.status = CLIENT_CLOSED


class _Progress:
    """Book-keeping of a started request as its output arrives: TTFT, the router's own count
    of what the worker holds (:meth:`Fleet.request_output`), duration, and the final release.
    """

    __slots__ = ("_charge", "_fleet", "_metrics", "_waiting_first", "exchange", "worker_id")

    def __init__(
        self,
        fleet: Fleet,
        metrics: FrontendMetrics,
        exchange: _Exchange,
        worker_id: str,
        charge: InFlight | None,
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self.exchange = exchange
        self.worker_id = worker_id
        self._charge = charge
        self._waiting_first = True

    def chunk(self, reply: wire.Chunk) -> bool:
        """Account for one chunk; return whether it was the first."""
        first = self._waiting_first
        if first:
            self._waiting_first = False
            self._metrics.observe_ttft(
                self.exchange.label, trio.current_time() - self.exchange.arrival
            )
        if self._charge is not None and reply.tokens:
            self._fleet.request_output(self.worker_id, self._charge, reply.tokens)
        return first

    def completed(self) -> None:
        """The response went out in full."""
        self._metrics.observe_duration(
            self.exchange.label, trio.current_time() - self.exchange.arrival
        )

    def finished(self) -> None:
        """The request is over, however it ended: drop the router's charge."""
        if self._charge is not None:
            self._fleet.request_finished(self.worker_id, self._charge)


class FrontendAPI:
    """The request handler of the frontend's HTTP server.

    Args:
        settings: the frontend settings.
        fleet: the load state.
        router: picks workers over the fleet.
        pool: the links to the workers.
        bridge: maps worker ids to link addresses.
        metrics: where requests are counted.
    """

    def __init__(
        self,
        *,
        settings: FrontendSettings,
        fleet: Fleet,
        router: Router,
        pool: WorkerPool,
        bridge: WorkerDirectory,
        metrics: FrontendMetrics,
    ) -> None:
        self._settings = settings
        self._fleet = fleet
        self._router = router
        self._pool = pool
        self._bridge = bridge
        self._metrics = metrics
        self._overload_status = settings.overload_status
        self._overload_body = overload_body(settings.overload_status)
        self._completions = CompletionRate()
        self._in_flight = 0
        #: Set by :meth:`begin_drain`; then set again each time the last request ends.
        self._draining = False
        self._idle = trio.Event()
        self._queue: FrontendQueue[trio.Event] | None = (
            FrontendQueue(settings.router_queue_capacity)
            if settings.router_queue_threshold is not None
            else None
        )
        self._routes: dict[tuple[str, str], Callable[[HTTPRequest, HTTPResponder], Awaitable[None]]]
        self._status = StatusRoutes(metrics.render, self._health)
        self._routes = {
            ("GET", "/v1/models"): self._models,
            ("GET", "/busy_threshold"): self._get_thresholds,
            ("POST", "/busy_threshold"): self._post_thresholds,
        }

    # ------------------------------------------------------------------ dispatch

    async def handle(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        """Answer one HTTP request (the :data:`~shim_common._httpserver.Handler`)."""
        endpoint = _ENDPOINTS.get(request.path)
        try:
            if endpoint is not None:
                if request.method != "POST":
                    raise BadRequest(405, f"{request.path} accepts POST only", allow="POST")
                await self._completion(request, responder, endpoint)
                return
            if request.path in STATUS_PATHS:
                await self._status(request, responder)
                return
            route = self._routes.get((request.method, request.path))
            if route is None:
                allowed = [method for method, path in self._routes if path == request.path]
                if allowed:
                    message = f"{request.method} is not allowed on {request.path}"
                    raise BadRequest(405, message, allow=", ".join(allowed))
                raise BadRequest(404, f"no such endpoint: {request.path}")
            await route(request, responder)
        except BadRequest as exc:
            if responder.started:
                raise
            body = (
                _json_encode({"error": str(exc)})
                if exc.admin
                else error_body(str(exc), exc.status, _error_type(exc.status))
            )
            headers = json_headers()
            if exc.allow is not None:
                headers.append((b"allow", exc.allow.encode("ascii")))
            await responder.send(exc.status, headers, body)

    def begin_drain(self) -> None:
        """Stop taking completions (503, ``Connection: close``); requests in flight go on.

        Parked requests are released at once: each is routed now or answered.
        """
        self._draining = True
        if self._queue is not None:
            for model in self._queue.models_waiting():
                for waiter in self._queue.pop(model, self._queue.waiting(model)):
                    waiter.set()
        if self._in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no completion is in flight (meant for after :meth:`begin_drain`)."""
        while self._in_flight:
            await self._idle.wait()
            self._idle = trio.Event()

    def on_fleet_change(self) -> None:
        """Release parked requests that may go on (called after events and request ends)."""
        if self._queue is not None and len(self._queue):
            for waiter in self._queue.release(self._fleet, trio.current_time()):
                waiter.set()

    # ------------------------------------------------------------------ completions

    async def _completion(
        self, request: HTTPRequest, responder: HTTPResponder, endpoint: wire.Endpoint
    ) -> None:
        arrival = trio.current_time()
        if self._draining:
            exchange = _Exchange(endpoint, self._shed_label(), arrival)
            try:
                await self._send_unavailable(responder, exchange, close=True)
            finally:
                self._count(exchange)
            return
        if self._fleet.all_models_busy(arrival):
            # Fast shed: nothing is free for any model, so the body cannot change the answer.
            exchange = _Exchange(endpoint, self._shed_label(), arrival)
            try:
                await self._send_overloaded(responder, exchange)
            finally:
                self._count(exchange)
            return
        # Counted from here, before the body is read: a drain must wait for a request that is
        # still uploading its prompt, not cut it off.
        self._in_flight += 1
        try:
            try:
                body = _parse_body(await request.read_body(), endpoint)
            except BadRequest as exc:
                self._metrics.count_request(UNKNOWN_MODEL_LABEL, endpoint, exc.status)
                raise
            except BodyTooLarge:
                self._metrics.count_request(UNKNOWN_MODEL_LABEL, endpoint, 413)
                raise
            model: str = body["model"]
            label = model if self._fleet.is_known_model(model) else UNKNOWN_MODEL_LABEL
            exchange = _Exchange(endpoint, label, arrival)
            inflight = self._metrics.inflight(label)
            inflight.inc()
            try:
                await self._route(responder, exchange, model, body)
            finally:
                inflight.dec()
                self._count(exchange)
        finally:
            self._in_flight -= 1
            self.on_fleet_change()
            if self._in_flight == 0:
                self._idle.set()

    def _shed_label(self) -> str:
        models = self._fleet.models()
        return models[0] if len(models) == 1 else UNKNOWN_MODEL_LABEL

    async def _route(
        self, responder: HTTPResponder, exchange: _Exchange, model: str, body: dict[str, Any]
    ) -> None:
        parks = self._queue is not None and self._queue.should_park(
            self._fleet, model, trio.current_time()
        )
        if parks and not await self._wait_in_queue(model):
            await self._send_overloaded(responder, exchange)
            return
        attempt = self._router.new_attempt()
        while True:
            now = trio.current_time()
            outcome = self._router.pick(model, now, exclude=attempt.rejected_by)
            if isinstance(outcome, AllBusy):
                await self._send_overloaded(responder, exchange)
                return
            if isinstance(outcome, NoWorkers):
                await self._send_unavailable(responder, exchange)
                return
            if isinstance(outcome, UnknownModel):
                exchange.status = 404
                message = f"The model `{model}` does not exist."
                await responder.send(404, json_headers(), error_body(message, 404))
                return
            worker_id = outcome.worker_id
            key = self._bridge.key_of(worker_id)
            link = self._pool.link(key) if key is not None else None
            if link is None:  # the worker went away between the event and this pick
                if attempt.on_rejected(self._router, worker_id, wire.REASON_DRAINING, now):
                    continue
                await self._send_unavailable(responder, exchange)
                return
            async with link.request(exchange.endpoint, body) as stream:
                first = await stream.first()
                if isinstance(first, wire.Started):
                    await self._serve(responder, exchange, stream, worker_id, first, body)
                    return
                if isinstance(first, wire.Rejected):
                    reason = first.reason
                elif first.kind == "unavailable":
                    reason = f"Server unavailable: {first.message}"
                else:
                    await self._send_failure(responder, exchange, first)
                    return
            if attempt.on_rejected(self._router, worker_id, reason, trio.current_time()):
                continue
            if classify_rejection(reason) is RejectionKind.OVERLOADED:
                await self._send_overloaded(responder, exchange)
            else:
                await self._send_unavailable(responder, exchange)
            return

    async def _wait_in_queue(self, model: str) -> bool:
        assert self._queue is not None
        waiter = trio.Event()
        if not self._queue.park(model, waiter):
            return False
        try:
            await waiter.wait()
        finally:
            if not waiter.is_set():
                self._queue.cancel(model, waiter)
        return True

    async def _serve(
        self,
        responder: HTTPResponder,
        exchange: _Exchange,
        stream: RequestStream,
        worker_id: str,
        started: wire.Started,
        body: dict[str, Any],
    ) -> None:
        progress = _Progress(
            self._fleet,
            self._metrics,
            exchange,
            worker_id,
            self._fleet.request_sent(worker_id, started.prompt_tokens),
        )
        try:
            if exchange.endpoint == "embeddings":
                await self._serve_embeddings(responder, progress, stream, body)
            elif body.get("stream") is True:
                await self._serve_stream(responder, progress, stream, body)
            else:
                await self._serve_whole(responder, progress, stream, body)
        finally:
            progress.finished()
            self._completions.record(trio.current_time())

    async def _serve_stream(
        self,
        responder: HTTPResponder,
        progress: _Progress,
        stream: RequestStream,
        body: dict[str, Any],
    ) -> None:
        exchange = progress.exchange
        shape = _ResponseShape(exchange.endpoint, body)
        exchange.status = 200
        await responder.start_stream(200, list(_SSE_HEADERS))
        async for reply in stream:
            if isinstance(reply, wire.Chunk):
                first = progress.chunk(reply)
                await responder.send_chunk(_sse(shape.chunk(reply, first)))
            elif isinstance(reply, wire.End):
                tail = b""
                if shape.include_usage:
                    tail = _sse(shape.usage_chunk(reply))
                await responder.send_chunk(tail + _DONE)
                await responder.end_stream()
                progress.completed()
                return
            else:
                _log.warning("request failed after it started: %s", reply.message)
                # The head said 200, but for the counters this request failed.
                exchange.status = 500
                error = {"error": {"message": reply.message, "type": reply.kind, "code": 500}}
                await responder.send_chunk(b"event: error\ndata: " + _json_encode(error) + b"\n\n")
                await responder.end_stream()
                return

    async def _serve_whole(
        self,
        responder: HTTPResponder,
        progress: _Progress,
        stream: RequestStream,
        body: dict[str, Any],
    ) -> None:
        exchange = progress.exchange
        shape = _ResponseShape(exchange.endpoint, body)
        pieces: list[str] = []
        finish_reason: str | None = None
        async for reply in stream:
            if isinstance(reply, wire.Chunk):
                progress.chunk(reply)
                pieces.append(reply.text)
                finish_reason = reply.finish_reason or finish_reason
            elif isinstance(reply, wire.End):
                exchange.status = 200
                payload = shape.whole("".join(pieces), finish_reason, reply)
                await responder.send(200, json_headers(), payload)
                progress.completed()
                return
            else:
                await self._send_failure(responder, exchange, reply)
                return

    async def _serve_embeddings(
        self,
        responder: HTTPResponder,
        progress: _Progress,
        stream: RequestStream,
        body: dict[str, Any],
    ) -> None:
        exchange = progress.exchange
        vectors: list[dict[str, Any]] = []
        async for reply in stream:
            if isinstance(reply, wire.Chunk):
                if reply.embedding is not None:
                    vectors.append(
                        {"object": "embedding", "index": reply.index, "embedding": reply.embedding}
                    )
            elif isinstance(reply, wire.End):
                vectors.sort(key=lambda item: item["index"])
                exchange.status = 200
                payload = {
                    "object": "list",
                    "data": vectors,
                    "model": body["model"],
                    "usage": {
                        "prompt_tokens": reply.prompt_tokens,
                        "total_tokens": reply.prompt_tokens,
                    },
                }
                await responder.send(200, json_headers(), _json_encode(payload))
                progress.completed()
                return
            else:
                await self._send_failure(responder, exchange, reply)
                return

    # ------------------------------------------------------------------ error answers

    async def _send_overloaded(self, responder: HTTPResponder, exchange: _Exchange) -> None:
        exchange.status = self._overload_status
        self._metrics.count_rejection(exchange.label, exchange.endpoint)
        retry_after = retry_after_seconds(
            self._in_flight, self._completions.rate(trio.current_time())
        )
        headers = json_headers((b"retry-after", b"%d" % retry_after))
        await responder.send(self._overload_status, headers, self._overload_body)

    async def _send_unavailable(
        self, responder: HTTPResponder, exchange: _Exchange, *, close: bool = False
    ) -> None:
        exchange.status = 503
        headers = json_headers((b"retry-after", b"1"))
        if close:  # draining: the client should reconnect, to another frontend
            headers.append((b"connection", b"close"))
        await responder.send(503, headers, UNAVAILABLE_BODY)

    async def _send_failure(
        self, responder: HTTPResponder, exchange: _Exchange, failed: wire.Failed
    ) -> None:
        if failed.kind == "bad_request":
            status, error_type = 400, "invalid_request_error"
        elif failed.kind == "unavailable":
            await self._send_unavailable(responder, exchange)
            return
        else:
            _log.warning("worker request failed: %s: %s", failed.kind, failed.message)
            status, error_type = 500, "internal_server_error"
        exchange.status = status
        await responder.send(status, json_headers(), error_body(failed.message, status, error_type))

    def _count(self, exchange: _Exchange) -> None:
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

    def _check_admin(self) -> None:
        if self._settings.admin_api_disabled:
            raise BadRequest(404, "no such endpoint: /busy_threshold")

    async def _get_thresholds(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        self._check_admin()
        entries = [_threshold_entry(model, t) for model, t in self._fleet.all_thresholds()]
        await responder.send(200, json_headers(), _json_encode({"thresholds": entries}))

    async def _post_thresholds(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        self._check_admin()
        model, update = _parse_threshold_update(await request.read_body())
        if not any(True for _ in self._fleet.workers(model)):
            message = (
                f"Model '{model}' not found. Thresholds can only be set for discovered models."
            )
            raise BadRequest(404, message, admin=True)
        current = (
            self._fleet.set_thresholds(model, update)
            if update.configured
            else self._fleet.thresholds(model)
        )
        await responder.send(200, json_headers(), _json_encode(_threshold_entry(model, current)))


# ----------------------------------------------------------------------------- request bodies


def _error_type(status: int) -> str:
    return {404: "not_found_error", 405: "invalid_request_error"}.get(
        status, "invalid_request_error"
    )


def _parse_body(raw: bytes, endpoint: wire.Endpoint) -> dict[str, Any]:
    """Parse and check what the frontend itself needs of a completion body (once)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(400, "`model` must be a non-empty string")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(400, "`stream` must be a boolean")
    if endpoint == "chat_completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(400, "`messages` must be a non-empty array")
    return body


def _parse_threshold_update(raw: bytes) -> tuple[str, Thresholds]:
    """The ``POST /busy_threshold`` body: 400 out of range, 422 wrong type or missing model."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}", admin=True) from None
    if not isinstance(body, dict):
        raise BadRequest(422, "request body must be a JSON object", admin=True)
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest(422, "missing field `model` (a string)", admin=True)
    decode = body.get("active_decode_blocks_threshold")
    tokens = body.get("active_prefill_tokens_threshold")
    frac = body.get("active_prefill_tokens_threshold_frac")
    for name, value in zip(_THRESHOLD_FIELDS, (decode, tokens, frac), strict=True):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequest(422, f"`{name}` must be a number, got {value!r}", admin=True)
    if tokens is not None and not isinstance(tokens, int):
        raise BadRequest(
            422, f"`{_THRESHOLD_FIELDS[1]}` must be an integer, got {tokens}", admin=True
        )
    try:
        update = Thresholds(
            active_decode_blocks=None if decode is None else float(decode),
            active_prefill_tokens=tokens,
            active_prefill_tokens_frac=None if frac is None else float(frac),
        )
    except ThresholdError as exc:
        raise BadRequest(400, str(exc), admin=True) from None
    return model, update


def _threshold_entry(model: str, thresholds: Thresholds) -> dict[str, Any]:
    return {
        "model": model,
        "active_decode_blocks_threshold": thresholds.active_decode_blocks,
        "active_prefill_tokens_threshold": thresholds.active_prefill_tokens,
        "active_prefill_tokens_threshold_frac": thresholds.active_prefill_tokens_frac,
    }


# ----------------------------------------------------------------------------- response bodies


# Response ids: unique per process start (random prefix) and cheap per request (a counter);
# a uuid4 per request cost an os.urandom call on the hot path.
_ID_PREFIX: Final = secrets.token_hex(8)
_id_counter = itertools.count()


def _sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class _ResponseShape:
    """The OpenAI response objects of one chat or text completion.

    A streamed chunk differs from the last only in its choice, so the envelope around the
    choice is encoded once per request and each chunk encodes just its choice.
    """

    __slots__ = ("_chunk_prefix", "chat", "created", "id", "include_usage", "model")

    def __init__(self, endpoint: wire.Endpoint, body: dict[str, Any]) -> None:
        self.chat = endpoint == "chat_completions"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{_ID_PREFIX}{next(_id_counter):08x}"
        self.created = int(time.time())
        self.model: str = body["model"]
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        envelope = _json_encode(
            {
                "id": self.id,
                "object": self._object(chunk=True),
                "created": self.created,
                "model": self.model,
                "choices": [],
            }
        )
        self._chunk_prefix = envelope[: -len(b"]}")]

    def _object(self, chunk: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def chunk(self, reply: wire.Chunk, first: bool) -> bytes:
        choice: dict[str, Any]
        if self.chat:
            delta: dict[str, Any] = {"content": reply.text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": reply.finish_reason}
        else:
            choice = {
                "index": 0,
                "text": reply.text,
                "finish_reason": reply.finish_reason,
                "logprobs": None,
            }
        return self._chunk_prefix + _json_encode(choice) + b"]}"

    def usage_chunk(self, end: wire.End) -> bytes:
        return _json_encode(
            {
                "id": self.id,
                "object": self._object(chunk=True),
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": _usage(end),
            }
        )

    def whole(self, text: str, finish_reason: str | None, end: wire.End) -> bytes:
        choice: dict[str, Any]
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason or "stop",
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": finish_reason or "stop",
                "logprobs": None,
            }
        return _json_encode(
            {
                "id": self.id,
                "object": self._object(chunk=False),
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": _usage(end),
            }
        )


def _usage(end: wire.End) -> dict[str, int]:
    return {
        "prompt_tokens": end.prompt_tokens,
        "completion_tokens": end.completion_tokens,
        "total_tokens": end.prompt_tokens + end.completion_tokens,
    }
