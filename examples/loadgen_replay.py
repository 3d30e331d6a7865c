"""The load generator's replay of a trace: each scaled request sent at its time (open loop) or by a
fixed number of clients (closed loop), its stream read as it arrives (time to first token, gaps
between tokens, the usage), and the figures, table and plot of the run.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h11
import trio
from loadgen_closed_loop import (
    Connection,
    ProgressCallback,
    Target,
    percentile,
    report_progress,
    status_name,
)
from loadgen_traces import PromptShape, ReplayItem, ReplayRecord
from rich.console import Group
from rich.table import Table

#: Percentiles of the replay's tables.
_REPLAY_PERCENTILES = (0.5, 0.9, 0.99)
#: One line of a streamed answer longer than this ends the request (a chunk is far smaller).
_MAX_SSE_LINE = 1024 * 1024


class _StreamReader:
    """Reads a streamed answer as it arrives: when text came, the usage, an error event."""

    def __init__(self, sent: float) -> None:
        self._sent = sent
        self._buffer = b""
        self.first: float | None = None
        self.last: float | None = None
        self.chunks = 0
        self.usage: dict[str, Any] | None = None
        self.error = False
        self.done = False

    def feed(self, data: bytes) -> None:
        now = trio.current_time()
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > _MAX_SSE_LINE:
            raise h11.RemoteProtocolError("a line of the stream is too long")
        for line in lines:
            self._line(line.rstrip(b"\r"), now)

    def _line(self, line: bytes, now: float) -> None:
        if line.startswith(b"event:") and line[6:].strip() == b"error":
            self.error = True
            return
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.error = True
            return
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            self.error = True
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            # Any chunk of a choice marks a token's time, with text or not: a server whose
            # tokens decode to nothing still sends the first (the role) and the last (the
            # finish reason) as they are generated.
            self.last = now
            if self.first is None:
                self.first = now
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                self.chunks += 1

    def fill(self, record: ReplayRecord) -> None:
        """Copy what the stream showed into ``record``."""
        if self.first is not None:
            record.ttft = self.first - self._sent
        usage = self.usage or {}
        completion = usage.get("completion_tokens")
        tokens = completion if isinstance(completion, int) and completion > 0 else self.chunks
        record.output_tokens = tokens
        if self.first is not None and self.last is not None and tokens > 1:
            record.itl = (self.last - self.first) / (tokens - 1)
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            record.prompt_tokens = prompt
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]
        if self.error or not self.done:
            record.status = 500


@dataclasses.dataclass
class ReplayReport:
    """What a replay measured.

    Attributes:
        planned: Requests of the window.
        records: One per request sent, in the order they ended.
        elapsed: Seconds from the start to the last answer.
        statuses: Requests per status (0: no answer, 500: also a stream that failed).
    """

    planned: int
    records: list[ReplayRecord] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0
    statuses: Counter[int] = dataclasses.field(default_factory=Counter)

    @property
    def total(self) -> int:
        """Requests that ended."""
        return len(self.records)

    def add(self, record: ReplayRecord) -> None:
        """Count a finished request."""
        self.records.append(record)
        self.statuses[record.status] += 1

    def summary(self, *, ttft_objective: float, itl_objective: float) -> dict[str, Any]:
        """The figures of the run as plain data (what ``--json`` writes).

        Args:
            ttft_objective: Seconds; a 200 counts toward goodput when its TTFT is at most this
            itl_objective: ... and its mean ITL at most this (seconds).
        """
        ok = [r for r in self.records if r.status == 200]
        elapsed = self.elapsed
        ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
        itls = sorted(r.itl for r in ok if r.itl is not None)
        reported = [r for r in ok if r.prompt_tokens is not None and r.cached_tokens is not None]
        prompt = sum(r.prompt_tokens or 0 for r in reported)
        cached = sum(r.cached_tokens or 0 for r in reported)
        good = [
            r
            for r in ok
            if r.ttft is not None
            and r.ttft <= ttft_objective
            and (r.itl is None or r.itl <= itl_objective)
        ]
        lags = sorted(max(0.0, r.sent - r.due) for r in self.records)

        def spread(values: list[float]) -> dict[str, float | None]:
            return {
                f"p{round(p * 100)}": percentile(values, p) if values else None
                for p in _REPLAY_PERCENTILES
            }

        def per_second(count: float) -> float:
            return count / elapsed if elapsed > 0 else 0.0

        return {
            "planned": self.planned,
            "sent": self.total,
            "elapsed_s": elapsed,
            "statuses": {str(s): n for s, n in sorted(self.statuses.items())},
            "ok": len(ok),
            "shed_rate": self.statuses[529] / self.total if self.total else 0.0,
            "throughput_rps": per_second(len(ok)),
            "output_tokens_per_s": per_second(sum(r.output_tokens for r in ok)),
            "ttft_s": spread(ttfts),
            "itl_s": spread(itls),
            "hit_rate": cached / prompt if prompt else None,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "usage_missing": len(ok) - len(reported),
            "goodput_rps": per_second(len(good)),
            "goodput_share": len(good) / self.total if self.total else 0.0,
            "ttft_objective_s": ttft_objective,
            "itl_objective_s": itl_objective,
            "send_lag_p99_s": percentile(lags, 0.99) if lags else None,
        }


class _ConnectionPool:
    """Idle keep-alive connections to one target, reused most recent first."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self._idle: list[Connection] = []

    async def take(self) -> Connection:
        if self._idle:
            return self._idle.pop()
        return Connection(await trio.open_tcp_stream(self._target.host, self._target.port))

    def give_back(self, connection: Connection) -> None:
        self._idle.append(connection)

    async def aclose(self) -> None:
        while self._idle:
            await self._idle.pop().stream.aclose()


