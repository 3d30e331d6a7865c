"""The frontend figures of ``bench/bench_frontend.py``, ours and NVIDIA Dynamo's, side by side.

Run from the repository's root: ``python -m bench.bench_dynamo [--seconds 5] [--connections 64]
[--repeats 3] [--processes 1] [--dynamo-python .venv-dynamo/bin/python]`` (needs ``wrk``:
``apt-get install -y wrk``). Servers are pinned to CPU 0 and wrk to CPU 1 with ``taskset``;
``--processes`` runs our frontends as that many HTTP processes (their CPU is summed over the
frontend's process tree). Several cores beside Dynamo: ``bench/bench_cores.py``.

Each system runs two deployments, both on loopback:

- busy: a mocker slowed down 50 times (``--speedup-ratio 0.02``) holding one long streamed
  chat, behind a frontend whose decode threshold is 0.0 (Dynamo's needs ``--router-mode kv`` for
  it), so every chat it gets is answered 529;
- fast: a mocker sped up 100 times behind a frontend without thresholds;
- stream: a mocker sped up 10,000 times behind a frontend without thresholds (ours also runs
  the same frontend in front of its instant engine, which does no work per token).

Figures, wrk on ``--connections`` keep-alive connections unless said otherwise, the systems
taking turns within each repeat, medians of ``--repeats``:

1. ``GET /live`` on the busy frontend;
2. chat answered 529 by the busy frontend;
3. chat with ``max_tokens`` 1 through the fast frontend and mocker;
4. chat for an unknown model on the fast frontend (404);
5. one connection: p50/p99 of the chat of 3 and of ``GET /live``, on the fast frontend;
6. streamed chat of ``--stream-tokens`` tokens (256) through the stream frontend and mocker
   (and, for ours, through the instant engine);
7. one connection, streamed as in 6: the inter-token latency the client sees (median over
   requests of each request's median gap between two ``data:`` events, and the p99 of every
   gap), read by a small client of this module on the load CPU.

For every figure, the CPU time each server process used (``/proc``: user plus system, summed
over the process group) divided by the requests answered, and for 6 by the tokens streamed:
what a request or a token costs each process. With both systems present, the report ends with
ours over Dynamo's for figures 1-4 and 6, from the same run.

Both sides log at warning level (``--dynamo-log`` sets Dynamo's ``DYN_LOG``): at info level
Dynamo writes lines for every request, a cost of its own. Even at warning level it writes three
to four error lines for every 529 and every 404; ours writes none. wrk's count of non-2xx answers
is printed too, so a figure that measured the wrong answer shows. Both systems stay up for the
whole run, each idle (but for its long request) while the other is measured.

Installing Dynamo (a separate virtual environment, so that its requirements stay out of ours;
its planner needs ``aisimulate``, which installs only from an index of its own and is not
needed by the frontend or the mocker, hence ``--no-deps`` and the list by hand)::

    python -m venv .venv-dynamo
    .venv-dynamo/bin/pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    .venv-dynamo/bin/pip install 'aiohttp>=3.14.3,<4' 'certifi>=2026.10.19' \\
        'kubernetes>=32.0.1,<33' 'msgspec>=0.19' 'prometheus-client>=0.23.1,<1' 'pyzmq>=26' \\
        'redis>=6.2,<9' 'tqdm>=4' 'transformers>=4.56' 'typing-extensions>=4.10' \\
        'zstandard>=0.23,<1' 'pydantic>=2.10.6,<=2.13.5' 'uvloop>=0.21'

(the ``Requires-Dist`` of both wheels, less ``aisimulate``). How Dynamo runs here (file
discovery, loopback, a tiny model folder) is :mod:`bench.kit.dynamo`. Without a Dynamo
interpreter the Dynamo column is skipped and says why.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.dynamo import (
    DEFAULT_PYTHON,
    MODEL,
    PLANES,
    dynamo_env,
    dynamo_version,
    skipped,
    write_model_folder,
)
from bench.kit.http import kept_busy, wait_status
from bench.kit.proc import tree_cpu_seconds
from bench.kit.processes import free_port, pin, serve
from bench.kit.shim import shim
from bench.kit.stats import percentile
from bench.kit.table import Table
from bench.kit.wrk import LOAD_CPU, SERVER_CPU, Wrk, need_wrk

SLOW: Final = "0.02"
FAST: Final = "100"
STREAM: Final = "10000"
#: Tokens of each streamed chat (figures 6 and 7); ``--stream-tokens`` changes it.
STREAM_TOKENS: Final = 256
CHAT_PATH: Final = "/v1/chat/completions"
CHAT: Final = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "one two"}], "max_tokens": 1}
)
UNKNOWN: Final = json.dumps(
    {
        "model": "no-such-model",
        "messages": [{"role": "user", "content": "one two"}],
        "max_tokens": 1,
    }
)
LONG: Final = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a b c"}],
        "max_tokens": 2000,
        "stream": True,
    }
)


def streamed_chat(tokens: int) -> str:
    """The body of a streamed chat of ``tokens`` tokens."""
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "one two"}],
            "max_tokens": tokens,
            "stream": True,
        }
    )


# ----------------------------------------------------------------------------- CPU per process


class Pair:
    """One frontend in front of one worker: its URL and the pids whose CPU is measured."""

    def __init__(self, url: str, frontend: int, worker: int) -> None:
        self.url = url
        self.pids = {"frontend": frontend, "worker": worker}

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each process of the pair (and its children)."""
        return {role: tree_cpu_seconds(pid) for role, pid in self.pids.items()}


