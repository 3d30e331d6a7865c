"""Per-request accounting: what the counters, the histograms and the router's own count hear.

One completion request leaves three traces, all kept here so that formatting the answer
(:mod:`frontend_shim._responses`) and routing it (:mod:`frontend_shim._api`) stay apart:

1. Metrics: every request is counted once by model label, endpoint and status
   (:class:`Exchange`, counted by the API when the request is over); TTFT at the first output
   of a started request, duration once its answer went out in full.
2. The status counted is the status sent: it is noted before an answer goes out, so a client that
   leaves during the answer is counted by what it was sent; a request whose client left before
   any answer is counted :data:`CLIENT_CLOSED`.
3. The fleet's view of what this frontend sent a worker: a started request is charged to the
   worker with its prompt tokens as the worker counted them
   (:meth:`~frontend_shim._load.Fleet.request_sent`; a charge the ``kv`` router made at the pick
   with its own count takes the worker's, :meth:`~frontend_shim._load.Fleet.request_started`),
   each output chunk moves that charge (:meth:`~frontend_shim._load.Fleet.request_output`), and
   the charge is dropped when the request ends, however it ends (:meth:`Progress.finished`): on
   the worker's final frame (:meth:`Progress.ended`), once every chunk read before it, in the
   same read too, is counted and before the answer's last bytes go out, so a client that sends
   its next request on the last byte finds the worker free. The frame's own token counts size
   what is taken off the worker's reports, whatever this frontend counted.
"""

from __future__ import annotations

from typing import Final

import trio

from frontend_shim._load import Fleet
from frontend_shim._metrics import FrontendMetrics
from frontend_shim._sequences import InFlight
from shim_common import wire

__all__ = ["CLIENT_CLOSED", "Exchange", "Progress"]

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


class Progress:
    """Book-keeping of a started request as its output arrives: TTFT, the router's own count
    of what the worker holds (rule 3), duration, and the final release.

    Build it with :meth:`start`, which charges the worker; call :meth:`finished` once, in a
    ``finally``.
    """

    __slots__ = (
        "_charge",
        "_first_unwritten",
        "_fleet",
        "_metrics",
        "_waiting_first",
        "exchange",
        "worker_id",
    )

    def __init__(
        self,
        fleet: Fleet,
        metrics: FrontendMetrics,
        exchange: Exchange,
        worker_id: str,
        charge: InFlight | None,
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self.exchange = exchange
        self.worker_id = worker_id
        self._charge = charge
        self._waiting_first = True
        self._first_unwritten = False

    @classmethod
    def start(
        cls,
        fleet: Fleet,
        metrics: FrontendMetrics,
        exchange: Exchange,
        worker_id: str,
        prompt_tokens: int,
        dp_rank: int | None = None,
        charge: InFlight | None = None,
    ) -> Progress:
        """The worker started the request with ``prompt_tokens`` (its count): charge it (the
        rank ``dp_rank`` when the router chose one), or bring the ``charge`` made at the pick
        to that count."""
        if charge is None:
            charge = fleet.request_sent(worker_id, prompt_tokens, dp_rank)
        else:
            fleet.request_started(worker_id, charge, prompt_tokens)
        return cls(fleet, metrics, exchange, worker_id, charge)

    @property
    def status(self) -> int:
        """The status counted for the request (that of its :class:`Exchange`)."""
        return self.exchange.status

    @status.setter
    def status(self, status: int) -> None:
        self.exchange.status = status

    def output(self, reply: wire.Chunk) -> None:
        """Account for one chunk of output in the router's own count (the first ends the
        request's prefill there at once)."""
        if self._waiting_first:
            self._waiting_first = False
            self._first_unwritten = True
        if self._charge is not None and reply.tokens:
            self._fleet.request_output(self.worker_id, self._charge, reply.tokens)

    def written(self) -> None:
        """The output so far reached the client: the time to first token, at the first call
        after the first output (from the request's arrival at the frontend to its first token
        written, what the client sees)."""
        if self._first_unwritten:
            self._first_unwritten = False
            self._metrics.observe_ttft(
                self.exchange.label, trio.current_time() - self.exchange.arrival
            )

    def completed(self) -> None:
        """The response went out in full."""
        self._metrics.observe_duration(
            self.exchange.label, trio.current_time() - self.exchange.arrival
        )

    def ended(self, final: wire.End | wire.Failed) -> None:
        """The worker ended the request: it leaves the worker's load now, before the answer's
        last bytes are written (rule 3), with the worker's word on which of its events still
        count it and on how many tokens it held."""
        self.finished(final)

    def finished(self, final: wire.End | wire.Failed | None = None) -> None:
        """The request is over, however it ended: drop the router's charge (idempotent).

        Args:
            final: the worker's final frame, when there was one (its event window, see
                :meth:`~frontend_shim._load.Fleet.request_finished`).
        """
        if self._charge is not None:
            self._fleet.request_finished(self.worker_id, self._charge, final)
            self._charge = None