async def _replay_one(
    target: Target,
    shape: PromptShape,
    item: ReplayItem,
    pool: _ConnectionPool,
    start: float,
    request_timeout: float,
    report: ReplayReport,
) -> None:
    body = shape.body(item)
    headers = [
        ("Host", f"{target.host}:{target.port}"),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
    ]
    request = h11.Request(method="POST", target=target.path, headers=headers)
    sent = trio.current_time()
    record = ReplayRecord(item.index, 0, due=item.arrival, sent=sent - start)
    reader = _StreamReader(sent)
    connection: Connection | None = None
    reusable = False
    with trio.move_on_after(request_timeout):
        try:
            connection = await pool.take()
            record.status, _, reusable = await connection.exchange(request, body, reader.feed)
        except (OSError, trio.BrokenResourceError, h11.ProtocolError):
            reusable = False
    if connection is not None:
        if reusable:
            pool.give_back(connection)
        else:
            with trio.CancelScope(shield=True):
                await connection.stream.aclose()
    record.latency = trio.current_time() - sent
    if record.status == 200:
        reader.fill(record)
    report.add(record)


async def run_replay(
    target: Target,
    shape: PromptShape,
    items: Sequence[ReplayItem],
    *,
    request_timeout: float,
    clients: int | None = None,
    max_in_flight: int = 256,
    duration: float | None = None,
    progress: ProgressCallback | None = None,
    progress_interval: float = 1.0,
) -> ReplayReport:
    """Replay ``items`` against ``target``, streamed, and measure each answer.

    Open loop (``clients`` None): each item is sent at its ``arrival``, whatever the answers
    before it, on a pooled keep-alive connection; at most ``max_in_flight`` at once (an item due
    while that many are out waits, and the wait shows as its send lag). Closed loop: ``clients``
    clients each send the next item as soon as their previous answer ended, ignoring arrivals.

    Bounds: no request starts after ``duration`` (default: the last arrival, or in closed loop
    the time every client would take at ``request_timeout`` a request), the run is cut
    ``request_timeout + 1`` s after that, and a request takes ``request_timeout`` at most.

    Args:
        target: Where to send.
        shape: How an item becomes a body.
        items: What to send, in arrival order.
        request_timeout: Seconds one request may take.
        clients: Closed-loop clients; None for the open loop.
        max_in_flight: Open loop: requests out at once at most.
        duration: Seconds during which requests start.
        progress: As for :func:`run_load`.
        progress_interval: Seconds between progress calls.

    Returns:
        The report.
    """
    if not request_timeout > 0 or max_in_flight < 1 or (clients is not None and clients < 1):
        raise ValueError("request_timeout, clients and max_in_flight must be positive")
    if duration is not None and not duration > 0:
        raise ValueError("duration must be positive")
    if progress is not None and not progress_interval > 0:
        raise ValueError("progress_interval must be positive")
    report = ReplayReport(planned=len(items))
    if duration is None:
        last = items[-1].arrival if items else 0.0
        # Open loop: an item may wait for a free slot for up to a request's time.
        duration = (
            last + request_timeout
            if clients is None
            else ((len(items) / clients + 1) * request_timeout)
        )
    start = trio.current_time()
    stop_at = start + duration
    pool = _ConnectionPool(target)
    try:
        with trio.move_on_after(duration + request_timeout + 1.0):
            async with trio.open_nursery() as outer:
                if progress is not None:
                    outer.start_soon(report_progress, progress, progress_interval, report, start)
                async with trio.open_nursery() as nursery:
                    if clients is None:
                        nursery.start_soon(
                            _open_loop, target, shape, items, pool, start, stop_at,
                            request_timeout, max_in_flight, report,
                        )  # fmt: skip
                    else:
                        queue = iter(items)
                        for _ in range(clients):
                            nursery.start_soon(
                                _closed_loop_client, target, shape, queue, pool, start, stop_at,
                                request_timeout, report,
                            )  # fmt: skip
                outer.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await pool.aclose()
    report.elapsed = trio.current_time() - start
    if progress is not None:
        progress(report, report.elapsed)
    return report


