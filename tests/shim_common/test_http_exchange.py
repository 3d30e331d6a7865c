"""What a handler sees (:mod:`shim_common._http_exchange`): the request's fields and headers,
the responder's complete and streamed answers, and the JSON error helpers.
"""

from __future__ import annotations

import json

import trio
import trio.testing
from http_test_client import (
    Client,
    echo,
    header,
    running_server,
)

from shim_common._httpserver import (
    HTTPRequest,
    HTTPResponder,
    error_body,
    json_headers,
)

# -- request fields and the request head ------------------------------------------------------


async def test_two_requests_on_one_connection_with_request_fields() -> None:
    with trio.fail_after(10):
        async with running_server(echo) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                client = Client(stream)
                head, body = await client.request("GET", "/a/b?x=1&y=2", [("X-Test", "v")])
                assert head.status_code == 200
                assert json.loads(body) == {
                    "method": "GET",
                    "path": "/a/b",
                    "query": "x=1&y=2",
                    "x-test": "v",
                    "body": "",
                }
                head, body = await client.request("POST", "/c", body=b"payload")
                assert head.status_code == 200
                assert header(head, b"connection") is None
                assert json.loads(body)["body"] == "payload"


async def test_an_absolute_form_target_is_served_as_its_path() -> None:
    with trio.fail_after(10):
        async with running_server(echo) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                client = Client(stream)
                for target, path, query in [
                    ("http://host:8000/health?x=1", "/health", "x=1"),
                    ("HTTP://host/a/b", "/a/b", ""),
                    ("http://host?q", "/", "q"),
                    ("http://host", "/", ""),
                ]:
                    head, body = await client.request("GET", target)
                    assert head.status_code == 200
                    answer = json.loads(body)
                    assert (answer["path"], answer["query"]) == (path, query)


# -- the responder ----------------------------------------------------------------------------


async def test_sse_stream_is_chunked_and_the_connection_is_kept() -> None:
    async def sse(request: HTTPRequest, responder: HTTPResponder) -> None:
        await responder.start_stream(200, [(b"content-type", b"text/event-stream")])
        assert responder.started
        for i in range(3):
            await responder.send_chunk(b"data: %d\n\n" % i)
        await responder.send_chunk(b"")  # sends nothing
        await responder.send_chunk(b"data: [DONE]\n\n")
        await responder.end_stream()

    with trio.fail_after(10):
        async with running_server(sse) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                client = Client(stream)
                head, body = await client.request("GET", "/stream")
                assert head.status_code == 200
                assert header(head, b"transfer-encoding") == b"chunked"
                assert header(head, b"content-length") is None
                assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
                head, body = await client.request("GET", "/again")
                assert body.endswith(b"data: [DONE]\n\n")


async def test_responding_twice_is_an_error() -> None:
    outcome: list[str] = []

    async def twice(request: HTTPRequest, responder: HTTPResponder) -> None:
        await responder.send(200, [], b"one")
        try:
            await responder.send(200, [], b"two")
        except RuntimeError:
            outcome.append("refused")

    with trio.fail_after(10):
        async with running_server(twice) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                _, body = await Client(stream).request("GET", "/")
    assert body == b"one"
    assert outcome == ["refused"]


def test_error_body_has_the_openai_shape() -> None:
    assert json.loads(error_body("too big", 413)) == {
        "error": {"message": "too big", "type": "invalid_request_error", "code": 413}
    }
    assert json_headers((b"retry-after", b"1")) == [
        (b"content-type", b"application/json"),
        (b"retry-after", b"1"),
    ]
