"""One connection's rules (:mod:`shim_common._http_connection`): keep-alive, pipelining, bodies,
limits, timeouts, backpressure, disconnects and failing handlers.

Most tests talk to a server on a loopback socket with an h11 client; the timeout and
backpressure tests drive :func:`serve_connection` over in-memory streams under the autojump
clock, where virtual time makes them exact.
"""

from __future__ import annotations

import json
import socket
import struct

import h11
import pytest
import trio
import trio.testing
from http_test_client import (
    MAX_READS,
    Client,
    echo,
    hello,
    read_until_eof,
    refuse,
    running_server,
)

from shim_common._httpserver import (
    BodyTooLarge,
    ClientDisconnected,
    HTTPLimits,
    HTTPRequest,
    HTTPResponder,
    InvalidResponse,
    json_headers,
    serve_connection,
)

# -- keep-alive and pipelining (rule 6) -------------------------------------------------------


async def test_pipelined_requests_are_answered_in_order() -> None:
    with trio.fail_after(10):
        async with running_server(echo) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                raw = (
                    b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(3))
                    + b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
                )
                await stream.send_all(raw)
                client = Client(stream)
                paths = []
                for _ in range(4):
                    client.expect_response_to()
                    head, body = await client.response_head_and_body()
                    client.conn.start_next_cycle()
                    assert head.status_code == 200
                    paths.append(json.loads(body)["path"])
                assert paths == ["/0", "/1", "/2", "/body"]


async def test_an_http_1_0_client_gets_its_answer_and_a_close() -> None:
    async def sse(request: HTTPRequest, responder: HTTPResponder) -> None:
        await responder.start_stream(200, [])
        await responder.send_chunk(b"data: 1\n\n")
        await responder.end_stream()

    with trio.fail_after(10):
        async with running_server(sse) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"GET / HTTP/1.0\r\n\r\n")
                raw = await read_until_eof(stream)
    # No chunked framing for HTTP/1.0: the body ends with the connection.
    assert raw.startswith(b"HTTP/1.1 200 ")
    assert raw.endswith(b"\r\n\r\ndata: 1\n\n")


async def test_an_upgrade_header_is_ignored_and_the_body_read() -> None:
    """curl --http2 on an http:// URL asks to upgrade to h2c: the server stays on HTTP/1.1."""
    with trio.fail_after(10):
        async with running_server(echo) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    b"POST /up HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
                    b"Content-Length: 7\r\n\r\npayload"
                    b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n"
                )
                client = Client(stream)
                answers = []
                for method in ("POST", "GET"):
                    client.expect_response_to(method)
                    head, body = await client.response_head_and_body()
                    client.conn.start_next_cycle()
                    assert head.status_code == 200
                    answers.append(json.loads(body))
    assert [(a["path"], a["body"]) for a in answers] == [("/up", "payload"), ("/after", "")]


async def test_a_connect_is_answered_and_the_connection_closed() -> None:
    with trio.fail_after(10):
        async with running_server(refuse) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    b"CONNECT host:443 HTTP/1.1\r\nHost: host:443\r\n\r\n"
                    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
                )
                raw = await read_until_eof(stream)
    assert raw.count(b"HTTP/1.1 ") == 1
    assert b"connection: close" in raw.lower()


# -- bodies, 100-continue, 413 (rules 2 and 4) ------------------------------------------------


async def test_expect_100_continue_is_answered_when_the_handler_reads_the_body() -> None:
    with trio.fail_after(10):
        async with running_server(echo) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                client = Client(stream)
                await client.send_request(
                    "POST", "/e", [("expect", "100-continue"), ("content-length", "5")]
                )
                informational = await client.next_event()
                assert isinstance(informational, h11.InformationalResponse)
                assert informational.status_code == 100
                await stream.send_all(
                    (client.conn.send(h11.Data(data=b"hello")) or b"")
                    + (client.conn.send(h11.EndOfMessage()) or b"")
                )
                head, body = await client.response_head_and_body()
                assert head.status_code == 200
                assert json.loads(body)["body"] == "hello"


