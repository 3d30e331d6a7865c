"""The processes of the fleet benchmark and what it reads of them: CPU, wait and memory from
``/proc``, the bytes left unread in sockets, a small HTTP/1.1 client (h11) for the frontend's
routes, and the child processes (the frontend, the simulators and their control protocol).
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
from collections.abc import Sequence
from typing import IO, Final

import h11
import trio

CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(pid, {cpu})


def raise_fd_limit() -> None:
    # Children inherit it: the frontend holds two sockets per worker.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ----------------------------------------------------------------------------- /proc readers


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def wait_seconds(pid: int) -> float:
    """Seconds the process's main thread spent runnable but waiting for a CPU.

    On a machine shared with other work this says how much of a window a process lost to them.
    """
    with open(f"/proc/{pid}/schedstat") as schedstat:
        return int(schedstat.read().split()[1]) / 1e9


def rss_mb(pid: int) -> tuple[float, float]:
    """Resident and peak resident memory of a process, in MiB."""
    values: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values.get("VmRSS", math.nan), values.get("VmHWM", math.nan)


def unread_bytes(remote_ports: set[int]) -> int:
    """Bytes received but not yet read on established IPv4 sockets to ``remote_ports``.

    The frontend's sockets to the workers are the only ones whose remote port is a worker's, so
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


# ----------------------------------------------------------------------------- HTTP client


class HttpClient:
    """One keep-alive HTTP/1.1 connection (h11 over a Trio socket), reopened when closed."""

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._stream: trio.SocketStream | None = None
        self._conn = h11.Connection(h11.CLIENT)

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None

    async def request(self, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
        """Send one request and read its whole response.

        Raises:
            OSError, trio.BrokenResourceError, h11.ProtocolError: the connection failed (the
                next request opens a new one).
        """
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self._host, self._port)
            self._conn = h11.Connection(h11.CLIENT)
        try:
            return await self._exchange(method, target, body)
        except BaseException:
            stream, self._stream = self._stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()
            raise

    async def _exchange(self, method: str, target: str, body: bytes) -> tuple[int, bytes]:
        assert self._stream is not None
        conn = self._conn
        headers = [("host", f"{self._host}:{self._port}"), ("content-length", str(len(body)))]
        if body:
            headers.append(("content-type", "application/json"))
        data = conn.send(h11.Request(method=method, target=target, headers=headers))
        if body:
            data = (data or b"") + (conn.send(h11.Data(data=body)) or b"")
        data = (data or b"") + (conn.send(h11.EndOfMessage()) or b"")
        await self._stream.send_all(data)
        status = 0
        chunks: list[bytes] = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                received = await self._stream.receive_some(65536)
                conn.receive_data(received)
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            await self.aclose()
        return status, b"".join(chunks)


# ----------------------------------------------------------------------------- child processes


class Child:
    """A child process whose stdout is read line by line and whose stdin takes commands."""

    def __init__(self, process: trio.Process, name: str) -> None:
        self.process = process
        self.name = name
        self._buffer = b""

    @classmethod
    async def start(cls, args: Sequence[str], *, cpu: int, stderr: IO[bytes], name: str) -> Child:
        env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
        process = await trio.lowlevel.open_process(
            list(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
        )
        pin(process.pid, cpu)
        return cls(process, name)

    async def readline(self) -> str:
        stdout = self.process.stdout
        assert stdout is not None
        while b"\n" not in self._buffer:
            data = await stdout.receive_some(65536)
            if not data:
                raise EOFError(f"{self.name} exited (code {self.process.poll()})")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    async def send(self, line: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(line.encode() + b"\n")

    async def stop(self) -> None:
        """Terminate, wait up to 10 s, then kill (shielded: always reaps)."""
        with trio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.terminate()
                with trio.move_on_after(10):
                    await self.process.wait()
                if self.process.returncode is None:
                    self.process.kill()
                    await self.process.wait()


class Simulator:
    """One ``fleet_sim.py`` process."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.ports: list[int] = []

    async def ready(self) -> None:
        while True:
            line = await self.child.readline()
            if line.startswith("fleet-sim ready "):
                ports = line.split("ports=", 1)[1]
                self.ports = [int(port) for port in ports.split(",") if port]
                return

    async def answer(self, prefix: str) -> str:
        line = await self.child.readline()
        if not line.startswith(prefix):
            raise RuntimeError(f"{self.child.name}: expected {prefix!r}, got {line!r}")
        return line

    async def stats(self) -> dict[str, float]:
        await self.child.send("stats")
        line = await self.answer("stats ")
        stats: dict[str, float] = json.loads(line.split(" ", 1)[1])
        return stats


async def fleet_stats(sims: Sequence[Simulator]) -> dict[str, float]:
    total: dict[str, float] = {}
    for sim in sims:
        for key, value in (await sim.stats()).items():
            total[key] = total.get(key, 0.0) + value
    return total


async def flip_fleet(sims: Sequence[Simulator], mode: str) -> None:
    for sim in sims:
        await sim.child.send(mode)


async def flip_acks(sims: Sequence[Simulator], mode: str) -> float:
    """Read every simulator's answer to a flip; return the latest ``time.monotonic()`` at which
    one of them had applied it."""
    applied = 0.0
    for sim in sims:
        line = await sim.answer(f"ok {mode}")
        applied = max(applied, float(line.split()[2]))
    return applied
