"""Client input the frontend refuses, and what it reads of a completion body.

:class:`BadRequest` is the one error type of the frontend's input checks (the OpenAI API of
:mod:`frontend_shim._api` and the admin API of :mod:`frontend_shim._admin`); the API turns it
into the answer of its status. :func:`parse_completion_body` parses a completion body once and
checks the few fields the frontend itself needs (``model``, ``stream``, ``messages``); the rest
goes to the worker as it came.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shim_common import wire

__all__ = ["BadRequest", "parse_completion_body"]


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


def parse_completion_body(raw: bytes, endpoint: wire.Endpoint) -> dict[str, Any]:
    """Parse and check what the frontend itself needs of a completion body (once).

    Raises:
        BadRequest: 400, naming what is wrong.
    """
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from None
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
    return body