async def test_no_100_continue_when_the_handler_answers_without_the_body() -> None:
    async def refuse(request: HTTPRequest, responder: HTTPResponder) -> None:
        await responder.send(529, json_headers(), b'{"code":529}')

    with trio.fail_after(10):
        async with running_server(refuse) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Expect: 100-continue\r\nContent-Length: 10\r\n\r\n"
                )
                raw = await read_until_eof(stream)
    assert raw.startswith(b"HTTP/1.1 529 ")
    assert b"100 Continue" not in raw
    assert b"\r\nconnection: close\r\n" in raw.lower()
    assert raw.endswith(b'{"code":529}')


async def test_early_response_drops_a_small_unread_body_and_keeps_the_connection() -> None:
    with trio.fail_after(10):
        async with running_server(refuse) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                # The handler never reads the body; the server drops it after the answer and
                # reads the next request on the same connection.
                await stream.send_all(
                    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nbody"
                    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nConnection: close"
                    b"\r\n\r\nbody"
                )
                raw = await read_until_eof(stream)
    assert raw.count(b"HTTP/1.1 529 ") == 2
    first = raw.partition(b"HTTP/1.1 529 ")[2].partition(b"HTTP/1.1 529 ")[0]
    assert b"connection: close" not in first.lower()


async def test_early_response_before_a_large_or_chunked_body_closes_the_connection() -> None:
    limits = HTTPLimits(discard_body_bytes=3)
    with trio.fail_after(10):
        async with running_server(refuse, limits=limits) as port:
            for request in (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nbody",
                b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"4\r\nbody\r\n0\r\n\r\n",
            ):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    await stream.send_all(request + b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    raw = await read_until_eof(stream)
                assert raw.count(b"HTTP/1.1") == 1
                assert raw.startswith(b"HTTP/1.1 529 ")
                assert b"connection: close" in raw.lower()


async def test_early_response_to_content_length_plus_chunked_closes_the_connection() -> None:
    with trio.fail_after(10):
        async with running_server(refuse) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                # Both framings at once (a smuggling shape): never kept alive, never discarded.
                await stream.send_all(
                    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n4\r\nbody\r\n0\r\n\r\n"
                    b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n"
                )
                raw = await read_until_eof(stream)
    assert raw.count(b"HTTP/1.1") == 1
    assert b"connection: close" in raw.lower()


def _send_part_of_a_body_then_leave(port: int) -> None:
    # A blocking socket, so that the last byte and the FIN leave back to back.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab")
        assert sock.recv(65536).startswith(b"HTTP/1.1 529 ")
        sock.sendall(b"c")
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):
            pass


async def test_a_client_leaving_mid_discard_is_not_a_server_error() -> None:
    errors: list[BaseException] = []
    with trio.fail_after(10):
        async with running_server(refuse, on_error=errors.append) as port:
            # The last byte and the EOF arrive together while the server drops the body: h11
            # then finds the body incomplete, which is the client leaving, not a server fault.
            for _ in range(40):
                await trio.to_thread.run_sync(_send_part_of_a_body_then_leave, port)
    assert errors == []


async def test_body_over_the_limit_by_content_length_gets_413_before_100_continue() -> None:
    limits = HTTPLimits(max_body_bytes=10)
    with trio.fail_after(10):
        async with running_server(echo, limits=limits) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                    b"Content-Length: 11\r\n\r\n"
                )
                raw = await read_until_eof(stream)
    assert raw.startswith(b"HTTP/1.1 413 ")
    assert b"100 Continue" not in raw
    body = json.loads(raw.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == 413
    assert body["error"]["type"] == "invalid_request_error"
    assert isinstance(body["error"]["message"], str)


async def test_body_at_the_limit_is_accepted() -> None:
    limits = HTTPLimits(max_body_bytes=10)
    with trio.fail_after(10):
        async with running_server(echo, limits=limits) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                head, body = await Client(stream).request("POST", "/", body=b"0123456789")
    assert head.status_code == 200
    assert json.loads(body)["body"] == "0123456789"


async def test_chunked_body_over_the_limit_gets_413() -> None:
    limits = HTTPLimits(max_body_bytes=10)
    with trio.fail_after(10):
        async with running_server(echo, limits=limits) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"6\r\nabcdef\r\n6\r\nghijkl\r\n0\r\n\r\n"
                )
                raw = await read_until_eof(stream)
    assert raw.startswith(b"HTTP/1.1 413 ")
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == 413


