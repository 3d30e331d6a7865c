"""Hostile HTTP framing against a real ``frontend-shim`` in front of a real worker, the hostile
client played by the test on a raw socket (docs/reliability.md, "Hostile input": HTTP framing).

- A chunked body in one-byte chunks is refused 400 once its chunks pass their bound, having cost
  the frontend a small, fixed amount; a body in chunks of a few hundred bytes is read whole, at
  a small multiple of what the same body costs with a ``Content-Length``.
- A head of thousands of tiny header lines is refused 431; one hundred are served.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import pytest
import trio
from test_e2e import MOCKER_FLAGS, clean_env, frontend_cmd, wait_connected, worker_cmd
from test_fleet_faults import started

pytestmark = pytest.mark.e2e

TIMEOUT = 60.0
MODEL = "mock-model"
#: What the hostile client may cost the frontend's memory: well under the ~90 MB that a 1 MiB
#: body in one-byte chunks cost when every chunk was an event of its own.
RSS_GROWTH_BOUND = 30 << 20


@asynccontextmanager
async def fleet() -> AsyncIterator[tuple[str, int]]:
    """A worker (the mocker) and a frontend routing to it: the frontend's URL and pid."""
    env = clean_env()
    async with (
        started([*worker_cmd("--model", MODEL, *MOCKER_FLAGS)], env) as (urls, _),
        started(frontend_cmd("--worker", urls[0]), env) as (front, process),
    ):
        await wait_connected(front[0])
        yield front[0], process.pid


def cpu_seconds(pid: int) -> float:
    """User and system CPU of a process so far (``/proc``; clock ticks of 10 ms)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def exchange(url: str, head: bytes, body: Iterable[bytes] = ()) -> tuple[int, bytes]:
    """Send ``head`` then the pieces of ``body`` while reading the answer; its status and body.

    The server may answer before the body is all sent and close: the rest is then not sent.
    """
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    received = bytearray()

    async def send() -> None:
        try:
            await stream.send_all(head)
            batch: list[bytes] = []
            for piece in body:
                batch.append(piece)
                if len(batch) == 4096:  # many pieces per write, so the test is not the bottleneck
                    await stream.send_all(b"".join(batch))
                    batch.clear()
            await stream.send_all(b"".join(batch))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # answered and closed before the whole body was sent

    async with stream, trio.open_nursery() as nursery:
        nursery.start_soon(send)
        for _ in range(10_000):
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            received += data
            if not data or _complete(received):
                break
        nursery.cancel_scope.cancel()
    status_line, _, rest = bytes(received).partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 "), received[:200]
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _complete(received: bytearray) -> bool:
    head, found, body = bytes(received).partition(b"\r\n\r\n")
    if not found:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def completion_head(url: str, framing: bytes) -> bytes:
    netloc = urllib.parse.urlsplit(url).netloc.encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s\r\n\r\n"
        % (netloc, framing)
    )


def refused_body(size: int) -> bytes:
    """A completion body of about ``size`` bytes that the frontend reads whole, then refuses
    (400 for ``max_tokens``), so that no worker time enters the measure."""
    body = {"model": MODEL, "prompt": "one two", "max_tokens": -1, "pad": ""}
    base = len(json.dumps(body))
    body["pad"] = "x" * max(0, size - base)
    return json.dumps(body).encode()


def in_chunks(body: bytes, size: int) -> Iterable[bytes]:
    for start in range(0, len(body), size):
        piece = body[start : start + size]
        yield b"%x\r\n%b\r\n" % (len(piece), piece)
    yield b"0\r\n\r\n"


async def test_a_body_in_one_byte_chunks_is_refused_at_a_small_fixed_cost() -> None:
    body = refused_body(1 << 20)
    with trio.fail_after(TIMEOUT):
        async with fleet() as (url, pid):
            rss, cpu = rss_bytes(pid), cpu_seconds(pid)
            status, answer = await exchange(
                url, completion_head(url, b"Transfer-Encoding: chunked"), in_chunks(body, 1)
            )
            assert status == 400, answer
            assert b"too many chunks" in answer
            assert rss_bytes(pid) - rss < RSS_GROWTH_BOUND
            # An order of magnitude: well under the ~0.5 s it cost when every chunk was an event.
            assert cpu_seconds(pid) - cpu < 0.2
            # The frontend serves on.
            status, answer = await exchange(url, completion_head(url, b"Content-Length: 2") + b"{}")
            assert status == 400, answer


async def test_a_body_in_small_chunks_costs_a_small_multiple_of_the_same_body_whole() -> None:
    body = refused_body(8 << 20)
    with trio.fail_after(TIMEOUT):
        async with fleet() as (url, pid):
            costs: dict[str, float] = {}
            for name, framing, pieces in (
                ("whole", b"Content-Length: %d" % len(body), [body]),
                ("chunked", b"Transfer-Encoding: chunked", in_chunks(body, 256)),
            ):
                cpu = cpu_seconds(pid)
                status, answer = await exchange(url, completion_head(url, framing), pieces)
                costs[name] = cpu_seconds(pid) - cpu
                # Read whole and refused by the handler for its field, not by the framing.
                assert status == 400, answer
                assert b"max_tokens" in answer, answer
            # An order of magnitude (ticks are 10 ms): it was up to 90 times.
            assert costs["chunked"] <= 10 * max(costs["whole"], 0.05), costs


async def test_thousands_of_tiny_headers_get_431_and_a_hundred_are_served() -> None:
    with trio.fail_after(TIMEOUT):
        async with fleet() as (url, _):
            netloc = urllib.parse.urlsplit(url).netloc.encode()

            def live(headers: int) -> bytes:
                lines = b"".join(b"x%d: y\r\n" % i for i in range(headers))
                return b"GET /live HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (netloc, lines)

            status, answer = await exchange(url, live(2600))
            assert status == 431, answer
            assert b"header lines" in answer
            status, answer = await exchange(url, live(99))  # with Host, 100
            assert status == 200, answer


# -- slow uploads ------------------------------------------------------------------------------

#: A completion body declared and never sent but for its first byte.
SLOW_BODY_BYTES = 100_000


async def open_slow_upload(url: str, priority: int | None = None) -> trio.SocketStream:
    """A connection sending a completion head and one byte of its body, then nothing."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    extra = b"" if priority is None else b"\r\nx-dynamo-priority: %d" % priority
    framing = b"Content-Length: %d%s" % (SLOW_BODY_BYTES, extra)
    await stream.send_all(completion_head(url, framing) + b"{")
    return stream


