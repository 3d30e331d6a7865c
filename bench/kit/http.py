"""HTTP/1.1 for a benchmark: one client for what it times or checks, and blocking helpers.

:class:`Client` is one keep-alive connection (h11 over a Trio socket) to one server, opened on
first use and again after a failure or a close by the server: a lean client, so that a
benchmark's own CPU is not what limits the load it offers. :func:`fetch` makes one request on a
connection of its own. A :class:`Reply` fills in as the answer arrives, so a caller that gives up
half-way (a client hanging up on purpose) still sees what had come.

The blocking helpers (:func:`get`, :func:`post`, :func:`wait_connected`, :func:`wait_status`,
:func:`kept_busy`, on the standard library and ``curl``) are for a benchmark that is a plain
script and asks a few questions around what it measures; :func:`health` and
:func:`wait_connected_trio` are their Trio counterparts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json as jsonlib
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import h11
import trio

__all__ = [
    "HTTP_ERRORS",
    "Client",
    "Reply",
    "fetch",
    "get",
    "health",
    "kept_busy",
    "post",
    "wait_connected",
    "wait_connected_trio",
    "wait_status",
]

#: What a failed connection or exchange raises from :class:`Client` (the connection is closed).
HTTP_ERRORS: Final = (OSError, trio.BrokenResourceError, h11.ProtocolError)
RECEIVE_BYTES: Final = 65536


@dataclasses.dataclass
class Reply:
    """What came back of one request, as far as it came."""

    #: 0 until the response's head arrived.
    status: int = 0
    body: bytearray = dataclasses.field(default_factory=bytearray)
    #: The response ended properly (its end of message was read).
    complete: bool = False

    def json(self) -> Any:
        """The body as JSON; None when it is not."""
        try:
            return jsonlib.loads(self.body)
        except ValueError:
            return None


class Client:
    """One keep-alive HTTP/1.1 connection to the server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"{url!r} names no host and port")
        self.host = parts.hostname
        self.port = parts.port
        self._netloc = parts.netloc
        self._stream: trio.SocketStream | None = None
        self._conn = h11.Connection(h11.CLIENT)

    @property
    def connected(self) -> bool:
        return self._stream is not None

    async def connect(self) -> None:
        """Open the connection now, if it is not open (a pool opens its connections ahead).

        Raises:
            OSError: the server could not be reached.
        """
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self.host, self.port)
            self._conn = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        """Close the connection now (no checkpoint: safe in a ``finally`` being cancelled)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.socket.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    async def request(
        self,
        method: str,
        target: str,
        body: bytes = b"",
        *,
        json: Any = None,
        headers: Sequence[tuple[str, str]] = (),
        reply: Reply | None = None,
        on_data: Callable[[bytes], None] | None = None,
    ) -> Reply:
        """Send one request and read its whole answer.

        Args:
            method: ``GET``, ``POST``...
            target: The path (and query).
            body: The body, sent as JSON (``content-type: application/json``).
            json: A value to send as the body instead, encoded.
            headers: More header fields.
            reply: Filled in as the answer arrives (a new one when None).
            on_data: Called with each piece of the body as it arrives.

        Raises:
            OSError, trio.BrokenResourceError, h11.ProtocolError: the connection failed (it is
                closed; the next request opens another).
        """
        if json is not None:
            body = jsonlib.dumps(json).encode()
        reply = reply if reply is not None else Reply()
        await self.connect()
        try:
            await self._exchange(method, target, body, headers, reply, on_data)
        except BaseException:
            self.close()
            raise
        return reply

    async def _exchange(
        self,
        method: str,
        target: str,
        body: bytes,
        extra: Sequence[tuple[str, str]],
        reply: Reply,
        on_data: Callable[[bytes], None] | None,
    ) -> None:
        stream, conn = self._stream, self._conn
        assert stream is not None
        headers = [("host", self._netloc)]
        if body or method != "GET":
            headers.append(("content-length", str(len(body))))
        if body:
            headers.append(("content-type", "application/json"))
        headers += extra
        data = conn.send(h11.Request(method=method, target=target, headers=headers)) or b""
        if body:
            data += conn.send(h11.Data(data=body)) or b""
        data += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(data)
        # Bounded by the answer: every pass takes an event or reads bytes (none: the end).
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(RECEIVE_BYTES))
            elif isinstance(event, h11.Response):
                reply.status = event.status_code
            elif isinstance(event, h11.Data):
                reply.body += event.data
                if on_data is not None:
                    on_data(event.data)
            elif isinstance(event, h11.EndOfMessage):
                reply.complete = True
                break
            elif isinstance(event, h11.ConnectionClosed):
                break
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            self.close()


async def fetch(
    url: str,
    method: str,
    target: str,
    body: bytes = b"",
    *,
    json: Any = None,
    headers: Sequence[tuple[str, str]] = (),
    reply: Reply | None = None,
    on_data: Callable[[bytes], None] | None = None,
) -> Reply:
    """One request (as :meth:`Client.request`) on a connection of its own, closed after."""
    client = Client(url)
    try:
        return await client.request(
            method, target, body, json=json, headers=headers, reply=reply, on_data=on_data
        )
    finally:
        client.close()


async def health(url: str) -> dict[str, Any]:
    """The frontend's ``GET /health`` answer (``{}`` when it is not JSON)."""
    answer = (await fetch(url, "GET", "/health")).json()
    return answer if isinstance(answer, dict) else {}


