"""The children of a benchmark that runs in Trio: started, their ready line read (or their log
searched), commanded on their standard input, and stopped however the run ends (the rules of
:mod:`bench.kit.processes`, which starts the children of a plain script).

``async with Child(args, env, cpu=0) as child:`` runs a server for the block, which starts once
its ready line is read (``child.addresses``); a child driven by hand (a simulator taking
commands, a worker killed and started again) uses :meth:`Child.start`, :meth:`Child.ready` and
:meth:`Child.stop`.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import trio

from bench.kit.processes import LINE_LIMIT, clean_env, end_session, pinned, ready_fields

__all__ = ["Child", "started_logging"]


class Child:
    """A child process of a Trio benchmark.

    Its standard output is read line by line (:meth:`readline`, :meth:`ready`); with
    ``control`` its standard input takes commands (:meth:`send`). :meth:`stop` always reaps it.

    Args:
        args: Its command line (:meth:`start` may be given another, to restart it).
        env: Its environment (:func:`clean_env` when None).
        name: What errors call it.
        cpu: The CPU it runs on (:func:`pinned`).
        cwd: Its working directory.
        log: Where its standard error goes; nowhere when None.
        log_stdout: Its standard output goes to ``log`` too, unread (a server that says it is
            ready somewhere in its log: :meth:`ready_in_log`).
        control: Open its standard input for :meth:`send`.
        session: Start it in a session of its own (see :mod:`bench.kit.processes`).
        grace: Seconds it gets to exit after SIGTERM before SIGKILL.
        ready_within: Seconds ``async with`` waits for its ready line.
    """

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        name: str | None = None,
        cpu: int | None = None,
        cwd: str | Path | None = None,
        log: IO[bytes] | None = None,
        log_stdout: bool = False,
        control: bool = False,
        session: bool = False,
        grace: float = 10.0,
        ready_within: float = 30.0,
    ) -> None:
        self.args = list(args)
        self.env = dict(env if env is not None else clean_env())
        self.name = name or " ".join(self.args[:3])
        self.cpu = cpu
        self.cwd = cwd
        self.log = log
        self.log_stdout = log_stdout
        self.control = control
        self.session = session
        self.grace = grace
        self.ready_within = ready_within
        self.process: trio.Process | None = None
        #: The fields of its last ready line.
        self.addresses: dict[str, str] = {}
        self._buffer = b""

    async def __aenter__(self) -> Child:
        """Start it and read its ready line.

        Raises:
            RuntimeError: it exited before its ready line.
            trio.TooSlowError: no ready line within ``ready_within`` seconds.
        """
        await self.start()
        try:
            with trio.fail_after(self.ready_within):
                await self.ready()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was not started"
        return self.process.pid

    async def start(self, args: Sequence[str] | None = None) -> None:
        """Start it (again, after :meth:`stop` or its end), with ``args`` if given."""
        if args is not None:
            self.args = list(args)
        self._buffer = b""
        sink: IO[bytes] | int = self.log if self.log is not None else subprocess.DEVNULL
        self.process = await trio.lowlevel.open_process(
            pinned(self.cpu, self.args),
            stdin=subprocess.PIPE if self.control else subprocess.DEVNULL,
            stdout=sink if self.log_stdout else subprocess.PIPE,
            stderr=sink,
            env=self.env,
            cwd=None if self.cwd is None else str(self.cwd),
            start_new_session=self.session,
        )

    async def readline(self) -> str:
        """The next line it prints, without its newline.

        Raises:
            EOFError: it closed its output (it exited).
        """
        assert self.process is not None
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            if len(self._buffer) > LINE_LIMIT:
                raise EOFError(f"{self.name} printed a line past {LINE_LIMIT} bytes")
            data = await self.process.stdout.receive_some(65536)
            if not data:
                raise EOFError(f"{self.name} exited (code {self.process.poll()})")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode(errors="replace")

    async def ready(self) -> dict[str, str]:
        """Read lines until its ready line; its fields (kept in :attr:`addresses`). The caller
        bounds the wait.

        Raises:
            RuntimeError: it exited before its ready line.
        """
        while True:
            try:
                line = await self.readline()
            except EOFError as exited:
                raise RuntimeError(f"{exited} before it was ready (see its log)") from None
            found = ready_fields(line)
            if found is not None:
                self.addresses = found
                return found

    async def ready_in_log(self, path: Path, pattern: re.Pattern[bytes]) -> re.Match[bytes]:
        """Read the log at ``path`` (its ``log``) until ``pattern`` is found in it. The caller
        bounds the wait.

        Raises:
            RuntimeError: it exited first.
        """
        assert self.process is not None
        while True:
            match = pattern.search(await trio.Path(path).read_bytes())
            if match is not None:
                return match
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited, see {path}")
            await trio.sleep(0.05)

    async def send(self, line: str) -> None:
        """Write one line to its standard input (``control`` only)."""
        assert self.process is not None
        assert self.process.stdin is not None
        await self.process.stdin.send_all(line.encode() + b"\n")

    async def wait(self) -> int:
        """Its exit code, once it exits."""
        assert self.process is not None
        return await self.process.wait()

    def kill(self) -> None:
        """SIGKILL, at once (a crash, as a fault of a run)."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace period; shielded: it always reaps."""
        process = self.process
        if process is None:
            return
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
                with trio.move_on_after(self.grace):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            if self.session:
                end_session(process.pid)
            for stream in (process.stdout, process.stdin):
                if stream is not None:
                    await stream.aclose()


@contextlib.asynccontextmanager
async def started_logging(
    args: Sequence[str],
    log: Path,
    ready: re.Pattern[bytes],
    env: Mapping[str, str] | None = None,
    *,
    name: str | None = None,
    cpu: int | None = None,
    ready_within: float = 60.0,
) -> AsyncIterator[tuple[Child, re.Match[bytes]]]:
    """A server that says it is ready somewhere in its log (llama.cpp's ``llama-server``, which
    prints where it listens): its output all goes to the file ``log``, and the block starts once
    ``ready`` is found there; yields the :class:`Child` and the match.

    Raises:
        RuntimeError: it exited first.
        trio.TooSlowError: ``ready`` not found within ``ready_within`` seconds.
    """
    with log.open("wb") as sink:
        child = Child(args, env, name=name, cpu=cpu, log=sink, log_stdout=True)
        await child.start()
    try:
        with trio.fail_after(ready_within):
            match = await child.ready_in_log(log, ready)
        yield child, match
    finally:
        await child.stop()