async def answer_head(url: str, request: bytes) -> bytes:
    """The head of the answer to ``request`` on a fresh connection."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    async with await trio.open_tcp_stream(parts.hostname, parts.port) as stream:
        await stream.send_all(request)
        received = b""
        for _ in range(1000):
            data = await stream.receive_some(65536)
            received += data
            if not data or b"\r\n\r\n" in received:
                break
    assert received.startswith(b"HTTP/1.1 "), received
    return received.partition(b"\r\n\r\n")[0]


def retry_after(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"retry-after":
            return int(value)
    raise AssertionError(f"no Retry-After in {head!r}")


async def test_slow_uploads_are_not_counted_in_retry_after() -> None:
    # The fleet made busy by one long stream (any KV block held is busy), after a pace of
    # completions is known; then forty uploads of a body that never comes. The Retry-After a
    # shed client gets is the same with them as without: the fleet holds nothing of them.
    env = clean_env()
    busy = ("--active-decode-blocks-threshold", "0.0", "--busy-exempt-priority", "0")
    async with (
        started([*worker_cmd("--model", MODEL)], env) as (urls, _),
        started(frontend_cmd("--worker", urls[0], *busy), env) as (front, _),
    ):
        url = front[0]
        with trio.fail_after(TIMEOUT):
            await wait_connected(url)
            short = json.dumps({"model": MODEL, "prompt": "one", "max_tokens": 1}).encode()
            for _ in range(8):
                status, answer = await exchange(
                    url, completion_head(url, b"Content-Length: %d" % len(short)) + short
                )
                assert status == 200, answer
                await trio.sleep(0.15)
            long = {"model": MODEL, "prompt": "one", "max_tokens": 20_000, "stream": True}
            held = json.dumps(long).encode()
            probe = completion_head(url, b"Content-Length: 2\r\nx-dynamo-priority: 5") + b"{}"
            async with trio.open_nursery() as nursery:
                # The stream holds the only worker busy until the test ends.
                nursery.start_soon(
                    exchange, url, completion_head(url, b"Content-Length: %d" % len(held)) + held
                )
                for _ in range(500):
                    head = await answer_head(url, probe)
                    if head.startswith(b"HTTP/1.1 529 "):
                        break
                    await trio.sleep(0.02)
                before = retry_after(head)
                # Busy-exempt uploads: their body is awaited although the fleet is busy.
                uploads = [await open_slow_upload(url, priority=-5) for _ in range(40)]
                await trio.sleep(0.5)
                head = await answer_head(url, probe)
                assert head.startswith(b"HTTP/1.1 529 "), head
                assert retry_after(head) <= before + 1, (before, head)
                for upload in uploads:
                    await upload.aclose()
                nursery.cancel_scope.cancel()


async def test_slow_uploads_at_the_descriptor_limit_give_way_to_new_clients() -> None:
    # A frontend with few descriptors, every one of them taken by an upload that sent one byte
    # of its body: once they fall behind the minimum rate (240 B/s after 5 s), the server closes
    # them to accept new clients, as it closes idle connections.
    env = clean_env()
    async with started([*worker_cmd("--model", MODEL)], env) as (urls, _):
        limited = ["prlimit", "--nofile=64:64", *frontend_cmd("--worker", urls[0])]
        async with started(limited, env) as (front, process):
            url = front[0]
            with trio.fail_after(TIMEOUT):
                await wait_connected(url)
                uploads: list[trio.SocketStream] = []
                # Until the frontend's table is full (the last ones wait in the listen backlog).
                for _ in range(64):
                    uploads.append(await open_slow_upload(url))
                    await trio.sleep(0.01)
                assert len(os.listdir(f"/proc/{process.pid}/fd")) >= 60
                netloc = urllib.parse.urlsplit(url).netloc.encode()
                live = b"GET /live HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % netloc
                with trio.fail_after(30):
                    head = await answer_head(url, live)
                assert head.startswith(b"HTTP/1.1 200 "), head
                for upload in uploads:
                    await upload.aclose()
