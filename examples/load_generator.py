"""A bounded load generator: N concurrent clients for T seconds against an OpenAI frontend.

Each client is a closed loop on one keep-alive HTTP/1.1 connection (trio + h11): send a request,
read the whole answer, record its status and latency, send the next. A connection the server
closes (the frontend closes after an early 529) is reopened. While it runs, a progress bar with
the running count of each status is drawn on stderr (on a terminal; elsewhere, such as CI or a
pipe, one plain line a second). At the end it prints a table to stdout: the count of each status,
the achieved rate and the latency percentiles of the 200s::

    python examples/load_generator.py --url http://127.0.0.1:8000 --clients 64 --duration 10

It needs the ``examples`` extra for the progress bar and the table: ``pip install -e '.[examples]'``
(rich).

Bounds, so a run always ends and never floods anything by mistake:

- time: no request starts after ``--duration`` seconds, and the run is cut at
  ``--duration + --timeout`` whatever the server does; one request may take ``--timeout`` at most;
- count: at most ``--max-requests`` requests in total;
- place: only loopback addresses unless ``--allow-remote`` is given;
- memory: latencies are kept only for 200s, one float each, and the count bound caps them.

The status ``no answer`` (0 in ``LoadReport.statuses``) counts requests that got none: refused,
reset or timed out.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import math
import sys
import urllib.parse
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import h11
import trio
from rich.console import Console, Group
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = [
    "LoadReport",
    "Target",
    "final_table",
    "main",
    "parse_target",
    "percentile",
    "progress_line",
    "run_load",
]

#: Called while the load runs with the report so far and the seconds since the start, every
#: ``progress_interval`` seconds and once more at the end.
ProgressCallback = Callable[["LoadReport", float], None]

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
            name = _status_name(status)
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


def _status_name(status: int) -> str:
    return "no answer" if status == 0 else str(status)


def _counts(report: LoadReport) -> str:
    return "  ".join(f"{_status_name(s)}: {report.statuses[s]}" for s in sorted(report.statuses))


def progress_line(report: LoadReport, elapsed: float) -> str:
    """One plain line of progress, for output that is not a terminal.

    Args:
        report: The report so far.
        elapsed: Seconds since the run started.

    Returns:
        E.g. ``[  3.0 s] 1234 requests, 411.3 req/s  200: 1200  529: 34``.
    """
    rate = report.total / elapsed if elapsed > 0 else 0.0
    return f"[{elapsed:5.1f} s] {report.total} requests, {rate:.1f} req/s  {_counts(report)}"


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
            _status_name(status),
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


class _Connection:
    """One keep-alive HTTP/1.1 client connection (reopened by the caller when it ends)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    async def exchange(self, request: h11.Request, body: bytes) -> tuple[int, str | None, bool]:
        """Send one request and read the whole answer.

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
    connection: _Connection | None = None
    try:
        while budget.take():
            request = h11.Request(method="POST", target=target.path, headers=headers)
            sent_at = trio.current_time()
            status = 0
            retry_after: str | None = None
            with trio.move_on_after(request_timeout):
                try:
                    if connection is None:
                        connection = _Connection(
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
                outer.start_soon(_report_progress, progress, progress_interval, report, start)
            async with trio.open_nursery() as nursery:
                for _ in range(clients):
                    nursery.start_soon(_client, target, payload, budget, request_timeout, report)
            outer.cancel_scope.cancel()  # the clients are done: stop reporting progress
    report.elapsed = trio.current_time() - start
    if progress is not None:
        progress(report, report.elapsed)
    return report


async def _report_progress(
    progress: ProgressCallback, interval: float, report: LoadReport, start: float
) -> None:
    # Ends when run_load cancels it, at the latest at the run's hard stop.
    while True:
        await trio.sleep(interval)
        progress(report, trio.current_time() - start)


class _LiveBar:
    """A rich progress bar on a terminal: time (or request count) used, and counts by status."""

    def __init__(self, console: Console, duration: float, max_requests: int) -> None:
        self._duration = duration
        self._max_requests = max_requests
        self.progress = Progress(
            TextColumn("load"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[rate]}"),
            TextColumn("{task.fields[counts]}"),
            console=console,
            auto_refresh=False,  # refreshed from the trio loop, no thread of its own
            transient=True,
        )
        self._task: TaskID = self.progress.add_task("load", total=1.0, rate="", counts="")

    def __call__(self, report: LoadReport, elapsed: float) -> None:
        done = max(elapsed / self._duration, report.total / self._max_requests)
        rate = report.total / elapsed if elapsed > 0 else 0.0
        self.progress.update(
            self._task,
            completed=min(1.0, done),
            rate=f"{report.total} requests, {rate:.1f} req/s",
            counts=_counts(report),
        )
        self.progress.refresh()


def _plain_progress(console: Console) -> ProgressCallback:
    def show(report: LoadReport, elapsed: float) -> None:
        console.print(progress_line(report, elapsed), markup=False, highlight=False)

    return show


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="frontend base URL")
    parser.add_argument("--model", default="mock-model")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--prompt", default="one two three four five six seven eight")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="total cap")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback host")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the load and print the report.

    Returns:
        The exit status: 0 after a run, 2 for invalid arguments.
    """
    args = _parse_args(argv)
    out = Console()
    err = Console(stderr=True)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    body: dict[str, Any] = {"model": args.model, "max_tokens": args.max_tokens}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        body["prompt"] = args.prompt
    live: _LiveBar | None = None
    progress: ProgressCallback
    try:
        target = parse_target(args.url, path, allow_remote=args.allow_remote)
        if args.duration > 0 and args.max_requests > 0 and err.is_terminal:
            live = _LiveBar(err, args.duration, args.max_requests)
            live.progress.start()
            progress, interval = live, 0.2
        else:
            progress, interval = _plain_progress(err), 1.0
        report = trio.run(
            lambda: run_load(
                target,
                body,
                clients=args.clients,
                duration=args.duration,
                max_requests=args.max_requests,
                request_timeout=args.timeout,
                progress=progress,
                progress_interval=interval,
            )
        )
    except ValueError as error:
        print(f"load_generator: {error}", file=sys.stderr)
        return 2
    finally:
        if live is not None:
            live.progress.stop()
    out.print(final_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
