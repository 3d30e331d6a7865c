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
import csv
import dataclasses
import datetime
import functools
import hashlib
import ipaddress
import json
import math
import sys
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

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


def _counts(report: Tally) -> str:
    return "  ".join(f"{_status_name(s)}: {report.statuses[s]}" for s in sorted(report.statuses))


def progress_line(report: Tally, elapsed: float) -> str:
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
    progress: ProgressCallback, interval: float, report: Tally, start: float
) -> None:
    # Ends when run_load cancels it, at the latest at the run's hard stop.
    while True:
        await trio.sleep(interval)
        progress(report, trio.current_time() - start)


# ----------------------------------------------------------------------------- trace replay

#: Tokens per block of the Mooncake trace's ``hash_ids``.
TRACE_BLOCK_TOKENS = 512
#: Prompts are made of the words ``w0`` ... ``w499``: one token each for the mocker's
#: whitespace tokenizer, and words a small word-level tokenizer can know.
VOCABULARY = 500
#: Percentiles of the replay's tables.
_REPLAY_PERCENTILES = (0.5, 0.9, 0.99)
#: One line of a streamed answer longer than this ends the request (a chunk is far smaller).
_MAX_SSE_LINE = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, as the trace gives it.

    Attributes:
        arrival: Seconds since the trace's start.
        input_tokens: Prompt tokens.
        output_tokens: Generated tokens.
        hash_ids: Names of the prompt's blocks of :data:`TRACE_BLOCK_TOKENS` tokens (Mooncake);
            empty when the trace has no prefix information (Azure).
    """

    arrival: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def read_trace(path: Path, trace_format: str = "auto") -> list[TraceRequest]:
    """Read a trace file in the Mooncake (JSONL) or Azure (CSV) format.

    Args:
        path: The file.
        trace_format: ``mooncake``, ``azure``, or ``auto`` (by the file's first character:
            ``{`` is Mooncake).

    Returns:
        The requests in arrival order.

    Raises:
        ValueError: an unknown format, or a line that is not a request of it (the message names
            the line).
    """
    with path.open(encoding="utf-8", newline="") as source:
        if trace_format == "auto":
            head = source.read(1)
            source.seek(0)
            trace_format = "mooncake" if head == "{" else "azure"
        if trace_format == "mooncake":
            requests = [
                _mooncake_request(line, f"{path}:{number}")
                for number, line in enumerate(source, 1)
                if line.strip()
            ]
        elif trace_format == "azure":
            requests = _azure_requests(source, str(path))
        else:
            raise ValueError(f"unknown trace format {trace_format!r} (mooncake, azure or auto)")
    requests.sort(key=lambda request: request.arrival)  # stable: equal times keep file order
    return requests


def _count(value: object, name: str, where: str, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{where}: {name} must be an integer >= {least}, got {value!r}")
    return value


def _mooncake_request(line: str, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    timestamp = row.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or timestamp < 0:
        raise ValueError(f"{where}: timestamp must be a number of ms >= 0, got {timestamp!r}")
    input_tokens = _count(row.get("input_length"), "input_length", where, least=1)
    output_tokens = _count(row.get("output_length"), "output_length", where, least=0)
    hash_ids = row.get("hash_ids")
    if not isinstance(hash_ids, list):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    ids = tuple(_count(h, "a hash id", where, least=0) for h in hash_ids)
    if len(ids) != math.ceil(input_tokens / TRACE_BLOCK_TOKENS):
        raise ValueError(
            f"{where}: {len(ids)} hash_ids for {input_tokens} tokens"
            f" (blocks of {TRACE_BLOCK_TOKENS} need {math.ceil(input_tokens / TRACE_BLOCK_TOKENS)})"
        )
    return TraceRequest(timestamp / 1000.0, input_tokens, output_tokens, ids)


def _azure_requests(source: Any, where: str) -> list[TraceRequest]:
    rows = csv.reader(source)
    header = next(rows, None)
    if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
        raise ValueError(f"{where}:1: expected the header TIMESTAMP,ContextTokens,GeneratedTokens")
    requests = []
    first: float | None = None
    for number, row in enumerate(rows, 2):
        if not row:
            continue
        at = f"{where}:{number}"
        if len(row) != 3:
            raise ValueError(f"{at}: expected 3 fields, got {len(row)}")
        moment = _azure_time(row[0], at)
        first = moment if first is None else first
        try:
            lengths = int(row[1]), int(row[2])
        except ValueError:
            raise ValueError(f"{at}: token counts must be integers, got {row[1:]!r}") from None
        input_tokens = _count(lengths[0], "ContextTokens", at, least=1)
        output_tokens = _count(lengths[1], "GeneratedTokens", at, least=0)
        requests.append(TraceRequest(moment - first, input_tokens, output_tokens))
    return requests


def _azure_time(text: str, where: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (100 ns digits kept)."""
    whole, _, fraction = text.strip().partition(".")
    try:
        moment = datetime.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
        digits = int(fraction) / 10 ** len(fraction) if fraction else 0.0
    except ValueError:
        raise ValueError(f"{where}: not a timestamp: {text!r}") from None
    return moment.replace(tzinfo=datetime.UTC).timestamp() + digits


def select_window(
    requests: Sequence[TraceRequest],
    *,
    start: float = 0.0,
    duration: float | None = None,
    count: int | None = None,
) -> list[TraceRequest]:
    """The requests of a window of the trace, their arrivals counted from its first one.

    Args:
        requests: The trace, in arrival order.
        start: Trace seconds before the window.
        duration: Trace seconds of the window (None: to the end).
        count: At most this many requests, the first ones of the window (None: all).

    Returns:
        The window's requests, the first arriving at 0.
    """
    end = math.inf if duration is None else start + duration
    chosen = [request for request in requests if start <= request.arrival < end]
    if count is not None:
        chosen = chosen[:count]
    if not chosen:
        return []
    origin = chosen[0].arrival
    return [dataclasses.replace(r, arrival=r.arrival - origin) for r in chosen]


@dataclasses.dataclass(frozen=True)
class ReplayItem:
    """One request as it is replayed: scaled in time and length.

    Attributes:
        index: Position in the window.
        arrival: Replay seconds from the start at which it is sent (open loop).
        prompt_tokens: Words of its prompt.
        max_tokens: Tokens it asks for.
        hash_ids: The trace's block names, each of ``block_tokens`` words (the last block
            possibly shorter); empty for a prompt shared with no other.
        block_tokens: Words per block.
    """

    index: int
    arrival: float
    prompt_tokens: int
    max_tokens: int
    hash_ids: tuple[int, ...]
    block_tokens: int


def scale_requests(
    requests: Sequence[TraceRequest],
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    output_scale: float | None = None,
) -> list[ReplayItem]:
    """Scale a window for replay, keeping its block structure.

    A Mooncake block of :data:`TRACE_BLOCK_TOKENS` tokens becomes ``round(512 x length_scale)``
    words, so two prompts that share k blocks still share exactly their first k blocks; the last,
    partial block shrinks in proportion (one word at least). A prompt without blocks (Azure) is
    ``round(tokens x length_scale)`` words, at least one.

    Args:
        requests: The window.
        time_scale: Replay seconds per trace second (0.25: four times the trace's rate).
        length_scale: Prompt tokens replayed per trace token.
        output_scale: Generated tokens asked per trace token (None: ``length_scale``); at least
            one is asked for.

    Returns:
        The items to replay.

    Raises:
        ValueError: a scale that is not positive, or a block that would have no token.
    """
    if not time_scale > 0 or not length_scale > 0:
        raise ValueError("time_scale and length_scale must be positive")
    out_scale = length_scale if output_scale is None else output_scale
    if not out_scale > 0:
        raise ValueError("output_scale must be positive")
    block_tokens = round(TRACE_BLOCK_TOKENS * length_scale)
    if block_tokens < 1:
        raise ValueError(f"length_scale {length_scale} leaves no token in a block of 512")
    items = []
    for index, request in enumerate(requests):
        if request.hash_ids:
            whole = len(request.hash_ids) - 1
            rest = request.input_tokens - whole * TRACE_BLOCK_TOKENS
            tail = min(block_tokens, max(1, round(rest * block_tokens / TRACE_BLOCK_TOKENS)))
            prompt = whole * block_tokens + tail
        else:
            prompt = max(1, round(request.input_tokens * length_scale))
        items.append(
            ReplayItem(
                index=index,
                arrival=request.arrival * time_scale,
                prompt_tokens=prompt,
                max_tokens=max(1, round(request.output_tokens * out_scale)),
                hash_ids=request.hash_ids,
                block_tokens=block_tokens,
            )
        )
    return items


@functools.lru_cache(maxsize=65536)
def block_words(name: str, count: int) -> tuple[str, ...]:
    """The words of one block: a pure function of its name, so equal names give equal text.

    Args:
        name: The block's name (``h<hash id>``, or ``r<request>.<block>`` for one never shared).
        count: Words in the block.
    """
    digest = hashlib.shake_256(name.encode()).digest(2 * count)
    return tuple(
        f"w{int.from_bytes(digest[i : i + 2], 'big') % VOCABULARY}" for i in range(0, 2 * count, 2)
    )


def prompt_text(item: ReplayItem) -> str:
    """The prompt of ``item``: block after block, the words of each named by its hash id."""
    words: list[str] = []
    left = item.prompt_tokens
    block = 0
    while left > 0:
        size = min(item.block_tokens, left)
        if block < len(item.hash_ids):
            name = f"h{item.hash_ids[block]}"
        else:  # no prefix information: words of this request alone
            name = f"r{item.index}.{block}"
        words.extend(block_words(name, item.block_tokens)[:size])
        left -= size
        block += 1
    return " ".join(words)


def unbounded_hit_rate(items: Sequence[ReplayItem]) -> float:
    """The share of prompt tokens an unbounded single prefix cache would find, in order.

    A prompt's full blocks are looked up from the first; the longest run already seen counts as
    cached (a partial last block never does: engines do not share it), as the mocker's cache and
    vLLM's count it.
    """
    seen: set[int] = set()
    cached = total = 0
    for item in items:
        total += item.prompt_tokens
        full = item.prompt_tokens // item.block_tokens
        hits = 0
        while hits < full and hits < len(item.hash_ids) and item.hash_ids[hits] in seen:
            hits += 1
        cached += hits * item.block_tokens
        seen.update(item.hash_ids[:full])
    return cached / total if total else 0.0


def distinct_blocks(items: Sequence[ReplayItem]) -> int:
    """Distinct full blocks of the items' prompts (what caches would have to hold)."""
    names: set[int] = set()
    for item in items:
        names.update(item.hash_ids[: item.prompt_tokens // item.block_tokens])
    return len(names)


@dataclasses.dataclass(frozen=True)
class PromptShape:
    """How an item becomes a request body.

    Attributes:
        endpoint: ``chat`` or ``completions``.
        model: The model name.
        extra: Fields merged into every body.
    """

    endpoint: str
    model: str
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def body(self, item: ReplayItem) -> bytes:
        """The streamed request of ``item``, asking for usage in the last chunk."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": item.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt_text(item)}]
        else:
            body["prompt"] = prompt_text(item)
        body.update(self.extra)
        return json.dumps(body).encode()


@dataclasses.dataclass
class ReplayRecord:
    """What one replayed request measured (times in seconds since the replay's start).

    Attributes:
        index: The item's position in the window.
        status: HTTP status; 0 for no answer, 500 for a stream that ended in an error event.
        due: When it was to be sent.
        sent: When it was sent.
        ttft: Seconds from sending to the answer's first chunk of a choice (None: none came).
        itl: Mean seconds between tokens after the first (None: fewer than two).
        latency: Seconds from sending to the end of the answer.
        prompt_tokens: From the answer's usage (None: no usage).
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` (None: not reported).
        output_tokens: Tokens generated (usage's count, else the chunks with text).
    """

    index: int
    status: int
    due: float
    sent: float
    ttft: float | None = None
    itl: float | None = None
    latency: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0


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
        self._idle: list[_Connection] = []

    async def take(self) -> _Connection:
        if self._idle:
            return self._idle.pop()
        return _Connection(await trio.open_tcp_stream(self._target.host, self._target.port))

    def give_back(self, connection: _Connection) -> None:
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
    connection: _Connection | None = None
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
                    outer.start_soon(_report_progress, progress, progress_interval, report, start)
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
        answers.add_row(_status_name(int(status)), str(count), share)
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

    def __call__(self, report: Tally, elapsed: float) -> None:
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
    def show(report: Tally, elapsed: float) -> None:
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
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of load (default 10; for a replay, the window's span)",
    )
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="total cap")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback host")
    replay = parser.add_argument_group("trace replay (with --trace)")
    replay.add_argument("--trace", type=Path, default=None, help="a Mooncake or Azure trace")
    replay.add_argument("--trace-format", choices=("auto", "mooncake", "azure"), default="auto")
    replay.add_argument("--trace-start", type=float, default=0.0, help="trace seconds skipped")
    replay.add_argument(
        "--trace-duration", type=float, default=None, help="trace seconds replayed (default all)"
    )
    replay.add_argument(
        "--trace-requests", type=int, default=None, help="the window's first K requests only"
    )
    replay.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="replay seconds per trace second (0.25: four times the trace's rate)",
    )
    replay.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="prompt tokens per trace token; a 512-token block becomes round(512 x this) words",
    )
    replay.add_argument(
        "--output-scale",
        type=float,
        default=None,
        help="generated tokens per trace token (default: the length scale)",
    )
    replay.add_argument(
        "--closed-loop",
        action="store_true",
        help="--clients clients send back to back, ignoring arrival times",
    )
    replay.add_argument(
        "--max-in-flight", type=int, default=256, help="open loop: requests out at once at most"
    )
    replay.add_argument("--ttft-objective", type=float, default=2.0, help="goodput: TTFT (s)")
    replay.add_argument("--itl-objective", type=float, default=0.025, help="goodput: ITL (s)")
    replay.add_argument(
        "--extra-body", default=None, help="a JSON object merged into every request body"
    )
    replay.add_argument("--json", type=Path, default=None, help="write the figures here")
    replay.add_argument(
        "--plot", type=Path, default=None, help="draw TTFT and hit rate here (needs matplotlib)"
    )
    return parser.parse_args(argv)


def _progress(err: Console, duration: float, total: int) -> tuple[ProgressCallback, float, Any]:
    """The progress callback, its interval, and the live bar to stop (None: plain lines)."""
    if duration > 0 and total > 0 and err.is_terminal:
        live = _LiveBar(err, duration, total)
        live.progress.start()
        return live, 0.2, live
    return _plain_progress(err), 1.0, None


def main(argv: list[str] | None = None) -> int:
    """Run the load (or replay the trace) and print the report.

    Returns:
        The exit status: 0 after a run, 2 for invalid arguments.
    """
    args = _parse_args(argv)
    out = Console()
    err = Console(stderr=True)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    if args.trace is not None:
        return _replay_main(args, path, out, err)
    duration = 10.0 if args.duration is None else args.duration
    body: dict[str, Any] = {"model": args.model, "max_tokens": args.max_tokens}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        body["prompt"] = args.prompt
    live: _LiveBar | None = None
    try:
        target = parse_target(args.url, path, allow_remote=args.allow_remote)
        progress, interval, live = _progress(err, duration, args.max_requests)
        report = trio.run(
            lambda: run_load(
                target,
                body,
                clients=args.clients,
                duration=duration,
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


def _replay_main(args: argparse.Namespace, path: str, out: Console, err: Console) -> int:
    live: _LiveBar | None = None
    try:
        target = parse_target(args.url, path, allow_remote=args.allow_remote)
        extra = json.loads(args.extra_body) if args.extra_body is not None else {}
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        if args.plot is not None:
            try:
                import matplotlib  # noqa: F401 - checked before a long run, not after
            except ImportError:
                raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
        if args.max_requests < 1:
            raise ValueError("--max-requests must be positive")
        window = select_window(
            read_trace(args.trace, args.trace_format),
            start=args.trace_start,
            duration=args.trace_duration,
            count=min(args.trace_requests or args.max_requests, args.max_requests),
        )
        items = scale_requests(
            window,
            time_scale=args.time_scale,
            length_scale=args.length_scale,
            output_scale=args.output_scale,
        )
        if not items:
            raise ValueError(f"no request of {args.trace} falls in the window")
        shape = PromptShape(args.endpoint, args.model, extra)
        span = args.duration or (items[-1].arrival if not args.closed_loop else 0.0)
        progress, interval, live = _progress(err, span or float(len(items)), len(items))
        report = trio.run(
            lambda: run_replay(
                target,
                shape,
                items,
                request_timeout=args.timeout,
                clients=args.clients if args.closed_loop else None,
                max_in_flight=args.max_in_flight,
                duration=args.duration,
                progress=progress,
                progress_interval=interval,
            )
        )
    except (ValueError, OSError) as error:
        print(f"load_generator: {error}", file=sys.stderr)
        return 2
    finally:
        if live is not None:
            live.progress.stop()
    summary = report.summary(ttft_objective=args.ttft_objective, itl_objective=args.itl_objective)
    summary["unbounded_hit_rate"] = unbounded_hit_rate(items)
    summary["distinct_blocks"] = distinct_blocks(items)
    summary["block_tokens"] = items[0].block_tokens
    out.print(replay_table(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    if args.plot is not None:
        plot_replay(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
