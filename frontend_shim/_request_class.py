"""A completion's admission class: its priority and its tenant, read once at the edge.

Rules (the gate that acts on them is worker_ingress/_fair_queue.py):

1. Priority: the header ``x-dynamo-priority``, else the body's ``priority`` field, else 0. An
   integer in [-1000, 1000] (lower is served first); anything else is a 400 naming the header
   or the field. The body field is left in the body, so an upstream such as vLLM
   (``--scheduling-policy priority``) sees it too.
2. Tenant: the header ``x-dynamo-tenant``, else the body's OpenAI ``user`` field, else ``""``
   (the shared tenant). At most 256 characters, else a 400 naming the header or the field; a
   ``user`` that is not a string is a 400 as well.
3. The header is read from the request head, so a priority given there is known before the
   body is read (what lets a busy frontend shed a non-exempt request without reading its body).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from frontend_shim._request_body import BadRequest, quote
from shim_common._numbers import PRIORITY, NumberError
from shim_common.wire import TENANT_MAX_CHARS

__all__ = [
    "PRIORITY_HEADER",
    "TENANT_HEADER",
    "header_priority",
    "request_class",
]

PRIORITY_HEADER: Final = b"x-dynamo-priority"
TENANT_HEADER: Final = b"x-dynamo-tenant"


def _header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _priority(value: object, where: str) -> int:
    # The range is the one check of shim_common._numbers.PRIORITY (the wire's and the flags').
    if isinstance(value, bytes):
        text = value.decode("latin-1").strip()
        # int() alone would take "+5", "5_0" and non-ASCII digits: plain decimal digits only.
        digits = text[1:] if text[:1] == "-" else text
        if not digits.isascii() or not digits.isdigit():
            raise BadRequest(400, f"{where} must be an integer, got {quote(text)}")
        # More digits than the range allows: out of range whatever they are (and int() refuses
        # thousands of them, a 500), so the text is what the message shows.
        number: object = int(text) if len(digits) <= len(str(PRIORITY.high)) else None
        given = str(number) if number is not None else quote(text)
    elif isinstance(value, int) and not isinstance(value, bool):
        number, given = value, str(value)
    else:
        raise BadRequest(400, f"{where} must be an integer, got {quote(value)}")
    try:
        return PRIORITY.check(number)
    except NumberError:
        raise BadRequest(
            400, f"{where} must be in [{PRIORITY.low}, {PRIORITY.high}], got {given}"
        ) from None


def header_priority(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    """The priority the request head gives (``None``: no header).

    Raises:
        BadRequest: 400, the header is not an integer in range.
    """
    raw = _header(headers, PRIORITY_HEADER)
    return None if raw is None else _priority(raw, "header x-dynamo-priority")


def request_class(
    headers: Sequence[tuple[bytes, bytes]], body: Mapping[str, Any]
) -> tuple[int, str]:
    """``(priority, tenant)`` of a completion request (rules 1 and 2).

    Raises:
        BadRequest: 400, naming the header or the field.
    """
    priority = header_priority(headers)
    if priority is None:
        value = body.get("priority")
        priority = 0 if value is None else _priority(value, "`priority`")
    raw = _header(headers, TENANT_HEADER)
    if raw is not None:
        tenant = raw.decode("utf-8", "replace")
        where = "header x-dynamo-tenant"
    else:
        user = body.get("user")
        if user is None:
            return priority, ""
        if not isinstance(user, str):
            raise BadRequest(400, f"`user` must be a string, got {quote(user)}")
        tenant, where = user, "`user`"
    if len(tenant) > TENANT_MAX_CHARS:
        raise BadRequest(
            400, f"{where} must be at most {TENANT_MAX_CHARS} characters, got {len(tenant)}"
        )
    return priority, tenant
