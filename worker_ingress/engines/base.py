"""The Engine protocol: what the worker ingress needs from the thing that generates tokens.

Life of a request inside a worker:

1. :meth:`Engine.prepare` validates the OpenAI body and counts its prompt tokens, synchronously
   and before admission, so bad input is answered without taking a slot or a queue place.
2. The admission gate grants an engine slot.
3. :meth:`Engine.generate` streams :class:`EngineOutput` items until the request is done. The
   caller closes the generator (``contextlib.aclosing``) on cancellation or early exit, and the
   engine then frees everything the request held (KV blocks, batch places) at once.

Load reporting: the engine keeps :meth:`Engine.load` current for each data-parallel rank and bumps
:attr:`Engine.load_changed` whenever a value there changes, so the event plane publishes on change.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

import msgspec
import trio

from worker_ingress.watch import ChangeSignal
from worker_ingress.wire import Endpoint, RankLoad

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineInputError",
    "EngineOutput",
    "PreparedRequest",
]


class EngineInputError(ValueError):
    """The request body is not something this engine can run (answered as HTTP 400)."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The runtime configuration an engine announces (the KV-cache and batching limits)."""

    kv_total_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    data_parallel_size: int


class PreparedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated request, ready to run.

    ``prompt_tokens`` is the number of prompt tokens as the engine counts them; ``payload`` is
    engine-specific (the parsed prompt, sampling parameters, ...).
    """

    endpoint: Endpoint
    prompt_tokens: int
    max_tokens: int
    payload: Any = None


class EngineOutput(msgspec.Struct, frozen=True, kw_only=True):
    """One streamed piece of a response."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    embedding: list[float] | None = None
    index: int = 0


class Engine(Protocol):
    """An inference engine behind the ingress. See the module docstring for the life cycle."""

    @property
    def config(self) -> EngineConfig:
        """KV-cache and batching limits.

        The worker reads them once :meth:`run` has reported started (an engine may learn them
        at start-up, e.g. from an upstream server); from then on they must not change.
        """
        ...

    @property
    def load_changed(self) -> ChangeSignal:
        """Bumped whenever any value of :meth:`load` changes."""
        ...

    def load(self) -> list[RankLoad]:
        """The current load of every data-parallel rank, rank 0 first."""
        ...

    def prepare(self, endpoint: Endpoint, body: dict[str, Any]) -> PreparedRequest:
        """Validate a request body.

        Raises:
            EngineInputError: with a message fit to show the client.
        """
        ...

    def generate(self, request: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Run a prepared request and stream its output.

        Raises:
            Exception: any engine failure; the worker reports it and frees the slot.
        """
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine's background work (its step loop) until cancelled.

        Calls ``task_status.started()`` once requests may be submitted.
        """
        ...
