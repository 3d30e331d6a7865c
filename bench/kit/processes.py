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

Here: :func:`serve`, the starter of a benchmark that is a plain script (a Trio one starts its
children with :mod:`bench.kit.children`), and where a child runs: :func:`pinned` puts it on one
CPU, :func:`clean_env` gives it an environment without the ``DYN_*`` variables of this one (its
flags are all it is told); :func:`pin` and :func:`raise_fd_limit` set up this process. This
module does not import Trio, so that a benchmark's lean helper processes need not load it.
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
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Final

__all__ = [
    "LINE_LIMIT",
    "Server",
    "clean_env",
    "end_session",
    "free_port",
    "pin",
    "pinned",
    "raise_fd_limit",
    "ready_fields",
    "serve",
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


def end_session(pid: int) -> None:
    """SIGKILL whatever is left of the process group (the session) a child led."""
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
        found: dict[str, str] | None = None
        while process.stdout is not None and found is None:  # None: not waited for
            line = process.stdout.readline(LINE_LIMIT)
            if not line:
                raise RuntimeError(f"{list(args[:3])} exited before its ready line")
            found = ready_fields(line.decode(errors="replace"))
        yield Server(process.pid, found or {})
    finally:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        end_session(process.pid)
        if process.stdout is not None:
            process.stdout.close()