async def test_chunked_body_under_the_limit_is_joined() -> None:
    with trio.fail_after(10):
        async with running_server(echo) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
                )
                await trio.sleep(0.01)  # the rest arrives in a later segment
                await stream.send_all(b"2\r\nde\r\n0\r\n\r\n")
                client = Client(stream)
                client.expect_response_to("POST")
                head, body = await client.response_head_and_body()
    assert head.status_code == 200
    assert json.loads(body)["body"] == "abcde"


async def test_a_handler_may_answer_body_too_large_itself() -> None:
    async def custom(request: HTTPRequest, responder: HTTPResponder) -> None:
        try:
            await request.read_body()
        except BodyTooLarge:
            await responder.send(413, json_headers(), b'{"custom":true}')

    with trio.fail_after(10):
        async with running_server(custom, limits=HTTPLimits(max_body_bytes=1)) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
                raw = await read_until_eof(stream)
    assert raw.startswith(b"HTTP/1.1 413 ")
    assert raw.endswith(b'{"custom":true}')


# -- malformed requests (rule 1) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"NOT A REQUEST\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\r\nNo-Colon\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", b"431"),
    ],
    ids=["garbage", "bad-header", "head-too-large"],
)
async def test_a_malformed_request_gets_an_error_and_a_close(raw: bytes, status: bytes) -> None:
    errors: list[BaseException] = []
    with trio.fail_after(10):
        async with running_server(hello, on_error=errors.append) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(raw)
                answer = await read_until_eof(stream)
    assert answer.startswith(b"HTTP/1.1 " + status + b" ")
    assert b"connection: close" in answer.lower()
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == int(status)
    assert errors == []  # a bad client is not a server error


# -- disconnects (rule 3) ---------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_client_disconnect_cancels_a_sleeping_handler(method: str) -> None:
    started = trio.Event()
    cleaned_up = trio.Event()
    errors: list[BaseException] = []

    async def slow_prefill(request: HTTPRequest, responder: HTTPResponder) -> None:
        await request.read_body()
        started.set()
        try:
            await trio.sleep_forever()  # nothing is written while "prefilling"
        finally:
            cleaned_up.set()

    with trio.fail_after(10):
        async with running_server(slow_prefill, on_error=errors.append) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            client = Client(stream)
            await client.send_request(method, "/", body=b"{}" if method == "POST" else None)
            if method == "GET":
                await stream.send_all(client.conn.send(h11.EndOfMessage()) or b"")
            await started.wait()
            await stream.aclose()
            await cleaned_up.wait()
    assert errors == []


async def test_client_disconnect_while_the_body_is_read() -> None:
    outcome: list[str] = []
    reading = trio.Event()
    done = trio.Event()

    async def reader(request: HTTPRequest, responder: HTTPResponder) -> None:
        reading.set()
        try:
            await request.read_body()
            outcome.append("body")  # pragma: no cover - the body never completes
        except ClientDisconnected:
            outcome.append("disconnected")
        finally:
            done.set()

    with trio.fail_after(10):
        async with running_server(reader) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
            await reading.wait()
            await stream.aclose()
            await done.wait()
    # Either the reader saw EOF first (cancelled) or read_body did: both end the handler.
    assert outcome in ([], ["disconnected"])


