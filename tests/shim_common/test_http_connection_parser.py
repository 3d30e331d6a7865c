"""The request parser of :mod:`shim_common._http_connection` (llhttp) against h11, differentially.

The same byte streams, split at random points, go to :class:`RequestParser` and to an h11
server connection; both must read the same requests, and stop at the same refusal. h11 is the
reference the server was built on before; where the server is stricter on purpose (the rules
at the top of ``_http_connection.py``), the difference is named here, and the server must refuse
exactly the request h11 accepted, having read the same requests before it.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shim_common._http_parser import (
    END,
    ParseFailure,
    RequestHead,
    RequestParser,
)

MAX_HEAD = 8192  # above anything generated, so that the head limit is tested apart


@dataclass
class Outcome:
    """What a parser made of a stream: complete requests, then a refusal or nothing."""

    requests: list[tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes, bytes]] = field(
        default_factory=list
    )
    refused: int | None = None  # the status of the refusal
    # Whether reading stopped after the last request (keep-alive off or a protocol switch).
    stopped: bool = False
    # Where h11 was left waiting (the reference only): the bytes of an incomplete head, or the
    # head of a request whose body is incomplete.
    pending: bytes = field(default=b"", compare=False)
    current: tuple[bytes, bytes, list[tuple[bytes, bytes]]] | None = field(
        default=None, compare=False
    )
    # The bytes from the start of each request h11 read (the reference only).
    starts: list[bytes] = field(default_factory=list, compare=False)


def read_with_ours(pieces: list[bytes]) -> Outcome:
    parser = RequestParser(MAX_HEAD)
    outcome = Outcome()
    head: RequestHead | None = None
    body = b""
    for piece in pieces:
        parser.feed(piece)
        while parser.events:
            event = parser.events.popleft()
            if isinstance(event, RequestHead):
                head, body = event, b""
            elif isinstance(event, bytes):
                body += event
            elif event is END:
                assert head is not None
                # h11 lower-cases Transfer-Encoding values; the server leaves them as sent.
                headers = [
                    (name, value.lower() if name == b"transfer-encoding" else value)
                    for name, value in head.headers
                ]
                outcome.requests.append(
                    (head.method, head.target, headers, head.http_version, body)
                )
                if not head.keep_alive or head.upgrade:
                    outcome.stopped = True
                    return outcome
            else:
                assert isinstance(event, ParseFailure)
                outcome.refused = event.status
                return outcome
    return outcome


_SPACES_AROUND_TARGET = re.compile(rb"\A([^ \r\n]+) +([^ \r\n]+) +")


def read_with_h11(raw: bytes) -> Outcome:
    """h11's reading of a whole stream, one fresh connection per request.

    Each connection is given the bytes after the previous request, less what llhttp tolerates
    and h11 does not: empty lines before a request line (RFC 9112 2.2 allows skipping them) and
    runs of spaces around the target (RFC 9112 3 allows splitting the line on whitespace).
    """
    outcome = Outcome()
    rest = raw
    for _ in range(100):
        rest = _SPACES_AROUND_TARGET.sub(rb"\1 \2 ", rest.lstrip(b"\r\n"), count=1)
        outcome.pending = rest
        if not rest:
            return outcome  # (h11 would take an empty receive_data for the end of the stream)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        conn.receive_data(rest)
        request: h11.Request | None = None
        body = b""
        outcome.starts.append(rest)
        for _ in range(1000):
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                outcome.refused = exc.error_status_hint
                return outcome
            if event is h11.NEED_DATA:
                return outcome
            if isinstance(event, h11.Request):
                request, body = event, b""
                outcome.current = (event.method, event.target, list(event.headers))
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            else:  # pragma: no cover - PAUSED or ConnectionClosed come only after the end
                raise AssertionError(event)
        assert request is not None
        headers = [(name, value) for name, value in request.headers]
        outcome.requests.append(
            (request.method, request.target, headers, request.http_version, body)
        )
        outcome.current = None
        # Answer (404: no protocol switch is accepted) to learn whether h11 would go on.
        conn.send(h11.Response(status_code=404, headers=[(b"content-length", b"0")]))
        conn.send(h11.EndOfMessage())
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            outcome.stopped = True
            return outcome
        if _switches_protocol(request):
            outcome.stopped = True  # the server answers it, then closes
            return outcome
        conn.start_next_cycle()
        rest = bytes(conn.trailing_data[0])
    raise AssertionError("more requests than generated")


def _switches_protocol(request: h11.Request) -> bool:
    # A CONNECT asks for a tunnel: the server answers it and closes. (An Upgrade is ignored.)
    return request.method == b"CONNECT"


# -- where the server is stricter than h11, on purpose ------------------------------------------

_TOKEN_METHODS = {b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT"}


def _stricter_refusal(raw: bytes, request: tuple[bytes, bytes, list[tuple[bytes, bytes]]]) -> bool:
    """Whether the server refuses, by a rule of its own, a request that h11 accepts."""
    method, target, headers = request
    names = [name for name, _ in headers]
    if b"content-length" in names and b"transfer-encoding" in names:
        return True  # two framings: refused, never guessed (request smuggling)
    head = raw.partition(b"\r\n\r\n")[0]
    if len(re.findall(rb"(?i)\ncontent-length:", head)) > 1 or re.search(
        rb"(?i)\ncontent-length:[^\r\n]*,", head
    ):
        return True  # one Content-Length header with one value, or nothing (h11 merges them)
    if re.search(rb"\r\n[ \t]", head):
        return True  # obs-fold (RFC 9112 5.2): refused rather than unfolded
    if b"upgrade" in names and b"transfer-encoding" in names:
        return True  # a chunked body with Upgrade: 501 (llhttp skips such a body)
    if method not in _TOKEN_METHODS and method != b"TRACE":
        return True  # llhttp knows the registered methods only
    # llhttp refuses some characters in a target that h11 lets through.
    return any(byte in b'"<>\\^`{|}' for byte in target) or b"\x7f" in head


def _stricter_refusal_of_a_partial_head(pending: bytes) -> bool:
    """Whether the server refuses, by a rule of its own, the start of a head h11 waits on."""
    pending = pending.lstrip(b"\r\n")
    method = pending.partition(b" ")[0]
    if b" " not in pending and any(known.startswith(method) for known in _TOKEN_METHODS):
        return False  # could still become a method llhttp knows
    line, _, rest = pending.partition(b"\r\n")
    target = line.partition(b" ")[2].rpartition(b" ")[0] or line.partition(b" ")[2]
    headers = [
        (name.strip().lower(), value.strip())
        for name, _, value in (h.partition(b":") for h in rest.split(b"\r\n") if b":" in h)
    ]
    return _stricter_refusal(pending, (method, target, headers))


def outcomes_agree(raw: bytes, ours: Outcome, reference: Outcome) -> None:
    if ours == reference:
        return
    read = len(ours.requests)
    assert ours.requests == reference.requests[:read], "the parsers read different requests"
    assert ours.refused is not None, "the server accepted what h11 refused"
    if read < len(reference.requests):
        method, target, headers, _, _ = reference.requests[read]
        assert _stricter_refusal(reference.starts[read], (method, target, headers)), (
            f"refused {reference.requests[read]!r}, which h11 accepts"
        )
        return
    if reference.refused is not None:
        # Both refused the same request. Which of "malformed" (400) and "not implemented" (501)
        # is said differs where a request is both, e.g. an invalid Transfer-Encoding.
        assert ours.refused == reference.refused or {ours.refused, reference.refused} <= {400, 501}
        return
    if reference.refused is None:
        # h11 still waits for more of a request the server refused already: either h11 refuses
        # it too once its line ends (llhttp refuses at the first wrong byte), or the server
        # refuses it by a rule of its own.
        if read_with_h11(raw + b"\r\n\r\n").refused is not None:
            return
        if reference.current is not None:
            assert _stricter_refusal(reference.pending, reference.current), (
                "refused a head h11 accepts"
            )
        else:
            assert _stricter_refusal_of_a_partial_head(reference.pending), (
                f"refused the start of a head, {reference.pending!r}, that h11 waits on"
            )
        return


# -- the streams ----------------------------------------------------------------------------

_request_lines = st.sampled_from(
    [
        b"GET / HTTP/1.1\r\n",
        b"GET /a/b?x=1&y=%20 HTTP/1.1\r\n",
        b"POST /v1/completions HTTP/1.1\r\n",
        b"HEAD /live HTTP/1.1\r\n",
        b"GET http://host:8000/health?x=1 HTTP/1.1\r\n",
        b"OPTIONS * HTTP/1.1\r\n",
        b"GET / HTTP/1.0\r\n",
        b"DELETE /x HTTP/1.1\r\n",
        b"get / HTTP/1.1\r\n",
        b"GET /\x7f HTTP/1.1\r\n",
        b"GET  / HTTP/1.1\r\n",
        b"GET / HTTP/1.1 \r\n",
        b"GET / HTTP/2\r\n",
        b"\r\nGET / HTTP/1.1\r\n",
    ]
)
_header_lines = st.sampled_from(
    [
        b"Host: x\r\n",
        b"Host: x\r\n",
        b"Host:\r\n",
        b"Content-Length: 5\r\n",
        b"Content-Length: 0\r\n",
        b"Content-Length: 05\r\n",
        b"Content-Length: 5, 5\r\n",
        b"Content-Length: -1\r\n",
        b"Content-Length: 99999999999999999999999\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: Chunked \r\n",
        b"Transfer-Encoding: gzip, chunked\r\n",
        b"Transfer-Encoding: identity\r\n",
        b"Transfer-Encoding:\r\n chunked\r\n",
        b"Connection: close\r\n",
        b"Connection: keep-alive, Upgrade\r\n",
        b"Upgrade: websocket\r\n",
        b"Expect: 100-continue\r\n",
        b"X-Test: a  b \t\r\n",
        b"X-Empty:\r\n",
        b"X-Obs: caf\xe9\r\n",
        b"X-Folded: a\r\n b\r\n",
        b"Bad Name: x\r\n",
        b"X-Nul: a\x00b\r\n",
        b"No-Colon\r\n",
        b": empty-name\r\n",
    ]
)
_bodies = st.sampled_from(
    [
        b"",
        b"hello",
        b"5\r\nhello\r\n0\r\n\r\n",
        b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: x\r\n\r\n",
        b"zz\r\nhello\r\n",
        b"5\r\nhelloXX0\r\n\r\n",
    ]
)
_requests = st.tuples(_request_lines, st.lists(_header_lines, max_size=5), _bodies).map(
    lambda parts: parts[0] + b"".join(parts[1]) + b"\r\n" + parts[2]
)
_streams = st.lists(st.one_of(_requests, st.binary(max_size=12)), min_size=1, max_size=4).map(
    b"".join
)


@st.composite
def split_streams(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    raw = draw(_streams)
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=6)))
    bounds = [0, *cuts, len(raw)]
    return raw, [raw[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_streams())
def test_llhttp_reads_what_h11_reads_or_refuses_by_a_stated_rule(
    stream: tuple[bytes, list[bytes]],
) -> None:
    raw, pieces = stream
    ours = read_with_ours(pieces)
    # How the bytes are split never matters.
    assert ours == read_with_ours([raw])
    outcomes_agree(raw, ours, read_with_h11(raw))


# -- the rules of our own, one by one -----------------------------------------------------------


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: 40\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
        b"content-length: 4\r\ntransfer-encoding: CHUNKED\r\n",
        b"Content-Length: 4\r\nTransfer-Encoding:\r\n chunked\r\n",
        b"Content-Length: 4\r\nTransfer-Encoding: x\r\n chunked\r\n",
        b"Content-Length: 4\r\nTransfer-Encoding : chunked\r\n",
        b"Content-Length: 4\r\n Transfer-Encoding: chunked\r\n",
    ],
    ids=["cl-te", "te-cl", "lower-case", "folded", "folded-value", "space-name", "indent"],
)
def test_both_framings_are_refused_and_nothing_after_them_is_read(framing: bytes) -> None:
    parser = RequestParser(MAX_HEAD)
    smuggled = b"0\r\n\r\nGET /hidden HTTP/1.1\r\nHost: x\r\n\r\n"
    parser.feed(b"POST / HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n" + smuggled)
    events = list(parser.events)
    assert not any(isinstance(event, RequestHead) for event in events)
    assert isinstance(events[-1], ParseFailure)
    assert events[-1].status == 400
    parser.feed(b"GET /later HTTP/1.1\r\nHost: x\r\n\r\n")
    assert list(parser.events) == events  # nothing more is parsed


@pytest.mark.parametrize("split", [False, True])
def test_a_head_over_the_limit_is_refused_431_whole_or_in_pieces(split: bool) -> None:
    raw = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    parser = RequestParser(16 * 1024)
    pieces = [raw[i : i + 1000] for i in range(0, len(raw), 1000)] if split else [raw]
    for piece in pieces:
        parser.feed(piece)
    events = list(parser.events)
    assert len(events) == 1
    assert isinstance(events[0], ParseFailure)
    assert events[0].status == 431


def test_a_head_just_under_the_limit_is_read() -> None:
    line = b"GET / HTTP/1.1\r\nHost: x\r\n"
    raw = line + b"X-Big: " + b"a" * (16 * 1024 - len(line) - 200) + b"\r\n\r\n"
    parser = RequestParser(16 * 1024)
    parser.feed(raw)
    assert isinstance(parser.events[0], RequestHead)
    assert parser.events[1] is END


def test_endless_trailers_are_refused() -> None:
    parser = RequestParser(1024)
    parser.feed(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n")
    for _ in range(100):
        parser.feed(b"X-Trailer: " + b"t" * 100)
        if isinstance(parser.events[-1], ParseFailure):
            break
    assert isinstance(parser.events[-1], ParseFailure)
    assert parser.events[-1].status in (400, 431)


@pytest.mark.parametrize(
    ("header", "status"),
    [(b"Transfer-Encoding: gzip\r\n", 501), (b"Transfer-Encoding: gzip, chunked\r\n", 501)],
)
def test_a_transfer_coding_other_than_chunked_is_501(header: bytes, status: int) -> None:
    parser = RequestParser(MAX_HEAD)
    parser.feed(b"POST / HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n")
    assert isinstance(parser.events[-1], ParseFailure)
    assert parser.events[-1].status == status


def test_an_absolute_form_target_is_read_as_sent() -> None:
    parser = RequestParser(MAX_HEAD)
    parser.feed(b"GET http://host/health?x=1 HTTP/1.1\r\nHost: host\r\n\r\n")
    head = parser.events[0]
    assert isinstance(head, RequestHead)
    assert head.target == b"http://host/health?x=1"


def test_a_head_of_more_header_lines_than_the_bound_is_refused_431() -> None:
    def head(lines: int) -> bytes:
        others = b"".join(b"h%d: v\r\n" % i for i in range(lines - 1))
        return b"GET / HTTP/1.1\r\nHost: x\r\n" + others + b"\r\n"

    parser = RequestParser(MAX_HEAD, max_headers=10)
    parser.feed(head(10))
    assert isinstance(parser.events[0], RequestHead)
    parser = RequestParser(MAX_HEAD, max_headers=10)
    parser.feed(head(11))
    refusal = parser.events[-1]
    assert isinstance(refusal, ParseFailure)
    assert (refusal.status, refusal.reason) == (431, "request head over 10 header lines")


def chunked_post(body: bytes, chunk: int) -> bytes:
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]
    framed = b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces)
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + framed + b"0\r\n\r\n"


def test_a_body_in_tiny_chunks_comes_out_as_one_piece_per_feed() -> None:
    body = bytes(range(256)) * 4
    parser = RequestParser(MAX_HEAD)
    parser.feed(chunked_post(body, 1))  # 1,024 chunks and the last: the free allowance
    events = list(parser.events)
    assert isinstance(events[0], RequestHead)
    assert events[1:] == [body, END]


def test_chunks_past_the_allowance_and_one_per_so_many_bytes_are_refused() -> None:
    # 4 free chunks, then one more per 8 bytes received: 16-byte chunks stay within it forever,
    # 2-byte chunks pass it soon.
    limits = {"max_body_chunks": 4, "bytes_per_extra_chunk": 8}
    parser = RequestParser(MAX_HEAD, **limits)
    parser.feed(chunked_post(b"x" * 16_000, 16))
    assert list(parser.events)[1:] == [b"x" * 16_000, END]
    parser = RequestParser(MAX_HEAD, **limits)
    parser.feed(chunked_post(b"x" * 16_000, 2))
    refusal = parser.events[-1]
    assert isinstance(refusal, ParseFailure)
    assert refusal.status == 400
    assert "too many chunks" in refusal.reason
    # What came before the refusal is the body so far, in one piece.
    assert sum(len(e) for e in parser.events if isinstance(e, bytes)) < 100
