"""What the soak runs and reads: its child processes (started, their ready line read, their
resident memory from ``/proc``), one HTTP/1.1 exchange (trio + h11, streamed or not), and the
Prometheus text of a ``/metrics`` page as numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import urllib.parse
from collections.abc import Sequence
from typing import IO, Any, Final

import h11
import trio

READY: Final = re.compile(r"\w+=(\S+)")
PAGE_BYTES: Final = os.sysconf("SC_PAGE_SIZE")
#: Seconds a process gets to print its ready line.
READY_TIMEOUT: Final = 30.0
SAMPLE_LINE: Final = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$")


# ----------------------------------------------------------------------------- processes


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def clean_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
    env.update(extra)
    return env


class Child:
    """A child process that prints one ready line with URLs; its stderr goes to a log file."""

    def __init__(self, name: str, args: Sequence[str], env: dict[str, str], log: IO[bytes]) -> None:
        self.name = name
        self.args = list(args)
        self.env = env
        self.log = log
        self.process: trio.Process | None = None
        self.urls: list[str] = []

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start(self, args: Sequence[str] | None = None) -> list[str]:
        process = await trio.lowlevel.open_process(
            list(args or self.args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=self.env,
        )
        self.process = process
        assert process.stdout is not None
        line = b""
        with trio.fail_after(READY_TIMEOUT):
            while not line.endswith(b"\n") and len(line) < 4096:
                chunk = await process.stdout.receive_some(4096)
                if not chunk:
                    raise RuntimeError(f"{self.name} exited before it was ready (see its log)")
                line += chunk
        self.urls = READY.findall(line.decode())
        return self.urls

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    async def stop(self) -> None:
        process = self.process
        if process is None:
            return
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
                with trio.move_on_after(10):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()


# ----------------------------------------------------------------------------- HTTP


@dataclasses.dataclass
class Reply:
    """What came back: ``status`` 0 when no response head arrived."""

    status: int = 0
    body: bytes = b""
    #: The response ended properly (its end of message was read).
    complete: bool = False

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


async def http(
    url: str, method: str, path: str, payload: Any = None, reply: Reply | None = None
) -> Reply:
    """One request on a fresh connection, read to its end (a lean client: the soak's own CPU
    must not be what limits the load it offers). ``reply`` is filled in as the answer comes,
    so a caller that gives up half-way still sees what had arrived.

    Raises:
        OSError: the connection could not be made.
    """
    reply = reply if reply is not None else Reply()
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    data = b"" if payload is None else json.dumps(payload).encode()
    headers = [("host", parts.netloc)]
    if method != "GET":
        headers += [("content-type", "application/json"), ("content-length", str(len(data)))]
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        out = conn.send(h11.Request(method=method, target=path, headers=headers))
        out += conn.send(h11.Data(data=data)) if data else b""
        out += conn.send(h11.EndOfMessage())
        try:
            await stream.send_all(out)
        except trio.BrokenResourceError:
            return reply
        body = bytearray()
        # Bounded by the size of the answer: every pass consumes bytes or ends.
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                break
            if event is h11.NEED_DATA:
                try:
                    received = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                conn.receive_data(bytes(received))
                continue
            if isinstance(event, h11.Response):
                reply.status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
                reply.body = bytes(body)
            elif isinstance(event, h11.EndOfMessage):
                reply.complete = True
                break
            else:
                break
    return reply


# ----------------------------------------------------------------------------- metrics


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of the samples of each metric name (labels summed over)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = SAMPLE_LINE.match(line)
        if match:
            values[match[1]] = values.get(match[1], 0.0) + float(match[3])
    return values


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` keyed by one label's value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = SAMPLE_LINE.match(line)
        if match and match[1] == name and match[2]:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match[2]))
            key = found.get(label, "")
            out[key] = out.get(key, 0.0) + float(match[3])
    return out
