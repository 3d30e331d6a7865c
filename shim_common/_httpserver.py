"""A small HTTP/1.1 server on Trio and h11: the frontend's API and the worker's system port.

h11 does the protocol (parsing, framing, keep-alive bookkeeping); this module only moves bytes
between a :class:`trio.abc.Stream` and h11, owns the tasks and enforces the limits. Everything here
runs over any ``Stream``, so tests drive it with ``trio.testing.memory_stream_pair`` as well as
with real loopback sockets.

Rules of one connection (a loop of request/response cycles):

1. Reading a request head is bounded in time and size. The first head must arrive within
   ``header_timeout`` of the accept; between requests the connection may sit idle for
   ``keepalive_timeout``, and once the next request's first bytes are in, its head must complete
   within ``header_timeout``. A head still incomplete past ``max_head_bytes`` is answered 431, a
   malformed one 400 (from ``h11.RemoteProtocolError``), and the connection is closed.
2. The body is read only when the handler asks (:meth:`HTTPRequest.read_body`). That is when
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
4. A handler answers exactly once: :meth:`HTTPResponder.send` (one complete response with
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
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11
import trio

__all__ = [
    "DEFAULT_LIMITS",
    "BodyTooLarge",
    "ClientDisconnected",
    "HTTPLimits",
    "HTTPRequest",
    "HTTPResponder",
    "Handler",
    "RequestTimeout",
    "error_body",
    "json_headers",
    "serve_connection",
    "serve_http",
    "serve_http_listeners",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HTTPLimits:
    """Bounds on what one connection may cost the server.

    Attributes:
        max_body_bytes: the largest request body accepted; larger bodies get 413.
        max_head_bytes: the largest incomplete request head h11 buffers (its
            ``max_incomplete_event_size``); a head still incomplete past it gets 431. h11 checks
            only incomplete heads, so one that arrives whole in a single read may be up to
            ``receive_bytes`` long.
        header_timeout: seconds a client has to send a whole request head, counted from the
            accept for the first request and from its first byte for later ones.
        keepalive_timeout: seconds an idle keep-alive connection is kept between requests.
        body_timeout: seconds to wait for each piece of a request body before giving up (408).
        receive_bytes: how much one ``receive_some`` call asks for.
        pipeline_buffer_bytes: how many bytes of a pipelined next request the disconnect watcher
            reads and keeps while a handler runs, before it stops reading.
        linger_timeout: seconds to drain the client's bytes after our EOF when closing.
        linger_bytes: at most this many bytes are drained when closing.
        discard_body_bytes: a request body the handler did not read is read and dropped after
            the response, keeping the connection, when its declared length is at most this.
    """

    max_body_bytes: int = 16 * 1024 * 1024
    max_head_bytes: int = 16 * 1024
    header_timeout: float = 10.0
    keepalive_timeout: float = 75.0
    body_timeout: float = 60.0
    receive_bytes: int = 64 * 1024
    pipeline_buffer_bytes: int = 64 * 1024
    linger_timeout: float = 2.0
    linger_bytes: int = 1024 * 1024
    discard_body_bytes: int = 64 * 1024


DEFAULT_LIMITS = HTTPLimits()


class BodyTooLarge(Exception):
    """The request body is larger than ``HTTPLimits.max_body_bytes`` (the server answers 413)."""


class ClientDisconnected(Exception):
    """The client went away while the request was being read or answered."""


class RequestTimeout(Exception):
    """The client was too slow sending the request body (the server answers 408)."""


Handler = Callable[["HTTPRequest", "HTTPResponder"], Awaitable[None]]

_JSON_CONTENT_TYPE = (b"content-type", b"application/json")
_REASONS: dict[int, bytes] = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}


def json_headers(*extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """Response headers for a JSON body.

    Args:
        *extra: further headers to append, e.g. ``(b"retry-after", b"1")``.

    Returns:
        A fresh list with ``Content-Type: application/json`` first, then ``extra``.
    """
    return [_JSON_CONTENT_TYPE, *extra]


def error_body(message: str, status: int, error_type: str = "invalid_request_error") -> bytes:
    """An error body in the OpenAI shape: ``{"error": {"message", "type", "code"}}``.

    Args:
        message: what went wrong, for a human.
        status: the HTTP status, repeated as ``code``.
        error_type: the OpenAI error type.

    Returns:
        The JSON encoded body.
    """
    error = {"message": message, "type": error_type, "code": status}
    return json.dumps({"error": error}, separators=(",", ":")).encode()


class HTTPRequest:
    """One request head, and the means to read its body.

    Attributes:
        method: the request method, e.g. ``"GET"``.
        path: the request target without the query, e.g. ``"/v1/chat/completions"``.
        query: the query string without ``?``; ``""`` when absent.
        http_version: ``"1.1"`` or ``"1.0"``.
    """

    __slots__ = ("_body", "_connection", "_h11_request", "http_version", "method", "path", "query")

    def __init__(self, connection: _Connection, request: h11.Request) -> None:
        self._connection = connection
        self._h11_request = request
        self._body: bytes | None = None
        self.method = request.method.decode("ascii")
        path, _, query = request.target.partition(b"?")
        # The target was validated by h11 as visible ASCII; latin-1 never fails on bytes.
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
        self.http_version = request.http_version.decode("ascii")

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """The request headers, names lower-cased, in the order received."""
        return list(self._h11_request.headers)

    def header(self, name: bytes) -> bytes | None:
        """The value of the first header called ``name`` (lower-case), or ``None``."""
        for header_name, value in self._h11_request.headers:
            if header_name == name:
                return value
        return None

    async def read_body(self) -> bytes:
        """Read the whole request body (once; later calls return the same bytes).

        Sends ``100 Continue`` first when the client waits for it and the declared length fits.

        Returns:
            The body; ``b""`` for a request without one.

        Raises:
            BodyTooLarge: the body is over ``HTTPLimits.max_body_bytes`` (declared or counted).
            ClientDisconnected: the client left before the body was complete.
            RequestTimeout: a piece of the body took longer than ``HTTPLimits.body_timeout``.
            h11.RemoteProtocolError: the body framing was invalid (the server answers 400).
        """
        if self._body is None:
            self._body = await self._connection.read_body(self._h11_request)
        return self._body


class HTTPResponder:
    """How a handler answers its request: exactly one response, complete or streamed.

    Attributes:
        started: whether a status line has gone out.
        finished: whether the response is complete.
    """

    __slots__ = ("_connection", "_head_request", "finished", "started")

    def __init__(self, connection: _Connection, head_request: bool) -> None:
        self._connection = connection
        self._head_request = head_request
        self.started = False
        self.finished = False

    async def send(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send a complete response with ``Content-Length``, head and body in one write.

        Args:
            status: the HTTP status code.
            headers: response headers, without ``Content-Length`` (added here).
            body: the whole body.

        Raises:
            RuntimeError: a response was already started.
            ClientDisconnected: the client is gone.
        """
        conn = self._connection
        all_headers = [*headers, (b"content-length", b"%d" % len(body))]
        if conn.closes_after_response() and not _says_close(headers):
            all_headers.append((b"connection", b"close"))
        head = _response(status, all_headers)  # validates: bad headers leave nothing started
        self._claim()
        h = conn.h11
        data = _bytes(h.send(head))
        if body and not self._head_request:
            data += _bytes(h.send(h11.Data(data=body)))
        data += _bytes(h.send(h11.EndOfMessage()))
        self.finished = True
        await conn.send_all(data)

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the head of a streamed (chunked) response; the body follows in chunks.

        Args:
            status: the HTTP status code.
            headers: response headers, without ``Content-Length`` (that would stop chunking).

        Raises:
            RuntimeError: a response was already started.
            ClientDisconnected: the client is gone.
        """
        conn = self._connection
        if conn.closes_after_response() and not _says_close(headers):
            headers = [*headers, (b"connection", b"close")]
        head = _response(status, headers)  # validates: bad headers leave nothing started
        self._claim()
        await conn.send_all(_bytes(conn.h11.send(head)))

    async def send_chunk(self, data: bytes) -> None:
        """Send one piece of a streamed body (empty data sends nothing).

        Blocks while the client is slow to read: backpressure reaches the caller.

        Raises:
            RuntimeError: no stream was started, or it has ended.
            ClientDisconnected: the client is gone.
        """
        if not self.started or self.finished:
            raise RuntimeError("send_chunk() outside a started stream")
        if data and not self._head_request:
            await self._connection.send_all(_bytes(self._connection.h11.send(h11.Data(data=data))))

    async def end_stream(self) -> None:
        """End a streamed body (the terminating chunk).

        Raises:
            RuntimeError: no stream was started, or it has ended.
            ClientDisconnected: the client is gone.
        """
        if not self.started or self.finished:
            raise RuntimeError("end_stream() outside a started stream")
        self.finished = True
        await self._connection.send_all(_bytes(self._connection.h11.send(h11.EndOfMessage())))

    def _claim(self) -> None:
        if self.started:
            raise RuntimeError("a response was already started for this request")
        self.started = True


def _says_close(headers: list[tuple[bytes, bytes]]) -> bool:
    return (b"connection", b"close") in headers


def _response(status: int, headers: list[tuple[bytes, bytes]]) -> h11.Response:
    return h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b""))


def _bytes(data: bytes | None) -> bytes:
    # h11 returns None only for ConnectionClosed, which this module never sends.
    assert data is not None
    return data


class _Connection:
    """The request/response cycles of one connection: see the rules at the top of the module.

    Two tasks share the connection. The reader task owns every read: it feeds h11, wakes the main
    task, and notices EOF at any time (cancelling a running handler). It stops reading when
    ``pipeline_buffer_bytes`` were fed that the main task has not asked h11 for yet. The main task
    runs the cycles and does every write.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        handler: Handler,
        limits: HTTPLimits,
        on_error: Callable[[BaseException], None] | None,
    ) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        self.handler = handler
        self.limits = limits
        self.on_error = on_error
        # Set when the client is known to be gone (EOF, reset, or a failed write).
        self.client_gone = False
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
        # Whether the request being handled may have its unread body dropped (rule 4).
        self._body_discardable = False

    def closes_after_response(self) -> bool:
        """Whether a response sent now must end the connection (rule 4)."""
        return self.h11.their_state is not h11.DONE and not self._body_discardable

    # -- moving bytes -------------------------------------------------------------------------

    async def send_all(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.client_gone = True
            raise ClientDisconnected("the client closed the connection") from exc

    async def _read_forever(self) -> None:
        """The reader task: socket to h11, bounded, until EOF (or cancelled with the connection)."""
        limits = self.limits
        drained = 0
        while True:
            if self._unconsumed >= limits.pipeline_buffer_bytes and not self._discarding:
                await self._budget_freed.park()
                continue
            try:
                received = await self.stream.receive_some(limits.receive_bytes)
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
            self.h11.receive_data(received if isinstance(received, bytes) else bytes(received))
            self._unconsumed += len(received)
            self._data_arrived.unpark_all()
        self._eof = True
        self.client_gone = True
        if not self._discarding:
            self.h11.receive_data(b"")
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
            nursery.start_soon(self._enforce_head_deadline)
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
                self.h11.our_state is h11.DONE
                and self.h11.their_state is not h11.DONE
                and self._body_discardable
            ):
                keep_alive = await self._discard_body()
            if keep_alive and self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                self.h11.start_next_cycle()
            else:
                await self._close_gracefully()
                return

    async def _read_head(self, first: bool) -> h11.Request | None:
        """Wait for the next request head; ``None`` when the connection should just end."""
        limits = self.limits
        idle = not first and not self.h11.trailing_data[0]
        # Past this deadline the timer cancels the connection's main task: a client that idles
        # or dribbles is simply disconnected.
        self._head_deadline = trio.current_time() + (
            limits.keepalive_timeout if idle else limits.header_timeout
        )
        # Each pass either returns or waits for more bytes into a buffer h11 caps at
        # max_head_bytes, so the loop is bounded by that size (and by the deadline).
        while True:
            try:
                event = self.h11.next_event()
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

    async def _enforce_head_deadline(self) -> None:
        """The timer task: cancel the main task once an awaited request head is overdue.

        It wakes at the recorded deadline, or after the shorter of the two head timeouts while
        none is recorded (no deadline set later can be due sooner), so it costs nothing per
        request and one wake-up per timeout period.
        """
        poll = min(self.limits.header_timeout, self.limits.keepalive_timeout)
        while True:
            now = trio.current_time()
            deadline = self._head_deadline
            if deadline <= now:
                self._scope.cancel()
                return
            await trio.sleep_until(min(deadline, now + poll))

    async def _answer_protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        if self.client_gone or self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
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
            _JSON_CONTENT_TYPE,
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        data = _bytes(self.h11.send(_response(status, headers)))
        data += _bytes(self.h11.send(h11.Data(data=body)))
        data += _bytes(self.h11.send(h11.EndOfMessage()))
        await self.send_all(data)

    async def _handle(self, h11_request: h11.Request) -> bool:
        """Run the handler for one request; ``True`` when the connection may go on."""
        if _declares_no_body(h11_request):
            # h11 reports the end of an empty body only when asked; ask now (no I/O happens) so
            # the client's side is DONE and a response need not close the connection.
            end = self.h11.next_event()
            assert isinstance(end, h11.EndOfMessage), end
        declared = _declared_length(h11_request)
        # Only a plain Content-Length body: a request that also says Transfer-Encoding is
        # framed by the latter, and RFC 9112 (6.1) wants the connection closed after it.
        self._body_discardable = (
            declared is not None
            and declared <= min(self.limits.discard_body_bytes, self.limits.max_body_bytes)
            and not self.h11.client_is_waiting_for_100_continue
            and not _has_transfer_encoding(h11_request)
        )
        request = HTTPRequest(self, h11_request)
        responder = HTTPResponder(self, h11_request.method == b"HEAD")
        failure: Exception | None = None
        if self._eof:
            return False  # the client left before its request could start
        try:
            # The reader cancels this when the client leaves (see _read_forever).
            await self.handler(request, responder)
        except Exception as exc:
            failure = exc

        if self.client_gone:
            return False
        if failure is not None:
            return await self._after_failure(failure, responder)
        if not responder.started:
            error = RuntimeError(f"handler returned without a response to {request.path}")
            self._report(error)
            await self._send_error_and_close(500, "internal error")
            return False
        if not responder.finished:
            await responder.end_stream()
        return True

    async def _after_failure(self, failure: Exception, responder: HTTPResponder) -> bool:
        if isinstance(failure, ClientDisconnected):
            return False
        if isinstance(failure, BodyTooLarge):
            status, message = 413, f"request body too large (limit {self.limits.max_body_bytes})"
        elif isinstance(failure, RequestTimeout):
            status, message = 408, "request body timed out"
        elif isinstance(failure, h11.RemoteProtocolError):
            status, message = failure.error_status_hint, f"malformed request: {failure}"
        else:
            self._report(failure)
            status, message = 500, "internal error"
        if responder.started:
            # Cut the response short: without the final chunk the client sees it incomplete.
            return False
        await self._send_error_and_close(status, message)
        return False

    async def _send_error_and_close(self, status: int, message: str) -> None:
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # h11 cannot send a response any more (e.g. after a local protocol error)
        try:
            await self._send_error(status, message)
        except ClientDisconnected:
            return
        await self._close_gracefully()

    def _report(self, error: BaseException) -> None:
        logger.error("HTTP handler failed", exc_info=error)
        if self.on_error is not None:
            try:
                self.on_error(error)
            except Exception:
                logger.exception("on_error callback failed")

    # -- reading the body and watching for disconnects -----------------------------------------

    async def read_body(self, request: h11.Request) -> bytes:
        conn = self.h11
        limits = self.limits
        if conn.their_state is h11.DONE:
            return b""
        declared = _declared_length(request)
        if declared is not None and declared > limits.max_body_bytes:
            raise BodyTooLarge(f"declared body of {declared} bytes")
        if conn.client_is_waiting_for_100_continue:
            await self.send_all(
                _bytes(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
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
        conn = self.h11
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
                if dropped > self.limits.discard_body_bytes:
                    return False
                continue
            if event is not h11.NEED_DATA or self._eof:
                return False
            with trio.move_on_after(self.limits.body_timeout) as scope:
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
        stream = self.stream
        if isinstance(stream, trio.abc.HalfCloseableStream):
            try:
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
        with trio.move_on_after(self.limits.linger_timeout):
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


async def serve_connection(
    stream: trio.abc.Stream,
    handler: Handler,
    *,
    limits: HTTPLimits = DEFAULT_LIMITS,
    on_error: Callable[[BaseException], None] | None = None,
) -> None:
    """Serve HTTP/1.1 on one connection until either side ends it; never raises ``Exception``.

    Args:
        stream: the connection (a socket stream, or a memory stream in tests).
        handler: called once per request.
        limits: the connection's bounds.
        on_error: called with each unexpected exception (a failing handler), e.g. to count it.
    """
    connection = _Connection(stream, handler, limits, on_error)
    try:
        await connection.run()
    except Exception as exc:
        # Whatever one connection does wrong stays with that connection.
        connection._report(exc)
    finally:
        await trio.aclose_forcefully(stream)


async def serve_http_listeners(
    handler: Handler,
    listeners: list[trio.SocketListener],
    *,
    limits: HTTPLimits = DEFAULT_LIMITS,
    on_error: Callable[[BaseException], None] | None = None,
) -> None:
    """Serve HTTP on listeners the caller opened, until cancelled.

    Args:
        handler: called once per request.
        listeners: the listening sockets.
        limits: every connection's bounds.
        on_error: called with each unexpected exception, e.g. to count it.
    """

    async def on_connection(stream: trio.SocketStream) -> None:
        await serve_connection(stream, handler, limits=limits, on_error=on_error)

    await trio.serve_listeners(on_connection, listeners)


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    limits: HTTPLimits = DEFAULT_LIMITS,
    on_error: Callable[[BaseException], None] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bind ``host:port`` and serve HTTP until cancelled.

    Args:
        handler: called once per request with the request and its responder.
        host: the address to listen on.
        port: the port; ``0`` picks a free one.
        limits: every connection's bounds.
        on_error: called with each unexpected exception, e.g. to count it.
        task_status: receives the bound port once listening (use with ``nursery.start``).

    Raises:
        OSError: the address could not be bound.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound_port: int = listeners[0].socket.getsockname()[1]
    task_status.started(bound_port)
    await serve_http_listeners(handler, listeners, limits=limits, on_error=on_error)