class Deployment:
    """The pairs of one system: busy, fast, stream, and (ours only) stream on the instant
    engine."""

    def __init__(self, busy: Pair, fast: Pair, stream: Pair, instant: Pair | None) -> None:
        self.busy = busy
        self.fast = fast
        self.stream = stream
        self.instant = instant


@contextlib.contextmanager
def shim_deployment(processes: int = 1) -> Iterator[Deployment]:
    """Our worker and frontend (of ``processes`` HTTP processes: its CPU is read over its
    process tree), four times: busy (slow mocker, threshold 0.0), fast, stream (mocker sped up
    10,000 times) and instant (the instant engine)."""
    quiet = ["--log-level", "warning"]
    front = [*quiet, "--processes", str(processes)]
    with contextlib.ExitStack() as stack:
        pairs: list[Pair] = []
        for worker_flags, frontend_flags in (
            (["--speedup-ratio", SLOW], ["--active-decode-blocks-threshold", "0.0"]),
            (["--speedup-ratio", FAST], []),
            (["--speedup-ratio", STREAM], []),
            (["--engine", "instant"], []),
        ):
            ours = stack.enter_context(
                shim([*quiet, *worker_flags], [*front, *frontend_flags], cpu=SERVER_CPU)
            )
            pairs.append(Pair(ours.url, ours.frontend.pid, ours.worker.pid))
        busy, fast, stream, instant = pairs
        wait_status(fast.url, CHAT_PATH, CHAT, 200, timeout=60)
        stack.enter_context(kept_busy(busy.url, CHAT_PATH, LONG, CHAT))
        yield Deployment(busy, fast, stream, instant)


