"""The ``openai`` engine: forward to a real OpenAI-compatible server (vLLM, SGLang, llama.cpp).

``--engine openai --upstream-url http://127.0.0.1:8001`` puts the admission gate in front of an
engine server, so the server never sees more than N requests at once. A trailing ``/v1`` on the
URL is accepted. Only ``http://`` is supported (the engine server normally sits next to the
worker).

Requests:

- :meth:`OpenAIUpstreamEngine.prepare` checks the prompt and the token limit with the helpers
  every engine shares (:func:`~worker_ingress.engines._base.prompt_words`, which here also accepts
  token ids, and :func:`~worker_ingress.engines._base.requested_max_tokens`) and
  encodes the body as JSON, so a body JSON cannot carry is refused before it takes a slot. Prompt
  tokens are *estimated* as whitespace-separated words (token ids count one each): the worker does
  not have the model's tokenizer, and the real count comes back in the upstream's ``usage``. The
  body is sent as given (its ``model`` too), except that completions are always streamed upstream
  (``"stream": true`` with ``"stream_options": {"include_usage": true}``), whatever the client
  asked: the frontend shapes the answer.
- :meth:`OpenAIUpstreamEngine.generate` yields one output per streamed delta with one token each;
  the final output of each choice (the one with ``finish_reason``) is held back until the usage
  chunk arrives, and it absorbs the difference between the upstream's ``completion_tokens`` and
  the deltas counted, so the token total matches the upstream, and carries the prompt tokens the
  upstream found in its prefix cache (``usage.prompt_tokens_details.cached_tokens``, as vLLM and
  llama.cpp report it, else llama.cpp's ``timings.cache_n``; 0 when the upstream says neither),
  which the worker's metrics count too (:meth:`OpenAIUpstreamEngine.prefix_cache_stats`). Only
  text is forwarded (content,
  not tool calls, reasoning or logprobs: :class:`~worker_ingress.engines._base.EngineOutput` carries
  text). Embeddings are one plain POST and one output per vector (``base64`` vectors are decoded).
- Errors: an upstream 4xx other than 408 and 429 raises
  :class:`~worker_ingress.engines._base.EngineInputError` with the upstream's message (the worker
  answers 400). 408, 429, 5xx, a broken connection, a silent upstream, an error event in the
  stream, or a stream that ends before a finish reason raise :class:`UpstreamError`. The
  upstream's message, of an error body whatever its shape or of an error event, is quoted by the
  one rule for peer text (:func:`~shim_common._client_text.shorten`).
- Cancellation: closing the generator closes the upstream connection (it is never returned to the
  pool with an unread body), so the upstream sees the disconnect and aborts the generation.

Configuration announced (:attr:`OpenAIUpstreamEngine.config`), read once in :meth:`run` before it
reports ready, first source that answers wins (asked by ``_discovery``, read by the
parsers of ``_probes`` and ``_metrics``):

1. vLLM: ``GET /metrics``, gauge ``vllm:cache_config_info``, labels ``num_gpu_blocks`` and
   ``block_size`` (summed over data-parallel engines).
2. SGLang: ``GET /get_server_info``: ``max_total_num_tokens`` (KV tokens), ``page_size`` (block
   size), ``max_running_requests``, ``chunked_prefill_size``, ``dp_size``.
3. llama.cpp: ``GET /props``: ``total_slots`` (sequences) times
   ``default_generation_settings.n_ctx`` (KV tokens per slot), in blocks of the configured block
   size.
4. Otherwise, and for every value a source does not give, the mocker shape flags
   (``--num-gpu-blocks``, ``--block-size``, ``--max-num-batched-tokens``, ``--max-num-seqs``).

What the upstream runs at once (SGLang's ``max_running_requests``, llama.cpp's ``total_slots``;
vLLM does not publish its ``--max-num-seqs``) is announced as ``max_num_seqs`` and compared with
N (``--engine-request-limit``): when N is unset or larger, a warning at start-up says so, because
the excess would wait inside the upstream, where the gate can neither see nor shed it.

The protocol wants the configuration fixed for the engine's life, so discovery changes it only if
nobody has read it yet; a worker that builds its hello before starting the engine keeps the flag
values, and a warning names the flags that would announce the upstream's real limits. The KV usage
gauge is a fraction, so it is scaled to whatever total was announced and stays consistent.

The upstream is announced as **one** data-parallel rank whatever its internal data parallelism:
it balances its ranks itself and the worker cannot see where a request lands, so the limits of a
``--data-parallel-size D`` upstream are multiplied by D and its load is reported on rank 0.

Load (:meth:`OpenAIUpstreamEngine.load`) is the larger of two readings: the estimate of
:class:`~worker_ingress.engines.upstream._in_flight.InFlightLoad` (what this engine has in
flight; it reacts at once) and the upstream's own numbers, polled every second (they see requests
of other clients, prefix-cache sharing and preemption): the KV usage gauge of its ``/metrics``
(``vllm:kv_cache_usage_perc``, older ``vllm:gpu_cache_usage_perc``, ``sglang:token_usage``) times
the total blocks, or for llama.cpp, whose ``/metrics`` has no such gauge, the tokens its busy
slots hold according to ``GET /slots``, in blocks. A request that ends is taken off the polled
figure at once (its blocks, as the estimate counted them) when that reading may count it (it
came in after the request started), until the next reading: the reading would otherwise
count it for up to a poll interval after its end, and the worker's first event after the end
would still show it (a frontend routing on a decode threshold of 0 would see the worker busy).
A request that ended while a reading was under way is taken off that reading too.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import struct
from collections.abc import AsyncGenerator
from typing import Any, Final

import httpx
import msgspec
import trio

from shim_common._client_text import shorten
from shim_common.wire import Endpoint, RankLoad
from worker_ingress._config import WorkerSettings
from worker_ingress._watch import ChangeSignal
from worker_ingress.engines._base import (
    DEFAULT_MAX_TOKENS,
    FIRST_OUTPUT,
    EngineConfig,
    EngineInputError,
    EngineOutput,
    PreparedRequest,
    prompt_words,
    requested_max_tokens,
)
from worker_ingress.engines._cache_stats import CacheHitCounter, PrefixCacheStats
from worker_ingress.engines.upstream._client import (
    DEFAULT_READ_TIMEOUT,
    Origin,
    SSEDecoder,
    UpstreamClient,
    UpstreamConnectionError,
    parse_base_url,
)
from worker_ingress.engines.upstream._discovery import UpstreamDiscovery
from worker_ingress.engines.upstream._in_flight import InFlightLoad

__all__ = ["DEFAULT_MAX_TOKENS", "OpenAIUpstreamEngine", "UpstreamError", "create"]

logger = logging.getLogger(__name__)

#: Seconds between two reads of the upstream's ``/metrics``.
METRICS_POLL_INTERVAL: Final = 1.0
#: Largest bodies read from the upstream.
MAX_ERROR_BODY_BYTES: Final = 64 * 1024
MAX_EMBEDDINGS_BODY_BYTES: Final = 256 * 1024 * 1024
#: After ``[DONE]``, how long and how much is read to let the connection be reused.
DRAIN_TIMEOUT: Final = 1.0
MAX_DRAIN_BYTES: Final = 64 * 1024

_PATHS: Final[dict[str, str]] = {
    "chat_completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
_JSON_HEADERS: Final = (("Content-Type", "application/json"),)
_STREAM_HEADERS: Final = (("Content-Type", "application/json"), ("Accept", "text/event-stream"))


class UpstreamError(RuntimeError):
    """The upstream server failed a request (not the client's fault)."""


# --------------------------------------------------------------------------------------------
# Request validation (sans-IO)


class _UpstreamCall(msgspec.Struct, frozen=True):
    """The payload of a prepared request: where to POST and the JSON body to send."""

    path: str
    body: bytes


# --------------------------------------------------------------------------------------------
# Upstream answers (typed decoding: cheaper and stricter than dicts)


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _PromptTokensDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptTokensDetails | None = None


class _Timings(msgspec.Struct):
    # llama.cpp: prompt tokens reused from the slot's cache.
    cache_n: int | None = None


class _StreamChunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    timings: _Timings | None = None
    error: Any = None
    object: str | None = None
    message: str | None = None


class _Embedding(msgspec.Struct):
    embedding: list[float] | str
    index: int = 0


class _EmbeddingResponse(msgspec.Struct):
    data: list[_Embedding]


_chunk_decoder: Final = msgspec.json.Decoder(_StreamChunk)
_embedding_decoder: Final = msgspec.json.Decoder(_EmbeddingResponse)


def _error_message(body: bytes) -> str:
    """The human message of an upstream error body, in any of the shapes servers use, quoted by
    the one rule for peer text (:func:`~shim_common._client_text.shorten`) whatever its shape."""
    return shorten(_error_text(body))


def _error_text(body: bytes) -> str:
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(decoded, dict):
        error = decoded.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if isinstance(decoded.get(key), str):
                return str(decoded[key])
    return body.decode("utf-8", "replace").strip()


def _decode_vector(value: list[float] | str) -> list[float]:
    if isinstance(value, list):
        return value
    raw = base64.b64decode(value)
    if len(raw) % 4:
        raise UpstreamError("upstream sent a base64 embedding that is not float32")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


# --------------------------------------------------------------------------------------------
# The engine (Trio shell)


class OpenAIUpstreamEngine:
    """An :class:`~worker_ingress.engines.Engine` that forwards to an OpenAI-compatible server.

    See the module docstring for what is forwarded, read and assumed.

    Args:
        origin: Where the upstream listens.
        fallback: Limits announced for whatever the upstream does not reveal.
        model: The model name the worker serves (checked against the upstream's ``/v1/models``).
        max_connections: Most requests forwarded at once (the worker's engine slots).
        request_limit: N, the worker's ``--engine-request-limit`` (``None`` when unset), compared
            at start-up with what the upstream says it runs at once.
        read_timeout: Seconds of upstream silence tolerated inside a request.
        metrics_poll_interval: Seconds between two reads of the upstream's ``/metrics``.
    """

    def __init__(
        self,
        origin: Origin,
        fallback: EngineConfig,
        *,
        model: str,
        max_connections: int = 64,
        request_limit: int | None = None,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        metrics_poll_interval: float = METRICS_POLL_INTERVAL,
    ) -> None:
        self._origin = origin
        self._config = fallback
        # The Engine protocol promises a config fixed for the engine's life: once someone has
        # read it (a worker builds its hello before the engine runs), discovery only advises.
        self._config_read = False
        self._model = model
        self._client = UpstreamClient(
            origin, max_connections=max_connections, read_timeout=read_timeout
        )
        self._discovery = UpstreamDiscovery(origin, model=model, request_limit=request_limit)
        self._metrics_poll_interval = metrics_poll_interval
        self._in_flight = InFlightLoad(fallback.block_size)
        self._hits = CacheHitCounter(1)
        self._upstream_used_blocks = 0
        # Readings taken so far; blocks of the requests the reading in force may count that
        # ended since (taken off it); blocks of every request that ended (to tell which ended
        # while a reading was under way).
        self._readings = 0
        self._ended_since_reading = 0
        self._ended_blocks = 0
        self._load_changed = ChangeSignal()
        self._published = self._snapshot()

    @property
    def client(self) -> UpstreamClient:
        """The connection pool requests go through."""
        return self._client

    @property
    def config(self) -> EngineConfig:
        """Limits announced: fixed from the first read on (see :meth:`run`)."""
        self._config_read = True
        return self._config

    @property
    def load_changed(self) -> ChangeSignal:
        """Bumped whenever :meth:`load` changes."""
        return self._load_changed

    def load(self) -> list[RankLoad]:
        """The load of the upstream as one rank (see the module docstring).

        Returns:
            One :class:`~shim_common.wire.RankLoad`, rank 0.
        """
        return [self._published]

    def prefix_cache_stats(self) -> list[PrefixCacheStats]:
        """Prompt tokens the upstream reported, and of those found in its prefix cache."""
        return self._hits.stats(trio.current_time())

    def _snapshot(self) -> RankLoad:
        polled = self._upstream_used_blocks - self._ended_since_reading
        blocks = max(self._in_flight.blocks, polled)
        return RankLoad(
            dp_rank=0,
            active_decode_blocks=blocks,
            active_prefill_tokens=self._in_flight.prefill_tokens,
            kv_used_blocks=blocks,
        )

    def _refresh(self) -> None:
        snapshot = self._snapshot()
        if snapshot != self._published:
            self._published = snapshot
            self._load_changed.bump()

    # -- requests ---------------------------------------------------------------------------

    def prepare(self, endpoint: Endpoint, body: dict[str, Any]) -> PreparedRequest:
        """Validate a body, estimate its prompt tokens and encode what will be sent upstream.

        Args:
            endpoint: Which OpenAI endpoint the body is for.
            body: The OpenAI request body.

        Returns:
            The prepared request; its payload is the upstream path and JSON body.

        Raises:
            EngineInputError: The body lacks its prompt, has a bad ``max_tokens`` or cannot be
                encoded as JSON.
        """
        if not isinstance(body, dict):
            raise EngineInputError("the request body must be a JSON object")
        prompt_tokens = prompt_words(endpoint, body, allow_token_ids=True)
        # Recorded for the load estimate only: the upstream applies its own default.
        max_tokens = requested_max_tokens(endpoint, body)
        if endpoint == "embeddings":
            upstream_body = body
        else:
            stream_options = body.get("stream_options")
            upstream_body = {
                **body,
                "stream": True,
                "stream_options": {
                    **(stream_options if isinstance(stream_options, dict) else {}),
                    "include_usage": True,
                },
            }
        try:
            encoded = msgspec.json.encode(upstream_body)
        except (TypeError, ValueError, OverflowError) as exc:
            raise EngineInputError(f"the request body cannot be sent as JSON: {exc}") from exc
        return PreparedRequest(
            endpoint=endpoint,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            payload=_UpstreamCall(_PATHS[endpoint], encoded),
        )

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Forward a prepared request and stream the upstream's answer.

        Args:
            request: What :meth:`prepare` returned.

        Yields:
            One output per delta (the last of each choice with ``finish_reason``), or one per
            embedding vector.

        Raises:
            EngineInputError: The upstream refused the request with a 4xx (not 408 or 429).
            UpstreamError: Any other upstream failure.
        """
        call = request.payload
        assert isinstance(call, _UpstreamCall), "generate() takes what prepare() returned"
        key = self._in_flight.start(request.prompt_tokens)
        readings_before = self._readings
        self._refresh()
        try:
            headers = _JSON_HEADERS if request.endpoint == "embeddings" else _STREAM_HEADERS
            async with self._client.stream(
                "POST", call.path, body=call.body, headers=headers
            ) as response:
                await self._check_status(response)
                if request.endpoint == "embeddings":
                    body = await self._client.read(response, MAX_EMBEDDINGS_BODY_BYTES)
                    self._in_flight.first_output(key)
                    self._refresh()
                    for output in _embedding_outputs(body):
                        yield output
                    return
                async with contextlib.aclosing(self._stream_outputs(response, key)) as outputs:
                    async for output in outputs:
                        yield output
        except UpstreamConnectionError as exc:
            raise UpstreamError(f"upstream {self._origin}: {exc}") from exc
        finally:
            ended = self._in_flight.finish(key)
            self._ended_blocks += ended
            if readings_before < self._readings:  # the reading in force came in after its start
                self._ended_since_reading += ended
            self._refresh()

    async def _check_status(self, response: httpx.Response) -> None:
        status = response.status_code
        if status < 400:
            return
        body = await self._client.read(response, MAX_ERROR_BODY_BYTES)
        message = _error_message(body)
        if status < 500 and status not in (408, 429):
            raise EngineInputError(message)
        raise UpstreamError(f"upstream {self._origin} answered {status}: {message}")

    async def _stream_outputs(
        self, response: httpx.Response, key: int
    ) -> AsyncGenerator[EngineOutput, None]:
        """Turn the SSE body into outputs (the token rules are in the module docstring)."""
        async with (
            contextlib.aclosing(self._client.iter_body(response)) as body,
            contextlib.aclosing(self._outputs_of(body, key)) as outputs,
        ):
            async for output in outputs:
                yield output

    async def _outputs_of(
        self, body: AsyncGenerator[bytes, None], key: int
    ) -> AsyncGenerator[EngineOutput, None]:
        decoder = SSEDecoder()
        counted = 0
        held: list[EngineOutput] = []
        completion_tokens: int | None = None
        cached_tokens: int | None = None
        done = False
        while not done:
            piece = await anext(body, b"")
            try:
                events = decoder.feed(piece) if piece else decoder.close()
            except ValueError as exc:
                raise UpstreamError(f"upstream {self._origin} sent a broken stream: {exc}") from exc
            for data in events:
                if data.strip() == "[DONE]":
                    done = True
                    break
                chunk = self._decode_chunk(data)
                if chunk.usage is not None:
                    completion_tokens = chunk.usage.completion_tokens
                    cached_tokens = _cached_tokens(chunk)
                    self._hits.count(
                        0, chunk.usage.prompt_tokens, cached_tokens or 0, trio.current_time()
                    )
                elif chunk.timings is not None and chunk.timings.cache_n is not None:
                    cached_tokens = chunk.timings.cache_n
                for choice in chunk.choices or ():
                    first = self._in_flight.first_output(key)
                    if first:
                        self._refresh()
                    text = (choice.delta.content if choice.delta else None) or choice.text or ""
                    if not text and choice.finish_reason is None:
                        if first:
                            yield FIRST_OUTPUT  # the first upstream chunk, role-only
                        continue  # a role-only or empty delta
                    output = EngineOutput(
                        text=text,
                        tokens=1 if text else 0,
                        finish_reason=choice.finish_reason,
                        index=choice.index,
                    )
                    if self._in_flight.generated(key, output.tokens):
                        self._refresh()
                    if output.finish_reason is not None:
                        held.append(output)
                        continue
                    counted += output.tokens
                    yield output
            if not piece:
                break
        if done:
            await _drain(body)
        if not held:
            if not done:
                raise UpstreamError(f"upstream {self._origin} ended the stream before finishing")
            held.append(EngineOutput(finish_reason="stop"))
        held_tokens = sum(output.tokens for output in held)
        missing = max((completion_tokens or 0) - counted - held_tokens, 0)
        last = held[-1]
        held[-1] = EngineOutput(
            text=last.text,
            tokens=last.tokens + missing,
            finish_reason=last.finish_reason,
            index=last.index,
            cached_tokens=cached_tokens or 0,
        )
        if missing and self._in_flight.generated(key, missing):
            self._refresh()
        for output in held:
            yield output

    def _decode_chunk(self, data: str) -> _StreamChunk:
        try:
            chunk = _chunk_decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise UpstreamError(f"upstream {self._origin} sent a bad stream chunk: {exc}") from exc
        if chunk.error is not None or chunk.object == "error":
            error = chunk.error
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                message = error["message"]
            elif isinstance(error, str):
                message = error
            else:
                message = chunk.message or "unknown error"
            raise UpstreamError(f"upstream {self._origin} failed mid-stream: {shorten(message)}")
        return chunk

    # -- background -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Wait for the upstream, read its limits, report ready, then poll its KV usage.

        Calls ``task_status.started()`` once ``GET /v1/models`` answers 200; until then it retries
        with a backoff from 0.1 s up to 5 s, logging each failure.
        """
        try:
            await self._discovery.wait_until_ready()
            await self._discover()
            task_status.started()
            if not self._discovery.polls_load:
                await trio.sleep_forever()
            while True:
                await trio.sleep(self._metrics_poll_interval)
                # Stale numbers are worse than none: without a fresh reading, the estimate counts.
                ended_before = self._ended_blocks
                used = await self._discovery.used_blocks(self._config)
                self._set_upstream_used_blocks(used or 0, self._ended_blocks - ended_before)
        finally:
            await self._client.aclose()
            await self._discovery.aclose()

    async def _discover(self) -> None:
        """Best effort: fill the config from what the upstream tells (module docstring)."""
        fallback = self._config
        found = await self._discovery.discover(fallback)
        discovered = found.config
        if discovered != fallback and self._config_read:
            logger.warning(
                "upstream %s reports %d KV blocks of %d tokens (from %s) but the worker already "
                "announced %d of %d; pass --num-gpu-blocks %d --block-size %d to announce them",
                self._origin,
                discovered.kv_total_blocks,
                discovered.block_size,
                found.source,
                fallback.kv_total_blocks,
                fallback.block_size,
                discovered.kv_total_blocks,
                discovered.block_size,
            )
        elif discovered != fallback:
            self._config = discovered
            if discovered.block_size != fallback.block_size:
                self._in_flight = _rebuilt(self._in_flight, discovered.block_size)
        logger.info(
            "upstream %s: %d KV blocks of %d tokens announced (from %s); its load is read from %s",
            self._origin,
            self._config.kv_total_blocks,
            self._config.block_size,
            found.source,
            found.load_source,
        )
        self._set_upstream_used_blocks(await self._discovery.used_blocks(self._config) or 0)

    def _set_upstream_used_blocks(self, blocks: int, ended_meanwhile: int = 0) -> None:
        # A new reading: what ended before it was asked for is out of it; what ended while it
        # was under way may not be, and stays taken off.
        self._upstream_used_blocks = blocks
        self._ended_since_reading = ended_meanwhile
        self._readings += 1
        self._refresh()


def _cached_tokens(chunk: _StreamChunk) -> int | None:
    """The prompt tokens the upstream found in its cache, as the usage (or llama.cpp's timings)
    of a chunk says; ``None`` when it says nothing. A negative count is taken as none."""
    usage = chunk.usage
    details = usage.prompt_tokens_details if usage is not None else None
    found = details.cached_tokens if details is not None else None
    if found is None and chunk.timings is not None:
        found = chunk.timings.cache_n
    return None if found is None else max(found, 0)


async def _drain(body: AsyncGenerator[bytes, None]) -> None:
    """Read what follows ``[DONE]`` (normally just the end of the body) so the connection can be
    reused; give up after a moment or a few bytes, and the connection is closed instead."""
    with trio.move_on_after(DRAIN_TIMEOUT):
        drained = 0
        while drained <= MAX_DRAIN_BYTES and (piece := await anext(body, b"")):
            drained += len(piece)


def _rebuilt(load: InFlightLoad, block_size: int) -> InFlightLoad:
    # Discovery runs before ready, so nothing is in flight yet; a fresh tracker is exact.
    assert len(load) == 0, "the block size changes only before requests are accepted"
    return InFlightLoad(block_size)


def _embedding_outputs(body: bytes) -> list[EngineOutput]:
    try:
        decoded = _embedding_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise UpstreamError(f"upstream sent a bad embeddings answer: {exc}") from exc
    items = sorted(decoded.data, key=lambda item: item.index)
    return [
        EngineOutput(embedding=_decode_vector(item.embedding), index=item.index) for item in items
    ]


def create(settings: WorkerSettings) -> OpenAIUpstreamEngine:
    """Build the engine from worker settings (``--engine openai``).

    Args:
        settings: The worker's settings: ``upstream_url`` is required; the mocker shape flags give
            the limits the upstream does not reveal.

    Returns:
        A new engine; its :meth:`~OpenAIUpstreamEngine.run` waits for the upstream.

    Raises:
        ValueError: ``upstream_url`` is missing or not a usable ``http://`` URL.
    """
    if not settings.upstream_url:
        raise ValueError("--engine openai needs --upstream-url (DYN_UPSTREAM_URL)")
    shape = settings.mocker
    ranks = shape.data_parallel_size
    return OpenAIUpstreamEngine(
        parse_base_url(settings.upstream_url),
        EngineConfig(
            kv_total_blocks=shape.num_gpu_blocks * ranks,
            block_size=shape.block_size,
            max_num_batched_tokens=shape.max_num_batched_tokens * ranks,
            max_num_seqs=shape.max_num_seqs * ranks,
            data_parallel_size=1,
        ),
        model=settings.model,
        max_connections=settings.engine_slots,
        request_limit=settings.engine_request_limit,
    )
