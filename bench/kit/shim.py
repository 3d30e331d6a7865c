"""Our servers as a benchmark starts them: a worker's and a frontend's command line, and one worker
with a frontend in front of it, connected, for the length of a block."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from bench.kit.http import wait_connected
from bench.kit.processes import Server, serve

__all__ = ["Shim", "frontend_command", "shim", "worker_command"]


def worker_command(*flags: str) -> list[str]:
    """``worker-ingress`` on ports from the OS (its ready line names them), with ``flags``."""
    return [sys.executable, "-m", "worker_ingress", "--port", "0", "--system-port", "0", *flags]


def frontend_command(*flags: str) -> list[str]:
    """``frontend-shim`` on a port from the OS, with ``flags`` (``--worker URL`` among them)."""
    return [sys.executable, "-m", "frontend_shim", "--http-port", "0", *flags]


@dataclasses.dataclass(frozen=True)
class Shim:
    """A frontend in front of one worker: the frontend's URL, and both servers."""

    url: str
    frontend: Server
    worker: Server


@contextlib.contextmanager
def shim(
    worker_flags: Sequence[str] = (),
    frontend_flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    cpu: int | None = None,
    cwd: str | Path | None = None,
) -> Iterator[Shim]:
    """One worker (``worker_flags``) and a frontend (``frontend_flags``) in front of it, both on
    CPU ``cpu``, until the block ends, which starts once the frontend follows the worker."""
    with (
        serve(worker_command(*worker_flags), env, cpu=cpu, cwd=cwd) as worker,
        serve(
            frontend_command("--worker", worker.addresses["ws"], *frontend_flags),
            env,
            cpu=cpu,
            cwd=cwd,
        ) as frontend,
    ):
        url = frontend.addresses["http"]
        wait_connected(url)
        yield Shim(url, frontend, worker)