@contextlib.contextmanager
def dynamo_deployment(python: str, scratch: Path, log: str) -> Iterator[Deployment]:
    """Dynamo's mocker and frontend, three times: busy, fast and stream, each pair with its own
    discovery."""
    model = scratch / "model"
    write_model_folder(model)
    mocker = [python, "-m", "dynamo.mocker", "--model-path", str(model), "--model-name", MODEL]
    frontend = [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1"]
    pairs: list[Pair] = []
    with contextlib.ExitStack() as stack:
        for name, speedup, extra in (
            ("busy", SLOW, ["--router-mode", "kv", "--active-decode-blocks-threshold", "0.0"]),
            ("fast", FAST, []),
            ("stream", STREAM, []),
        ):
            env = dynamo_env(scratch / f"kv-{name}", log)
            port = free_port()
            theirs = stack.enter_context(
                serve(
                    [*mocker, *PLANES, "--speedup-ratio", speedup],
                    env,
                    cpu=SERVER_CPU,
                    log=scratch / f"dynamo-mocker-{name}.log",
                    ready=False,
                    grace=15.0,
                )
            )
            front = stack.enter_context(
                serve(
                    [*frontend, "--http-port", str(port), *PLANES, *extra],
                    env,
                    cpu=SERVER_CPU,
                    log=scratch / f"dynamo-frontend-{name}.log",
                    ready=False,
                    grace=15.0,
                )
            )
            pairs.append(Pair(f"http://127.0.0.1:{port}", front.pid, theirs.pid))
        busy, fast, stream = pairs
        for pair in pairs:
            wait_status(pair.url, CHAT_PATH, CHAT, 200, timeout=180)
        stack.enter_context(kept_busy(busy.url, CHAT_PATH, LONG, CHAT))
        yield Deployment(busy, fast, stream, None)


# ----------------------------------------------------------------------------- figures


def stream_gaps(url: str, tokens: int, requests: int) -> dict[str, float]:
    """Figure 7: stream ``requests`` chats of ``tokens`` tokens one after another on one
    keep-alive connection, timing every ``data:`` event as it arrives.

    Returns:
        ``itl_p50_ms``: the median over requests of the inter-token latency, the time from the
        first content event to the last divided by the tokens after the first (as benchmark
        clients define it: a server that sends several tokens in one event is not flattered);
        ``gap_p99_ms``: the p99 of the gaps between consecutive events, every request's (a
        stall shows here); ``ttft_p50_ms``: the median time from sending to the first event;
        ``events``: the median count of events per request (tokens merged into one event, or
        tokens that decoded to no text, show here).
    """
    body = json.dumps(
        {**json.loads(streamed_chat(tokens)), "stream_options": {"include_usage": True}}
    )
    target = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=30)
    per_token: list[float] = []
    gaps: list[float] = []
    firsts: list[float] = []
    counts: list[int] = []
    try:
        for _ in range(requests):
            sent = time.perf_counter()
            connection.request(
                "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
            )
            reply = connection.getresponse()
            if reply.status != 200:
                raise RuntimeError(f"{url}: streamed chat answered {reply.status}")
            stamps: list[float] = []
            while line := reply.readline():
                # Content events only: the usage event and [DONE] are not tokens.
                if line.startswith(b"data: {") and b'"usage"' not in line:
                    stamps.append(time.perf_counter())
            gaps.extend((b - a) * 1000 for a, b in itertools.pairwise(stamps))
            if len(stamps) >= 2 and tokens > 1:
                per_token.append((stamps[-1] - stamps[0]) * 1000 / (tokens - 1))
            if stamps:
                firsts.append((stamps[0] - sent) * 1000)
            counts.append(len(stamps))
    finally:
        connection.close()
    return {
        "itl_p50_ms": statistics.median(per_token) if per_token else float("nan"),
        "gap_p99_ms": percentile(gaps, 0.99),
        "ttft_p50_ms": statistics.median(firsts) if firsts else float("nan"),
        "events": statistics.median(counts) if counts else 0.0,
    }


@contextlib.contextmanager
def _on_load_cpu() -> Iterator[None]:
    """Run this process on the load CPU for the block, as wrk runs."""
    before = os.sched_getaffinity(0)
    pin(LOAD_CPU)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


Figures = dict[str, dict[str, float]]


class Figure:
    """One figure: which pair it loads, how (a ``GET``, or the body of ``body`` posted), and
    what its CPU is divided by."""

    def __init__(
        self,
        pair: str,
        body: str | None,
        path: str,
        *,
        connections: int | None = None,
        tokens: bool = False,
    ) -> None:
        self.pair = pair
        self.body = body
        self.path = path
        self.connections = connections
        self.tokens = tokens


#: The figures of the module docstring (but 7), in the order they run.
FIGURES: Final = {
    "live": Figure("busy", None, "/live"),
    "shed": Figure("busy", "chat", CHAT_PATH),
    "chat": Figure("fast", "chat", CHAT_PATH),
    "unknown": Figure("fast", "unknown", CHAT_PATH),
    "chat1": Figure("fast", "chat", CHAT_PATH, connections=1),
    "live1": Figure("fast", None, "/live", connections=1),
    "stream": Figure("stream", "stream", CHAT_PATH, tokens=True),
    "instant": Figure("instant", "stream", CHAT_PATH, tokens=True),
}


