"""The mocker: a simulated continuous-batching engine (vLLM-like) with a paged KV cache.

It does no inference. It reproduces what the admission layer and the router care about: how long
requests take, how many KV blocks they hold, and how many prompt tokens wait for prefill, with
step times of a real GPU (see docs/mocker.md for the performance model and where it comes from).

This module is the Trio shell, :class:`MockerEngine`: one step loop per data-parallel rank that
asks its :class:`~worker_ingress.engines._mock_scheduler.RankScheduler` for the next step, sleeps
for the simulated step time, applies the step and wakes the request generators that progressed.
The rules of a sequence inside a rank (tokens, states, chunked prefill, KV blocks, preemption,
the prefix cache) are at the top of :mod:`worker_ingress.engines._mock_scheduler`.

A prompt becomes token ids through :mod:`shim_common.prefix` (one token per word, or a model's
``tokenizer.json`` with ``--tokenizer``), the same tokenisation and block names a cache-aware
frontend uses, so what the frontend predicts is what this engine caches.

Disaggregated serving (every role of the mocker can do both hops): a ``prefill_only`` request is
prefilled like any (prefix cache, KV events) and ends at once, its blocks back in the cache,
evictable, with one output carrying the :class:`~shim_common.wire.Handoff` that names them. A
request with a ``handoff`` is a decode hop: its rank admits it as a transfer (rule 9 of the
scheduler), its generator then waits out the transfer, ``kv_bytes`` at
``--kv-transfer-bandwidth`` GB/s in wall seconds (not divided by the speedup ratio, as in
Dynamo's mocker, whose live engine sleeps the unscaled transfer time), and the rank decodes it.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Final

import msgspec
import trio

from shim_common._numbers import MAX_COUNT
from shim_common.prefix import (
    FileTokenizer,
    PromptTokenizer,
    WordTokenizer,
    block_names,
    prompt_token_ids,
)
from shim_common.wire import Endpoint, Handoff, RankLoad
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress._kv_events import KvEventLog
from worker_ingress._watch import ChangeSignal
from worker_ingress.engines._base import (
    DEFAULT_MAX_TOKENS,
    EngineConfig,
    EngineInputError,
    EngineOutput,
    PreparedRequest,
    prompt_texts,
    refuse_several_choices,
    requested_max_tokens,
)
from worker_ingress.engines._cache_stats import CacheHitCounter, PrefixCacheStats
from worker_ingress.engines._mock_scheduler import (
    GpuStepModel,
    MockSequence,
    RankScheduler,
    SequenceState,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "EMBEDDING_DIMENSIONS",
    "MockerEngine",
    "MockerPayload",
    "create",
    "embedding_for",
    "output_word",
]

#: Length of the pseudo embedding vectors.
EMBEDDING_DIMENSIONS: Final = 16
#: How far behind its timeline a step loop may run and still catch up (wall seconds).
_MAX_CATCH_UP_SECONDS: Final = 0.02
#: The most a step aims early to make up for the clock's late wake-ups (wall seconds).
_MAX_TIMER_LATENESS: Final = 0.001
#: Steps a step loop behind its timeline runs back to back before it yields to other tasks.
_STEPS_PER_YIELD: Final = 4

_OUTPUT_WORDS: Final = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliett",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
)


def output_word(index: int) -> str:
    """The text of generated token ``index`` (0-based): deterministic, one word per token.

    Every token but the first starts with a space, so the concatenated stream reads as words.
    """
    word = _OUTPUT_WORDS[index % len(_OUTPUT_WORDS)]
    return word if index == 0 else " " + word


def embedding_for(text: str) -> list[float]:
    """A deterministic unit vector of :data:`EMBEDDING_DIMENSIONS` floats derived from ``text``."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=2 * EMBEDDING_DIMENSIONS).digest()
    raw = [
        int.from_bytes(digest[i : i + 2], "big") / 32767.5 - 1.0 for i in range(0, len(digest), 2)
    ]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [v / norm for v in raw]


