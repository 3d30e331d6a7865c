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

With ``--trace FILE`` it replays a request trace instead (Mooncake JSONL with block hashes, or
Azure CSV), scaled in time (``--time-scale``) and length (``--length-scale``: a 512-token block
becomes ``round(512 x F)`` words, so shared prefixes stay shared block for block), over a window
(``--trace-start``, ``--trace-duration``, ``--trace-requests``), open loop at the arrival times or
``--closed-loop`` with ``--clients`` clients. Every request is streamed; the table gives TTFT and
ITL percentiles, the hit rate (``usage.prompt_tokens_details.cached_tokens`` over the prompt
tokens), the shed rate (529s) and goodput within ``--ttft-objective`` and ``--itl-objective``;
``--json`` writes the figures, ``--plot`` draws them (matplotlib)::

    python examples/load_generator.py --trace mooncake_conversation.jsonl --trace-duration 300 \
        --time-scale 0.5 --length-scale 0.03125

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
import json
import sys
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

# The script's own modules sit beside it: running it puts this folder on the path, loading it
# from its file (as a test does) does not.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen_closed_loop import (
    LoadReport,
    ProgressCallback,
    Tally,
    Target,
    final_table,
    parse_target,
    percentile,
    progress_line,
    run_load,
    status_counts,
)
from loadgen_replay import ReplayReport, plot_replay, replay_table, run_replay
from loadgen_traces import (
    VOCABULARY,
    PromptShape,
    ReplayRecord,
    TraceRequest,
    distinct_blocks,
    prompt_text,
    read_trace,
    scale_requests,
    select_window,
    unbounded_hit_rate,
)

__all__ = [
    "LoadReport",
    "PromptShape",
    "ReplayRecord",
    "ReplayReport",
    "Target",
    "TraceRequest",
    "VOCABULARY",
    "distinct_blocks",
    "final_table",
    "main",
    "parse_target",
    "percentile",
    "plot_replay",
    "progress_line",
    "prompt_text",
    "read_trace",
    "run_load",
    "run_replay",
    "scale_requests",
    "select_window",
    "unbounded_hit_rate",
]


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
            counts=status_counts(report),
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
