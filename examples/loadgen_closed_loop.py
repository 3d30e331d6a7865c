"""The load generator's closed loop: N clients on keep-alive HTTP/1.1 connections (trio + h11) for
T seconds, the report of their answers, and its progress line and final table.

The bounds of the run are the ones ``load_generator.py`` states; this module is its part that
sends requests one after another on a connection and counts what comes back.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import urllib.parse
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import h11
import trio
from rich.console import Group
from rich.table import Table


class Tally(Protocol):
    """What progress is drawn from: a :class:`LoadReport` or a :class:`ReplayReport`."""

    @property
    def statuses(self) -> Counter[int]:
        """Requests per status so far."""

    @property
    def total(self) -> int:
        """Requests ended so far."""


#: Called while the load runs with the report so far and the seconds since the start, every
#: ``progress_interval`` seconds and once more at the end.
ProgressCallback = Callable[[Tally, float], None]

#: Latency percentiles of the final table.
_PERCENTILES = (0.5, 0.9, 0.99)

#: Bytes read from the socket per call.
_READ_SIZE = 65536
#: A response body larger than this ends the connection (a completion is far smaller).
_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Target:
    """Where to send the load.

    Attributes:
        host: Host name or address.
        port: TCP port.
        path: Request path, e.g. ``/v1/chat/completions``.
    """

    host: str
    port: int
    path: str


def parse_target(url: str, path: str, *, allow_remote: bool = False) -> Target:
    """Check the frontend URL and join it with the endpoint path.

    Args:
        url: Base URL of the frontend, ``http://host:port``.
        path: Endpoint path.
        allow_remote: Accept a host that is not a loopback address.

    Returns:
        The target.

    Raises:
        ValueError: not an ``http://`` URL, or not loopback while ``allow_remote`` is false.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"expected http://host:port, got {url!r}")
    host = parts.hostname
    if not allow_remote and not _is_loopback(host):
        raise ValueError(f"{host} is not a loopback address; pass --allow-remote to load it")
    return Target(host, parts.port or 80, parts.path.rstrip("/") + path)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile of already sorted values.

    Args:
        sorted_values: Values in ascending order (not empty).
        fraction: In ``[0, 1]``, e.g. 0.99 for p99.

    Returns:
        The smallest value with at least ``fraction`` of all values at or below it.

    Raises:
        ValueError: no values, or ``fraction`` out of range.
    """
    if not sorted_values:
        raise ValueError("no values")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclasses.dataclass
class LoadReport:
    """What a run measured.

    Attributes:
        statuses: Requests per HTTP status (0: no answer).
        ok_latencies: Seconds from send to the end of the answer, for each 200.
        elapsed: Seconds from the first request to the last answer.
        retry_after: ``Retry-After`` values seen, per value.
    """

    statuses: Counter[int] = dataclasses.field(default_factory=Counter)
    ok_latencies: list[float] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0
    retry_after: Counter[str] = dataclasses.field(default_factory=Counter)

    @property
    def total(self) -> int:
        """Requests that ended (answered or failed)."""
        return sum(self.statuses.values())

    def summary(self) -> str:
        """The report as a few lines of text."""
        lines = [f"requests: {self.total} in {self.elapsed:.2f} s"]
        rate = self.total / self.elapsed if self.elapsed > 0 else 0.0
        ok_rate = self.statuses[200] / self.elapsed if self.elapsed > 0 else 0.0
        lines.append(f"achieved rate: {rate:.1f} req/s ({ok_rate:.1f} req/s of 200)")
        for status in sorted(self.statuses):
            name = status_name(status)
            share = self.statuses[status] / self.total
            lines.append(f"  {name:>9}: {self.statuses[status]:8d}  ({share:6.1%})")
        if self.ok_latencies:
            ordered = sorted(self.ok_latencies)
            lines.append(
                f"latency of 200s: p50 {percentile(ordered, 0.5) * 1e3:.1f} ms,"
                f" p99 {percentile(ordered, 0.99) * 1e3:.1f} ms"
            )
        if self.retry_after:
            seen = ", ".join(f"{v} s x{n}" for v, n in sorted(self.retry_after.items()))
            lines.append(f"Retry-After seen: {seen}")
        return "\n".join(lines)


def status_name(status: int) -> str:
    return "no answer" if status == 0 else str(status)


def status_counts(report: Tally) -> str:
    return "  ".join(f"{status_name(s)}: {report.statuses[s]}" for s in sorted(report.statuses))


def progress_line(report: Tally, elapsed: float) -> str:
    """One plain line of progress, for output that is not a terminal.

    Args:
        report: The report so far.
        elapsed: Seconds since the run started.

    Returns:
        E.g. ``[  3.0 s] 1234 requests, 411.3 req/s  200: 1200  529: 34``.
    """
    rate = report.total / elapsed if elapsed > 0 else 0.0
    return f"[{elapsed:5.1f} s] {report.total} requests, {rate:.1f} req/s  {status_counts(report)}"


def final_table(report: LoadReport) -> Group:
    """The end-of-run report as rich tables: answers by status, then latency of the 200s.

    Args:
        report: The finished run.

    Returns:
        Something ``rich.console.Console.print`` renders (plain text when not on a terminal).
    """
    elapsed = report.elapsed
    answers = Table(title=f"{report.total} requests in {elapsed:.2f} s", title_justify="left")
    answers.add_column("status")
    answers.add_column("answers", justify="right")
    answers.add_column("share", justify="right")
    answers.add_column("rate (req/s)", justify="right")
    for status in sorted(report.statuses):
        count = report.statuses[status]
        answers.add_row(
            status_name(status),
            str(count),
            f"{count / report.total:.1%}",
            f"{count / elapsed:.1f}" if elapsed > 0 else "-",
        )
    answers.add_section()
    answers.add_row(
        "all",
        str(report.total),
        "100.0%" if report.total else "-",
        f"{report.total / elapsed:.1f}" if elapsed > 0 else "-",
    )
    latency = Table(title="latency of the 200s (ms)", title_justify="left")
    names = [f"p{round(p * 100)}" for p in _PERCENTILES]
    for name in [*names, "max"]:
        latency.add_column(name, justify="right")
    if report.ok_latencies:
        ordered = sorted(report.ok_latencies)
        values = [percentile(ordered, p) for p in _PERCENTILES] + [ordered[-1]]
        latency.add_row(*(f"{v * 1e3:.1f}" for v in values))
    else:
        latency.add_row(*("-" for _ in range(len(names) + 1)))
    parts: list[Any] = [answers, latency]
    if report.retry_after:
        seen = ", ".join(f"{v} s x{n}" for v, n in sorted(report.retry_after.items()))
        parts.append(f"Retry-After seen: {seen}")
    return Group(*parts)


class _Budget:
    """Hands out request permits until the time or count bound is reached."""

    def __init__(self, max_requests: int, stop_at: float) -> None:
        self._left = max_requests
        self._stop_at = stop_at

    def take(self) -> bool:
        if self._left <= 0 or trio.current_time() >= self._stop_at:
            return False
        self._left -= 1
        return True


class Connection:
    """One keep-alive HTTP/1.1 client connection (reopened by the caller when it ends)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    async def exchange(
        self,
        request: h11.Request,
        body: bytes,
        on_data: Callable[[bytes], None] | None = None,
    ) -> tuple[int, str | None, bool]:
        """Send one request and read the whole answer.

        Args:
            request: The request's head.
            body: Its body.
            on_data: Called with each piece of the answer's body as it arrives.

        Returns:
            Status, ``Retry-After`` header, and whether the connection can be reused.
        """
        out = self.h11.send(request) or b""
        out += self.h11.send(h11.Data(data=body)) or b""
        out += self.h11.send(h11.EndOfMessage()) or b""
        await self.stream.send_all(out)
        status = 0
        retry_after: str | None = None
        received = 0
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                data = await self.stream.receive_some(_READ_SIZE)
                self.h11.receive_data(data)  # b"" means EOF; h11 then raises or ends the message
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                for name, value in event.headers:
                    if name == b"retry-after":
                        retry_after = value.decode("latin-1")
            elif isinstance(event, h11.Data):
                received += len(event.data)
                if received > _MAX_BODY_BYTES:
                    return status, retry_after, False
                if on_data is not None:
                    on_data(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("connection closed before the answer ended")
        reusable = self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE
        if reusable:
            self.h11.start_next_cycle()
        return status, retry_after, reusable


async def _client(
    target: Target,
    body: bytes,
    budget: _Budget,
    request_timeout: float,
    report: LoadReport,
) -> None:
    headers = [
        ("Host", f"{target.host}:{target.port}"),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
    ]
    connection: Connection | None = None
    try:
        while budget.take():
            request = h11.Request(method="POST", target=target.path, headers=headers)
            sent_at = trio.current_time()
            status = 0
            retry_after: str | None = None
            with trio.move_on_after(request_timeout):
                try:
                    if connection is None:
                        connection = Connection(
                            await trio.open_tcp_stream(target.host, target.port)
                        )
                    status, retry_after, reusable = await connection.exchange(request, body)
                except (OSError, trio.BrokenResourceError, h11.ProtocolError):
                    reusable = False
                if not reusable and connection is not None:
                    await connection.stream.aclose()
                    connection = None
            if status == 0 and connection is not None:  # timed out mid-answer: start afresh
                await connection.stream.aclose()
                connection = None
            report.statuses[status] += 1
            if status == 200:
                report.ok_latencies.append(trio.current_time() - sent_at)
            elif retry_after is not None:
                report.retry_after[retry_after] += 1
            if status == 0:
                # Nothing listens (or it broke): do not spin on refused connections.
                await trio.sleep(0.05)
    finally:
        if connection is not None:
            with trio.CancelScope(shield=True):
                await connection.stream.aclose()


async def run_load(
    target: Target,
    body: dict[str, Any],
    *,
    clients: int,
    duration: float,
    max_requests: int,
    request_timeout: float,
    progress: ProgressCallback | None = None,
    progress_interval: float = 1.0,
) -> LoadReport:
    """Run ``clients`` closed-loop clients against ``target`` and measure.

    Args:
        target: Where to send.
        body: The JSON request body each client sends.
        clients: Concurrent clients (connections).
        duration: Seconds during which new requests start.
        max_requests: Requests in total at most.
        request_timeout: Seconds one request may take.
        progress: Called with the report so far every ``progress_interval`` seconds, and once
            at the end with the finished report.
        progress_interval: Seconds between progress calls.

    Returns:
        The report.
    """
    if clients < 1 or max_requests < 1 or not duration > 0 or not request_timeout > 0:
        raise ValueError("clients, max_requests, duration and request_timeout must be positive")
    if progress is not None and not progress_interval > 0:
        raise ValueError("progress_interval must be positive")
    report = LoadReport()
    payload = json.dumps(body).encode()
    start = trio.current_time()
    budget = _Budget(max_requests, start + duration)
    # The hard stop: even a server that never answers cannot hold the run past this.
    with trio.move_on_after(duration + request_timeout + 1.0):
        async with trio.open_nursery() as outer:
            if progress is not None:
                outer.start_soon(report_progress, progress, progress_interval, report, start)
            async with trio.open_nursery() as nursery:
                for _ in range(clients):
                    nursery.start_soon(_client, target, payload, budget, request_timeout, report)
            outer.cancel_scope.cancel()  # the clients are done: stop reporting progress
    report.elapsed = trio.current_time() - start
    if progress is not None:
        progress(report, report.elapsed)
    return report


async def report_progress(
    progress: ProgressCallback, interval: float, report: Tally, start: float
) -> None:
    # Ends when run_load cancels it, at the latest at the run's hard stop.
    while True:
        await trio.sleep(interval)
        progress(report, trio.current_time() - start)