async def test_writing_to_a_departed_client_raises_client_disconnected() -> None:
    outcome: list[str] = []
    errors: list[BaseException] = []
    finished = trio.Event()
    client_gone = trio.Event()

    async def streamer(request: HTTPRequest, responder: HTTPResponder) -> None:
        await responder.start_stream(200, [])
        try:
            with trio.CancelScope(shield=True):
                # Shielded, so the reader's cancellation cannot win: the write must fail.
                await client_gone.wait()
                for _ in range(MAX_READS):
                    await responder.send_chunk(b"x" * 65536)
        except ClientDisconnected:
            outcome.append("disconnected")
        finally:
            finished.set()

    with trio.fail_after(10):
        async with running_server(streamer, on_error=errors.append) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            client = Client(stream)
            await client.send_request("GET", "/")
            await stream.send_all(client.conn.send(h11.EndOfMessage()) or b"")
            assert isinstance(await client.next_event(), h11.Response)
            # Linger on, timeout 0: the close sends a reset, so the server's writes fail fast.
            linger = struct.pack("ii", 1, 0)
            stream.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, linger)
            await stream.aclose()
            client_gone.set()
            await finished.wait()
    assert outcome == ["disconnected"]
    assert errors == []


# -- failing handlers (rule 5) ----------------------------------------------------------------


async def test_a_handler_that_does_not_answer_gets_500() -> None:
    errors: list[BaseException] = []

    async def silent(request: HTTPRequest, responder: HTTPResponder) -> None:
        return None

    with trio.fail_after(10):
        async with running_server(silent, on_error=errors.append) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                raw = await read_until_eof(stream)
    assert raw.startswith(b"HTTP/1.1 500 ")
    assert [type(e) for e in errors] == [RuntimeError]


async def test_invalid_response_headers_give_500() -> None:
    errors: list[BaseException] = []

    async def bad_headers(request: HTTPRequest, responder: HTTPResponder) -> None:
        await responder.send(200, [(b"bad header", b"x")], b"")

    with trio.fail_after(10):
        async with running_server(bad_headers, on_error=errors.append) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                raw = await read_until_eof(stream)
    assert raw.startswith(b"HTTP/1.1 500 ")
    assert [type(e) for e in errors] == [InvalidResponse]


async def test_a_stream_left_open_by_the_handler_is_ended_for_it() -> None:
    async def forgetful(request: HTTPRequest, responder: HTTPResponder) -> None:
        await responder.start_stream(200, [])
        await responder.send_chunk(b"x")

    with trio.fail_after(10):
        async with running_server(forgetful) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                head, body = await Client(stream).request("GET", "/")
    assert (head.status_code, body) == (200, b"x")


async def test_a_handler_failing_mid_stream_cuts_the_stream_short() -> None:
    errors: list[BaseException] = []

    async def failing(request: HTTPRequest, responder: HTTPResponder) -> None:
        await responder.start_stream(200, [])
        await responder.send_chunk(b"partial")
        raise ValueError("engine fell over")

    with trio.fail_after(10):
        async with running_server(failing, on_error=errors.append) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                client = Client(stream)
                await client.send_request("GET", "/")
                await stream.send_all(client.conn.send(h11.EndOfMessage()) or b"")
                with pytest.raises(h11.RemoteProtocolError):
                    await client.response_head_and_body()
    assert [type(e) for e in errors] == [ValueError]


# -- timeouts and backpressure (rules 1, 3 and 7; in memory, virtual time) --------------------


async def test_header_timeout_disconnects_a_slow_client(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client, server = trio.testing.memory_stream_pair()
    limits = HTTPLimits(header_timeout=10.0)
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(server, hello, limits=limits))
            started = trio.current_time()
            await client.send_all(b"GET / HTTP/1.1\r\nHost:")  # never finished
            assert await read_until_eof(client) == b""
            assert trio.current_time() - started == pytest.approx(10.0)