class MockerPayload(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`MockerEngine.prepare` keeps of a body: the embedding inputs, if any, and the
    names of the prompt's full blocks (empty with prefix caching off)."""

    embedding_inputs: list[str] | None = None
    block_names: list[int] = []


class MockerEngine:
    """The simulated engine: the :class:`~worker_ingress.engines._base.Engine` protocol over
    one :class:`RankScheduler` per data-parallel rank.

    Args:
        settings: the shape of the simulated engine (blocks, batch limits, ranks, speedup,
            prefix caching, tokenizer, KV transfer).
        model: the GPU step-time model; Dynamo's polynomial model when omitted.
        worker_id: the worker's id, which its hand-offs name.

    Raises:
        ValueError: a setting out of range (the CLI validates first; this guards other callers),
            or a tokenizer file that cannot be read (also when the ``tokenizers`` library is
            missing).
    """

    #: Every role of the mocker runs prefill-only and hand-off requests (the ``disagg`` feature).
    hands_off_kv = True

    def __init__(
        self,
        settings: MockerSettings,
        *,
        model: GpuStepModel | None = None,
        worker_id: str = "mocker",
    ) -> None:
        for name in (
            "num_gpu_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "data_parallel_size",
            "kv_bytes_per_token",
        ):
            if getattr(settings, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(settings, name)!r}")
        if not settings.speedup_ratio > 0 or math.isinf(settings.speedup_ratio):
            raise ValueError(f"speedup_ratio must be > 0, got {settings.speedup_ratio!r}")
        bandwidth = settings.kv_transfer_bandwidth
        if not bandwidth >= 0 or math.isinf(bandwidth):
            raise ValueError(f"kv_transfer_bandwidth must be >= 0 and finite, got {bandwidth!r}")
        self._settings = settings
        self._worker_id = worker_id
        #: Hand-off handles are this process's prefix and a count: unique per worker, also
        #: across a restart under the same id.
        self._handle_prefix = secrets.token_hex(4)
        self._handoffs = 0
        self._tokenizer: PromptTokenizer = WordTokenizer()
        if settings.tokenizer is not None:
            try:
                self._tokenizer = FileTokenizer(settings.tokenizer)
            except ImportError as error:
                raise ValueError(str(error)) from None
        self._config = EngineConfig(
            kv_total_blocks=settings.num_gpu_blocks,
            block_size=settings.block_size,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            data_parallel_size=settings.data_parallel_size,
        )
        step_model = model if model is not None else GpuStepModel()
        self._ranks = tuple(
            RankScheduler(
                num_blocks=settings.num_gpu_blocks,
                block_size=settings.block_size,
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                model=step_model,
                prefix_caching=settings.enable_prefix_caching,
            )
            for _ in range(settings.data_parallel_size)
        )
        self._kv_events: KvEventLog | None = None
        if settings.enable_prefix_caching:
            self._kv_events = KvEventLog(
                self._cached_names,
                backlog_limit=settings.num_gpu_blocks * settings.data_parallel_size,
            )
        self._hits = CacheHitCounter(len(self._ranks))
        #: (queried, hit) tokens of each rank already counted in ``_hits``.
        self._hits_seen = [(0, 0)] * len(self._ranks)
        self._work_arrived: list[trio.Event | None] = [None] * len(self._ranks)
        #: The wake-up of each sequence whose generator waits for its next token or its end.
        self._progress: dict[MockSequence, trio.Event] = {}
        self._load_changed = ChangeSignal()
        self._loads = [rank.load(i) for i, rank in enumerate(self._ranks)]

    # --- Engine protocol ---------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """KV-cache and batching limits (``kv_total_blocks`` is per rank)."""
        return self._config

    @property
    def load_changed(self) -> ChangeSignal:
        """Bumped whenever any rank's :class:`RankLoad` changes."""
        return self._load_changed

    @property
    def ranks(self) -> Sequence[RankScheduler]:
        """The per-rank schedulers (for inspection and tests)."""
        return self._ranks

    def load(self) -> list[RankLoad]:
        """The current load of every rank, rank 0 first."""
        return list(self._loads)

    @property
    def kv_events(self) -> KvEventLog | None:
        """What enters and leaves the ranks' prefix caches (``None`` with caching off)."""
        return self._kv_events

    def prefix_cache_stats(self) -> list[PrefixCacheStats]:
        """Prompt tokens looked up and found per rank, and the last minute's hit rate."""
        return self._hits.stats(trio.current_time())

    def prepare(self, endpoint: Endpoint, body: dict[str, Any]) -> PreparedRequest:
        """Validate a body, tokenise its prompt and name its full blocks.

        Chat and completions read the prompt as :func:`shim_common.prefix.prompt_token_ids`
        does (a completion's ``prompt`` may be token ids); embeddings read ``input`` as text.

        Raises:
            EngineInputError: a missing or ill-typed prompt/messages/input or max_tokens, a
                request for several choices, or a request whose KV would not fit the whole
                cache of a rank.
        """
        if not isinstance(body, dict):
            raise EngineInputError("the request body must be a JSON object")
        refuse_several_choices(endpoint, body)
        max_tokens = requested_max_tokens(endpoint, body)
        if endpoint == "embeddings":
            texts = prompt_texts(endpoint, body)
            payload = MockerPayload(embedding_inputs=texts)
            prompt_tokens = sum(len(self._tokenizer.encode(text)) for text in texts)
        else:
            try:
                tokens = prompt_token_ids(endpoint, body, self._tokenizer)
            except ValueError as error:
                raise EngineInputError(str(error)) from None
            prompt_tokens = len(tokens)
            names: list[int] = []
            if self._settings.enable_prefix_caching:
                names = block_names(tokens, self._settings.block_size)
            payload = MockerPayload(block_names=names)
        if not self._ranks[0].fits(prompt_tokens, max_tokens):
            capacity = self._settings.num_gpu_blocks * self._settings.block_size
            raise EngineInputError(
                f"request needs KV for {prompt_tokens} prompt + {max_tokens} generated tokens, "
                f"more than the KV cache holds ({capacity} tokens)"
            )
        return PreparedRequest(
            endpoint=endpoint,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            payload=payload,
        )

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Run a prepared request on its rank and stream its output.

        The rank is ``request.dp_rank`` when this engine has it, else the least loaded. Text
        requests yield one output per wake-up with every token generated since the last (one
        per step at speedups the clock can follow; several when the step loop runs behind),
        the last with ``finish_reason="length"`` (a single empty one when ``max_tokens`` is 0),
        the first carrying ``cached_tokens``;
        embeddings yield one vector per input once the prefill is done. A ``prefill_only``
        request yields one output once its prefill is done, with its ``cached_tokens`` and
        its ``handoff``; a request with a ``handoff`` first receives the hand-off's KV (the
        transfer), then decodes as a text request, its first output carrying the hand-off's
        ``cached_tokens``. Closing the generator early frees the request's blocks at once, in
        the middle of a transfer too.
        """
        chosen = request.dp_rank
        if chosen is not None and 0 <= chosen < len(self._ranks):
            rank_index = chosen
        else:
            rank_index = self._least_loaded_rank()
        rank = self._ranks[rank_index]
        payload = request.payload
        names = payload.block_names if isinstance(payload, MockerPayload) else []
        inputs = payload.embedding_inputs if isinstance(payload, MockerPayload) else None
        handoff = request.handoff
        seq = MockSequence(
            prompt_tokens=request.prompt_tokens,
            # A prefill hop generates nothing: its prefill ends it (its one token is not sent).
            max_tokens=0 if request.prefill_only else request.max_tokens,
            block_names=names,
            handed_off=handoff is not None,
            tenant=request.tenant,
        )
        if handoff is not None:
            # What the prompt found, in the prefill worker's cache; this rank looks nothing up.
            seq.cached_tokens = handoff.cached_tokens
        rank.add(seq)
        self._loads_may_have_changed()
        self._wake_rank(rank_index)
        try:
            if handoff is not None:
                await self._receive(seq, rank_index, handoff.kv_bytes)
            if request.prefill_only:
                while not seq.done:
                    await self._wait_for_progress(seq)
                yield EngineOutput(
                    cached_tokens=seq.cached_tokens, handoff=self._handoff_of(seq, rank_index)
                )
                return
            if request.endpoint == "embeddings":
                while not seq.done:
                    await self._wait_for_progress(seq)
                for index, text in enumerate(inputs or []):
                    yield EngineOutput(embedding=embedding_for(text), index=index)
                return
            sent = 0
            while True:
                generated = seq.generated
                if sent < generated:
                    # Every token generated since the last wake-up, as one output.
                    yield EngineOutput(
                        text="".join(map(output_word, range(sent, generated))),
                        tokens=generated - sent,
                        finish_reason="length" if generated == seq.max_tokens else None,
                        cached_tokens=seq.cached_tokens if sent == 0 else None,
                    )
                    sent = generated
                if seq.done:
                    break
                await self._wait_for_progress(seq)
            if seq.max_tokens == 0:
                yield EngineOutput(finish_reason="length", cached_tokens=seq.cached_tokens)
        finally:
            # Runs on completion, error and aclose() alike; synchronous, so nothing can
            # interrupt it between the abort and the load update.
            self._progress.pop(seq, None)
            if not seq.done:
                rank.abort(seq)
                self._loads_may_have_changed()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run one step loop per rank until cancelled."""
        async with trio.open_nursery() as nursery:
            for rank_index in range(len(self._ranks)):
                nursery.start_soon(self._step_loop, rank_index)
            task_status.started()

    # --- internals ---------------------------------------------------------------------------

    async def _step_loop(self, rank_index: int) -> None:
        rank = self._ranks[rank_index]
        speedup = self._settings.speedup_ratio
        # Steps end on a timeline of absolute deadlines rather than after relative sleeps: on
        # the real clock a sleep wakes on the next whole millisecond (epoll's timeout is in
        # milliseconds), which at high speedup ratios would stretch every step, so lateness is
        # made up on the next steps, but never more than _MAX_CATCH_UP_SECONDS of it (after a
        # stall the engine does not burst).
        deadline = trio.current_time()
        # How late past their target this loop's sleeps wake, on average: the real clock wakes
        # a sleep on the next whole millisecond, so each step aims that much early and its end
        # falls around its deadline instead of always after it (a step of 0.2 ms would
        # otherwise take a whole millisecond). Zero on a virtual clock.
        lateness = 0.0
        steps_unyielded = 0
        while True:
            step = rank.schedule()
            self._start_transfers(rank)
            if step is None:
                # A step that preempted everything it scheduled may still have evicted, or
                # started transfers (their blocks are held now).
                self._loads_may_have_changed()
                # Park until generate() adds work; no await between the check and the wait.
                arrived = trio.Event()
                self._work_arrived[rank_index] = arrived
                await arrived.wait()
                deadline = trio.current_time()
                continue
            self._loads_may_have_changed()
            deadline = max(
                deadline + step.duration / speedup,
                trio.current_time() - _MAX_CATCH_UP_SECONDS,
            )
            target = deadline - lateness
            if target > trio.current_time():
                await trio.sleep_until(target)
                woke_late = min(trio.current_time() - target, _MAX_TIMER_LATENESS)
                lateness += (woke_late - lateness) / 8
                steps_unyielded = 0
            else:
                # Behind the timeline (a high speedup ratio, or a stall being made up): a few
                # steps run back to back before the loop yields, so that the requests they
                # advanced each wake once for several tokens instead of once per token.
                steps_unyielded += 1
                if steps_unyielded >= _STEPS_PER_YIELD:
                    steps_unyielded = 0
                    await trio.lowlevel.checkpoint()
            progress = self._progress
            for seq in rank.complete(step):
                waiting = progress.pop(seq, None)
                if waiting is not None:
                    waiting.set()
            self._loads_may_have_changed()

    def _start_transfers(self, rank: RankScheduler) -> None:
        # A hand-off admitted by this schedule: its generator times the transfer.
        progress = self._progress
        for seq in rank.take_started_transfers():
            waiting = progress.pop(seq, None)
            if waiting is not None:
                waiting.set()

    async def _receive(self, seq: MockSequence, rank_index: int, kv_bytes: int) -> None:
        """Wait until the rank admits a hand-off, then out its transfer, then let it decode."""
        while seq.state is SequenceState.WAITING:
            await self._wait_for_progress(seq)
        bandwidth = self._settings.kv_transfer_bandwidth
        if bandwidth > 0:
            await trio.sleep(kv_bytes / (bandwidth * 1e9))
        self._ranks[rank_index].finish_transfer(seq)
        self._loads_may_have_changed()
        self._wake_rank(rank_index)

    def _handoff_of(self, seq: MockSequence, rank_index: int) -> Handoff:
        """The hand-off of a finished prefill hop: its blocks are cached now, evictable."""
        self._handoffs += 1
        prompt = seq.prompt_tokens
        return Handoff(
            handle=f"{self._handle_prefix}-{self._handoffs}",
            worker_id=self._worker_id,
            dp_rank=rank_index,
            block_size=self._settings.block_size,
            prompt_tokens=prompt,
            cached_tokens=seq.cached_tokens or 0,
            block_names=list(seq.block_names),
            # A count (2**53 at most) however large the two flags' product.
            kv_bytes=min(prompt * self._settings.kv_bytes_per_token, MAX_COUNT),
        )

    async def _wait_for_progress(self, seq: MockSequence) -> None:
        """Sleep until the step loop reports progress (a token, the end) for ``seq``."""
        event = self._progress.get(seq)
        if event is None:
            event = self._progress[seq] = trio.Event()
        await event.wait()

    def _wake_rank(self, rank_index: int) -> None:
        arrived = self._work_arrived[rank_index]
        if arrived is not None:
            self._work_arrived[rank_index] = None
            arrived.set()

    def _least_loaded_rank(self) -> int:
        # Fewest live requests, then fewest blocks in use, then the lowest rank.
        return min(
            range(len(self._ranks)),
            key=lambda i: (self._ranks[i].live_sequences, self._ranks[i].used_blocks),
        )

    def _cached_names(self) -> list[list[int]]:
        return [rank.pool.names() for rank in self._ranks]

    def _record_cache_changes(self) -> None:
        # Synchronously after every change, so the KV log and the caches agree at every await.
        log = self._kv_events
        for index, rank in enumerate(self._ranks):
            events = rank.take_kv_events()
            if events and log is not None:
                log.record(index, events)
            seen = self._hits_seen[index]
            if rank.queried_tokens != seen[0]:
                self._hits.count(
                    index,
                    rank.queried_tokens - seen[0],
                    rank.hit_tokens - seen[1],
                    trio.current_time(),
                )
                self._hits_seen[index] = (rank.queried_tokens, rank.hit_tokens)

    def _loads_may_have_changed(self) -> None:
        self._record_cache_changes()
        changed = False
        for index, rank in enumerate(self._ranks):
            current = self._loads[index]
            if (
                current.active_decode_blocks != rank.used_blocks
                or current.active_prefill_tokens != rank.prefill_tokens
                or current.kv_used_blocks != rank.used_blocks
            ):
                self._loads[index] = rank.load(index)
                changed = True
        if changed:
            self._load_changed.bump()


def create(settings: WorkerSettings) -> MockerEngine:
    """The factory the worker CLI calls for ``--engine mocker``."""
    return MockerEngine(settings.mocker, worker_id=settings.worker_id)
