"""From worker replies to HTTP answers: response objects, SSE framing, and error answers.

The status line of a completion goes out only once the worker has started the request
(:class:`~shim_common.wire.Started`); :func:`serve_started` takes over from there:

1. Streaming (``"stream": true``): 200 with ``text/event-stream``, one ``data:`` event per chunk,
   then the usage chunk when ``stream_options.include_usage`` asks for it, then ``data: [DONE]``.
   A failure after the start ends the stream with an ``event: error`` and no ``[DONE]``; the
   head already said 200, but the request is counted as 500.
2. Whole: one JSON body once the worker ends the request; a failure before that is answered
   400 (bad input), 503 (the worker became unavailable) or 500.
3. Embeddings: one vector per input, in input order, once the worker ends the request.
4. What a worker sends is bounded like what a client sends (:mod:`frontend_shim._request_body`):
   choice indexes below ``MAX_CHOICES``, at most ``MAX_EMBEDDING_INPUTS`` vectors, and at most
   :data:`MAX_ANSWER_CHARS` of text gathered for one whole answer. A worker past them fails the
   request as a 500 (an error event once streaming), logged, and the request is cancelled.

A streamed chunk differs from the last only in its choice, so :class:`ResponseShape` encodes the
envelope around the choice once per request and each chunk encodes just its choice.

This module formats; it keeps no books. What it answers is noted on a :class:`Tally` (the status,
before the answer goes out) and, for a started request, an :class:`OutputTally` (each chunk, what
of it was written, the worker's final frame once the chunks read with it are counted, and the
answer's completion): the request's accounting (:mod:`frontend_shim._accounting`) stands behind
both, so formatting knows nothing of routing or metrics.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from typing import Any, Final, Protocol

import msgspec
import trio

from frontend_shim._request_body import MAX_CHOICES, MAX_EMBEDDING_INPUTS
from frontend_shim._request_plane import RequestStream
from shim_common import wire
from shim_common._httpserver import HTTPResponder, error_body, json_headers, openai_error_type
from shim_common._status import REJECT_REASON_HEADER

__all__ = [
    "MAX_ANSWER_CHARS",
    "QUEUE_WAIT_HEADER",
    "REJECT_REASON_HEADER",
    "UNAVAILABLE_BODY",
    "OutputTally",
    "ResponseShape",
    "Tally",
    "overload_body",
    "send_failure",
    "send_unavailable",
    "serve_started",
]

_log = logging.getLogger(__name__)

UNAVAILABLE_BODY: Final = (
    b'{"message":"Service temporarily unavailable","type":"Service Unavailable","code":503}'
)
_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]
_DONE: Final = b"data: [DONE]\n\n"
#: Characters of text one whole (not streamed) answer may gather (rule 4): far more than any
#: context window, and a bound on what a worker that ignores ``max_tokens`` can cost.
MAX_ANSWER_CHARS: Final = 16 * 1024 * 1024
#: Whole milliseconds a started request waited in the worker's queue.
QUEUE_WAIT_HEADER: Final = b"x-dynamo-queue-wait-ms"
_json_encode = msgspec.json.Encoder().encode


def overload_body(status: int) -> bytes:
    """The overload answer's body, byte for byte; ``code`` follows the configured status."""
    return b'{"message":"Service temporarily overloaded","type":"Overloaded","code":%d}' % status


class Tally(Protocol):
    """Where the status of an answer is noted for the request counters.

    Set before the answer goes out, so a client that leaves during it is counted by the status
    it was sent.
    """

    status: int


class OutputTally(Tally, Protocol):
    """What answering a started request reports besides its status."""

    def output(self, reply: wire.Chunk) -> None:
        """One chunk of output arrived from the worker."""

    def written(self, now: float) -> None:
        """The output that arrived so far was written to the client (a stream's events)."""

    def ended(self, final: wire.End | wire.Failed) -> None:
        """The worker's final frame, once every chunk read before it (in the same read too) has
        gone through :meth:`output`, and before the answer's last bytes are written."""

    def completed(self, now: float) -> None:
        """The answer went out in full."""


async def serve_started(
    responder: HTTPResponder,
    endpoint: wire.Endpoint,
    stream: RequestStream,
    body: dict[str, Any],
    tally: OutputTally,
    queue_wait_ms: int = 0,
) -> None:
    """Answer a request the worker has started, from its replies (see the module rules).

    Every 200 carries ``x-dynamo-queue-wait-ms``: how long the worker queued the request.
    """
    wait = (QUEUE_WAIT_HEADER, b"%d" % queue_wait_ms)
    if endpoint == "embeddings":
        await _serve_embeddings(responder, stream, body, tally, wait)
    elif body.get("stream") is True:
        await _serve_stream(responder, endpoint, stream, body, tally, wait)
    else:
        await _serve_whole(responder, endpoint, stream, body, tally, wait)