async def test_idle_keepalive_timeout_and_header_timeout_after_first_byte(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client_stream, server = trio.testing.memory_stream_pair()
    limits = HTTPLimits(header_timeout=10.0, keepalive_timeout=75.0)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(server, hello, limits=limits))
            client = Client(client_stream)
            head, _ = await client.request("GET", "/")
            assert head.status_code == 200
            # Idle for less than the keep-alive timeout (far longer than the header timeout):
            # the connection is still usable.
            await trio.sleep(70.0)
            head, _ = await client.request("GET", "/")
            assert head.status_code == 200
            # Idle past the keep-alive timeout: closed.
            idle_since = trio.current_time()
            assert await read_until_eof(client_stream) == b""
            assert trio.current_time() - idle_since == pytest.approx(75.0)


async def test_a_second_head_must_complete_within_the_header_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client_stream, server = trio.testing.memory_stream_pair()
    limits = HTTPLimits(header_timeout=10.0, keepalive_timeout=75.0)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(server, hello, limits=limits))
            head, _ = await Client(client_stream).request("GET", "/")
            assert head.status_code == 200
            await trio.sleep(5.0)
            await client_stream.send_all(b"GET / HTT")
            partial_since = trio.current_time()
            assert await read_until_eof(client_stream) == b""
            assert trio.current_time() - partial_since == pytest.approx(10.0)


async def test_a_stalled_body_gets_408(autojump_clock: trio.testing.MockClock) -> None:
    client_stream, server = trio.testing.memory_stream_pair()
    limits = HTTPLimits(body_timeout=30.0)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(server, echo, limits=limits))
            await client_stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n")
            raw = await read_until_eof(client_stream)
    assert raw.startswith(b"HTTP/1.1 408 ")


async def test_the_reader_stops_at_the_pipeline_budget() -> None:
    """Bytes sent while a handler runs are read only up to the budget: TCP holds the rest."""
    release = trio.Event()

    async def waiting(request: HTTPRequest, responder: HTTPResponder) -> None:
        await release.wait()
        await responder.send(200, [], b"ok")

    client_stream, server = trio.testing.lockstep_stream_pair()
    limits = HTTPLimits(pipeline_buffer_bytes=1024, receive_bytes=256)
    sent = trio.Event()

    async def send_a_lot() -> None:
        await client_stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"y" * 100_000)
        sent.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(server, waiting, limits=limits))
            nursery.start_soon(send_a_lot)
            await trio.testing.wait_all_tasks_blocked()
            # A lockstep stream's send_all returns only once everything was received.
            assert not sent.is_set()
            release.set()
            nursery.cancel_scope.cancel()


async def test_a_client_that_stops_reading_a_stream_is_dropped_and_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    left = trio.Event()
    stalls: list[None] = []

    async def endless(request: HTTPRequest, responder: HTTPResponder) -> None:
        await responder.start_stream(200, [])
        try:
            while True:
                await responder.send_chunk(b"data: x\n\n")
                await trio.sleep(0.1)
        finally:
            left.set()

    client_stream, server = trio.testing.lockstep_stream_pair()
    limits = HTTPLimits(send_timeout=30.0, header_timeout=10.0, keepalive_timeout=75.0)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: serve_connection(
                    server, endless, limits=limits, on_send_stall=lambda: stalls.append(None)
                )
            )
            await client_stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            seen = b""
            for _ in range(100):
                seen += await client_stream.receive_some(65536)
                if b"data: x" in seen:
                    break
            stopped = trio.current_time()
            await left.wait()  # the client reads nothing more
            waited = trio.current_time() - stopped
    # Dropped after the send timeout, noticed at most one timer period (10 s here) late.
    assert 30.0 <= waited <= 41.0
    assert stalls == [None]


async def test_a_slow_steady_reader_of_a_large_response_is_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = b"z" * (256 * 1024)
    stalls: list[None] = []

    async def large(request: HTTPRequest, responder: HTTPResponder) -> None:
        await responder.send(200, [], body)

    client_stream, server = trio.testing.lockstep_stream_pair()
    # Each 64 KiB piece gets its own 10 s; the whole body takes far longer than that.
    limits = HTTPLimits(send_timeout=10.0, send_piece_bytes=64 * 1024)
    received = b""
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: serve_connection(
                    server, large, limits=limits, on_send_stall=lambda: stalls.append(None)
                )
            )
            await client_stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            started = trio.current_time()
            for _ in range(1000):
                await trio.sleep(1.0)
                received += await client_stream.receive_some(16 * 1024)
                if received.endswith(b"z" * 1024) and len(received) > len(body):
                    break
            assert trio.current_time() - started > 10.0
            nursery.cancel_scope.cancel()
    assert received.endswith(body)
    assert stalls == []


