"""The state of one HTTP connection's request/response cycle (sans-IO): what h11 calls the
client's state and ours.

:class:`Cycle` holds no bytes and does no I/O; the connection (:mod:`shim_common._http_connection`)
moves the bytes and tells it what happened, and asks it what the rules allow. Two states, one
per side, and the two facts of the current request that outlive its head:

- :data:`Theirs` (the client): ``IDLE`` (no head taken yet), ``SEND_BODY`` (the head is taken,
  the end of its body is not), ``DONE`` (the request's end is taken), ``GONE`` (final).
- :data:`Ours` (the server): ``IDLE`` (no request to answer), ``SEND_RESPONSE`` (a request is
  handled, nothing of its answer sent), ``SEND_BODY`` (a streamed answer's head is out, its end
  is not), ``DONE`` (the answer is complete), ``CLOSED`` (final).
- :attr:`Cycle.keep_alive`: whether the connection may carry another request after this one;
  :attr:`Cycle.waiting_for_continue`: whether the client still waits for ``100 Continue``;
  :attr:`Cycle.half_closed`: whether the client has ended its input (a half-close), a fact of
  the connection rather than of one cycle.

Rules:

1. A cycle starts with both sides ``IDLE``; a request head makes ours ``SEND_RESPONSE`` and
   theirs ``SEND_BODY``, or ``DONE`` when the request has no body left to read.
2. Exactly one answer per request: from ``SEND_RESPONSE`` only, a complete answer makes ours
   ``DONE``, a streamed one ``SEND_BODY`` until its end makes it ``DONE``. Anything else is a
   handler's mistake (``RuntimeError``), and changes nothing. The first answer ends the wait for
   ``100 Continue``: the client is not to send a body the server did not ask for.
3. An answer closes the connection (``keep_alive`` off) when the client or the handler said
   ``Connection: close``, when the body ends with the connection (a stream to an HTTP/1.0
   client), or when it goes out before the request's body is read and that body may not be
   dropped. A body may be dropped when it is declared by ``Content-Length``, at most the discard
   size, and not awaited behind ``100 Continue``.
4. Once ours is ``DONE``: with theirs ``DONE`` and ``keep_alive``, the next cycle starts; with
   theirs ``SEND_BODY`` and a body that may be dropped, the body is discarded first and the
   question asked again; otherwise the connection closes.
5. An error answer of the server's own (a refused head, a failed handler) is complete and
   closes the connection.
6. ``GONE`` (the client's EOF, a broken socket, a failed or stalled write) is final: no later
   event changes it, and no next cycle starts. ``CLOSED`` (our graceful close begun: the
   client's last bytes are read and dropped) is our last state: no answer and no next cycle
   follow it, since no request is read after it.
7. The client's EOF when every byte it sent belongs to whole requests (a half-close:
   ``shutdown(SHUT_WR)``, or a close the server cannot tell from one) is not ``GONE``: it sets
   :attr:`~Cycle.half_closed`, and theirs keeps its state. The requests already received are
   answered in order, each cycle by rules 1 to 5, and once none is left the connection closes
   (no next request can come). An EOF in the middle of a request (a partial head or body) is
   ``GONE`` (rule 6).
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = [
    "CLOSE",
    "CLOSED",
    "DISCARD_BODY",
    "DONE",
    "GONE",
    "IDLE",
    "NEXT_CYCLE",
    "SEND_BODY",
    "SEND_RESPONSE",
    "Cycle",
    "Next",
    "Ours",
    "Theirs",
]

# The states are named strings, as h11's are named sentinels, rather than enum members: on
# Python 3.11 looking up an enum member costs a descriptor call (~80 ns), and the connection
# reads these about twenty times per request.

#: The client's states (see the rules at the top of the module).
Theirs = Literal["IDLE", "SEND_BODY", "DONE", "GONE"]
#: The server's states (see the rules at the top of the module).
Ours = Literal["IDLE", "SEND_RESPONSE", "SEND_BODY", "DONE", "CLOSED"]
#: What the connection does once an answer is complete (rule 4).
Next = Literal["NEXT_CYCLE", "DISCARD_BODY", "CLOSE"]

IDLE: Final = "IDLE"
SEND_RESPONSE: Final = "SEND_RESPONSE"
SEND_BODY: Final = "SEND_BODY"
DONE: Final = "DONE"
GONE: Final = "GONE"
CLOSED: Final = "CLOSED"
NEXT_CYCLE: Final = "NEXT_CYCLE"
DISCARD_BODY: Final = "DISCARD_BODY"
CLOSE: Final = "CLOSE"


class Cycle:
    """Both sides' states of one connection's current cycle, and the rules that move them.

    Attributes:
        ours: the server's state.
        theirs: the client's state.
        keep_alive: whether the connection may carry another request after this one.
        waiting_for_continue: whether the client waits for ``100 Continue`` before its body.
    """

    __slots__ = (
        "_discardable",
        "half_closed",
        "keep_alive",
        "ours",
        "theirs",
        "waiting_for_continue",
    )

    def __init__(self) -> None:
        self.ours: Ours = IDLE
        self.theirs: Theirs = IDLE
        self.keep_alive = True
        self.waiting_for_continue = False
        self.half_closed = False
        # Whether the current request's unread body may be read and dropped (rule 3).
        self._discardable = False

    @property
    def response_started(self) -> bool:
        """Whether the current request's answer has begun (a status line is out)."""
        ours = self.ours
        return ours != IDLE and ours != SEND_RESPONSE

    @property
    def response_finished(self) -> bool:
        """Whether the current request's answer is complete."""
        ours = self.ours
        return ours in (DONE, CLOSED)

    @property
    def client_is_gone(self) -> bool:
        """Whether the client is gone (theirs ``GONE``): nothing more will come from it."""
        return self.theirs == GONE

    @property
    def input_over(self) -> bool:
        """Whether nothing more will come from the client: gone, or half-closed (rules 6, 7)."""
        return self.half_closed or self.theirs == GONE

    def request_received(
        self, keep_alive: bool, expects_continue: bool, discardable: bool, ended: bool
    ) -> None:
        """A request head was taken (rule 1).

        Args:
            keep_alive: whether the client allows another request after this one.
            expects_continue: whether the client waits for ``100 Continue``.
            discardable: whether its body may be read and dropped unread (rule 3).
            ended: whether its end was taken with the head (no body left to read).
        """
        self.ours = SEND_RESPONSE
        if self.theirs != GONE:
            self.theirs = DONE if ended else SEND_BODY
        self.keep_alive = keep_alive
        self.waiting_for_continue = expects_continue
        self._discardable = discardable

    def request_ended(self) -> None:
        """The end of the request's body was taken."""
        if self.theirs != GONE:
            self.theirs = DONE

    def continue_due(self) -> bool:
        """Whether ``100 Continue`` is to be sent now, the handler reading the body; once."""
        if self.waiting_for_continue:
            self.waiting_for_continue = False
            return True
        return False

    def start_response(self, says_close: bool, streamed: bool, ends_with_connection: bool) -> bool:
        """An answer begins (rules 2 and 3); whether it must carry ``Connection: close``.

        Args:
            says_close: the handler's own headers say ``Connection: close``.
            streamed: the body follows in pieces (ours ``SEND_BODY``) rather than whole.
            ends_with_connection: the body is delimited by the connection's end.

        Raises:
            RuntimeError: an answer was already started for this request.
        """
        if self.ours != SEND_RESPONSE:
            raise RuntimeError("a response was already started for this request")
        self.ours = SEND_BODY if streamed else DONE
        self.waiting_for_continue = False
        if ends_with_connection:
            self.keep_alive = False
        if says_close:
            self.keep_alive = False
            return False  # the handler's own header already says it
        if not self.keep_alive:
            return True
        if self.theirs != DONE and not self._discardable:
            self.keep_alive = False
            return True
        return False

    def check_streaming(self, operation: str) -> None:
        """Raise unless a streamed answer is in progress (rule 2).

        Raises:
            RuntimeError: ``operation`` (e.g. ``"send_chunk()"``) outside a started stream.
        """
        if self.ours != SEND_BODY:
            raise RuntimeError(f"{operation} outside a started stream")

    def end_response(self) -> None:
        """A streamed answer ends (rule 2).

        Raises:
            RuntimeError: no streamed answer is in progress.
        """
        self.check_streaming("end_stream()")
        self.ours = DONE

    def refuse(self) -> None:
        """The server answers with an error of its own, which closes the connection (rule 5)."""
        self.ours = DONE
        self.waiting_for_continue = False
        self.keep_alive = False

    def after_response(self) -> Next:
        """What follows a complete answer (rule 4)."""
        theirs = self.theirs
        if theirs == DONE:
            return NEXT_CYCLE if self.keep_alive else CLOSE
        if theirs == SEND_BODY and self._discardable and self.ours == DONE:
            return DISCARD_BODY
        return CLOSE

    def start_next_cycle(self) -> None:
        """Both sides are done and the connection is kept: the next request may come (rule 1).

        Raises:
            RuntimeError: the cycle is not complete, or the connection is not kept.
        """
        if not (self.ours == DONE and self.theirs == DONE and self.keep_alive):
            raise RuntimeError(f"no next cycle from ours {self.ours}, theirs {self.theirs}")
        self.ours = IDLE
        self.theirs = IDLE

    def client_gone(self) -> None:
        """The client is gone: its EOF mid-request, a broken socket, or a write that failed or
        stalled."""
        self.theirs = GONE

    def input_ended(self) -> None:
        """The client's EOF came after whole requests only (rule 7)."""
        self.half_closed = True

    def close(self) -> None:
        """Our graceful close begins (rule 6): what the client still sends is dropped."""
        self.ours = CLOSED
