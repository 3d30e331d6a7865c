"""A zero-work engine: answers at once, for tests and for measuring the ingress itself.

``--engine instant`` selects it. A completion streams exactly
``max_tokens`` chunks (16 when absent) of one token each with no delay; an embedding request
answers one small vector per input. Bodies are read by the helpers of
:mod:`worker_ingress.engines._base`, like the mocker reads them: one prompt token per
whitespace-separated word of the prompt (all message contents, for chat). The engine holds no KV
cache, so its load is always zero and :attr:`InstantEngine.load_changed` never moves.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Final

import trio

from shim_common.wire import Endpoint, RankLoad
from worker_ingress._config import WorkerSettings
from worker_ingress._watch import ChangeSignal
from worker_ingress.engines._base import (
    DEFAULT_MAX_TOKENS,
    EngineConfig,
    EngineOutput,
    PreparedRequest,
    count_words,
    prompt_texts,
    refuse_several_choices,
    requested_max_tokens,
)

__all__ = ["DEFAULT_MAX_TOKENS", "EMBEDDING_SIZE", "InstantEngine", "create"]

EMBEDDING_SIZE: Final = 8


class InstantEngine:
    """An :class:`~worker_ingress.engines._base.Engine` that does no work.

    Args:
        config: The limits it announces (nothing enforces them).
    """

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._load_changed = ChangeSignal()
        self._loads = [
            RankLoad(
                dp_rank=rank, active_decode_blocks=0, active_prefill_tokens=0, kv_used_blocks=0
            )
            for rank in range(config.data_parallel_size)
        ]

    @property
    def config(self) -> EngineConfig:
        """The limits announced in the worker's hello."""
        return self._config

    @property
    def load_changed(self) -> ChangeSignal:
        """Never bumped: the load is always zero."""
        return self._load_changed

    def load(self) -> list[RankLoad]:
        """Zero load on every rank."""
        return list(self._loads)

    def prepare(self, endpoint: Endpoint, body: dict[str, Any]) -> PreparedRequest:
        """Validate a body and count its prompt tokens.

        Args:
            endpoint: Which OpenAI endpoint the body is for.
            body: The OpenAI request body.

        Returns:
            The prepared request.

        Raises:
            EngineInputError: The body lacks its prompt, has a bad ``max_tokens`` (see
                :func:`~worker_ingress.engines._base.requested_max_tokens`) or asks for several
                choices.
        """
        refuse_several_choices(endpoint, body)
        texts = prompt_texts(endpoint, body)
        return PreparedRequest(
            endpoint=endpoint,
            prompt_tokens=sum(count_words(text) for text in texts),
            max_tokens=requested_max_tokens(endpoint, body),
            # An embedding answers one vector per input: keep how many there are.
            payload=len(texts) if endpoint == "embeddings" else None,
        )

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream the answer with no delay (one checkpoint per chunk, so it stays cancellable).

        Args:
            request: What :meth:`prepare` returned.

        Yields:
            ``max_tokens`` one-token chunks, the last with ``finish_reason="length"``; or one
            vector per input for embeddings.
        """
        if request.endpoint == "embeddings":
            for index in range(int(request.payload)):
                await trio.lowlevel.checkpoint()
                yield EngineOutput(embedding=[0.0] * EMBEDDING_SIZE, index=index)
            return
        for produced in range(1, request.max_tokens + 1):
            await trio.lowlevel.checkpoint()
            last = produced == request.max_tokens
            yield EngineOutput(text=" tok", tokens=1, finish_reason="length" if last else None)
        if request.max_tokens == 0:
            yield EngineOutput(finish_reason="length")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Nothing runs in the background; ready at once, then sleeps until cancelled."""
        task_status.started()
        await trio.sleep_forever()


def create(settings: WorkerSettings) -> InstantEngine:
    """Build the engine from worker settings (the ``package.module:factory`` entry point).

    Args:
        settings: The worker's settings; the mocker's shape supplies the announced limits.

    Returns:
        A new engine.
    """
    shape = settings.mocker
    return InstantEngine(
        EngineConfig(
            kv_total_blocks=shape.num_gpu_blocks,
            block_size=shape.block_size,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            max_num_seqs=shape.max_num_seqs,
            data_parallel_size=shape.data_parallel_size,
        )
    )