async def test_a_handler_may_run_far_longer_than_the_head_timeouts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow(request: HTTPRequest, responder: HTTPResponder) -> None:
        await trio.sleep(500.0)
        await responder.start_stream(200, [])
        await trio.sleep(500.0)
        await responder.send_chunk(b"late")
        await responder.end_stream()

    client_stream, server = trio.testing.memory_stream_pair()
    limits = HTTPLimits(header_timeout=10.0, keepalive_timeout=75.0)
    with trio.fail_after(5000):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(server, slow, limits=limits))
            started = trio.current_time()
            head, body = await Client(client_stream).request("GET", "/")
            assert (head.status_code, body) == (200, b"late")
            assert trio.current_time() - started == pytest.approx(1000.0)
            await client_stream.aclose()


# -- hostile input (rules 1 and 2) --------------------------------------------------------------


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: 44\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 44\r\n",
        b"Content-Length: 44\r\nTransfer-Encoding:\r\n chunked\r\n",
        b"Content-Length: 44\r\nTransfer-Encoding: cHuNkEd\r\n",
    ],
    ids=["cl-te", "te-cl", "folded-te", "mixed-case"],
)
async def test_a_request_with_two_framings_is_refused_and_nothing_hidden_is_served(
    framing: bytes,
) -> None:
    served: list[str] = []

    async def recording(request: HTTPRequest, responder: HTTPResponder) -> None:
        served.append(request.path)
        await refuse(request, responder)

    # The Content-Length covers the chunked body and the hidden request after it.
    hidden = b"GET /hidden HTTP/1.1\r\nHost: x\r\n\r\n"
    with trio.fail_after(10):
        async with running_server(recording) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    b"POST /outer HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n0\r\n\r\n" + hidden
                )
                raw = await read_until_eof(stream)
    assert raw.startswith(b"HTTP/1.1 400 ")
    assert raw.count(b"HTTP/1.1 ") == 1
    assert b"connection: close" in raw.lower()
    assert served == []


async def test_a_head_over_the_limit_in_one_write_gets_431() -> None:
    errors: list[BaseException] = []
    big = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (60 * 1024) + b"\r\n\r\n"
    with trio.fail_after(10):
        async with running_server(hello, on_error=errors.append) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(big)
                raw = await read_until_eof(stream)
    assert raw.startswith(b"HTTP/1.1 431 ")
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == 431
    assert errors == []


async def test_a_head_under_the_limit_is_served() -> None:
    line = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: "
    with trio.fail_after(10):
        async with running_server(hello) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(line + b"a" * (15 * 1024) + b"\r\n\r\n")
                client = Client(stream)
                client.expect_response_to()
                head, _ = await client.response_head_and_body()
    assert head.status_code == 200


async def test_a_body_dribbled_past_the_whole_body_deadline_gets_408(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client_stream, server = trio.testing.memory_stream_pair()
    # Each piece well within the per-piece timeout; the whole body far past its deadline.
    limits = HTTPLimits(body_timeout=60.0, body_total_timeout=120.0)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_connection(server, echo, limits=limits))
            await client_stream.send_all(
                b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            started = trio.current_time()
            answered = b""
            for _ in range(100):
                with trio.move_on_after(20.0):
                    answered += await client_stream.receive_some(65536)
                if answered:
                    break
                await client_stream.send_all(b"1\r\na\r\n")
            waited = trio.current_time() - started
            nursery.cancel_scope.cancel()
    assert answered.startswith(b"HTTP/1.1 408 ")
    assert waited == pytest.approx(120.0, abs=20.0)
