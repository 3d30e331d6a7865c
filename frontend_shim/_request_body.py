"""Client input the frontend refuses, and what it reads of a request body.

:class:`BadRequest` is the one error type of the frontend's input checks (the OpenAI API of
:mod:`frontend_shim._api` and the admin API of :mod:`frontend_shim._admin`); the API turns it
into the answer of its status. Rules of a JSON request body (both APIs):

1. Bounded before it is parsed: a body of more than :data:`MAX_BODY_VALUES` JSON values (object
   members and array elements) is refused with 413 before any of it becomes Python objects. The
   count is an upper bound taken at the speed of a byte search (commas and opening brackets,
   those inside strings included), and only for bodies large enough to hold that many. So
   one body costs at most its bytes (the ``--max-body-bytes`` cap) plus about 100 bytes per
   value of its parse (about 13 MB at the bound, whatever its shape), instead of up to 15 times
   its bytes.
2. Parsed once (msgspec), then checked in one pass: nested at most :data:`MAX_BODY_DEPTH` deep,
   every integer a signed 64-bit one (what the worker's protocol carries), every number finite
   (msgspec already refuses a literal out of the double range). Else 400, naming the bound.
3. A completion body: ``model`` a non-empty string; ``stream`` a boolean; for chat a non-empty
   ``messages`` array; ``n``, when given, an integer in ``[1, MAX_CHOICES]`` (the OpenAI
   bound); for embeddings, an ``input`` array of at most :data:`MAX_EMBEDDING_INPUTS` items (the
   OpenAI bound). The rest goes to the worker as it came, which checks what its engine reads.
4. An error message quotes client input by a short prefix only (the one rule of
   :mod:`shim_common._client_text`), however long the input.
"""

from __future__ import annotations

import math
from typing import Any, Final

import msgspec

from shim_common import wire
from shim_common._client_text import quote

__all__ = [
    "MAX_BODY_DEPTH",
    "MAX_BODY_VALUES",
    "MAX_CHOICES",
    "MAX_EMBEDDING_INPUTS",
    "BadRequest",
    "decode_json_body",
    "parse_completion_body",
]

#: JSON values (object members and array elements) one request body may hold (rule 1): 2**17,
#: room for a prompt of 128 Ki token ids.
MAX_BODY_VALUES: Final = 131_072
#: Levels of nesting of a request body (rule 2); the body itself is level 1.
MAX_BODY_DEPTH: Final = 64
#: ``n``: choices per completion request, as the OpenAI API bounds it.
MAX_CHOICES: Final = 128
#: ``input`` items of one embeddings request, as the OpenAI API bounds it.
MAX_EMBEDDING_INPUTS: Final = 2048

_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**63 - 1
#: A body shorter than this cannot hold more than MAX_BODY_VALUES values (each takes at least
#: two bytes: one for itself, one for the comma before the next): no count needed.
_COUNT_FROM: Final = 2 * MAX_BODY_VALUES


class BadRequest(Exception):
    """Client input the frontend refuses; ``status`` is 400, 404, 405, 413 or 422."""

    def __init__(
        self, status: int, message: str, *, admin: bool = False, allow: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        #: The admin API answers ``{"error": "..."}``, the OpenAI API its nested error object.
        self.admin = admin
        #: The ``Allow`` header of a 405: the methods the path accepts.
        self.allow = allow




def decode_json_body(raw: bytes, *, admin: bool = False) -> Any:
    """Parse a JSON request body within the bounds of rules 1 and 2.

    Args:
        raw: the body as read.
        admin: raise errors in the admin API's shape.

    Raises:
        BadRequest: 413 past :data:`MAX_BODY_VALUES`, else 400 naming what is wrong.
    """
    if len(raw) > _COUNT_FROM:
        # Every container holds its first value and one more after each comma: at most one
        # value per comma and per opening bracket (those inside strings counted too).
        most = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if most > MAX_BODY_VALUES:
            raise BadRequest(
                413,
                f"request body holds more than {MAX_BODY_VALUES} JSON values "
                "(object members and array elements)",
                admin=admin,
            )
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}", admin=admin) from None
    except RecursionError:
        raise BadRequest(400, _too_deep(), admin=admin) from None
    problem = _out_of_bounds(body)
    if problem is not None:
        raise BadRequest(400, problem, admin=admin)
    return body


def _too_deep() -> str:
    return f"request body is nested more than {MAX_BODY_DEPTH} levels deep"


def _out_of_bounds(body: Any) -> str | None:
    """What breaks rule 2 in a parsed body, or ``None``: one pass, no recursion."""
    problem = _scalar_out_of_bounds(body)
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack and problem is None:
        value, depth = stack.pop()
        kind = type(value)
        if kind is not dict and kind is not list:
            continue
        for child in value.values() if kind is dict else value:
            kind = type(child)
            if kind is dict or kind is list:
                if depth >= MAX_BODY_DEPTH:
                    return _too_deep()
                stack.append((child, depth + 1))
            elif kind is int or kind is float:
                problem = _scalar_out_of_bounds(child)
                if problem is not None:
                    break
    return problem


def _scalar_out_of_bounds(value: Any) -> str | None:
    if type(value) is int and not _INT_MIN <= value <= _INT_MAX:
        return (
            f"an integer in the request body is out of range: {quote(value)} "
            f"(a signed 64-bit integer is at most {_INT_MAX})"
        )
    if type(value) is float and not math.isfinite(value):
        return "a number in the request body is not finite"
    return None


def parse_completion_body(raw: bytes, endpoint: wire.Endpoint) -> dict[str, Any]:
    """Parse a completion body and check what the frontend itself needs (rules 1-3).

    Raises:
        BadRequest: 413 or 400, naming what is wrong.
    """
    body = decode_json_body(raw)
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
    if endpoint == "embeddings":
        inputs = body.get("input")
        if isinstance(inputs, list) and len(inputs) > MAX_EMBEDDING_INPUTS:
            raise BadRequest(
                400,
                f"`input` holds {len(inputs)} items, at most {MAX_EMBEDDING_INPUTS} are "
                "accepted in one request",
            )
    else:
        choices = body.get("n")
        if choices is not None and (
            type(choices) is not int or not 1 <= choices <= MAX_CHOICES
        ):
            raise BadRequest(
                400, f"`n` must be an integer from 1 to {MAX_CHOICES}, got {quote(choices)}"
            )
    return body
