"""A benchmark's child processes: the servers it measures and the helpers it runs.

Every server of this project, and every child a benchmark starts, prints one *ready line* on its
standard output once it serves, naming its addresses as ``key=value`` fields:
``worker-ingress ready ws=ws://... system=http://...``, ``frontend-shim ready http=http://...``,
``fleet-sim ready workers=K ports=P1,P2``. A child is started, its ready line read
(:func:`ready_fields`), used, and stopped however the run ends: SIGTERM, a grace period, then
SIGKILL. A child started in a session of its own has whatever is left of its process group killed
too (Dynamo and Ray leave helpers behind), and competes for a CPU as a session of its own: with
the kernel's autogroup scheduling (Linux's default) CPU time is shared between sessions first, so
servers left in the benchmark's session would share one session's share of a core.

Two starters: :func:`serve`, a context manager for a benchmark that is a plain script, and
:class:`Child` (with :func:`started`) for one that runs in Trio. Where a child runs:
:func:`pinned` puts it on one CPU, :func:`clean_env` gives it an environment without the
``DYN_*`` variables of this one (its flags are all it is told), and :func:`pin` and
:func:`raise_fd_limit` set up this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Final

import trio

__all__ = [
    "Child",
    "Server",
    "clean_env",
    "free_port",
    "pin",
    "pinned",
    "raise_fd_limit",
    "ready_fields",
    "serve",
    "started",
    "started_logging",
]

_FIELD: Final = re.compile(r"(\w+)=(\S+)")
#: Bytes of one line read at most: a child that prints more without a newline is broken.
LINE_LIMIT: Final = 1 << 20


def ready_fields(line: str) -> dict[str, str] | None:
    """The ``key=value`` fields of a ready line (``NAME ready key=value ...``); None for a line
    that is not one."""
    words = line.split(maxsplit=2)
    if len(words) < 2 or words[1] != "ready":
        return None
    return dict(_FIELD.findall(line))


def clean_env(tree: str | Path | None = None, **extra: str) -> dict[str, str]:
    """This process's environment less its ``DYN_*`` variables, plus ``extra``.

    Args:
        tree: A checkout whose code the child imports: put alone on ``PYTHONPATH`` (run the
            child from it too: ``python -m`` puts the working directory first on the path).
        extra: More variables (``DYN_*`` ones included).
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    env.update(extra)
    return env


def _several_cpus() -> bool:
    return (os.cpu_count() or 1) >= 2


def pinned(cpu: int | None, args: Sequence[str]) -> list[str]:
    """``args`` to run on CPU ``cpu`` (through ``taskset``); as they are where the machine has
    one CPU, ``taskset`` is missing, or ``cpu`` is None."""
    if cpu is not None and _several_cpus() and shutil.which("taskset"):
        return ["taskset", "-c", str(cpu), *args]
    return list(args)


def pin(cpu: int, pid: int = 0) -> None:
    """Keep a process (this one by default) on CPU ``cpu``, where the machine has several."""
    if _several_cpus() and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, {cpu})


def raise_fd_limit() -> None:
    """Raise this process's open-file limit to its hard limit (children inherit it): a
    frontend following thousands of workers, or a client holding hundreds of connections,
    needs more than the usual 1,024 descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server that takes a port number rather than 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _end_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- plain scripts


@dataclasses.dataclass(frozen=True)
class Server:
    """A running child: its pid and the fields of its ready line (none when not waited for)."""

    pid: int
    addresses: dict[str, str]


@contextlib.contextmanager
def serve(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    cpu: int | None = None,
    cwd: str | Path | None = None,
    log: Path | None = None,
    ready: bool = True,
    grace: float = 10.0,
) -> Iterator[Server]:
    """Run a server in a session of its own until the block ends.

    Args:
        args: Its command line.
        env: Its environment (:func:`clean_env` when None).
        cpu: The CPU it runs on (:func:`pinned`).
        cwd: Its working directory.
        log: Where its standard error goes, appended (and its standard output too when
            ``ready`` is false); nowhere when None.
        ready: Wait for its ready line before the block starts; otherwise the block starts at
            once and the caller finds out itself when the server answers.
        grace: Seconds it gets to exit after SIGTERM before SIGKILL.

    Raises:
        RuntimeError: it exited before its ready line.
    """
    with contextlib.ExitStack() as files:
        sink: IO[bytes] | int = subprocess.DEVNULL
        if log is not None:
            sink = files.enter_context(log.open("ab"))
        process = subprocess.Popen(
            pinned(cpu, args),
            stdout=subprocess.PIPE if ready else sink,
            stderr=sink,
            env=dict(env if env is not None else clean_env()),
            cwd=cwd,
            start_new_session=True,
        )
    try:
        addresses: dict[str, str] = {}
        if ready:
            assert process.stdout is not None
            while (line := process.stdout.readline(LINE_LIMIT).decode(errors="replace")) and (
                found := ready_fields(line)
            ) is None:
                pass
            if not line:
                raise RuntimeError(f"{list(args[:3])} exited before its ready line")
            addresses = found or {}
        yield Server(process.pid, addresses)
    finally:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        _end_session(process.pid)
        if process.stdout is not None:
            process.stdout.close()


# ----------------------------------------------------------------------------- Trio benchmarks


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
        session: Start it in a session of its own (see the module's docstring).
        grace: Seconds it gets to exit after SIGTERM before SIGKILL.
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
        self.process: trio.Process | None = None
        #: The fields of its last ready line.
        self.addresses: dict[str, str] = {}
        self._buffer = b""

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
                _end_session(process.pid)
            for stream in (process.stdout, process.stdin):
                if stream is not None:
                    await stream.aclose()


@contextlib.asynccontextmanager
async def started(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    name: str | None = None,
    cpu: int | None = None,
    cwd: str | Path | None = None,
    log: IO[bytes] | None = None,
    session: bool = False,
    grace: float = 10.0,
    ready_within: float = 30.0,
) -> AsyncIterator[Child]:
    """A :class:`Child` (the same arguments) started until the block ends, which starts once
    its ready line is read.

    Raises:
        RuntimeError: it exited before its ready line.
        trio.TooSlowError: no ready line within ``ready_within`` seconds.
    """
    child = Child(args, env, name=name, cpu=cpu, cwd=cwd, log=log, session=session, grace=grace)
    await child.start()
    try:
        with trio.fail_after(ready_within):
            await child.ready()
        yield child
    finally:
        await child.stop()


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
