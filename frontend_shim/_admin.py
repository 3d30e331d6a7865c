"""The admin API: ``GET`` and ``POST /busy_threshold``.

- ``GET``: ``{"thresholds": [entry, ...]}``, one entry per model ever announced, unset thresholds
  as ``null``.
- ``POST {"model": M, <thresholds>...}``: sets the non-null values given and answers the model's
  entry (a body with no threshold returns it unchanged). A value out of range is 400, a wrong
  type or a missing ``model`` 422, a model no connected worker serves 404; these errors are
  ``{"error": "..."}``, not the OpenAI shape. The body is bounded and parsed as every request
  body is (:mod:`frontend_shim._request_body`: 413 past its value bound, 400 too deep).
- With the admin API disabled (``DYN_DISABLE_FRONTEND_ADMIN_API``) both answer 404 as an
  unknown path would.
- With ``DYN_ADMIN_TOKEN`` set, both need ``Authorization: Bearer <token>`` (compared in
  constant time); without it or with a wrong one: 401 with ``WWW-Authenticate: Bearer`` and an
  OpenAI-shaped error body, before the body is read. Nothing else of the API needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Protocol

import msgspec

from frontend_shim._load import Fleet
from frontend_shim._request_body import BadRequest, decode_json_body
from shim_common._access import bearer_matches
from shim_common._busy import ThresholdError
from shim_common._client_text import no_such_endpoint, quote, shorten
from shim_common._httpserver import HTTPRequest, HTTPResponder, error_body, json_headers
from shim_common.wire import BusyThresholds

__all__ = ["AdminRoutes", "FleetThresholds", "ThresholdBook", "parse_threshold_update"]

_THRESHOLD_FIELDS: Final = (
    "active_decode_blocks_threshold",
    "active_prefill_tokens_threshold",
    "active_prefill_tokens_threshold_frac",
)
_json_encode = msgspec.json.Encoder().encode


class ThresholdBook(Protocol):
    """Where the thresholds in force are read and set: this process's fleet
    (:class:`FleetThresholds`), or its host's (:class:`~frontend_shim._host_client.HostClient`)."""

    def all_thresholds(self) -> list[tuple[str, BusyThresholds]]:
        """``(model, thresholds)`` for every known model."""
        ...

    async def set_thresholds(self, model: str, update: BusyThresholds) -> BusyThresholds | None:
        """Set the values ``update`` gives (none: leave them) and return those in force for
        ``model``; ``None`` when no connected worker serves it."""
        ...


class FleetThresholds:
    """The thresholds of this process's own fleet.

    Args:
        fleet: the load state whose thresholds are read and set.
        on_change: told a model's new thresholds after a change (to pass them to its workers).
    """

    __slots__ = ("_fleet", "_on_change")

    def __init__(
        self,
        fleet: Fleet,
        on_change: Callable[[str, BusyThresholds], None] = lambda _model, _thresholds: None,
    ) -> None:
        self._fleet = fleet
        self._on_change = on_change

    def all_thresholds(self) -> list[tuple[str, BusyThresholds]]:
        return self._fleet.all_thresholds()

    async def set_thresholds(self, model: str, update: BusyThresholds) -> BusyThresholds | None:
        return self.set_now(model, update)

    def set_now(self, model: str, update: BusyThresholds) -> BusyThresholds | None:
        """:meth:`set_thresholds`, without waiting."""
        fleet = self._fleet
        if not any(True for _ in fleet.workers(model)):
            return None
        if not update.configured:
            return fleet.thresholds(model)
        current = fleet.set_thresholds(model, update)
        self._on_change(model, current)
        return current


class AdminRoutes:
    """The handlers of ``/busy_threshold``.

    Args:
        book: where the thresholds are read and set.
        disabled: answer 404 to both methods.
        token: ``DYN_ADMIN_TOKEN`` (``None``: no token asked).
    """

    __slots__ = ("_book", "_disabled", "_token")

    def __init__(self, book: ThresholdBook, *, disabled: bool, token: str | None = None) -> None:
        self._book = book
        self._disabled = disabled
        self._token = token.encode("ascii") if token is not None else None

    def _check_enabled(self) -> None:
        if self._disabled:
            raise BadRequest(404, no_such_endpoint("/busy_threshold"))

    async def _refused(self, request: HTTPRequest, responder: HTTPResponder) -> bool:
        """Answer 401 and return True when a token is required and not presented."""
        if self._token is None or bearer_matches(request.header(b"authorization"), self._token):
            return False
        body = error_body("/busy_threshold needs Authorization: Bearer <DYN_ADMIN_TOKEN>", 401)
        await responder.send(401, json_headers((b"www-authenticate", b"Bearer")), body)
        return True

    async def get(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        """``GET /busy_threshold``."""
        self._check_enabled()
        if await self._refused(request, responder):
            return
        entries = [_threshold_entry(model, t) for model, t in self._book.all_thresholds()]
        await responder.send(200, json_headers(), _json_encode({"thresholds": entries}))

    async def post(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        """``POST /busy_threshold``."""
        self._check_enabled()
        if await self._refused(request, responder):
            return
        model, update = parse_threshold_update(await request.read_body())
        current = await self._book.set_thresholds(model, update)
        if current is None:
            message = (
                f"Model '{shorten(model)}' not found. "
                "Thresholds can only be set for discovered models."
            )
            raise BadRequest(404, message, admin=True)
        await responder.send(200, json_headers(), _json_encode(_threshold_entry(model, current)))


def parse_threshold_update(raw: bytes) -> tuple[str, BusyThresholds]:
    """The ``POST /busy_threshold`` body: 400 out of range, 422 wrong type or missing model."""
    body = decode_json_body(raw, admin=True)
    if not isinstance(body, dict):
        raise BadRequest(422, "request body must be a JSON object", admin=True)
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest(422, "missing field `model` (a string)", admin=True)
    decode = body.get("active_decode_blocks_threshold")
    tokens = body.get("active_prefill_tokens_threshold")
    frac = body.get("active_prefill_tokens_threshold_frac")
    for name, value in zip(_THRESHOLD_FIELDS, (decode, tokens, frac), strict=True):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequest(422, f"`{name}` must be a number, got {quote(value)}", admin=True)
    if tokens is not None and not isinstance(tokens, int):
        raise BadRequest(
            422, f"`{_THRESHOLD_FIELDS[1]}` must be an integer, got {quote(tokens)}", admin=True
        )
    try:
        update = BusyThresholds.checked(
            active_decode_blocks=decode,
            active_prefill_tokens=tokens,
            active_prefill_tokens_frac=frac,
        )
    except ThresholdError as exc:
        raise BadRequest(400, str(exc), admin=True) from None
    return model, update


def _threshold_entry(model: str, thresholds: BusyThresholds) -> dict[str, Any]:
    return {
        "model": model,
        "active_decode_blocks_threshold": thresholds.active_decode_blocks,
        "active_prefill_tokens_threshold": thresholds.active_prefill_tokens,
        "active_prefill_tokens_threshold_frac": thresholds.active_prefill_tokens_frac,
    }
