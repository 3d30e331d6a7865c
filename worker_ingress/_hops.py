"""Disaggregated serving at the worker: which hop a request is, and whether it may run here
(sans-IO; docs/protocol.md, "Disaggregated serving").

A ``generate`` is a plain request (neither field), a *prefill hop* (``prefill_only``) or a
*decode hop* (``handoff``). Rules, checked once per request after the engine prepared it and
before it meets the gate, so a refusal takes no slot:

1. A plain request runs whole on every worker, whatever its role: nothing here touches it.
2. A hop runs only on a worker whose engine hands KV off (it lists the ``disagg`` feature); an
   engine that does not is never given one, whatever a client sends (``bad_request``).
3. A request is one hop or the other, never both, and never an embedding (no prompt KV).
4. A prefill hop needs a prompt of at least one token, and of at most
   :data:`~shim_common._disagg.MAX_HANDOFF_BLOCKS` full blocks, so its hand-off fits a message.
5. A decode hop takes a hand-off of the worker's own block size only, and of the request's own
   prompt as this worker counts it (same tokens: same prompt, same tokenisation).
6. A decode hop's prompt costs its tenant nothing in the gate's fair share: it is received,
   not computed here (:func:`gate_prompt_tokens`).
"""

from __future__ import annotations

import msgspec

from shim_common._disagg import MAX_HANDOFF_BLOCKS
from shim_common.wire import Generate
from worker_ingress.engines._base import EngineInputError, PreparedRequest

__all__ = ["gate_prompt_tokens", "prepare_hop"]


def prepare_hop(
    generate: Generate, prepared: PreparedRequest, *, hands_off: bool, block_size: int
) -> PreparedRequest:
    """The prepared request with its hop (rules 1-5).

    Args:
        generate: The request as the client sent it.
        prepared: What the engine made of its body.
        hands_off: Whether the engine runs hops (``hands_off_kv``).
        block_size: The engine's tokens per KV block.

    Returns:
        ``prepared`` itself for a plain request, else a copy marked with its hop.

    Raises:
        EngineInputError: the hop cannot run here (answered ``failed``/``bad_request``).
    """
    handoff = generate.handoff
    if not generate.prefill_only and handoff is None:
        return prepared
    if not hands_off:
        raise EngineInputError(
            "this worker's engine does not run prefill-only or hand-off requests "
            "(its hello lists no 'disagg')"
        )
    if generate.prefill_only and handoff is not None:
        raise EngineInputError("a request is either prefill_only or a hand-off's decode, not both")
    if prepared.endpoint == "embeddings":
        raise EngineInputError("embeddings have no prompt KV to hand off")
    if handoff is None:
        if prepared.prompt_tokens < 1:
            raise EngineInputError("the prompt has no tokens: there is no KV to hand off")
        if prepared.prompt_tokens // block_size > MAX_HANDOFF_BLOCKS:
            raise EngineInputError(
                f"the prompt fills {prepared.prompt_tokens // block_size} KV blocks, more than a "
                f"hand-off carries ({MAX_HANDOFF_BLOCKS})"
            )
        return msgspec.structs.replace(prepared, prefill_only=True)
    if handoff.block_size != block_size:
        raise EngineInputError(
            f"the hand-off's KV blocks hold {handoff.block_size} tokens and this worker's "
            f"{block_size}: a decode worker takes a hand-off of its own block size only"
        )
    if handoff.prompt_tokens != prepared.prompt_tokens:
        raise EngineInputError(
            f"the hand-off is of a {handoff.prompt_tokens}-token prompt and this request's has "
            f"{prepared.prompt_tokens} tokens (another prompt, or another tokenisation)"
        )
    return msgspec.structs.replace(prepared, handoff=handoff)


def gate_prompt_tokens(prepared: PreparedRequest) -> int:
    """The prompt tokens a request costs its tenant at the gate (rule 6)."""
    return 0 if prepared.handoff is not None else prepared.prompt_tokens
