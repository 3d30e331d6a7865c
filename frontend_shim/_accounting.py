"""Per-request accounting: what the request counters hear of one completion request.

1. Every request is counted once by model label, endpoint and status (:class:`Exchange`,
   counted by the API when the request is over); a started request's time to first token and
   duration are observed by its dispatch (:mod:`frontend_shim._dispatch`, rule 3).
2. The status counted is the status sent: it is noted before an answer goes out, so a client that
   leaves during the answer is counted by what it was sent; a request whose client left before
   any answer is counted :data:`CLIENT_CLOSED`.
"""

from __future__ import annotations

from typing import Final

from shim_common import wire

__all__ = ["CLIENT_CLOSED", "Exchange"]

#: Status counted for a request whose client left before an answer (nginx's convention).
CLIENT_CLOSED: Final = 499


class Exchange:
    """Book-keeping of one completion request for metrics (rules 1 and 2)."""

    __slots__ = ("arrival", "endpoint", "label", "status")

    def __init__(self, endpoint: wire.Endpoint, label: str, arrival: float) -> None:
        self.endpoint = endpoint
        self.label = label
        self.arrival = arrival
        #: The status of the answer sent, or :data:`CLIENT_CLOSED` before any.
        self.status: int = CLIENT_CLOSED
