"""``--local-workers K``: child ``worker-ingress`` processes started and stopped with the frontend.

The embedded default a newcomer runs: ``frontend-shim --local-workers 2`` and nothing else.

Life of the children (:func:`run_local_workers`):

1. Start: each child runs ``python -m worker_ingress --port 0 --system-port 0 <worker flags>``
   with this process's environment (so ``DYN_*`` settings reach it), its stderr passed through
   to ours (its logs), and its stdout read by us.
2. Ready: a child is ready when it prints ``worker-ingress ready ws=... system=...``. A child
   that exits first, or says nothing within ``ready_timeout`` seconds, fails the start with
   :class:`LocalWorkerError` (after every child has been stopped). Once all are ready, the ws
   URLs are reported through ``task_status``.
3. Serve: the rest of each child's stdout is copied to our stderr line by line, so a chatty
   child never blocks on a full pipe (our stdout carries only the frontend's own ready line).
4. A child that dies while the frontend runs is logged at ERROR with its exit status and not
   restarted: its port would have to be taken again and a crash loop would hide the cause.
   The frontend's link to it keeps retrying and the router sees it as down (HTTP 503 when no
   worker is left), which an operator notices.
5. Stop (cancellation of the caller): SIGTERM to every child, so each drains; up to
   ``stop_timeout`` seconds for all to exit; SIGKILL for any still running. Shielded, so a
   cancelled frontend never leaves orphans behind.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Final

import trio

__all__ = [
    "READY_LINE",
    "LocalWorker",
    "LocalWorkerError",
    "parse_ready_line",
    "run_local_workers",
    "worker_command",
]

logger = logging.getLogger(__name__)

#: The ready line of the worker process (see the contract), with its two URLs captured.
READY_LINE: Final = re.compile(r"^worker-ingress ready ws=(?P<ws>\S+) system=(?P<system>\S+)\s*$")

#: A stdout line longer than this is cut (a child cannot make us buffer without limit).
MAX_LINE_BYTES: Final = 64 * 1024


class LocalWorkerError(RuntimeError):
    """A child worker could not be started (it exited, or never said it was ready)."""


@dataclasses.dataclass(frozen=True)
class LocalWorker:
    """A ready child worker."""

    index: int
    pid: int
    ws_url: str
    system_url: str


def parse_ready_line(line: str) -> tuple[str, str] | None:
    """The ``(ws_url, system_url)`` of a worker's ready line, or ``None`` for any other line."""
    match = READY_LINE.match(line)
    if match is None:
        return None
    return match["ws"], match["system"]


def worker_command(worker_args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The command line of one child: free ports, then the worker flags given to the frontend."""
    return [python, "-m", "worker_ingress", "--port", "0", "--system-port", "0", *worker_args]


class _LineReader:
    """Lines of a child's stdout, each cut at :data:`MAX_LINE_BYTES`."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self._eof = False

    async def readline(self) -> str | None:
        """The next line without its end, or ``None`` at end of stream."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0 or len(self._buffer) >= MAX_LINE_BYTES:
                cut = end if end >= 0 else MAX_LINE_BYTES
                line = bytes(self._buffer[:cut])
                del self._buffer[: cut + 1 if end >= 0 else cut]
                return line.decode("utf-8", "replace").rstrip("\r")
            if self._eof:
                if not self._buffer:
                    return None
                line = bytes(self._buffer)
                self._buffer.clear()
                return line.decode("utf-8", "replace")
            data = await self._stream.receive_some(MAX_LINE_BYTES)
            if not data:
                self._eof = True
            self._buffer += data


class _Child:
    """One child process and what we know of it."""

    def __init__(self, index: int, process: trio.Process) -> None:
        self.index = index
        self.process = process
        assert process.stdout is not None
        self.lines = _LineReader(process.stdout)
        self.stopping = False

    async def wait_ready(self) -> LocalWorker:
        while True:
            line = await self.lines.readline()
            if line is None:
                status = await self.process.wait()
                raise LocalWorkerError(
                    f"local worker {self.index} (pid {self.process.pid}) exited with status "
                    f"{status} before it was ready (its stderr above says why)"
                )
            urls = parse_ready_line(line)
            if urls is not None:
                return LocalWorker(self.index, self.process.pid, urls[0], urls[1])
            _copy_line(self.index, line)

    async def watch(self) -> None:
        """Copy the rest of stdout; report the exit if it was not asked for."""
        while (line := await self.lines.readline()) is not None:
            _copy_line(self.index, line)
        status = await self.process.wait()
        if not self.stopping:
            logger.error(
                "local worker %d (pid %d) exited with status %d; it is not restarted",
                self.index,
                self.process.pid,
                status,
            )


def _copy_line(index: int, line: str) -> None:
    print(f"[local worker {index}] {line}", file=sys.stderr, flush=True)


async def run_local_workers(
    count: int,
    worker_args: Sequence[str],
    *,
    python: str = sys.executable,
    ready_timeout: float = 30.0,
    stop_timeout: float = 10.0,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``count`` child workers until cancelled (see the module docstring).

    Use with ``urls = await nursery.start(run_local_workers, k, worker_flags)``.

    Args:
        count: how many children (at least 1).
        worker_args: worker flags given to the frontend, e.g. ``["--engine-request-limit", "4"]``.
        python: the interpreter that runs ``-m worker_ingress``.
        ready_timeout: seconds each child gets to print its ready line (they start in parallel).
        stop_timeout: seconds the children get to exit after SIGTERM, before SIGKILL.
        task_status: receives the children's ws URLs, in child order.

    Raises:
        ValueError: ``count`` is below 1.
        LocalWorkerError: a child exited or stayed silent before it was ready.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    command = worker_command(worker_args, python)
    children: list[_Child] = []
    try:
        for index in range(count):
            process = await trio.lowlevel.open_process(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None
            )
            children.append(_Child(index, process))
        # The children start in parallel; reading their ready lines one after the other costs
        # nothing (the pipes hold what the later ones print meanwhile) and keeps errors plain.
        workers: list[LocalWorker] = []
        with trio.move_on_after(ready_timeout) as deadline:
            for child in children:
                workers.append(await child.wait_ready())
        if deadline.cancelled_caught:
            raise LocalWorkerError(
                f"local worker {len(workers)} (pid {children[len(workers)].process.pid}) printed "
                f"no ready line within {ready_timeout} s"
            )
        for worker in workers:
            logger.info("local worker %d (pid %d) at %s", worker.index, worker.pid, worker.ws_url)
        async with trio.open_nursery() as watching:
            for child in children:
                watching.start_soon(child.watch)
            task_status.started([worker.ws_url for worker in workers])
    finally:
        with trio.CancelScope(shield=True):
            await _stop(children, stop_timeout)


async def _stop(children: list[_Child], stop_timeout: float) -> None:
    """SIGTERM, a bounded wait, then SIGKILL; returns once every child has exited."""
    for child in children:
        child.stopping = True
        if child.process.returncode is None:
            child.process.send_signal(signal.SIGTERM)
    with trio.move_on_after(stop_timeout):
        for child in children:
            await child.process.wait()
    for child in children:
        if child.process.returncode is None:
            logger.warning(
                "local worker %d (pid %d) did not stop within %s s: killing it",
                child.index,
                child.process.pid,
                stop_timeout,
            )
            child.process.kill()
        await child.process.wait()
        if child.process.stdout is not None:
            await child.process.stdout.aclose()