async def wait_connected_trio(url: str, workers: int = 1) -> None:
    """Return once the frontend at ``url`` follows ``workers`` workers (``/health``); the
    caller bounds the wait."""
    while True:
        if (await health(url)).get("workers_connected", 0) >= workers:
            return
        await trio.sleep(0.02)


# ----------------------------------------------------------------------------- blocking helpers


def get(url: str, target: str, *, timeout: float = 10.0) -> tuple[int, bytes]:
    """``GET target`` on the server at ``url``: its status and body (an error status too)."""
    try:
        with urllib.request.urlopen(url + target, timeout=timeout) as answer:
            return int(answer.status), answer.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read()


def post(url: str, target: str, body: str | bytes, *, timeout: float = 10.0) -> int:
    """``POST target`` of the JSON ``body`` on the server at ``url``: the status answered."""
    data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(
        url + target, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            answer.read()
            return int(answer.status)
    except urllib.error.HTTPError as error:
        with error:
            return error.code


def wait_connected(url: str, workers: int = 1, *, timeout: float = 60.0) -> None:
    """Return once the frontend at ``url`` follows ``workers`` workers (``/health``).

    Raises:
        RuntimeError: not within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            _, body = get(url, "/health")
            if jsonlib.loads(body).get("workers_connected", 0) >= workers:
                return
        time.sleep(0.02)
    raise RuntimeError(f"{url} did not connect to its {workers} worker(s) in {timeout:g} s")


def wait_status(url: str, target: str, body: str, want: int, *, timeout: float) -> None:
    """Post ``body`` until it is answered ``want`` (a connection refused counts as not yet).

    Raises:
        RuntimeError: not within ``timeout`` seconds (says the last answer).
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = post(url, target, body)
        except OSError as error:
            last = error
        if last == want:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{url}{target} never answered {want} (last: {last!r})")


@contextlib.contextmanager
def kept_busy(
    url: str, target: str, long_body: str, probe: str, *, timeout: float = 60.0
) -> Iterator[None]:
    """Keep the frontend at ``url`` busy for the block: one long streamed request
    (``long_body``, to ``target``) holds KV blocks on its fleet, whose decode threshold makes a
    worker busy as soon as it holds any, until ``probe`` is answered 529.

    Probing starts only once the stream has begun: a probe sent alongside it could be admitted
    first, make the fleet busy for a moment, and have the long request itself shed.

    Raises:
        RuntimeError: the stream did not start, or the fleet did not turn busy, in time.
    """
    with tempfile.TemporaryDirectory() as scratch:
        stream = Path(scratch) / "stream"
        holder = subprocess.Popen(
            ["curl", "-sN", "-o", str(stream), "-H", "Content-Type: application/json",
             "-d", long_body, url + target]
        )  # fmt: skip
        try:
            deadline = time.monotonic() + timeout
            while not (stream.exists() and stream.stat().st_size > 0):
                if holder.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the long request to {url} did not start streaming")
                time.sleep(0.1)
            wait_status(url, target, probe, 529, timeout=timeout)
            yield
        finally:
            holder.terminate()
            holder.wait()
