"""One HTTP/1.1 connection of the server: its two tasks, the loop of cycles, and the bytes.

Three sans-IO pieces decide; this module moves bytes between a :class:`trio.abc.Stream` and
them, owns the tasks and enforces the time limits. :class:`~shim_common._http_parser.RequestParser`
(llhttp) turns bytes into request events; :class:`~shim_common._http_cycle.Cycle` holds the
states of the current request/response cycle (the client's and ours: keep-alive,
``100 Continue``, a body to discard, the close) and the rules that move them;
:mod:`shim_common._http_head_writer` writes response heads. :class:`Connection` is the only code
of the server that drives them: the handler's ``HTTPRequest`` and ``HTTPResponder``
(:mod:`shim_common._http_exchange`) reach it through the narrow
:class:`~shim_common._http_exchange.HTTPChannel` interface, which it implements, and hold no
protocol state of their own.

Rules of one connection (a loop of request/response cycles):

1. Reading a request head is bounded in time and size. The first head must arrive within
   ``header_timeout`` of the accept; between requests the connection may sit idle for
   ``keepalive_timeout``, and once the next request's first bytes are in, its head must complete
   within ``header_timeout``. A head (request line and header lines) longer than
   ``max_head_bytes`` is answered 431, whether it arrives whole or in pieces; a malformed one
   400, a transfer coding other than ``chunked`` 501; then the connection is closed. A request
   carrying both ``Content-Length`` and ``Transfer-Encoding`` (any spelling; an obs-folded header
   line is malformed too) is refused 400 and the connection closed, so no second request is ever
   read out of bytes that two framings disagree on. An absolute-form target
   (``GET http://host/path``) is served as its path.
2. The body is read only when the handler asks (``HTTPRequest.read_body``). That is when
   ``100 Continue`` is sent to a client that waits for it, after the ``Content-Length`` has been
   checked against ``max_body_bytes``; a chunked body is counted as it arrives. Over the cap:
   :class:`BodyTooLarge`, answered 413 unless the handler answers itself. Each piece of the body
   must arrive within ``body_timeout`` and the whole body within ``body_total_timeout`` of the
   head, else :class:`RequestTimeout` (408).
3. A reader task owns every read for the life of the connection: it feeds the parser and so
   notices EOF at any time. A reset, a broken socket, or EOF in the middle of a request (part of
   a head or of a body) means the client left: the reader cancels the connection's main task,
   so a handler that writes nothing for a while (a long prefill) is cancelled all the same, its
   ``finally:`` blocks run, and the connection closes without a response. EOF after whole
   requests only is a half-close (rule 7 of :mod:`shim_common._http_cycle`): they are answered,
   in order, the one in flight to its end, then the connection closes; the reader tells a
   client that closed both ways by the reset one ``100 Continue`` draws, and cancels it then
   (:mod:`shim_common._http_half_close`).
   The reader runs ahead of what the main task took from the parser by at most
   ``pipeline_buffer_bytes`` (the bytes of a pipelined next request, or of a body the handler
   has not asked for yet; a read counts at least 512 bytes, each being an object of its own);
   then it stops reading, TCP flow control holds the client back, and a disconnect is noticed at
   the next write instead.
4. A handler answers exactly once: ``HTTPResponder.send`` (one complete response with
   ``Content-Length``, head and body in a single ``send_all``) or ``start_stream`` /
   ``send_chunk`` / ``end_stream`` (chunked, for server-sent events; an HTTP/1.0 client gets the
   body unframed and the connection closed after it). A response may go out while the request
   body is still unread (an early 529 decides without it). When the body is declared with a
   ``Content-Length`` of at most ``discard_body_bytes`` and the client is not waiting for
   ``100 Continue``, the server reads and drops the body after the response and keeps the
   connection (a shed client keeps its connection, so shedding stays cheap); otherwise the
   response carries ``Connection: close`` and the connection closes after it, since the next
   request cannot be found before the unread body is.
5. One bad peer or one failing handler never takes the server down. A handler exception is
   passed to ``on_error`` (to be counted) and logged, answered 500 when nothing was sent yet, and
   that connection is closed; a stream that had begun is cut short so the client sees it
   incomplete. A handler that returns without answering gets 500 too; one that returns with a
   stream still open has the stream ended for it. Invalid response headers raise
   :class:`~shim_common._http_exchange.InvalidResponse` before anything is written.
6. Keep-alive: when both sides of a cycle are done and neither said ``Connection: close``
   (an HTTP/1.0 client always does, in effect), the next cycle starts; otherwise the connection
   closes gracefully (send EOF, drain the client's last bytes for a moment, close), so a client
   still writing a body it was refused reads the answer instead of a TCP reset. An ``Upgrade``
   header is ignored (the server switches no protocol; RFC 9110 7.8), except that a chunked body
   beside it is refused 501 (the parser does not read one by hand); a ``CONNECT`` is answered as
   any other request and the connection closed after it.
7. A write that makes no progress for ``send_timeout`` (a client that stopped reading a stream)
   drops the connection: the handler is cancelled as if the client had left (its ``finally:``
   blocks run, a worker request is cancelled) and ``on_send_stall`` counts it. A large write
   goes out in pieces of ``send_piece_bytes``, each with its own deadline, so a client that
   reads slowly but steadily is kept. The same timer task as rule 1 watches this deadline.
8. While a connection waits for a request it has received nothing of (the first one, or the
   next on a keep-alive connection), it is listed in the server's :class:`IdleConnections`; a
   server out of file descriptors closes the longest idle of them first, each idle for at
   least ``MIN_IDLE_SECONDS`` (:mod:`shim_common._httpserver`). So is a connection waiting for
   more of a body that has fallen behind ``min_body_rate`` bytes per second once
   ``min_body_rate_grace`` has passed since its head: a slow upload holds a descriptor the
   server needs no longer than an idle connection does (its handler is cancelled as if the
   client had left).
9. A server that stops winds its connections down (:meth:`Connection.wind_down`): each one
   answers the request it has begun to receive, or the first one of a connection that has sent
   nothing yet (it was accepted, so it is owed an answer), with ``Connection: close``, then
   closes; one that waits for a next request on a kept connection closes at once. (A client
   that sends a next request at that very moment finds the connection closed, the race every
   keep-alive client must retry, RFC 9112 9.3.1.)
10. A request the handler can answer from its head alone (an
    :data:`~shim_common._http_exchange.AnswerAtOnce`: ``GET /live``, a shed decided before the
    body) is answered by the reader task itself, without waking the main task, when the main task
    waits for a next request and the whole request (body and end included) is in: a kept
    connection (no ``Connection: close``, not a ``CONNECT``, no ``100 Continue``, not ``HEAD``,
    the server not winding down). Its body is dropped unread, its cycle runs by the same rules, and
    the answers to every such request that arrived together leave in one write; the first request
    that does not qualify, or that the handler leaves to itself, goes to the main task with
    everything after it, in order. An exception of the answer is reported as in rule 5 and the
    request goes to the handler. While the reader writes, the connection is not idle (rule 8)
    and a wind-down waits for the write (rule 9); the write is bounded as in rule 7.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from shim_common._http_cycle import (
    CLOSE,
    CLOSED,
    DISCARD_BODY,
    DONE,
    GONE,
    IDLE,
    NEXT_CYCLE,
    SEND_BODY,
    SEND_RESPONSE,
    Cycle,
)
from shim_common._http_exchange import (
    JSON_CONTENT_TYPE,
    AnswerAtOnce,
    BodyTooLarge,
    ClientDisconnected,
    Handler,
    HTTPLimits,
    HTTPRequest,
    HTTPResponder,
    MalformedRequest,
    RequestTimeout,
    error_body,
)
from shim_common._http_half_close import watch_half_closed
from shim_common._http_head_writer import (
    CHUNKED_LINE,
    CLOSE_LINE,
    CONTINUE,
    LAST_CHUNK,
    header_lines,
    status_line,
)
from shim_common._http_idle import IdleConnections
from shim_common._http_parser import (
    END,
    ParseFailure,
    RequestHead,
    RequestParser,
    end_of_request,
)
from shim_common._socket_io import ConnectionIO

__all__ = ["Connection"]

# The server's logger, whichever of its modules writes.
logger = logging.getLogger("shim_common._httpserver")

# The most answers given at once in one write (rule 10): what a burst of pipelined requests may
# make the reader hold before it writes.
_MOST_ANSWERS_PER_WRITE = 64
# The least a read counts toward the read-ahead budget (rule 3): a read is an event of its own,
# some 40 bytes besides its data, and a client sending a byte per segment must not make the
# reader hold 64 Ki of them.
_LEAST_READ_BYTES = 512


class Connection:
    """The request/response cycles of one connection: see the rules at the top of the module.

    Two tasks share the connection. The reader task owns every read: it feeds the parser, wakes
    the main task, and notices EOF at any time (cancelling a running handler). It stops reading
    when ``pipeline_buffer_bytes`` were fed that the main task has not taken events for yet. The
    main task runs the cycles and does every write, the handler's included (through the
    :class:`~shim_common._http_exchange.HTTPChannel` methods, which act on the current request).
    The states of the current cycle are its :class:`~shim_common._http_cycle.Cycle`'s.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        handler: Handler,
        limits: HTTPLimits,
        on_error: Callable[[BaseException], None] | None,
        on_send_stall: Callable[[], None] | None = None,
        idle: IdleConnections | None = None,
        answer_at_once: AnswerAtOnce | None = None,
    ) -> None:
        self._stream = stream
        self._io = ConnectionIO(stream)  # the system calls tried first (a plain TCP stream)
        self._idle = idle
        self._answer_at_once = answer_at_once
        # The main task waits for a next request with every event taken (the reader may answer
        # at once, rule 10), and whether it is listed as idle meanwhile (rule 8).
        self._awaiting_head = False
        self._listed_idle = False
        # The reader is writing answers given at once; how many writes it has made.
        self._writing_at_once = False
        self._writes_at_once = 0
        self._parser = RequestParser(
            limits.max_head_bytes,
            max_headers=limits.max_headers,
            max_body_chunks=limits.max_body_chunks,
            bytes_per_extra_chunk=limits.bytes_per_extra_chunk,
        )
        self._events = self._parser.events
        self._handler = handler
        self._limits = limits
        self._on_error = on_error
        self._on_send_stall = on_send_stall
        # When the write in progress is due (rule 7); infinite while none is in progress.
        self._send_deadline = math.inf
        # Both sides' states of the current cycle, and the rules that move them.
        self._cycle = Cycle()
        # Bytes fed to the parser since the main task last found its events all taken (the
        # reader's budget).
        self._unconsumed = 0
        self._data_arrived = trio.lowlevel.ParkingLot()  # the main task waits here for bytes
        self._budget_freed = trio.lowlevel.ParkingLot()  # the reader waits here for budget
        # The main task's scope, one for the connection's life (entering a fresh scope per
        # request costs more): the reader cancels it when the client leaves, the timer when a
        # request head is late.
        self._scope = trio.CancelScope()
        # When the awaited request head is due; infinite while no head is awaited. A plain float
        # that the timer task polls, because moving a cancel scope's deadline twice per request
        # costs several percent of the request rate.
        self._head_deadline = math.inf
        # The request being handled: its head, and when it arrived.
        self._request: RequestHead | None = None
        self._request_started = 0.0
        # The server stops: no request after the current one (rule 9).
        self._winding_down = False

    @property
    def response_started(self) -> bool:
        """Whether the current request's status line has gone out."""
        return self._cycle.response_started

    @property
    def response_finished(self) -> bool:
        """Whether the current request's response is complete."""
        return self._cycle.response_finished

    # -- the handler's requests (the HTTPChannel interface) ------------------------------------

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send one complete response with ``Content-Length``, head and body in one write."""
        lines, says_close = header_lines(headers)  # validates: bad headers leave nothing started
        head = status_line(status) + lines + b"content-length: %d\r\n" % len(body)
        if self._cycle.start_response(says_close, False, False):
            head += CLOSE_LINE
        if body and not self._head_only():
            await self._send_all(head + b"\r\n" + body)
        else:
            await self._send_all(head + b"\r\n")

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the head of a chunked response (no chunking for an HTTP/1.0 client)."""
        lines, says_close = header_lines(headers)  # validates: bad headers leave nothing started
        head = status_line(status) + lines
        chunked = self._chunked_response()
        if chunked:
            head += CHUNKED_LINE
        # Unchunked, the body ends with the connection (a HEAD answer has none).
        ends_with_connection = not chunked and not self._head_only()
        if self._cycle.start_response(says_close, True, ends_with_connection):
            head += CLOSE_LINE
        await self._send_all(head + b"\r\n")

    async def send_data(self, data: bytes) -> None:
        """Send one piece of a streamed body; empty data sends nothing."""
        self._cycle.check_streaming("send_chunk()")
        if not data or self._head_only():
            return
        if self._chunked_response():
            await self._send_all(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            await self._send_all(data)

    async def end_stream(self) -> None:
        """Send the end of a streamed body."""
        self._cycle.end_response()
        if self._chunked_response() and not self._head_only():
            await self._send_all(LAST_CHUNK)

    def _head_only(self) -> bool:
        return self._request is not None and self._request.method == b"HEAD"

    def _chunked_response(self) -> bool:
        # An HTTP/1.0 client does not know chunking: its streamed body ends with the connection.
        return self._request is not None and self._request.http_version >= b"1.1"

    # -- moving bytes -------------------------------------------------------------------------

    async def _send_all(self, data: bytes) -> None:
        timeout = self._limits.send_timeout
        piece = self._limits.send_piece_bytes
        try:
            if len(data) <= piece:
                # What the kernel takes at once needs no deadline (rule 7 bounds a wait).
                sent = self._io.send_now(data)
                if sent < len(data):
                    self._send_deadline = trio.current_time() + timeout
                    await self._io.send_rest(data, sent)
            else:
                view = memoryview(data)
                for start in range(0, len(data), piece):
                    self._send_deadline = trio.current_time() + timeout
                    await self._io.send_all(view[start : start + piece])
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._cycle.client_gone()
            raise ClientDisconnected("the client closed the connection") from exc
        finally:
            self._send_deadline = math.inf

    async def _read_forever(self) -> None:
        """The reader task: socket to parser, bounded, until EOF (or cancelled with the
        connection)."""
        limits = self._limits
        parser = self._parser
        cycle = self._cycle
        drained = 0
        while True:
            if self._unconsumed >= limits.pipeline_buffer_bytes and cycle.ours != CLOSED:
                await self._budget_freed.park()
                continue
            try:
                received = await self._io.receive_some(limits.receive_bytes)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                break  # a reset: the client left
            if not received:
                if cycle.ours != CLOSED and not parser.mid_request:  # a half-close (rule 3)
                    cycle.input_ended()
                    self._wake_main_task()
                    if await watch_half_closed(cycle, self._io, lambda: self._request):
                        return
                break
            if cycle.ours == CLOSED:  # closing: what the client still sends is dropped
                drained += len(received)
                if drained >= limits.linger_bytes:
                    break
                continue
            parser.feed(received)
            self._unconsumed += max(len(received), _LEAST_READ_BYTES)
            if self._awaiting_head and self._answer_at_once is not None:
                if not await self._answer_ready_requests():
                    break  # the client left
                if self._awaiting_head:
                    continue  # all answered: the main task waits on
            self._wake_main_task()
        cycle.client_gone()
        # The client left: stop whatever the main task does, a running handler included.
        self._scope.cancel()
        self._data_arrived.unpark_all()

    def _wake_main_task(self) -> None:
        self._awaiting_head = False  # what is in the parser is the main task's now
        self._data_arrived.unpark_all()

    async def _answer_ready_requests(self) -> bool:
        """Answer at once the requests at the front of the parser's events that qualify (rule
        10), in one write per batch; ``False`` when the client left meanwhile.

        The main task stays asleep while nothing is left for it (a partial head, a request the
        handler leaves to itself, a wind-down); otherwise it is woken as the reader would.
        """
        events = self._events
        parser = self._parser
        limits = self._limits
        # Bounded: each batch takes at least one whole request out of the events.
        while True:
            answers = self._take_answers()
            if not answers:
                break
            if not events and not parser.mid_request:
                self._unconsumed = 0  # every byte fed is consumed (see _wait_for_data)
            self._writes_at_once += 1
            if self._listed_idle and self._idle is not None:
                self._idle.discard(self)  # busy while it writes (rule 8)
            self._head_deadline = math.inf  # the write has its own deadline (rule 7)
            self._writing_at_once = True
            try:
                await self._send_all(b"".join(answers))
            except ClientDisconnected:
                return False
            finally:
                self._writing_at_once = False
            waits_for_more = bool(events) or parser.mid_request
            self._head_deadline = trio.current_time() + (
                limits.header_timeout if waits_for_more else limits.keepalive_timeout
            )
            if waits_for_more or self._winding_down:
                break
            if self._listed_idle and self._idle is not None:
                self._idle.add(self)
            return True
        if events or parser.mid_request or self._winding_down:
            self._wake_main_task()
        return True

    def _take_answers(self) -> list[bytes]:
        """The answers given at once to the whole requests at the front of the events, each
        request's events taken and its cycle run (rule 10)."""
        events = self._events
        cycle = self._cycle
        answer = self._answer_at_once
        answers: list[bytes] = []
        # Bounded by the answers per write and by the events (each pass takes a request's).
        while events and answer is not None and len(answers) < _MOST_ANSWERS_PER_WRITE:
            head = events[0]
            if not (
                isinstance(head, RequestHead)
                and head.keep_alive
                and not head.upgrade
                and not head.expects_continue
                and head.method != b"HEAD"
                and not self._winding_down
                and cycle.ours == IDLE
                and cycle.theirs == IDLE
            ):
                break
            ends_at = end_of_request(events)
            if ends_at < 0:
                break  # its body is not all in (or its framing broke): the main task's
            request = HTTPRequest(self, head.method, head.target, head.headers, head.http_version)
            try:
                response = answer(request)
            except Exception as exc:
                self.report(exc)
                response = None
            if response is None:
                break
            for _ in range(ends_at + 1):
                events.popleft()
            # The cycle of a request taken whole and answered whole on a kept connection: its
            # after_response is NEXT_CYCLE.
            cycle.request_received(True, False, False, True)
            cycle.start_response(False, False, False)
            cycle.start_next_cycle()
            answers.append(response)
        return answers

    async def _wait_for_data(self) -> None:
        """Wait until the reader fed the parser more bytes (or saw EOF); every event is taken."""
        # The parser holds at most a partial head (bounded by max_head_bytes) or partial chunk
        # framing: what the reader fed before is consumed, so its budget renews.
        self._unconsumed = 0
        self._budget_freed.unpark_all()
        if not self._cycle.input_over:
            await self._data_arrived.park()

    # -- the connection loop ------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_forever)
                nursery.start_soon(self._enforce_deadlines)
                with self._scope:
                    await self._run_cycles()
                nursery.cancel_scope.cancel()
        finally:
            if self._idle is not None:
                self._idle.discard(self)

    def close_idle(self) -> None:
        """End the connection now, as it waits for a request it has received nothing of, or for
        more of a body that has fallen behind the minimum rate (rule 8)."""
        self._scope.cancel()

    def wind_down(self) -> None:
        """End the connection after the request it answers or awaits first (rule 9)."""
        self._winding_down = True
        self._cycle.keep_alive = False
        self._wake_main_task()  # a wait for a next request ends (see _read_head)

    async def _run_cycles(self) -> None:
        cycle = self._cycle
        first = True
        while True:
            request = await self._read_head(first)
            if request is None:
                return
            first = False
            if not await self._handle(request):
                return
            after = cycle.after_response()
            if after == DISCARD_BODY:
                after = cycle.after_response() if await self._discard_body() else CLOSE
            if after != NEXT_CYCLE:
                await self._close_gracefully()
                return
            cycle.start_next_cycle()

    async def _read_head(self, first: bool) -> RequestHead | None:
        """Wait for the next request head; ``None`` when the connection should just end."""
        limits = self._limits
        events = self._events
        idle = not first and not events and not self._parser.mid_request
        # Past this deadline the timer cancels the connection's main task: a client that idles
        # or dribbles is simply disconnected.
        self._head_deadline = trio.current_time() + (
            limits.keepalive_timeout if idle else limits.header_timeout
        )
        # Each pass either returns or waits for more bytes of a head the parser caps at
        # max_head_bytes, so the loop is bounded by that size (and by the deadline).
        while True:
            if events:
                event = events.popleft()
                if isinstance(event, RequestHead):
                    self._head_deadline = math.inf
                    return event
                if isinstance(event, ParseFailure):
                    await self._answer_protocol_error(event)
                return None  # pragma: no cover - a head always comes first
            if self._cycle.input_over:
                return None  # a close between requests, a partial head at EOF, a half-close
            if (
                self._winding_down
                and not first
                and not self._parser.mid_request
                and not self._writing_at_once  # a wind-down waits for the reader's write
            ):
                return None  # no next request is awaited (rule 9)
            writes_at_once = self._writes_at_once
            # Every event is taken: the reader may answer what comes next itself (rule 10).
            self._awaiting_head = True
            try:
                if self._idle is None or self._parser.mid_request:
                    await self._wait_for_data()
                else:
                    # Nothing of a request yet: closable when the process runs out of
                    # descriptors.
                    self._idle.add(self)
                    self._listed_idle = True
                    try:
                        await self._wait_for_data()
                    finally:
                        self._listed_idle = False
                        self._idle.discard(self)
            finally:
                self._awaiting_head = False
            if writes_at_once != self._writes_at_once:
                # The reader answered requests meanwhile: this is the wait for the one after.
                first = False
                idle = True
            if idle and (events or self._parser.mid_request):
                idle = False
                self._head_deadline = trio.current_time() + limits.header_timeout

    async def _enforce_deadlines(self) -> None:
        """The timer task: cancel the main task once an awaited request head (rule 1) or a
        write in progress (rule 7) is overdue.

        It wakes at the earlier recorded deadline, or after the shortest timeout while none is
        recorded (a deadline set meanwhile is then noticed at most that late), so it costs
        nothing per request and one wake-up per timeout period.
        """
        limits = self._limits
        poll = min(limits.header_timeout, limits.keepalive_timeout, limits.send_timeout)
        while True:
            now = trio.current_time()
            if self._head_deadline <= now:
                self._scope.cancel()
                return
            if self._send_deadline <= now:
                self._cycle.client_gone()
                logger.info("dropping a client that read nothing for %s s", limits.send_timeout)
                if self._on_send_stall is not None:
                    self._on_send_stall()
                self._scope.cancel()
                return
            await trio.sleep_until(min(self._head_deadline, self._send_deadline, now + poll))

    async def _answer_protocol_error(self, failure: ParseFailure) -> None:
        if self._cycle.theirs == GONE:
            return
        try:
            await self._send_error(failure.status, f"malformed request: {failure.reason}")
        except ClientDisconnected:
            return
        await self._close_gracefully()

    async def _send_error(self, status: int, message: str) -> None:
        body = error_body(message, status)
        content_type = b"%s: %s\r\n" % JSON_CONTENT_TYPE
        head = status_line(status) + content_type + b"content-length: %d\r\n" % len(body)
        self._cycle.refuse()
        await self._send_all(head + CLOSE_LINE + b"\r\n" + body)

    async def _handle(self, head: RequestHead) -> bool:
        """Run the handler for one request; ``True`` when the connection may go on."""
        events = self._events
        cycle = self._cycle
        # A request without a body ends right after its head, in the same piece of input.
        ended = bool(events) and events[0] is END
        if ended:
            events.popleft()
        self._request = head
        self._request_started = trio.current_time()
        declared = head.content_length
        # Only a plain Content-Length body (a request with both framings never gets here).
        discardable = (
            declared is not None
            and declared <= min(self._limits.discard_body_bytes, self._limits.max_body_bytes)
            and not head.expects_continue
        )
        # Positional arguments: this runs once per request.
        cycle.request_received(
            head.keep_alive and not head.upgrade and not self._winding_down,
            head.expects_continue,
            discardable,
            ended,
        )
        request = HTTPRequest(self, head.method, head.target, head.headers, head.http_version)
        failure: Exception | None = None
        if cycle.theirs == GONE:
            return False  # the client left before its request could start
        try:
            # The reader cancels this when the client leaves (see _read_forever).
            await self._handler(request, HTTPResponder(self))
        except Exception as exc:
            failure = exc

        if cycle.client_is_gone:  # the reader may have seen EOF meanwhile
            return False
        if failure is not None:
            return await self._after_failure(failure)
        ours = cycle.ours
        if ours == SEND_RESPONSE:
            error = RuntimeError(f"handler returned without a response to {request.path}")
            self.report(error)
            await self._send_error_and_close(500, "internal error")
            return False
        if ours == SEND_BODY:
            await self.end_stream()
        return True

    async def _after_failure(self, failure: Exception) -> bool:
        if isinstance(failure, ClientDisconnected):
            return False
        if isinstance(failure, BodyTooLarge):
            status, message = 413, f"request body too large (limit {self._limits.max_body_bytes})"
        elif isinstance(failure, RequestTimeout):
            status, message = 408, "request body timed out"
        elif isinstance(failure, MalformedRequest):
            status, message = failure.status, f"malformed request: {failure}"
        else:
            self.report(failure)
            status, message = 500, "internal error"
        if self.response_started:
            # Cut the response short: without the final chunk the client sees it incomplete.
            return False
        await self._send_error_and_close(status, message)
        return False

    async def _send_error_and_close(self, status: int, message: str) -> None:
        if self.response_started:
            return  # the response has begun: nothing else can be sent in its place
        try:
            await self._send_error(status, message)
        except ClientDisconnected:
            return
        await self._close_gracefully()

    def report(self, error: BaseException) -> None:
        """Log an unexpected exception and pass it to ``on_error`` (rule 5)."""
        logger.error("HTTP handler failed", exc_info=error)
        if self._on_error is not None:
            try:
                self._on_error(error)
            except Exception:
                logger.exception("on_error callback failed")

    # -- reading the body and watching for disconnects -----------------------------------------

    async def receive_body(self) -> bytes:
        """Read the current request's whole body (rule 2)."""
        head = self._request
        assert head is not None, "a body is read only while a request is handled"
        cycle = self._cycle
        if cycle.theirs == DONE:
            return b""
        limits = self._limits
        declared = head.content_length
        if declared is not None and declared > limits.max_body_bytes:
            raise BodyTooLarge(f"declared body of {declared} bytes")
        if cycle.continue_due():
            await self._send_all(CONTINUE)
        events = self._events
        started = self._request_started
        whole_body_due = started + limits.body_total_timeout
        # Data arrived since the last wait: the next wait starts a fresh per-piece deadline (the
        # clock is read only when waiting, as most bodies arrive with their head).
        fresh = True
        piece_due = math.inf
        # The first piece as it came (the usual body, whole in one read, is never copied), then
        # one buffer grown in place: a list of pieces cost an object per read, some 40 times a
        # body that arrives a byte per TCP segment.
        body: bytes | bytearray = b""
        size = 0
        # Every pass consumes at least one byte of a body capped at max_body_bytes, or ends,
        # or waits within the deadlines (at most once more when the upload falls behind the
        # minimum rate).
        while True:
            if events:
                event = events.popleft()
                if event is END:
                    cycle.request_ended()
                    return body if isinstance(body, bytes) else bytes(body)
                if isinstance(event, bytes):
                    size += len(event)
                    if size > limits.max_body_bytes:
                        raise BodyTooLarge(f"body over {limits.max_body_bytes} bytes")
                    if not body:
                        body = event
                    else:
                        if isinstance(body, bytes):
                            body = bytearray(body)
                        body += event
                    fresh = True
                    continue
                assert isinstance(event, ParseFailure), event
                raise MalformedRequest(event.reason, event.status)
            if cycle.input_over:  # half-closed mid-body is GONE: this is a departure either way
                raise ClientDisconnected("the client left during the request body")
            now = trio.current_time()
            if fresh:
                piece_due = now + limits.body_timeout
                fresh = False
            due = min(piece_due, whole_body_due)
            # When this upload falls behind the minimum rate (rule 8); never without a registry
            # of idle connections to be listed in.
            behind = (
                math.inf
                if self._idle is None
                else started + limits.min_body_rate_grace + size / limits.min_body_rate
            )
            if self._idle is not None and now >= behind:
                self._idle.add(self)
                try:
                    with trio.move_on_at(due) as scope:
                        await self._wait_for_data()
                finally:
                    self._idle.discard(self)
            else:
                with trio.move_on_at(min(due, behind)) as scope:
                    await self._wait_for_data()
                if scope.cancelled_caught and behind < due:
                    continue  # fell behind the rate: the next wait is a closable one
            if scope.cancelled_caught:
                if piece_due <= whole_body_due:
                    raise RequestTimeout(f"no body data for {limits.body_timeout} s")
                raise RequestTimeout(f"body not complete in {limits.body_total_timeout} s")

    async def _discard_body(self) -> bool:
        """Read and drop the rest of a small declared body; ``True`` when the cycle completed.

        The body of an early response usually came in with the head, so this rarely waits; when
        it must, the wait is bounded by ``body_timeout``.
        """
        events = self._events
        dropped = 0
        # Bounded: each pass consumes body bytes (at most discard_body_bytes) or ends.
        while True:
            if events:
                event = events.popleft()
                if event is END:
                    self._cycle.request_ended()
                    return True
                if isinstance(event, bytes):
                    dropped += len(event)
                    if dropped > self._limits.discard_body_bytes:
                        return False
                    continue
                return False  # the framing broke mid-body: just close
            if self._cycle.input_over:
                return False
            with trio.move_on_after(self._limits.body_timeout) as scope:
                await self._wait_for_data()
            if scope.cancelled_caught:
                return False

    async def _close_gracefully(self) -> None:
        """Half-close, let the reader drain what the client still sends (bounded), then close.

        Closing a socket with unread bytes makes the kernel send a reset, which can destroy the
        response before the client reads it; draining until the client's EOF avoids that.
        """
        self._cycle.close()
        self._budget_freed.unpark_all()
        stream = self._stream
        if isinstance(stream, trio.abc.HalfCloseableStream):
            try:
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
        with trio.move_on_after(self._limits.linger_timeout):
            # The reader wakes this task only at EOF (or after linger_bytes): one pass or two.
            while not self._cycle.input_over:
                await self._data_arrived.park()
