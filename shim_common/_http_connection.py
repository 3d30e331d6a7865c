"""One HTTP/1.1 connection of the server: its two tasks and the loop of request/response cycles.

h11 does the protocol (parsing, framing, keep-alive bookkeeping); :class:`Connection` moves bytes
between a :class:`trio.abc.Stream` and h11, owns the tasks and enforces the limits. It is the only
code of the server that drives h11: the handler's ``HTTPRequest`` and ``HTTPResponder``
(:mod:`shim_common._http_exchange`) reach it through the narrow
:class:`~shim_common._http_exchange.HTTPChannel` interface, which it implements, and hold no
protocol state of their own.

Rules of one connection (a loop of request/response cycles):

1. Reading a request head is bounded in time and size. The first head must arrive within
   ``header_timeout`` of the accept; between requests the connection may sit idle for
   ``keepalive_timeout``, and once the next request's first bytes are in, its head must complete
   within ``header_timeout``. A head still incomplete past ``max_head_bytes`` is answered 431, a
   malformed one 400 (from ``h11.RemoteProtocolError``), and the connection is closed.
2. The body is read only when the handler asks (``HTTPRequest.read_body``). That is when
   ``100 Continue`` is sent to a client that waits for it, after the ``Content-Length`` has been
   checked against ``max_body_bytes``; a chunked body is counted as it arrives. Over the cap:
   :class:`BodyTooLarge`, answered 413 unless the handler answers itself.
3. A reader task owns every read for the life of the connection: it feeds h11 and so notices
   EOF at any time. EOF or a broken socket means the client left: the reader cancels the
   connection's main task, so a handler that writes nothing for a while (a long prefill) is
   cancelled all the same, its ``finally:`` blocks run, and the connection closes without a
   response. The reader runs ahead of what the main task asked h11 for by at most
   ``pipeline_buffer_bytes`` (the bytes of a pipelined next request, or of a body the handler
   has not asked for yet); then it stops reading, TCP flow control holds the client back, and
   a disconnect is noticed at the next write instead.
4. A handler answers exactly once: ``HTTPResponder.send`` (one complete response with
   ``Content-Length``, head and body in a single ``send_all``) or ``start_stream`` /
   ``send_chunk`` / ``end_stream`` (chunked, for server-sent events). A response may go out
   while the request body is still unread (an early 529 decides without it). When the body is
   declared with a ``Content-Length`` of at most ``discard_body_bytes`` and the client is not
   waiting for ``100 Continue``, the server reads and drops the body after the response and
   keeps the connection (a shed client keeps its connection, so shedding stays cheap);
   otherwise the response carries ``Connection: close`` and the connection closes after it,
   because h11 cannot start the next cycle before the client's side is done.
5. One bad peer or one failing handler never takes the server down. A handler exception is
   passed to ``on_error`` (to be counted) and logged, answered 500 when nothing was sent yet, and
   that connection is closed; a stream that had begun is cut short so the client sees it
   incomplete. A handler that returns without answering gets 500 too; one that returns with a
   stream still open has the stream ended for it.
6. Keep-alive: when both sides of a cycle are done, h11 starts the next cycle; otherwise the
   connection closes gracefully (send EOF, drain the client's last bytes for a moment, close), so a
   client still writing a body it was refused reads the answer instead of a TCP reset.
7. A write that makes no progress for ``send_timeout`` (a client that stopped reading a stream)
   drops the connection: the handler is cancelled as if the client had left (its ``finally:``
   blocks run, a worker request is cancelled) and ``on_send_stall`` counts it. A large write
   goes out in pieces of ``send_piece_bytes``, each with its own deadline, so a client that
   reads slowly but steadily is kept. The same timer task as rule 1 watches this deadline.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from http import HTTPStatus

import h11
import trio

from shim_common._http_exchange import (
    JSON_CONTENT_TYPE,
    BodyTooLarge,
    ClientDisconnected,
    Handler,
    HTTPLimits,
    HTTPRequest,
    HTTPResponder,
    RequestTimeout,
    error_body,
)

__all__ = ["Connection"]

# The server's logger, whichever of its modules writes.
logger = logging.getLogger("shim_common._httpserver")

_REASONS: dict[int, bytes] = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}
_CONNECTION_CLOSE = (b"connection", b"close")


class Connection:
    """The request/response cycles of one connection: see the rules at the top of the module.

    Two tasks share the connection. The reader task owns every read: it feeds h11, wakes the main
    task, and notices EOF at any time (cancelling a running handler). It stops reading when
    ``pipeline_buffer_bytes`` were fed that the main task has not asked h11 for yet. The main task
    runs the cycles and does every write, the handler's included (through the
    :class:`~shim_common._http_exchange.HTTPChannel` methods, which act on the current request).

    Attributes:
        response_started: whether the current request's status line has gone out.
        response_finished: whether the current request's response is complete.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        handler: Handler,
        limits: HTTPLimits,
        on_error: Callable[[BaseException], None] | None,
        on_send_stall: Callable[[], None] | None = None,
    ) -> None:
        self._stream = stream
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        self._handler = handler
        self._limits = limits
        self._on_error = on_error
        self._on_send_stall = on_send_stall
        # When the write in progress is due (rule 7); infinite while none is in progress.
        self._send_deadline = math.inf
        # Set when the client is known to be gone (EOF, reset, or a failed write).
        self._client_gone = False
        self._eof = False
        # Bytes fed to h11 since the main task last found h11 needing more (the reader's budget).
        self._unconsumed = 0
        self._data_arrived = trio.lowlevel.ParkingLot()  # the main task waits here for bytes
        self._budget_freed = trio.lowlevel.ParkingLot()  # the reader waits here for budget
        self._discarding = False  # closing: the reader drops what it reads
        # The main task's scope, one for the connection's life (entering a fresh scope per
        # request costs more): the reader cancels it when the client leaves, the timer when a
        # request head is late.
        self._scope = trio.CancelScope()
        # When the awaited request head is due; infinite while no head is awaited. A plain float
        # that the timer task polls, because moving a cancel scope's deadline twice per request
        # costs several percent of the request rate.
        self._head_deadline = math.inf
        # The request being handled: its head, whether its unread body may be dropped (rule 4),
        # whether it is a HEAD request (answered without a body), and its response's state.
        self._request: h11.Request | None = None
        self._body_discardable = False
        self._head_only = False
        self.response_started = False
        self.response_finished = False

    # -- the handler's requests (the HTTPChannel interface) ------------------------------------

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send one complete response with ``Content-Length``, head and body in one write."""
        all_headers = [*headers, (b"content-length", b"%d" % len(body))]
        if self._closes_after_response() and _CONNECTION_CLOSE not in headers:
            all_headers.append(_CONNECTION_CLOSE)
        head = _response_head(status, all_headers)  # validates: bad headers leave nothing started
        self._claim_response()
        self.response_finished = True
        h = self._h11
        data = _sent(h.send(head))
        if body and not self._head_only:
            data += _sent(h.send(h11.Data(data=body)))
        data += _sent(h.send(h11.EndOfMessage()))
        await self._send_all(data)

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the head of a chunked response (no chunking for an HTTP/1.0 client)."""
        if self._closes_after_response() and _CONNECTION_CLOSE not in headers:
            headers = [*headers, _CONNECTION_CLOSE]
        head = _response_head(status, headers)  # validates: bad headers leave nothing started
        self._claim_response()
        await self._send_all(_sent(self._h11.send(head)))

    async def send_data(self, data: bytes) -> None:
        """Send one piece of a streamed body; empty data sends nothing."""
        if not self.response_started or self.response_finished:
            raise RuntimeError("send_chunk() outside a started stream")
        if data and not self._head_only:
            await self._send_all(_sent(self._h11.send(h11.Data(data=data))))

    async def end_stream(self) -> None:
        """Send the end of a streamed body."""
        if not self.response_started or self.response_finished:
            raise RuntimeError("end_stream() outside a started stream")
        self.response_finished = True
        await self._send_all(_sent(self._h11.send(h11.EndOfMessage())))

    def _claim_response(self) -> None:
        if self.response_started:
            raise RuntimeError("a response was already started for this request")
        self.response_started = True

    def _closes_after_response(self) -> bool:
        """Whether a response sent now must end the connection (rule 4)."""
        return self._h11.their_state is not h11.DONE and not self._body_discardable

    # -- moving bytes -------------------------------------------------------------------------

    async def _send_all(self, data: bytes) -> None:
        timeout = self._limits.send_timeout
        piece = self._limits.send_piece_bytes
        try:
            if len(data) <= piece:
                self._send_deadline = trio.current_time() + timeout
                await self._stream.send_all(data)
            else:
                view = memoryview(data)
                for start in range(0, len(data), piece):
                    self._send_deadline = trio.current_time() + timeout
                    await self._stream.send_all(view[start : start + piece])
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._client_gone = True
            raise ClientDisconnected("the client closed the connection") from exc
        finally:
            self._send_deadline = math.inf

    async def _read_forever(self) -> None:
        """The reader task: socket to h11, bounded, until EOF (or cancelled with the connection)."""
        limits = self._limits
        drained = 0
        while True:
            if self._unconsumed >= limits.pipeline_buffer_bytes and not self._discarding:
                await self._budget_freed.park()
                continue
            try:
                received = await self._stream.receive_some(limits.receive_bytes)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                received = b""
            if not received:
                break
            if self._discarding:
                drained += len(received)
                if drained >= limits.linger_bytes:
                    break
                continue
            # Socket streams give bytes; other streams may give a bytearray.
            self._h11.receive_data(received if isinstance(received, bytes) else bytes(received))
            self._unconsumed += len(received)
            self._data_arrived.unpark_all()
        self._eof = True
        self._client_gone = True
        if not self._discarding:
            self._h11.receive_data(b"")
        # The client left: stop whatever the main task does, a running handler included.
        self._scope.cancel()
        self._data_arrived.unpark_all()

    async def _wait_for_data(self) -> None:
        """Wait until the reader fed h11 more bytes (or saw EOF); h11 has just said NEED_DATA."""
        # NEED_DATA means h11 holds at most a partial event, capped by max_head_bytes or a
        # partial chunk header: what the reader fed before is consumed, so its budget renews.
        self._unconsumed = 0
        self._budget_freed.unpark_all()
        if not self._eof:
            await self._data_arrived.park()

    # -- the connection loop ------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_forever)
            nursery.start_soon(self._enforce_deadlines)
            with self._scope:
                await self._run_cycles()
            nursery.cancel_scope.cancel()

    async def _run_cycles(self) -> None:
        first = True
        while True:
            request = await self._read_head(first)
            if request is None:
                return
            first = False
            keep_alive = await self._handle(request)
            if not keep_alive:
                return
            if (
                self._h11.our_state is h11.DONE
                and self._h11.their_state is not h11.DONE
                and self._body_discardable
            ):
                keep_alive = await self._discard_body()
            if keep_alive and self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
                self._h11.start_next_cycle()
            else:
                await self._close_gracefully()
                return

    async def _read_head(self, first: bool) -> h11.Request | None:
        """Wait for the next request head; ``None`` when the connection should just end."""
        limits = self._limits
        idle = not first and not self._h11.trailing_data[0]
        # Past this deadline the timer cancels the connection's main task: a client that idles
        # or dribbles is simply disconnected.
        self._head_deadline = trio.current_time() + (
            limits.keepalive_timeout if idle else limits.header_timeout
        )
        # Each pass either returns or waits for more bytes into a buffer h11 caps at
        # max_head_bytes, so the loop is bounded by that size (and by the deadline).
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                await self._answer_protocol_error(exc)
                return None
            if isinstance(event, h11.Request):
                self._head_deadline = math.inf
                return event
            if event is not h11.NEED_DATA:
                # ConnectionClosed (a clean close between requests), or PAUSED, which cannot
                # happen here as every cycle that reaches this point was restarted.
                return None
            await self._wait_for_data()
            if idle:
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
                self._client_gone = True
                logger.info("dropping a client that read nothing for %s s", limits.send_timeout)
                if self._on_send_stall is not None:
                    self._on_send_stall()
                self._scope.cancel()
                return
            await trio.sleep_until(min(self._head_deadline, self._send_deadline, now + poll))

    async def _answer_protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        if self._client_gone or self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = exc.error_status_hint
        try:
            await self._send_error(status, f"malformed request: {exc}")
        except ClientDisconnected:
            return
        await self._close_gracefully()

    async def _send_error(self, status: int, message: str) -> None:
        error_type = "server_error" if status >= 500 else "invalid_request_error"
        body = error_body(message, status, error_type)
        headers = [
            JSON_CONTENT_TYPE,
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        data = _sent(self._h11.send(_response_head(status, headers)))
        data += _sent(self._h11.send(h11.Data(data=body)))
        data += _sent(self._h11.send(h11.EndOfMessage()))
        await self._send_all(data)

    async def _handle(self, h11_request: h11.Request) -> bool:
        """Run the handler for one request; ``True`` when the connection may go on."""
        if _declares_no_body(h11_request):
            # h11 reports the end of an empty body only when asked; ask now (no I/O happens) so
            # the client's side is DONE and a response need not close the connection.
            end = self._h11.next_event()
            assert isinstance(end, h11.EndOfMessage), end
        declared = _declared_length(h11_request)
        # Only a plain Content-Length body: a request that also says Transfer-Encoding is
        # framed by the latter, and RFC 9112 (6.1) wants the connection closed after it.
        self._body_discardable = (
            declared is not None
            and declared <= min(self._limits.discard_body_bytes, self._limits.max_body_bytes)
            and not self._h11.client_is_waiting_for_100_continue
            and not _has_transfer_encoding(h11_request)
        )
        self._request = h11_request
        self._head_only = h11_request.method == b"HEAD"
        self.response_started = self.response_finished = False
        head = h11_request
        request = HTTPRequest(self, head.method, head.target, head.headers, head.http_version)
        failure: Exception | None = None
        if self._eof:
            return False  # the client left before its request could start
        try:
            # The reader cancels this when the client leaves (see _read_forever).
            await self._handler(request, HTTPResponder(self))
        except Exception as exc:
            failure = exc

        if self._client_gone:
            return False
        if failure is not None:
            return await self._after_failure(failure)
        if not self.response_started:
            error = RuntimeError(f"handler returned without a response to {request.path}")
            self.report(error)
            await self._send_error_and_close(500, "internal error")
            return False
        if not self.response_finished:
            await self.end_stream()
        return True

    async def _after_failure(self, failure: Exception) -> bool:
        if isinstance(failure, ClientDisconnected):
            return False
        if isinstance(failure, BodyTooLarge):
            status, message = 413, f"request body too large (limit {self._limits.max_body_bytes})"
        elif isinstance(failure, RequestTimeout):
            status, message = 408, "request body timed out"
        elif isinstance(failure, h11.RemoteProtocolError):
            status, message = failure.error_status_hint, f"malformed request: {failure}"
        else:
            self.report(failure)
            status, message = 500, "internal error"
        if self.response_started:
            # Cut the response short: without the final chunk the client sees it incomplete.
            return False
        await self._send_error_and_close(status, message)
        return False

    async def _send_error_and_close(self, status: int, message: str) -> None:
        if self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # h11 cannot send a response any more (e.g. after a local protocol error)
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
        request = self._request
        assert request is not None, "a body is read only while a request is handled"
        conn = self._h11
        limits = self._limits
        if conn.their_state is h11.DONE:
            return b""
        declared = _declared_length(request)
        if declared is not None and declared > limits.max_body_bytes:
            raise BodyTooLarge(f"declared body of {declared} bytes")
        if conn.client_is_waiting_for_100_continue:
            await self._send_all(
                _sent(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
            )
        parts: list[bytes] = []
        size = 0
        # Every pass consumes at least one byte of a body capped at max_body_bytes, or ends.
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limits.max_body_bytes:
                    raise BodyTooLarge(f"body over {limits.max_body_bytes} bytes")
                parts.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            elif event is h11.NEED_DATA:
                if self._eof:
                    raise ClientDisconnected("the client left during the request body")
                with trio.move_on_after(limits.body_timeout) as scope:
                    await self._wait_for_data()
                if scope.cancelled_caught:
                    raise RequestTimeout(f"no body data for {limits.body_timeout} s")
            else:  # pragma: no cover - h11 yields only Data/EndOfMessage/NEED_DATA here
                raise RuntimeError(f"unexpected h11 event {event!r}")
        return b"".join(parts)

    async def _discard_body(self) -> bool:
        """Read and drop the rest of a small declared body; ``True`` when the cycle completed.

        The body of an early response usually came in with the head, so this rarely waits; when
        it must, the wait is bounded by ``body_timeout``.
        """
        conn = self._h11
        dropped = 0
        # Bounded: each pass consumes body bytes (at most discard_body_bytes) or ends.
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return False  # the client left or broke the framing mid-body: just close
            if isinstance(event, h11.EndOfMessage):
                return True
            if isinstance(event, h11.Data):
                dropped += len(event.data)
                if dropped > self._limits.discard_body_bytes:
                    return False
                continue
            if event is not h11.NEED_DATA or self._eof:
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
        self._discarding = True
        self._budget_freed.unpark_all()
        stream = self._stream
        if isinstance(stream, trio.abc.HalfCloseableStream):
            try:
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
        with trio.move_on_after(self._limits.linger_timeout):
            # The reader wakes this task only at EOF (or after linger_bytes): one pass or two.
            while not self._eof:
                await self._data_arrived.park()


def _declares_no_body(request: h11.Request) -> bool:
    # The framing rules h11 applies to requests: no Transfer-Encoding and no (or a zero)
    # Content-Length means an empty body.
    for name, value in request.headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return False
    return True


def _has_transfer_encoding(request: h11.Request) -> bool:
    return any(name == b"transfer-encoding" for name, _ in request.headers)


def _declared_length(request: h11.Request) -> int | None:
    # h11 has already validated Content-Length (digits, one consistent value).
    for name, value in request.headers:
        if name == b"content-length":
            return int(value)
    return None


def _response_head(status: int, headers: list[tuple[bytes, bytes]]) -> h11.Response:
    return h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b""))


def _sent(data: bytes | None) -> bytes:
    # h11 returns None only for ConnectionClosed, which the server never sends.
    assert data is not None
    return data
