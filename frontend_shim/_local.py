"""``--local-workers K``: child ``worker-ingress`` processes started and stopped with the frontend.

The embedded default a newcomer runs: ``frontend-shim --local-workers 2`` and nothing else.

Life of the children (:func:`run_local_workers`):

1. Start: each child runs ``python -m worker_ingress --port 0 --system-port 0
   --stop-on-stdin-eof <worker flags>`` with this process's environment (so ``DYN_*`` settings,
   ``DYN_WORKER_TOKEN`` included, reach it), its stderr passed through to ours (its logs), its
   stdout read by us, and its stdin a pipe whose write end only we hold and never write to.
2. Ready: a child is ready when it prints ``worker-ingress ready ws=... system=...``. A child
   that exits first, or says nothing within ``ready_timeout`` seconds, fails the start with
   :class:`LocalWorkerError` (after every child has been stopped). Once all are ready, the ws
   URLs are reported through ``task_status``.
3. Serve: the rest of each child's stdout is copied to our stderr line by line, so a chatty
   child never blocks on a full pipe (our stdout carries only the frontend's own ready line).
4. A child that dies while the frontend runs (a non-zero exit; 0 means it drained after a
   signal, e.g. a Ctrl-C that reached the whole process group) is logged at ERROR with its
   exit status and started again on the same two ports, so the frontend's link to it (which
   keeps retrying) finds it at the same URL. Restarts back off from ``RESTART_DELAY`` seconds,
   doubling up to ``RESTART_DELAY_CAP``; a child that stayed up for ``RESTART_DELAY_RESET``
   seconds starts the backoff over. Every exit is logged, so a crash loop stays visible.
5. Stop (cancellation of the caller): SIGTERM to every child, so each drains; up to
   ``stop_timeout`` seconds for all to exit; SIGKILL for any still running. Shielded, so a
   cancelled frontend never leaves orphans behind.
6. A frontend that dies without stopping them (SIGKILL, a crash of the interpreter) closes the
   stdin pipes with it: the kernel closes every descriptor of a dead process. Each child reads
   end of file and drains (``--stop-on-stdin-eof``). A pipe rather than Linux's
   ``PR_SET_PDEATHSIG``: that signal fires when the *thread* that forked the child exits, and
   Trio starts processes from a worker thread that it retires when idle, so a healthy frontend
   would lose its children; a pipe also works on every POSIX system.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
import subprocess
import sys
import urllib.parse
from collections.abc import Sequence
from typing import Final

import trio

from shim_common._net import Backoff

__all__ = [
    "READY_LINE",
    "LocalWorker",
    "LocalWorkerError",
    "parse_ready_line",
    "run_local_workers",
    "worker_command",
]

logger = logging.getLogger(__name__)

#: The ready line of the worker process (docs/configuration.md), with its two URLs captured.
READY_LINE: Final = re.compile(r"^worker-ingress ready ws=(?P<ws>\S+) system=(?P<system>\S+)\s*$")

#: A stdout line longer than this is cut (a child cannot make us buffer without limit).
MAX_LINE_BYTES: Final = 64 * 1024

#: Seconds before the first restart of a child that died; doubled per restart up to the cap.
RESTART_DELAY: Final = 0.5
RESTART_DELAY_CAP: Final = 30.0
#: A child that ran this long before dying is restarted after RESTART_DELAY again.
RESTART_DELAY_RESET: Final = 60.0


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


def worker_command(
    worker_args: Sequence[str],
    python: str = sys.executable,
    *,
    port: int = 0,
    system_port: int = 0,
) -> list[str]:
    """The command line of one child: its ports (0: free ones), then the frontend's worker flags."""
    return [
        python,
        "-m",
        "worker_ingress",
        "--port",
        str(port),
        "--system-port",
        str(system_port),
        "--stop-on-stdin-eof",
        *worker_args,
    ]


def _port_of(url: str) -> int:
    return urllib.parse.urlsplit(url).port or 0


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
    """One child worker: its current process, and how to start it again."""

    def __init__(
        self,
        index: int,
        process: trio.Process,
        worker_args: Sequence[str],
        python: str,
        ready_timeout: float,
    ) -> None:
        self.index = index
        self.process = process
        assert process.stdout is not None
        self.lines = _LineReader(process.stdout)
        self.stopping = False
        self._worker_args = worker_args
        self._python = python
        self._ready_timeout = ready_timeout
        self._ready: LocalWorker | None = None

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
                self._ready = LocalWorker(self.index, self.process.pid, urls[0], urls[1])
                return self._ready
            _copy_line(self.index, line)

    async def watch(self) -> None:
        """Copy stdout until the child exits; restart it unless its exit was asked for."""
        backoff = Backoff(initial=RESTART_DELAY, cap=RESTART_DELAY_CAP)
        started = trio.current_time()
        while True:
            while (line := await self.lines.readline()) is not None:
                _copy_line(self.index, line)
            status = await self.process.wait()
            if self.stopping:
                return
            if status == 0:
                # A worker exits 0 only after a drain it was asked for (a Ctrl-C reaches the
                # whole process group, children included): a stop, not a crash.
                logger.info(
                    "local worker %d (pid %d) stopped (status 0); not restarted",
                    self.index,
                    self.process.pid,
                )
                return
            if trio.current_time() - started >= RESTART_DELAY_RESET:
                backoff.reset()
            delay = backoff.next_delay()
            logger.error(
                "local worker %d (pid %d) exited with status %d; restarting it in %.1f s",
                self.index,
                self.process.pid,
                status,
                delay,
            )
            await trio.sleep(delay)
            started = trio.current_time()
            await self._restart()

    async def _restart(self) -> None:
        """Start the child again on the ports it had; a failure is logged (and retried)."""
        assert self._ready is not None
        command = worker_command(
            self._worker_args,
            self._python,
            port=_port_of(self._ready.ws_url),
            system_port=_port_of(self._ready.system_url),
        )
        await _close_pipes(self.process)
        try:
            process = await _spawn(command)
        except OSError as exc:
            # The old process is reaped and its output closed: watch() backs off and retries.
            logger.error("cannot restart local worker %d: %s", self.index, exc)
            return
        self.process = process
        assert self.process.stdout is not None
        self.lines = _LineReader(self.process.stdout)
        with trio.move_on_after(self._ready_timeout) as deadline:
            try:
                worker = await self.wait_ready()
            except LocalWorkerError as exc:
                logger.error("%s", exc)
                return
        if deadline.cancelled_caught:
            logger.error(
                "restarted local worker %d (pid %d) printed no ready line within %s s: killing it",
                self.index,
                self.process.pid,
                self._ready_timeout,
            )
            self.process.kill()
            return
        logger.info(
            "local worker %d restarted (pid %d) at %s", self.index, worker.pid, worker.ws_url
        )


async def _spawn(command: list[str]) -> trio.Process:
    # stdin: the pipe that tells the child we are gone (rule 6); we never write to it.
    return await trio.lowlevel.open_process(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None
    )


async def _close_pipes(process: trio.Process) -> None:
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            await pipe.aclose()


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
            process = await _spawn(command)
            children.append(_Child(index, process, worker_args, python, ready_timeout))
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
        await _close_pipes(child.process)
