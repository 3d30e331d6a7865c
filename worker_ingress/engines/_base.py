"""The Engine protocol: what the worker ingress needs from the thing that generates tokens.

Life of a request inside a worker:

1. :meth:`Engine.prepare` validates the OpenAI body and counts its prompt tokens, synchronously
   and before admission, so bad input is answered without taking a slot or a queue place.
2. The admission gate grants an engine slot.
3. :meth:`Engine.generate` streams :class:`EngineOutput` items until the request is done. The
   caller closes the generator (``contextlib.aclosing``) on cancellation or early exit, and the
   engine then frees everything the request held (KV blocks, batch places) at once. The first
   item it yields is the request's *first output*: the gate then gives back the request's
   waiting place (``--engine-request-waiting-limit``). An engine whose first sign of progress
   carries nothing to send (an upstream's role-only first chunk) yields :data:`FIRST_OUTPUT`,
   which the worker does not forward; every other output goes to the client as
   :meth:`EngineOutput.chunk`.

Disaggregated serving: an engine that can run a request's prefill and decode apart says so with
``hands_off_kv = True`` (:func:`hands_off_kv`; the worker then lists the ``disagg`` feature). The
worker gives it :attr:`PreparedRequest.prefill_only` requests, which it prefills and ends with one
output carrying the :class:`~shim_common.wire.Handoff` (its text is not sent), and
:attr:`PreparedRequest.handoff` requests, which it decodes from the hand-off's KV. The worker
checks both against the request before the gate (docs/protocol.md lists the checks).

Load reporting: the engine keeps :meth:`Engine.load` current for each data-parallel rank and bumps
:attr:`Engine.load_changed` whenever a value there changes, so the event plane publishes on change.

Request reading shared by every engine, so all of them answer one body the same way:

- :func:`requested_max_tokens`: OpenAI semantics. For chat, ``max_completion_tokens`` is the newer
  name of ``max_tokens`` and wins when both are given; a completion reads ``max_tokens`` only; an
  embedding generates nothing. Absent or ``null`` means :data:`DEFAULT_MAX_TOKENS`.
- :func:`prompt_texts` / :func:`prompt_words`: the prompt of a body and its token count, one token
  per whitespace-separated word (all message contents, for chat), as docs/mocker.md counts them.
- :func:`refuse_several_choices`: for an engine that generates one choice per request, ``n``
  other than 1 is refused (400) rather than silently answered with one choice.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any, Final, Protocol

import msgspec
import trio

from shim_common import prefix
from shim_common._client_text import quote
from shim_common.wire import Chunk, Endpoint, Handoff, RankLoad
from worker_ingress._watch import ChangeSignal

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "Engine",
    "EngineConfig",
    "EngineInputError",
    "EngineOutput",
    "FIRST_OUTPUT",
    "PreparedRequest",
    "chat_texts",
    "count_words",
    "hands_off_kv",
    "prompt_texts",
    "prompt_words",
    "refuse_several_choices",
    "requested_max_tokens",
]

#: Generated tokens when a completion body sets no limit.
DEFAULT_MAX_TOKENS: Final = 16


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
    #: The data-parallel rank the router chose (``Generate.dp_rank``), set by the worker after
    #: :meth:`Engine.prepare`; an engine without ranks, or a rank it does not have: ignored.
    dp_rank: int | None = None
    #: Prefill only and end with a hand-off (``Generate.prefill_only``); set by the worker, for
    #: an engine that :func:`hands_off_kv` only.
    prefill_only: bool = False
    #: Decode from this hand-off's KV instead of prefilling (``Generate.handoff``); set by the
    #: worker, for an engine that :func:`hands_off_kv` only.
    handoff: Handoff | None = None
    #: Whose request it is (``Generate.tenant``; ``""``: the shared tenant), set by the worker
    #: after :meth:`Engine.prepare` as the admission gate reads it: an engine may share what it
    #: keeps between requests (the mocker's prefix cache) fairly among tenants.
    tenant: str = ""


class EngineOutput(msgspec.Struct, frozen=True, kw_only=True):
    """One streamed piece of a response: the fields of a :class:`~shim_common.wire.Chunk` but its
    request id, and what the worker keeps for itself (``cached_tokens``)."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    embedding: list[float] | None = None
    index: int = 0
    #: Prompt tokens found in the engine's prefix cache, on any one output of the request (the
    #: worker reports the last it saw in ``End.cached_tokens``); ``None``: not said here.
    cached_tokens: int | None = None
    #: The prompt's KV held for a decode worker, on the output that ends a ``prefill_only``
    #: request (the worker reports it in ``End.handoff`` and sends nothing of that request's
    #: outputs); ``None`` on every other.
    handoff: Handoff | None = None

    def chunk(self, request_id: int) -> Chunk:
        """The wire's chunk of this output for request ``request_id``: the one place an
        engine's output becomes a wire message."""
        return Chunk(
            request_id=request_id,
            text=self.text,
            tokens=self.tokens,
            finish_reason=self.finish_reason,
            embedding=self.embedding,
            index=self.index,
        )


#: Yielded by an engine to say "the request produced its first output" when that output has
#: nothing to send; compared by identity, never forwarded to the client.
FIRST_OUTPUT: Final = EngineOutput()


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

        Called from a worker thread for a large request-plane message (``_planes`` rule 1), so
        it may read the body and the engine's fixed configuration, and change nothing.

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


