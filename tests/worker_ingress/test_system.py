"""The worker's system port: routes, status codes and bodies, over loopback sockets."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import h11
import pytest
import trio
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import choose_encoder

from worker_ingress._system import serve_system

MAX_READS = 1000


class Health:
    """A settable health state, as the worker keeps it."""

    def __init__(self) -> None:
        self.status = "starting"

    def __call__(self) -> str:
        return self.status


def prometheus_renderer(registry: CollectorRegistry) -> Callable[[str | None], tuple[bytes, str]]:
    def render(accept: str | None) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept or "")
        return encoder(registry), content_type

    return render


@asynccontextmanager
async def system_port(
    render: Callable[[str | None], tuple[bytes, str]],
    health: Callable[[], str],
    on_error: Callable[[BaseException], None] | None = None,
) -> AsyncIterator[int]:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_system(
                "127.0.0.1",
                0,
                render_metrics=render,
                health=health,
                on_error=on_error,
                task_status=task_status,
            )
        )
        yield port
        nursery.cancel_scope.cancel()


async def fetch(
    port: int, method: str, path: str, headers: list[tuple[str, str]] | None = None
) -> tuple[h11.Response, bytes]:
    """One request on a fresh connection; returns the response head and body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(
            method=method, target=path, headers=[("host", "127.0.0.1"), *(headers or [])]
        )
        await stream.send_all((conn.send(request) or b"") + (conn.send(h11.EndOfMessage()) or b""))
        head: h11.Response | None = None
        body = b""
        for _ in range(MAX_READS):
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(bytes(await stream.receive_some(65536)))
            elif isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return head, body
        raise AssertionError("response did not end")


def header(response: h11.Response, name: bytes) -> bytes | None:
    for key, value in response.headers:
        if key == name:
            return value
    return None


def no_metrics(accept: str | None) -> tuple[bytes, str]:
    return b"", "text/plain"


async def test_health_follows_the_worker_state() -> None:
    health = Health()
    with trio.fail_after(10):
        async with system_port(no_metrics, health) as port:
            for status, code in [("starting", 503), ("ready", 200), ("draining", 503)]:
                health.status = status
                head, body = await fetch(port, "GET", "/health")
                assert head.status_code == code
                assert header(head, b"content-type") == b"application/json"
                assert json.loads(body) == {"status": status}
                # A 503 says why, as every 503 of the frontend does; a 200 has no reason.
                reason = header(head, b"x-dynamo-reject-reason")
                assert reason == (None if code == 200 else status.encode())


async def test_live_answers_whatever_the_health() -> None:
    health = Health()
    with trio.fail_after(10):
        async with system_port(no_metrics, health) as port:
            for status in ("starting", "ready", "draining"):
                health.status = status
                head, body = await fetch(port, "GET", "/live")
                assert head.status_code == 200
                assert json.loads(body) == {"status": "live"}


async def test_metrics_are_the_registry_in_prometheus_text() -> None:
    registry = CollectorRegistry()
    rejected = Counter(
        "dynamo_rejection_request", "Requests rejected", registry=registry
    )  # exported as dynamo_rejection_request_total
    rejected.inc(3)
    with trio.fail_after(10):
        async with system_port(prometheus_renderer(registry), Health()) as port:
            head, body = await fetch(port, "GET", "/metrics")
            assert head.status_code == 200
            assert (header(head, b"content-type") or b"").startswith(b"text/plain")
            assert b"dynamo_rejection_request_total 3.0" in body
            head, body = await fetch(
                port, "GET", "/metrics", [("accept", "application/openmetrics-text")]
            )
            assert (header(head, b"content-type") or b"").startswith(
                b"application/openmetrics-text"
            )
            assert body.rstrip().endswith(b"# EOF")


async def test_the_accept_header_reaches_the_renderer() -> None:
    seen: list[str | None] = []

    def render(accept: str | None) -> tuple[bytes, str]:
        seen.append(accept)
        return b"m 1\n", "text/plain; version=0.0.4"

    with trio.fail_after(10):
        async with system_port(render, Health()) as port:
            await fetch(port, "GET", "/metrics")
            await fetch(port, "GET", "/metrics", [("accept", "text/plain")])
    assert seen == [None, "text/plain"]


@pytest.mark.parametrize(
    ("method", "path", "code"),
    [
        ("GET", "/", 404),
        ("GET", "/v1/models", 404),
        ("POST", "/nothing", 404),
        ("POST", "/health", 405),
        ("DELETE", "/metrics", 405),
        ("PUT", "/live", 405),
    ],
)
async def test_unknown_paths_and_methods(method: str, path: str, code: int) -> None:
    with trio.fail_after(10):
        async with system_port(no_metrics, Health()) as port:
            head, body = await fetch(port, method, path)
    assert head.status_code == code
    assert header(head, b"content-type") == b"application/json"
    assert json.loads(body)["error"]["code"] == code
    if code == 405:
        assert header(head, b"allow") == b"GET, HEAD"


async def test_a_404_quotes_a_long_path_by_a_short_prefix() -> None:
    path = "/" + "p" * 16_000
    with trio.fail_after(10):
        async with system_port(no_metrics, Health()) as port:
            head, body = await fetch(port, "GET", path)
    assert head.status_code == 404
    error = json.loads(body)["error"]
    assert error["message"] == f"no such endpoint: {path[:64]}... (16001 characters)"
    assert error["type"] == "not_found_error"


async def test_head_gets_the_headers_without_a_body() -> None:
    with trio.fail_after(10):
        async with system_port(no_metrics, Health()) as port:
            head, body = await fetch(port, "HEAD", "/live")
    assert head.status_code == 200
    assert body == b""
    assert header(head, b"content-length") == b"17"


async def test_a_failing_metrics_renderer_gives_500_and_is_reported() -> None:
    errors: list[BaseException] = []

    def broken(accept: str | None) -> tuple[bytes, str]:
        raise RuntimeError("collector failed")

    with trio.fail_after(10):
        async with system_port(broken, Health(), on_error=errors.append) as port:
            head, _ = await fetch(port, "GET", "/metrics")
            assert head.status_code == 500
            head, _ = await fetch(port, "GET", "/live")
            assert head.status_code == 200
    assert [type(e) for e in errors] == [RuntimeError]