async def _serve_stream(
    responder: HTTPResponder,
    endpoint: wire.Endpoint,
    stream: RequestStream,
    body: dict[str, Any],
    tally: OutputTally,
    wait: tuple[bytes, bytes],
) -> None:
    shape = ResponseShape(endpoint, body)
    tally.status = 200
    await responder.start_stream(200, [*_SSE_HEADERS, wait])
    started_choices: set[int] = set()  # a request with n > 1 interleaves its choices
    # The events of every reply that arrived together leave in one write (one chunk of the
    # HTTP body); a client that keeps up gets each token as it comes.
    while replies := await stream.ready():
        events: list[bytes] = []
        for reply in replies:
            if isinstance(reply, wire.Chunk):
                tally.output(reply)
                if not 0 <= reply.index < MAX_CHOICES:
                    await _send_events(responder, events)
                    tally.written(trio.current_time())
                    await _end_stream_with_error(responder, tally, _bad_index(reply.index))
                    return
                first = reply.index not in started_choices
                started_choices.add(reply.index)
                events.append(shape.event(reply, first))
            elif isinstance(reply, wire.End):
                # The chunks of this read are counted by now: the release sees all of them.
                tally.ended(reply)
                if shape.include_usage:
                    events.append(_sse(shape.usage_chunk(reply)))
                events.append(_DONE)
                await _send_events(responder, events)
                tally.written(trio.current_time())
                await responder.end_stream()
                tally.completed(trio.current_time())
                return
            else:
                tally.ended(reply)
                await _send_events(responder, events)
                tally.written(trio.current_time())
                await _end_stream_with_error(responder, tally, reply.message, reply.kind)
                return
        await _send_events(responder, events)
        tally.written(trio.current_time())


async def _send_events(responder: HTTPResponder, events: list[bytes]) -> None:
    if events:
        await responder.send_chunk(events[0] if len(events) == 1 else b"".join(events))


async def _end_stream_with_error(
    responder: HTTPResponder, tally: Tally, message: str, kind: str | None = None
) -> None:
    _log.warning("request failed after it started: %s", message)
    # The head said 200, but for the counters this request failed.
    tally.status = 500
    error = {"error": {"message": message, "type": kind or openai_error_type(500), "code": 500}}
    await responder.send_chunk(b"event: error\ndata: " + _json_encode(error) + b"\n\n")
    await responder.end_stream()


def _bad_index(index: int) -> str:
    return f"the worker sent choice index {index}, outside [0, {MAX_CHOICES})"


async def _send_worker_overrun(responder: HTTPResponder, tally: Tally, message: str) -> None:
    """Answer 500 for a worker whose answer broke the bounds of rule 4."""
    failed = wire.Failed(request_id=0, kind="engine", message=message)
    await send_failure(responder, tally, failed)


async def _serve_whole(
    responder: HTTPResponder,
    endpoint: wire.Endpoint,
    stream: RequestStream,
    body: dict[str, Any],
    tally: OutputTally,
    wait: tuple[bytes, bytes],
) -> None:
    shape = ResponseShape(endpoint, body)
    pieces: dict[int, list[str]] = {0: []}  # choice index -> its texts
    finish_reasons: dict[int, str] = {}
    chars = 0
    async for reply in stream:
        if isinstance(reply, wire.Chunk):
            tally.output(reply)
            # A whole answer's first token waits for its last: its time to first token is
            # when the worker's first output arrived, not when the body goes out.
            tally.written(trio.current_time())
            chars += len(reply.text)
            if not 0 <= reply.index < MAX_CHOICES:
                await _send_worker_overrun(responder, tally, _bad_index(reply.index))
                return
            if chars > MAX_ANSWER_CHARS:
                message = f"the worker's answer is over {MAX_ANSWER_CHARS} characters"
                await _send_worker_overrun(responder, tally, message)
                return
            pieces.setdefault(reply.index, []).append(reply.text)
            if reply.finish_reason:
                finish_reasons[reply.index] = reply.finish_reason
        elif isinstance(reply, wire.End):
            tally.ended(reply)
            tally.status = 200
            choices = {
                index: ("".join(texts), finish_reasons.get(index))
                for index, texts in sorted(pieces.items())
            }
            payload = shape.whole(choices, reply)
            await responder.send(200, json_headers(wait), payload)
            tally.completed(trio.current_time())
            return
        else:
            tally.ended(reply)
            await send_failure(responder, tally, reply)
            return


