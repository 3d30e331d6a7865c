"""An engine with a fixed number of slots and a fixed service time, for goodput benchmarks.

Load it with ``worker-ingress --engine bench.kit.fixed_engine:create`` from the repository's root
(so that ``bench`` is importable). Two environment variables shape it:

- ``BENCH_FIXED_SLOTS``: how many requests it serves at once (default 4);
- ``BENCH_FIXED_SERVICE_SECONDS``: how long each one takes, whatever it asks for (default 0.2).

So its capacity is ``slots / service seconds`` requests per second (20/s by default), the same
with or without the worker's admission gate. Requests beyond ``slots`` wait inside the engine,
first come first served, for as long as it takes: that is the engine queue an ungated worker
builds under overload. Every completion answers one token, after the whole service time.

Load: each running request counts as one KV block in use and one active decode block out of
``slots`` blocks, so a frontend's decode threshold can judge it; waiting requests count nothing.
The load changes, and :attr:`FixedEngine.load_changed` moves, whenever a request starts or ends.
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncGenerator, Mapping
from typing import Any, Final

import msgspec
import trio

from shim_common.wire import Endpoint, RankLoad
from worker_ingress._config import WorkerSettings
from worker_ingress.engines import (
    ChangeSignal,
    EngineConfig,
    EngineInputError,
    EngineOutput,
    PreparedRequest,
)
from worker_ingress.engines._base import prompt_words, requested_max_tokens

__all__ = [
    "DEFAULT_SERVICE_SECONDS",
    "DEFAULT_SLOTS",
    "SERVICE_ENV",
    "SLOTS_ENV",
    "FixedEngine",
    "FixedShape",
    "create",
    "shape_from_env",
]

SLOTS_ENV: Final = "BENCH_FIXED_SLOTS"
SERVICE_ENV: Final = "BENCH_FIXED_SERVICE_SECONDS"
DEFAULT_SLOTS: Final = 4
DEFAULT_SERVICE_SECONDS: Final = 0.2


class FixedShape(msgspec.Struct, frozen=True, kw_only=True):
    """Slots and service time of a :class:`FixedEngine`."""

    slots: int
    service_seconds: float

    @property
    def capacity(self) -> float:
        """Requests per second the engine completes when it is never idle."""
        return self.slots / self.service_seconds


def shape_from_env(env: Mapping[str, str]) -> FixedShape:
    """Read the engine's shape from environment variables.

    Args:
        env: The environment (``os.environ`` or a test's mapping).

    Returns:
        The shape, with defaults for variables that are unset or empty.

    Raises:
        ValueError: A value that is not a positive integer (slots) or a positive finite number
            of seconds (service time), naming the variable.
    """
    raw_slots = env.get(SLOTS_ENV) or str(DEFAULT_SLOTS)
    raw_service = env.get(SERVICE_ENV) or str(DEFAULT_SERVICE_SECONDS)
    try:
        slots = int(raw_slots)
    except ValueError:
        slots = 0
    if slots < 1:
        raise ValueError(f"{SLOTS_ENV} must be a positive integer, got {raw_slots!r}")
    try:
        service = float(raw_service)
    except ValueError:
        service = math.nan
    if not (service > 0 and math.isfinite(service)):
        raise ValueError(f"{SERVICE_ENV} must be a positive number of seconds, got {raw_service!r}")
    return FixedShape(slots=slots, service_seconds=service)


class FixedEngine:
    """An :class:`~worker_ingress.engines.Engine` whose every request takes the same time.

    Args:
        shape: Slots and service time.
        block_size: Tokens per KV block, announced only.
        max_num_batched_tokens: Announced only.
    """

    def __init__(self, shape: FixedShape, *, block_size: int, max_num_batched_tokens: int) -> None:
        self.shape = shape
        self._config = EngineConfig(
            kv_total_blocks=shape.slots,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=shape.slots,
            data_parallel_size=1,
        )
        self._slots = trio.Semaphore(shape.slots)
        self._running = 0
        self._load_changed = ChangeSignal()

    @property
    def config(self) -> EngineConfig:
        """One KV block per slot, one data-parallel rank."""
        return self._config

    @property
    def load_changed(self) -> ChangeSignal:
        """Bumped when a request starts or ends its service."""
        return self._load_changed

    @property
    def running(self) -> int:
        """Requests holding a slot now."""
        return self._running

    def load(self) -> list[RankLoad]:
        """Running requests as blocks in use."""
        return [
            RankLoad(
                dp_rank=0,
                active_decode_blocks=self._running,
                active_prefill_tokens=0,
                kv_used_blocks=self._running,
            )
        ]

    def prepare(self, endpoint: Endpoint, body: dict[str, Any]) -> PreparedRequest:
        """Check the body the way every engine of the project does; embeddings are refused.

        Raises:
            EngineInputError: A missing prompt, a bad ``max_tokens`` or an embedding request.
        """
        if endpoint == "embeddings":
            raise EngineInputError("this engine serves completions only")
        return PreparedRequest(
            endpoint=endpoint,
            prompt_tokens=prompt_words(endpoint, body),
            max_tokens=requested_max_tokens(endpoint, body),
        )

    async def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Wait for a slot, hold it for the service time, answer one token.

        Cancellation (the client left) gives the slot, or the place in the wait, back at once.
        """
        async with self._slots:
            self._running += 1
            self._load_changed.bump()
            try:
                await trio.sleep(self.shape.service_seconds)
            finally:
                self._running -= 1
                self._load_changed.bump()
        yield EngineOutput(text=" done", tokens=1, finish_reason="length")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Nothing runs in the background."""
        task_status.started()
        await trio.sleep_forever()


def create(settings: WorkerSettings) -> FixedEngine:
    """Build the engine (the ``--engine bench.kit.fixed_engine:create`` entry point).

    Args:
        settings: The worker's settings; the mocker's block size and batch budget are announced.

    Returns:
        A new engine shaped by ``BENCH_FIXED_SLOTS`` and ``BENCH_FIXED_SERVICE_SECONDS``.

    Raises:
        ValueError: A variable is malformed (the worker stops with its message).
    """
    return FixedEngine(
        shape_from_env(os.environ),
        block_size=settings.mocker.block_size,
        max_num_batched_tokens=settings.mocker.max_num_batched_tokens,
    )
