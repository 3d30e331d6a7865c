"""Disaggregated serving's shared types: a worker's role and the hand-off of a prompt's KV from a
prefill worker to a decode worker. :mod:`shim_common.wire` carries them (``RuntimeConfig``'s
``worker_type``, ``Generate.handoff``, ``End.handoff``) and re-exports them; docs/protocol.md,
"Disaggregated serving", describes the exchange.

Every field is checked on decode, the cross-field rules too (:meth:`Handoff.__post_init__`, which
msgspec also runs on decode): a message carrying a bad hand-off does not decode.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from shim_common._numbers import MAX_COUNT, MAX_RANKS, Count

__all__ = ["MAX_HANDOFF_BLOCKS", "MAX_HANDOFF_ID_CHARS", "Handoff", "WorkerType"]

#: A worker's role (``RuntimeConfig.worker_type``): ``agg`` runs requests whole; ``prefill`` is
#: meant for a prefill pool's hops, ``decode`` for a decode pool's. Every role serves a plain
#: ``generate`` whole.
WorkerType = Literal["agg", "prefill", "decode"]

#: The most block names a :class:`Handoff` carries (1 Mi, about 9 MiB of msgpack): one hand-off
#: travels in an ``end`` and again, beside its prompt, in a ``generate``, and both must fit a
#: message (``wire.MAX_MESSAGE_BYTES``, 16 MiB and 64 KiB). At 16 tokens a block that is a
#: 16 Mi-token prompt, past every model's context; a prompt with more full blocks is not handed
#: off (``bad_request``).
MAX_HANDOFF_BLOCKS: Final = 2**20
#: The longest :attr:`Handoff.handle` and :attr:`Handoff.worker_id` (a worker id's own bound).
MAX_HANDOFF_ID_CHARS: Final = 256

_HandoffId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HANDOFF_ID_CHARS)]
_BlockName = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class Handoff(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt's KV, computed by a prefill worker and held for a decode worker to take.

    What a real engine's hand-off carries, engine-neutral: the prefill worker answers a
    ``prefill_only`` request with one in ``End.handoff``, and the client passes it on unchanged
    in the decode worker's ``Generate.handoff``. A message with a bad field does not decode
    (on the request plane: close 1007).
    """

    #: Opaque, unique among the hand-offs of the prefill worker that made it.
    handle: _HandoffId
    #: The prefill worker (its hello's ``worker_id``).
    worker_id: _HandoffId
    #: The prefill worker's rank that holds the KV.
    dp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
    #: Tokens per KV block on the prefill worker; a decode worker takes a hand-off of its own
    #: block size only.
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    #: The prompt's tokens, all of whose KV is handed off (at least one).
    prompt_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    #: Of the prompt's tokens, those found in the prefill worker's prefix cache.
    cached_tokens: Count
    #: The chained names of the prompt's full blocks (:func:`shim_common.prefix.block_names`),
    #: all ``prompt_tokens // block_size`` of them, or none from a prefill worker that names no
    #: blocks (its prefix cache off).
    block_names: Annotated[list[_BlockName], msgspec.Meta(max_length=MAX_HANDOFF_BLOCKS)]
    #: Bytes of KV to move: ``prompt_tokens`` times the model's KV bytes per token.
    kv_bytes: Count

    def __post_init__(self) -> None:
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("a hand-off's cached_tokens must be at most its prompt_tokens")
        if self.block_names and len(self.block_names) != self.prompt_tokens // self.block_size:
            raise ValueError(
                "a hand-off's block_names must name every full block of its prompt, or none"
            )