async def _serve_embeddings(
    responder: HTTPResponder,
    stream: RequestStream,
    body: dict[str, Any],
    tally: OutputTally,
    wait: tuple[bytes, bytes],
) -> None:
    vectors: list[dict[str, Any]] = []
    async for reply in stream:
        if isinstance(reply, wire.Chunk):
            if reply.embedding is not None:
                if len(vectors) == MAX_EMBEDDING_INPUTS:
                    message = f"the worker sent more than {MAX_EMBEDDING_INPUTS} vectors"
                    await _send_worker_overrun(responder, tally, message)
                    return
                vectors.append(
                    {"object": "embedding", "index": reply.index, "embedding": reply.embedding}
                )
        elif isinstance(reply, wire.End):
            tally.ended(reply)
            vectors.sort(key=lambda item: item["index"])
            tally.status = 200
            payload = {
                "object": "list",
                "data": vectors,
                "model": body["model"],
                "usage": {
                    "prompt_tokens": reply.prompt_tokens,
                    "total_tokens": reply.prompt_tokens,
                },
            }
            await responder.send(200, json_headers(wait), _json_encode(payload))
            tally.completed(trio.current_time())
            return
        else:
            tally.ended(reply)
            await send_failure(responder, tally, reply)
            return


async def send_unavailable(
    responder: HTTPResponder, tally: Tally, reason: str, *, close: bool = False
) -> None:
    """Answer 503 with ``Retry-After: 1`` and ``x-dynamo-reject-reason: <reason>``
    (``no_workers``, ``draining`` or ``other``); ``close``: and end the connection (draining)."""
    tally.status = 503
    headers = json_headers((b"retry-after", b"1"), (REJECT_REASON_HEADER, reason.encode()))
    if close:  # draining: the client should reconnect, to another frontend
        headers.append((b"connection", b"close"))
    await responder.send(503, headers, UNAVAILABLE_BODY)


async def send_failure(responder: HTTPResponder, tally: Tally, failed: wire.Failed) -> None:
    """Answer a request the worker failed before it started."""
    if failed.kind == "bad_request":
        status = 400
    elif failed.kind == "unavailable":
        await send_unavailable(responder, tally, "draining")
        return
    else:
        _log.warning("worker request failed: %s: %s", failed.kind, failed.message)
        status = 500
    tally.status = status
    await responder.send(status, json_headers(), error_body(failed.message, status))


# Response ids: unique per process start (random prefix) and cheap per request (a counter);
# a uuid4 per request cost an os.urandom call on the hot path.
_ID_PREFIX: Final = secrets.token_hex(8)
_id_counter = itertools.count()


def _sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class ResponseShape:
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

    def event(self, reply: wire.Chunk, first: bool) -> bytes:
        """The SSE event of one streamed chunk, the bytes of ``_sse(self.chunk(reply, first))``.

        The common chunk (a chat's text, neither the first of its choice nor the last) is
        formatted in one step around its encoded text, with no dict built and encoded per token.
        """
        if self.chat and not first and reply.finish_reason is None:
            return b'data: %b{"index":%d,"delta":{"content":%b},"finish_reason":null}]}\n\n' % (
                self._chunk_prefix,
                reply.index,
                _json_encode(reply.text),
            )
        return _sse(self.chunk(reply, first))

    def chunk(self, reply: wire.Chunk, first: bool) -> bytes:
        choice: dict[str, Any]
        if self.chat:
            delta: dict[str, Any] = {"content": reply.text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": reply.index, "delta": delta, "finish_reason": reply.finish_reason}
        else:
            choice = {
                "index": reply.index,
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

    def whole(self, choices: dict[int, tuple[str, str | None]], end: wire.End) -> bytes:
        """The answer to a request without ``stream``: ``choices`` maps each choice's index to
        its text and finish reason."""
        return _json_encode(
            {
                "id": self.id,
                "object": self._object(chunk=False),
                "created": self.created,
                "model": self.model,
                "choices": [
                    self._whole_choice(index, text, finish_reason)
                    for index, (text, finish_reason) in choices.items()
                ],
                "usage": _usage(end),
            }
        )

    def _whole_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason or "stop",
            }
        return {
            "index": index,
            "text": text,
            "finish_reason": finish_reason or "stop",
            "logprobs": None,
        }


def _usage(end: wire.End) -> dict[str, Any]:
    # OpenAI's prompt_tokens_details.cached_tokens: the prompt tokens the engine found in its
    # prefix cache (0 from an engine, or an older worker, that does not say).
    return {
        "prompt_tokens": end.prompt_tokens,
        "completion_tokens": end.completion_tokens,
        "total_tokens": end.prompt_tokens + end.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": end.cached_tokens},
    }