def measure(deployment: Deployment, wrk: Wrk, tokens: int, itl_requests: int) -> Figures:
    """The figures of the module docstring, on one system, each with the CPU per request (and
    per token, for streams) of the processes it loaded."""
    bodies = {"chat": CHAT, "unknown": UNKNOWN, "stream": streamed_chat(tokens), None: None}
    figures: Figures = {}
    for name, figure in FIGURES.items():
        pair: Pair | None = getattr(deployment, figure.pair)
        if pair is None:
            continue
        before = pair.cpu()
        result = wrk.run(
            pair.url + figure.path, body=bodies[figure.body], connections=figure.connections
        )
        after = pair.cpu()
        for role in before:
            used = after[role] - before[role]
            if result["requests"]:
                result[f"{role}_us_per_request"] = used / result["requests"] * 1e6
                if figure.tokens:
                    result[f"{role}_us_per_token"] = used / (result["requests"] * tokens) * 1e6
        figures[name] = result
    for name, pair in (("itl", deployment.stream), ("itl_instant", deployment.instant)):
        if pair is not None:
            with _on_load_cpu():
                figures[name] = stream_gaps(pair.url, tokens, itl_requests)
    return figures


def median_figures(runs: list[Figures]) -> Figures:
    """Each figure's median over runs."""
    return {
        name: {
            key: statistics.median(run[name][key] for run in runs if key in run[name])
            for key in runs[0][name]
        }
        for name in runs[0]
    }


def _rate(f: dict[str, float]) -> str:
    return f"{f['rps']:,.0f}"


def _latency(f: dict[str, float]) -> str:
    return f"{f.get('p50_ms', float('nan')):.2f} / {f.get('p99_ms', float('nan')):.2f}"


def _cpu(unit: str) -> Callable[[dict[str, float]], str]:
    def show(f: dict[str, float]) -> str:
        frontend = f.get(f"frontend_us_per_{unit}", float("nan"))
        worker = f.get(f"worker_us_per_{unit}", float("nan"))
        return f"{frontend:.1f} + {worker:.1f}"

    return show


def _itl(f: dict[str, float]) -> str:
    return (
        f"{f['itl_p50_ms']:.3f} / {f['gap_p99_ms']:.3f} (TTFT {f['ttft_p50_ms']:.2f},"
        f" {f['events']:.0f} events)"
    )


ROWS: Final[list[tuple[str, str, Callable[[dict[str, float]], str]]]] = [
    ("GET /live, busy frontend (req/s)", "live", _rate),
    ("chat answered 529, fleet busy (req/s)", "shed", _rate),
    ("chat max_tokens 1, fast mocker (req/s)", "chat", _rate),
    ("chat, unknown model 404 (req/s)", "unknown", _rate),
    ("streamed chat, mocker at 10,000x (req/s)", "stream", _rate),
    ("streamed chat, instant engine (req/s)", "instant", _rate),
    ("one connection: chat p50 / p99 (ms)", "chat1", _latency),
    ("one connection: /live p50 / p99 (ms)", "live1", _latency),
    ("CPU per 529, frontend + worker (us)", "shed", _cpu("request")),
    ("CPU per 1-token chat, frontend + worker (us)", "chat", _cpu("request")),
    ("CPU per /live, frontend (us)", "live", _cpu("request")),
    ("CPU per streamed token, mocker 10,000x, frontend + worker (us)", "stream", _cpu("token")),
    ("CPU per streamed token, instant, frontend + worker (us)", "instant", _cpu("token")),
    ("one connection, streamed: inter-token p50 / event gap p99 (ms)", "itl", _itl),
    ("same, instant engine", "itl_instant", _itl),
]
#: The figures whose rates are compared across systems.
COMPARED: Final = ("live", "shed", "chat", "unknown", "stream")


def _non_2xx(figure: dict[str, float] | None) -> str:
    if figure is None or "requests" not in figure:
        return "-"
    return f"{figure['non_2xx'] / figure['requests']:.0%}" if figure["requests"] else "n/a"