async def _open_loop(
    target: Target,
    shape: PromptShape,
    items: Sequence[ReplayItem],
    pool: _ConnectionPool,
    start: float,
    stop_at: float,
    request_timeout: float,
    max_in_flight: int,
    report: ReplayReport,
) -> None:
    limiter = trio.CapacityLimiter(max_in_flight)

    async def send(item: ReplayItem) -> None:
        try:
            await _replay_one(target, shape, item, pool, start, request_timeout, report)
        finally:
            limiter.release_on_behalf_of(item)

    async with trio.open_nursery() as nursery:
        for item in items:
            await trio.sleep_until(start + item.arrival)
            await limiter.acquire_on_behalf_of(item)
            if trio.current_time() >= stop_at:
                limiter.release_on_behalf_of(item)
                return
            nursery.start_soon(send, item)


async def _closed_loop_client(
    target: Target,
    shape: PromptShape,
    queue: Iterator[ReplayItem],
    pool: _ConnectionPool,
    start: float,
    stop_at: float,
    request_timeout: float,
    report: ReplayReport,
) -> None:
    for item in queue:  # the clients share one iterator: each item is sent once
        if trio.current_time() >= stop_at:
            return
        now = trio.current_time() - start
        await _replay_one(
            target, shape, dataclasses.replace(item, arrival=now), pool, start,
            request_timeout, report,
        )  # fmt: skip


def replay_table(summary: Mapping[str, Any]) -> Group:
    """The replay's figures as rich tables: answers, latency, cache and goodput.

    Args:
        summary: What :meth:`ReplayReport.summary` returned.
    """
    elapsed = summary["elapsed_s"]
    answers = Table(
        title=f"{summary['sent']} of {summary['planned']} requests sent, in {elapsed:.2f} s",
        title_justify="left",
    )
    for column in ("status", "answers", "share"):
        answers.add_column(column, justify="left" if column == "status" else "right")
    sent = summary["sent"]
    for status, count in summary["statuses"].items():
        share = f"{count / sent:.1%}" if sent else "-"
        answers.add_row(status_name(int(status)), str(count), share)
    latency = Table(title="latency of the 200s (ms)", title_justify="left")
    latency.add_column("")
    names = [f"p{round(p * 100)}" for p in _REPLAY_PERCENTILES]
    for name in names:
        latency.add_column(name, justify="right")
    for label, key in (("TTFT", "ttft_s"), ("ITL", "itl_s")):
        values = summary[key]
        latency.add_row(
            label, *(f"{values[n] * 1e3:.1f}" if values[n] is not None else "-" for n in names)
        )
    figures = Table(title="figures", title_justify="left")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    hit = summary["hit_rate"]
    rows = [
        ("throughput (200s/s)", f"{summary['throughput_rps']:.2f}"),
        ("output tokens/s", f"{summary['output_tokens_per_s']:.1f}"),
        ("shed rate (529s)", f"{summary['shed_rate']:.1%}"),
        ("hit rate (cached / prompt tokens)", f"{hit:.1%}" if hit is not None else "-"),
        ("answers without usage", str(summary["usage_missing"])),
        (
            f"goodput (TTFT <= {summary['ttft_objective_s'] * 1e3:g} ms,"
            f" ITL <= {summary['itl_objective_s'] * 1e3:g} ms)",
            f"{summary['goodput_rps']:.2f} req/s ({summary['goodput_share']:.1%})",
        ),
    ]
    if summary["send_lag_p99_s"] is not None:
        rows.append(("send lag p99 (ms)", f"{summary['send_lag_p99_s'] * 1e3:.1f}"))
    for row in rows:
        figures.add_row(*row)
    return Group(answers, latency, figures)


def plot_replay(report: ReplayReport, path: Path) -> None:
    """Draw TTFT over the run and the hit rate so far into ``path`` (needs matplotlib).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = sorted(report.records, key=lambda r: r.sent)
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    ok = [r for r in records if r.status == 200 and r.ttft is not None]
    top.scatter([r.sent for r in ok], [(r.ttft or 0) * 1e3 for r in ok], s=4, label="200")
    shed = [r for r in records if r.status == 529]
    if shed:
        top.scatter([r.sent for r in shed], [0.0] * len(shed), s=4, c="red", label="529")
    top.set_ylabel("TTFT (ms)")
    top.legend(loc="upper left")
    times, rates = [], []
    prompt = cached = 0
    for r in records:
        if r.status == 200 and r.prompt_tokens and r.cached_tokens is not None:
            prompt += r.prompt_tokens
            cached += r.cached_tokens
            times.append(r.sent)
            rates.append(cached / prompt)
    bottom.plot(times, rates)
    bottom.set_ylabel("hit rate so far")
    bottom.set_xlabel("seconds since the start")
    bottom.set_ylim(0, 1)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
