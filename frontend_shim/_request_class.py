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
4. Who may claim a class (:class:`ClassPolicy`, from ``--max-client-priority`` and
   ``DYN_GATEWAY_TOKEN``). By default a request's class is what it says (rules 1 and 2). With
   a maximum client priority P, a claimed priority more urgent than P (lower) is raised to P.
   With a gateway token, only a request whose ``x-dynamo-gateway-token`` header carries it
   (compared in constant time) is from the trusted gateway: its class is taken as it says,
   unclamped. Every other request is a client speaking for itself: its priority is clamped to
   P (to 0 when P is unset: it may ask to wait longer, never to be served sooner) and its
   tenant is the shared tenant ``""``, whatever it claims. A claim is still checked (rules 1
   and 2: out of range is a 400) before it is clamped or set aside.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Mapping, Sequence
from typing import Any, Final

from frontend_shim._request_body import BadRequest
from shim_common._client_text import quote
from shim_common._httpserver import header_value
from shim_common._numbers import PRIORITY, NumberError
from shim_common.wire import TENANT_MAX_CHARS

__all__ = [
    "GATEWAY_TOKEN_ENV",
    "GATEWAY_TOKEN_HEADER",
    "OPEN_POLICY",
    "PRIORITY_HEADER",
    "ClassPolicy",
    "TENANT_HEADER",
    "header_priority",
    "request_class",
]

PRIORITY_HEADER: Final = b"x-dynamo-priority"
TENANT_HEADER: Final = b"x-dynamo-tenant"
#: The header a trusted gateway sends its token in (rule 4).
GATEWAY_TOKEN_HEADER: Final = b"x-dynamo-gateway-token"
#: The variable that holds the gateway's token (never a flag: it would show in ``ps``).
GATEWAY_TOKEN_ENV: Final = "DYN_GATEWAY_TOKEN"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassPolicy:
    """Who may claim which class (rule 4).

    Attributes:
        max_client_priority: The most urgent priority a client may claim (``None``: any, or 0
            for a client that is not the gateway when a gateway token is set).
        gateway_token: The trusted gateway's token, as bytes; ``None``: every request is
            trusted (bounded by ``max_client_priority`` alone).
    """

    max_client_priority: int | None = None
    gateway_token: bytes | None = dataclasses.field(default=None, repr=False)

    def trusts(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """Whether the request comes from the trusted gateway (there is one, and its token is
        in the request's ``x-dynamo-gateway-token`` header)."""
        token = self.gateway_token
        if token is None:
            return False
        presented = header_value(headers, GATEWAY_TOKEN_HEADER)
        # Constant time, as every token comparison (shim_common/_access.py, rule 2).
        return presented is not None and hmac.compare_digest(presented.strip(), token)

    def priority_floor(self, headers: Sequence[tuple[bytes, bytes]]) -> int | None:
        """The most urgent priority this request may have (``None``: no bound)."""
        if self.gateway_token is None:
            return self.max_client_priority
        if self.trusts(headers):
            return None
        return 0 if self.max_client_priority is None else self.max_client_priority


#: Every claim taken as it is (no flag, no variable): the default.
OPEN_POLICY: Final = ClassPolicy()


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


def header_priority(
    headers: Sequence[tuple[bytes, bytes]], policy: ClassPolicy = OPEN_POLICY
) -> int | None:
    """The priority the request head gives (``None``: no header), as the policy allows it.

    Raises:
        BadRequest: 400, the header is not an integer in range.
    """
    raw = header_value(headers, PRIORITY_HEADER)
    if raw is None:
        return None
    return _allowed(_priority(raw, "header x-dynamo-priority"), policy.priority_floor(headers))


def _allowed(priority: int, floor: int | None) -> int:
    return priority if floor is None or priority >= floor else floor


def request_class(
    headers: Sequence[tuple[bytes, bytes]],
    body: Mapping[str, Any],
    policy: ClassPolicy = OPEN_POLICY,
) -> tuple[int, str]:
    """``(priority, tenant)`` of a completion request (rules 1, 2 and 4).

    Raises:
        BadRequest: 400, naming the header or the field.
    """
    priority = header_priority(headers, policy)
    if priority is None:
        value = body.get("priority")
        priority = 0 if value is None else _priority(value, "`priority`")
        priority = _allowed(priority, policy.priority_floor(headers))
    tenant = _tenant(headers, body)
    if policy.gateway_token is not None and not policy.trusts(headers):
        return priority, ""
    return priority, tenant


def _tenant(headers: Sequence[tuple[bytes, bytes]], body: Mapping[str, Any]) -> str:
    raw = header_value(headers, TENANT_HEADER)
    if raw is not None:
        tenant = raw.decode("utf-8", "replace")
        where = "header x-dynamo-tenant"
    else:
        user = body.get("user")
        if user is None:
            return ""
        if not isinstance(user, str):
            raise BadRequest(400, f"`user` must be a string, got {quote(user)}")
        tenant, where = user, "`user`"
    if len(tenant) > TENANT_MAX_CHARS:
        raise BadRequest(
            400, f"{where} must be at most {TENANT_MAX_CHARS} characters, got {len(tenant)}"
        )
    return tenant