def report(columns: dict[str, Figures]) -> str:
    """The figures as a Markdown table, one column per system, then the ratios within each."""
    names = list(columns)
    figures = Table("figure", *names, "non-2xx share")
    for label, key, show in ROWS:
        cells = [show(columns[name][key]) if key in columns[name] else "-" for name in names]
        checks = " / ".join(_non_2xx(columns[name].get(key)) for name in names)
        figures.add(label, *cells, checks)
    within = Table("ratio, within each system", *names)
    for label, top, bottom in (
        ("529s / GET /live", "shed", "live"),
        ("chat / GET /live", "chat", "live"),
        ("404s / GET /live", "unknown", "live"),
    ):
        within.add(
            label, *(f"{columns[n][top]['rps'] / columns[n][bottom]['rps']:.2f}" for n in names)
        )
    added = [
        columns[n]["chat1"].get("p50_ms", float("nan"))
        - columns[n]["live1"].get("p50_ms", float("nan"))
        for n in names
    ]
    within.add("one connection: chat p50 - /live p50", *(f"{ms:.2f} ms" for ms in added))
    tables = [str(figures), str(within)]
    if len(names) == 2:
        ours, theirs = names
        across = Table(f"ratio, {ours} / {theirs} (same run)", "requests/s")
        both = [key for key in COMPARED if key in columns[ours] and key in columns[theirs]]
        for label, key, show in ROWS:
            if key in both and show is _rate:
                ratio = columns[ours][key]["rps"] / columns[theirs][key]["rps"]
                across.add(label.removesuffix(" (req/s)"), f"{ratio:.2f}")
        if "itl" in columns[ours] and "itl" in columns[theirs]:
            itl = columns[ours]["itl"]["itl_p50_ms"] / columns[theirs]["itl"]["itl_p50_ms"]
            across.add("one connection, streamed: inter-token p50 (lower is better)", f"{itl:.2f}")
        tables.append(str(across))
    return "\n\n".join(tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-tokens", type=int, default=STREAM_TOKENS)
    parser.add_argument(
        "--itl-requests", type=int, default=20, help="streamed chats timed for figure 7"
    )
    parser.add_argument(
        "--dynamo-python",
        default=str(DEFAULT_PYTHON),
        help="an interpreter that can import dynamo.frontend and dynamo.mocker",
    )
    parser.add_argument("--no-dynamo", action="store_true", help="measure ours alone")
    parser.add_argument(
        "--processes", type=int, default=1, help="our frontends' --processes (HTTP processes)"
    )
    parser.add_argument("--dynamo-log", default="warn", help="DYN_LOG of the Dynamo processes")
    parser.add_argument("--logs", type=Path, default=None, help="keep the servers' logs here")
    options = parser.parse_args()
    need_wrk()
    version = None if options.no_dynamo else dynamo_version(options.dynamo_python)
    if version is None and not options.no_dynamo:
        print(skipped(options.dynamo_python))
    with tempfile.TemporaryDirectory() as tmp:
        scratch = options.logs or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        wrk = Wrk(options.seconds, options.connections, scratch)
        runs: dict[str, list[Figures]] = {}
        ours = "dynamo-shim"
        theirs = f"Dynamo {version}"
        with contextlib.ExitStack() as stack:
            deployments = {ours: stack.enter_context(shim_deployment(options.processes))}
            if version is not None:
                deployments[theirs] = stack.enter_context(
                    dynamo_deployment(options.dynamo_python, scratch, options.dynamo_log)
                )
            names = list(deployments)
            for repeat in range(options.repeats):
                turn = repeat % len(names)
                for name in [*names[turn:], *names[:turn]]:
                    print(f"repeat {repeat + 1}: {name}", file=sys.stderr)
                    figures = measure(
                        deployments[name], wrk, options.stream_tokens, options.itl_requests
                    )
                    runs.setdefault(name, []).append(figures)
    print(
        f"wrk: {options.connections} connections (one for the one-connection rows),"
        f" {options.seconds:g} s per figure, medians of {options.repeats} repeats;"
        f" streamed chats of {options.stream_tokens} tokens; CPU from /proc"
    )
    print()
    print(report({name: median_figures(figures) for name, figures in runs.items()}))


if __name__ == "__main__":
    main()