def hands_off_kv(engine: object) -> bool:
    """Whether an engine runs a request's prefill and decode apart (``hands_off_kv = True``):
    what makes its worker list the ``disagg`` feature. An engine that does not say so does not.
    """
    return getattr(engine, "hands_off_kv", False) is True


# --------------------------------------------------------------------------------------------
# Request reading (sans-IO), shared by the engines


def refuse_several_choices(endpoint: Endpoint, body: Mapping[str, Any]) -> None:
    """Refuse a completion that asks for several choices (``n`` other than 1 or absent).

    For an engine that generates one choice per request: answering ``n: 3`` with one choice
    would be a silent lie.

    Raises:
        EngineInputError: ``n`` is given, and is not 1.
    """
    choices = body.get("n")
    if endpoint != "embeddings" and choices is not None and choices != 1:
        raise EngineInputError(
            f"this engine generates one choice per request: 'n' is {quote(choices)}"
        )


def requested_max_tokens(
    endpoint: Endpoint, body: Mapping[str, Any], default: int = DEFAULT_MAX_TOKENS
) -> int:
    """How many tokens a request asks to generate.

    Chat reads ``max_completion_tokens`` and, when that is absent or ``null``, ``max_tokens``
    (OpenAI deprecated the older name for chat; both are validated when both are given). A
    completion reads ``max_tokens`` only. An embedding generates nothing.

    Args:
        endpoint: Which OpenAI endpoint the body is for.
        body: The OpenAI request body.
        default: The limit when the body sets none.

    Returns:
        The number of tokens to generate (0 for embeddings).

    Raises:
        EngineInputError: A limit that is not a non-negative integer (booleans included), or an
            unknown endpoint.
    """
    if endpoint == "embeddings":
        return 0
    if endpoint == "chat_completions":
        fields: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    elif endpoint == "completions":
        fields = ("max_tokens",)
    else:
        raise EngineInputError(f"unsupported endpoint {endpoint!r}")
    chosen: int | None = None
    for field in fields:
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise EngineInputError(f"'{field}' must be a non-negative integer, got {value!r}")
        if chosen is None:
            chosen = value
    return default if chosen is None else chosen


def count_words(text: str) -> int:
    """Prompt tokens of a text: one per whitespace-separated word.

    Args:
        text: Any text.

    Returns:
        The number of words in it.
    """
    return len(text.split())


def chat_texts(messages: object) -> list[str]:
    """The texts of a chat's ``messages``, in order (non-text content parts are skipped); the
    one reading of :func:`shim_common.prefix.chat_texts`, which the frontend tokenises by too.

    Args:
        messages: The ``messages`` value of a chat body.

    Returns:
        Every text of every message.

    Raises:
        EngineInputError: ``messages`` is not a non-empty list of objects, a message has neither
            ``content`` nor ``tool_calls``, or a content is ill-typed.
    """
    try:
        return prefix.chat_texts(messages)
    except ValueError as error:
        raise EngineInputError(str(error)) from None


def _prompt_field(endpoint: Endpoint) -> str:
    if endpoint == "completions":
        return "prompt"
    if endpoint == "embeddings":
        return "input"
    raise EngineInputError(f"unsupported endpoint {endpoint!r}")


def _strings(body: Mapping[str, Any], field: str) -> list[str]:
    value = body.get(field)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return value
    if value is None:
        raise EngineInputError(f"'{field}' is required: a string or a list of strings")
    raise EngineInputError(f"'{field}' must be a string or a non-empty list of strings")


def prompt_texts(endpoint: Endpoint, body: Mapping[str, Any]) -> list[str]:
    """The prompt of a body as texts.

    Chat: the texts of all messages (:func:`chat_texts`); completions: ``prompt``; embeddings:
    ``input``; each of the last two a string or a non-empty list of strings.

    Args:
        endpoint: Which OpenAI endpoint the body is for.
        body: The OpenAI request body.

    Returns:
        The texts, one per string of the prompt (one per message text, for chat).

    Raises:
        EngineInputError: A missing or ill-typed prompt, or an unknown endpoint.
    """
    if endpoint == "chat_completions":
        return chat_texts(body.get("messages"))
    return _strings(body, _prompt_field(endpoint))


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_words(
    endpoint: Endpoint, body: Mapping[str, Any], *, allow_token_ids: bool = False
) -> int:
    """Prompt tokens of a body: one per whitespace-separated word of :func:`prompt_texts`.

    Args:
        endpoint: Which OpenAI endpoint the body is for.
        body: The OpenAI request body.
        allow_token_ids: Also accept what OpenAI accepts besides text for ``prompt`` and
            ``input``: a list whose items are strings, token ids or lists of token ids, each
            token id counting one (for engines that forward the body to a real server).

    Returns:
        The number of prompt tokens.

    Raises:
        EngineInputError: A missing or ill-typed prompt, or an unknown endpoint.
    """
    if endpoint == "chat_completions" or not allow_token_ids:
        return sum(count_words(text) for text in prompt_texts(endpoint, body))
    field = _prompt_field(endpoint)
    value = body.get(field)
    if value is None:
        raise EngineInputError(f"'{field}' is required: a string, a list of strings or token ids")
    if isinstance(value, str):
        return count_words(value)
    if isinstance(value, list) and value:
        total = 0
        for item in value:
            if isinstance(item, str):
                total += count_words(item)
            elif _is_token_id(item):
                total += 1
            elif isinstance(item, list) and all(_is_token_id(token) for token in item):
                total += len(item)
            else:
                break
        else:
            return total
    raise EngineInputError(
        f"'{field}' must be a string or a non-empty list of strings or token ids"
    )
