"""Our servers as child processes of a Trio benchmark: start one, read its ready line, ask it.

The benchmarks that run inside Trio (``bench/slo_e2e.py``, ``bench/bench_hostile_classes.py``)
start a worker and a frontend the same way: the child prints one line naming its addresses
(``worker-ingress ready ws=... system=...``, ``frontend-shim ready http=...``), is asked over
plain HTTP, and is terminated (killed after 5 s) however the run ends.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import h11
import trio

__all__ = ["http_get", "pinned", "started"]

#: The addresses of a ready line, in order (``ws=``, ``system=``, ``http=``).
READY: Final = re.compile(rb"\w+=(\S+)")
#: Bytes of a ready line read at most: a child that prints more without a newline is not ready.
READY_LINE_LIMIT: Final = 4096


def pinned(cpu: int, args: Sequence[str]) -> list[str]:
    """``args`` run on CPU ``cpu`` through ``taskset`` (unpinned where it is missing)."""
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(cpu), *args] if taskset else list(args)


@asynccontextmanager
async def started(
    args: Sequence[str], env: dict[str, str], *, cwd: Path | None = None
) -> AsyncIterator[list[str]]:
    """Run ``args`` until the block ends; yields the addresses its ready line names.

    Raises:
        RuntimeError: the child ended or printed something else before its ready line.
        trio.TooSlowError: no ready line within 30 s.
    """
    process = await trio.lowlevel.open_process(
        list(args),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=None if cwd is None else str(cwd),
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n") and len(line) < READY_LINE_LIMIT:
                chunk = await process.stdout.receive_some(4096)
                if not chunk:
                    break
                line += chunk
        if b" ready " not in line:
            raise RuntimeError(f"{list(args)!r} did not start: {line!r}")
        yield [url.decode() for url in READY.findall(line)]
    finally:
        with trio.CancelScope(shield=True):
            process.terminate()
            with trio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


async def http_get(url: str, path: str) -> str:
    """The body of ``GET path`` on the server at ``url``, on a connection of its own."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="GET", target=path, headers=[("host", parts.netloc)])
        await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
        body = b""
        for _ in range(100_000):
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
    return body.decode()
