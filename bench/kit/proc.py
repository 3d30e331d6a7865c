"""What the kernel says of a process, from ``/proc`` (Linux): its CPU time, alone or with its
descendants, the time it waited for a CPU, its memory, its open descriptors, and the bytes left
unread in sockets to given ports.

Read from outside, these figures need nothing of the process measured: a benchmark takes one
before and one after what it measures.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from typing import Final

__all__ = [
    "Memory",
    "cpu_seconds",
    "descriptors",
    "memory",
    "tree_cpu_seconds",
    "unread_bytes",
    "wait_seconds",
]

CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process so far, all its threads.

    Raises:
        OSError: the process is gone.
    """
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def tree_cpu_seconds(root: int) -> float:
    """User plus system CPU seconds of ``root`` and of every live process below it."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat(entry.name)
        except OSError:
            continue  # gone meanwhile
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime
    tree = {root}
    grew = True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        grew = bool(below)
        tree |= below
    return sum(ticks.get(pid, 0) for pid in tree) / CLOCK_TICKS


def wait_seconds(pid: int) -> float:
    """Seconds the process's main thread spent runnable but waiting for a CPU.

    On a machine shared with other work this says how much of a window a process lost to them.
    """
    with open(f"/proc/{pid}/schedstat") as schedstat:
        return int(schedstat.read().split()[1]) / 1e9


@dataclasses.dataclass(frozen=True)
class Memory:
    """A process's resident memory now and at its peak, in bytes (0 once it is gone)."""

    resident: int
    peak: int


def memory(pid: int) -> Memory:
    """The resident memory of a process (``VmRSS`` and ``VmHWM``)."""
    values: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return Memory(values.get("VmRSS", 0), values.get("VmHWM", 0))


def descriptors(pid: int) -> int:
    """The file descriptors a process holds open (its connections among them)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def unread_bytes(remote_ports: Collection[int]) -> int:
    """Bytes received but not yet read on established IPv4 sockets to ``remote_ports``.

    A frontend's sockets to its workers are the only ones whose remote port is a worker's, so
    this is what the frontend has not read yet of what the workers sent.
    """
    total = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[3] != "01":
                continue
            if int(fields[2].rsplit(":", 1)[1], 16) in remote_ports:
                total += int(fields[4].split(":")[1], 16)
    return total
