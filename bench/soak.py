"""Soak: a frontend and a few mocker workers at about three times their capacity, with faults.

Run: ``scripts/soak [--seconds 300] [--workers 3] [--json report.json]`` (or
``python bench/soak.py ...``). Exit status 0 when every check held, 1 otherwise.

What runs, all real processes on 127.0.0.1 with free ports:

1. ``--workers`` mocker workers, each with N = ``--engine-request-limit`` and Q =
   ``--queue-limit``, and one frontend routing to them with ``--migration-limit 1``.
2. Calibration: one burst of as many requests as the fleet has slots measures its capacity
   (requests per second).
3. Load for ``--seconds``: open-loop arrivals (exponential gaps) at ``--overload`` times that
   capacity, half of them streamed, ``max_tokens`` drawn around the calibration size; a share
   (``--disconnect-share``) of clients hang up at a random moment. Meanwhile, at fixed points of
   the run: a decode threshold is set with ``POST /busy_threshold`` (30 %) and changed (70 %),
   and one worker is killed with SIGKILL (40 %) and started again on its ports two seconds later.
4. Every ``--sample-interval`` seconds, every worker's and the frontend's ``/metrics`` are read,
   and every process's resident memory.
5. Load stops; the run waits for every gauge to return to 0.

Checks (each failure is listed in the report):

- no sample shows a worker over its cap: ``dynamo_engine_request <= N``,
  ``dynamo_request_queue <= Q``;
- every worker's books close at every sample: received = started + rejected + draining
  rejected + queue cancelled + queued now (the worker's own counters);
- once load stops, every worker's engine and queue gauges and the frontend's in-flight gauge
  return to 0 within ``--settle`` seconds;
- every request that the client did not abandon got an answer (200 whole, or the overload or
  unavailable status) or a clean error (an error status with a JSON body, or a stream ending in
  an SSE error event) within ``--answer-timeout`` seconds;
- the frontend counted exactly the requests sent (``dynamo_frontend_requests_total``);
- the resident memory of the frontend and of each worker that was not restarted grew by at most
  ``--memory-margin-mb`` plus ``--memory-margin-share`` of its size after the warm-up (the first
  ``--warmup`` share of the load phase).

Linux only (it reads ``/proc``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import IO, Any, Final

import trio

if not __package__:
    # Run as ``python bench/soak.py``: the package ``bench`` is in the folder above, as it is for
    # ``python -m bench.soak``.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.children import Child
from bench.kit.http import HTTP_ERRORS, Reply, fetch
from bench.kit.metrics import by_label, sums
from bench.kit.proc import memory
from bench.kit.processes import clean_env

MODEL: Final = "mock-model"
#: Mocker shape: a small cache and slow steps, so requests hold their slots for a while.
MOCKER_FLAGS: Final = ("--num-gpu-blocks", "512", "--block-size", "4")
#: The decode thresholds set at run time: the first bites when a worker's slots are all busy
#: (the frontend then sheds before the worker does), the second never does (the workers'
#: own rejections take over again).
BUSY_THRESHOLD: Final = 0.04
FREE_THRESHOLD: Final = 0.5
#: Seconds a process gets to print its ready line.
READY_TIMEOUT: Final = 30.0

# ----------------------------------------------------------------------------- the report


@dataclasses.dataclass
class WorkerBook:
    """What the sampler saw of one worker slot (the same ports across a restart)."""

    index: int
    peak_running: int = 0
    peak_queued: int = 0
    peak_in_flight: int = 0
    samples: int = 0
    last: dict[str, float] = dataclasses.field(default_factory=dict)
    restarted: bool = False
    rss_start: int = 0
    rss_end: int = 0


@dataclasses.dataclass
class Report:
    seconds: float
    workers: int
    engine_request_limit: int
    queue_limit: int
    seed: int
    capacity_rps: float = 0.0
    #: Seconds one request took in the calibration burst.
    service_seconds: float = 1.0
    offered_rps: float = 0.0
    requests: int = 0
    #: Abandoned by the client before any answer arrived: the frontend may not have seen them.
    abandoned_before_answer: int = 0
    outcomes: Counter[str] = dataclasses.field(default_factory=Counter)
    statuses: Counter[int] = dataclasses.field(default_factory=Counter)
    abandoned: int = 0
    generator_skipped: int = 0
    frontend_counted: float = 0.0
    #: The frontend's request count when the load started (the calibration's requests).
    frontend_counted_before: float = 0.0
    frontend_statuses: dict[str, float] = dataclasses.field(default_factory=dict)
    books: list[WorkerBook] = dataclasses.field(default_factory=list)
    frontend_rss_start: int = 0
    frontend_rss_end: int = 0
    frontend_rss_peak: int = 0
    events: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)

    def fail(self, message: str) -> None:
        if message not in self.failures:
            self.failures.append(message)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["outcomes"] = dict(self.outcomes)
        data["statuses"] = {str(k): v for k, v in sorted(self.statuses.items())}
        data["passed"] = not self.failures
        return data

    def text(self) -> str:
        cap = self.engine_request_limit + self.queue_limit
        mib = 1024 * 1024
        lines = [
            f"soak: {self.seconds:.0f} s, {self.workers} workers (N={self.engine_request_limit},"
            f" Q={self.queue_limit}), seed {self.seed}",
            f"capacity {self.capacity_rps:.1f} req/s, offered {self.offered_rps:.1f} req/s",
            f"requests sent: {self.requests} (the frontend counted {self.frontend_counted:.0f});"
            f" abandoned by the client on purpose: {self.abandoned};"
            f" arrivals skipped at the generator's concurrency cap: {self.generator_skipped}",
            "answers by status: "
            + ", ".join(f"{code}: {count}" for code, count in sorted(self.statuses.items())),
            "outcomes: "
            + ", ".join(f"{kind}: {count}" for kind, count in sorted(self.outcomes.items())),
        ]
        for book in self.books:
            lines.append(
                f"worker {book.index}: peak in flight {book.peak_in_flight} of N+Q={cap}"
                f" (running {book.peak_running}/{self.engine_request_limit},"
                f" queued {book.peak_queued}/{self.queue_limit}), {book.samples} samples,"
                f" rss {book.rss_start / mib:.1f} -> {book.rss_end / mib:.1f} MiB"
                + (" (restarted: memory not judged)" if book.restarted else "")
            )
        lines.append(
            f"frontend rss after warm-up {self.frontend_rss_start / mib:.1f} MiB,"
            f" at the end {self.frontend_rss_end / mib:.1f} MiB,"
            f" peak {self.frontend_rss_peak / mib:.1f} MiB"
        )
        lines.extend(f"event: {event}" for event in self.events)
        if self.failures:
            lines.extend(f"FAILED: {failure}" for failure in self.failures)
        else:
            lines.append("PASSED")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- load


@dataclasses.dataclass(frozen=True)
class Options:
    seconds: float
    workers: int
    engine_request_limit: int
    queue_limit: int
    overload: float
    disconnect_share: float
    speedup_ratio: float
    max_tokens: int
    sample_interval: float
    settle: float
    answer_timeout: float
    warmup: float
    memory_margin_mb: float
    memory_margin_share: float
    seed: int
    logs: Path


async def ask(url: str, method: str, path: str, payload: Any = None) -> Reply:
    """One request (``payload`` as JSON); what came back, as far as it came (status 0 when no
    answer did: the checks judge it, the run goes on)."""
    reply = Reply()
    with contextlib.suppress(*HTTP_ERRORS):
        await fetch(url, method, path, json=payload, reply=reply)
    return reply


async def start_child(child: Child, args: Sequence[str] | None = None) -> dict[str, str]:
    """Start ``child`` (again, with ``args`` if given); the fields of its ready line."""
    await child.start(args)
    with trio.fail_after(READY_TIMEOUT):
        return await child.ready()


async def one_request(url: str, rng: random.Random, options: Options, report: Report) -> None:
    stream = rng.random() < 0.5
    tokens = max(1, int(rng.uniform(0.5, 1.5) * options.max_tokens))
    words = "one two three four five six"
    body: dict[str, Any]
    if rng.random() < 0.5:
        path, body = "/v1/completions", {"model": MODEL, "prompt": words}
    else:
        messages = [{"role": "user", "content": words}]
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": messages}
    body.update(max_tokens=tokens, stream=stream)
    abandon = rng.random() < options.disconnect_share
    # Somewhere between at once and about twice the time of a request.
    abandon_after = rng.uniform(0.0, 2.0 * report.service_seconds) if abandon else math.inf
    report.requests += 1
    reply = Reply()
    outcome = "broken (no response)"
    with trio.move_on_after(abandon_after) as hang_up:
        with trio.move_on_after(options.answer_timeout) as late:
            try:
                await fetch(url, "POST", path, json=body, reply=reply)
            except OSError as exc:
                outcome = f"broken (connect: {exc.strerror or exc})"
            except HTTP_ERRORS:
                outcome = classify(reply, stream)
            else:
                outcome = classify(reply, stream)
        if late.cancelled_caught:
            outcome = "no answer in time"
    if reply.status:
        report.statuses[reply.status] += 1
    if hang_up.cancelled_caught:
        report.abandoned += 1
        report.abandoned_before_answer += not reply.status
        outcome = "abandoned"
    report.outcomes[outcome] += 1


def classify(reply: Reply, stream: bool) -> str:
    """answered, shed, clean-error, or broken (with why)."""
    if reply.status == 0:
        return "broken (no response)"
    if reply.status == 200 and stream:
        if b"data: [DONE]" in reply.body and reply.complete:
            return "answered"
        if b"event: error" in reply.body:
            return "clean-error"
        return "broken (stream cut without an error event)"
    decoded = reply.json()
    if not reply.complete or not isinstance(decoded, dict):
        return f"broken (HTTP {reply.status} without a whole JSON body)"
    if reply.status == 200:
        return "answered" if "choices" in decoded else "broken (200 without choices)"
    if reply.status in (429, 503, 529):
        return "shed"
    return "clean-error"


async def generate_load(
    url: str,
    rate: float,
    seconds: float,
    options: Options,
    report: Report,
) -> None:
    rng = random.Random(options.seed)
    cap = 16 * options.workers * (options.engine_request_limit + options.queue_limit)
    limiter = trio.CapacityLimiter(cap)
    end = trio.current_time() + seconds
    async with trio.open_nursery() as nursery:

        async def limited(seed: int) -> None:
            async with limiter:
                await one_request(url, random.Random(seed), options, report)

        next_at = trio.current_time()
        while next_at < end:
            await trio.sleep_until(next_at)
            if limiter.available_tokens == 0:
                report.generator_skipped += 1
            else:
                nursery.start_soon(limited, rng.getrandbits(32))
            next_at += rng.expovariate(rate)


async def calibrate(url: str, options: Options, report: Report) -> float:
    """Requests per second the fleet completes with every slot busy (and notes how long one
    request takes)."""
    slots = options.workers * options.engine_request_limit
    body = {"model": MODEL, "prompt": "one two three", "max_tokens": options.max_tokens}
    done = 0
    started = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def one() -> None:
            nonlocal done
            reply = await ask(url, "POST", "/v1/completions", body)
            done += reply.status == 200

        for _ in range(slots):
            nursery.start_soon(one)
    elapsed = trio.current_time() - started
    if done == 0:
        raise RuntimeError("calibration: no request was served")
    report.service_seconds = elapsed
    return done / elapsed


# ----------------------------------------------------------------------------- sampling


class Sampler:
    def __init__(
        self, workers: list[Child], frontend: Child, options: Options, report: Report
    ) -> None:
        self.workers = workers
        self.frontend = frontend
        self.options = options
        self.report = report
        self.down: set[int] = set()
        self.frontend_metrics: dict[str, float] = {}

    async def sample_once(self) -> None:
        report, options = self.report, self.options
        for index, worker in enumerate(self.workers):
            book = report.books[index]
            reply = Reply()
            with trio.move_on_after(5.0), contextlib.suppress(*HTTP_ERRORS):
                await fetch(worker.addresses["system"], "GET", "/metrics", reply=reply)
            if not reply.complete:
                if index not in self.down:
                    report.fail(f"worker {index}: /metrics unreachable while it should be up")
                continue
            values = sums(reply.body.decode())
            running = int(values.get("dynamo_engine_request", 0))
            queued = int(values.get("dynamo_request_queue", 0))
            book.samples += 1
            book.last = values
            book.peak_running = max(book.peak_running, running)
            book.peak_queued = max(book.peak_queued, queued)
            book.peak_in_flight = max(book.peak_in_flight, running + queued)
            if running > options.engine_request_limit or queued > options.queue_limit:
                report.fail(
                    f"worker {index}: {running} running and {queued} queued, over "
                    f"N={options.engine_request_limit} Q={options.queue_limit}"
                )
            accounted = (
                values.get("dynamo_worker_started_request_total", 0)
                + values.get("dynamo_rejection_request_total", 0)
                + values.get("dynamo_worker_draining_rejection_total", 0)
                + values.get("dynamo_worker_queue_cancelled_total", 0)
                + queued
            )
            received = values.get("dynamo_worker_received_request_total", 0)
            if received != accounted:
                report.fail(
                    f"worker {index}: received {received:.0f} but started + rejected + "
                    f"cancelled while queued + queued = {accounted:.0f}"
                )
        reply = Reply()
        with trio.move_on_after(5.0), contextlib.suppress(*HTTP_ERRORS):
            await fetch(self.frontend.addresses["http"], "GET", "/metrics", reply=reply)
        if reply.complete:
            text = reply.body.decode()
            self.frontend_metrics = sums(text)
            report.frontend_statuses = by_label(text, "dynamo_frontend_requests_total", "status")
        rss = memory(self.frontend.pid).resident
        report.frontend_rss_peak = max(report.frontend_rss_peak, rss)

    async def run(self) -> None:
        while True:
            await self.sample_once()
            await trio.sleep(self.options.sample_interval)


# ----------------------------------------------------------------------------- the run


async def _faults(
    workers: list[Child],
    frontend_url: str,
    sampler: Sampler,
    options: Options,
    report: Report,
) -> None:
    """The faults of a run, at fixed shares of the load phase."""
    start = trio.current_time()

    async def at(share: float) -> None:
        await trio.sleep_until(start + share * options.seconds)

    def note(text: str) -> None:
        report.events.append(f"at {trio.current_time() - start:.1f} s of load: {text}")

    await at(0.3)
    update = {"model": MODEL, "active_decode_blocks_threshold": BUSY_THRESHOLD}
    reply = await ask(frontend_url, "POST", "/busy_threshold", update)
    note(f"decode threshold set to {BUSY_THRESHOLD}: HTTP {reply.status}")
    if reply.status != 200:
        report.fail(f"POST /busy_threshold answered {reply.status}")
    await at(0.4)
    victim = workers[1 % len(workers)]
    index = workers.index(victim)
    ws_port = victim.addresses["ws"].rsplit(":", 1)[1]
    system_port = victim.addresses["system"].rsplit(":", 1)[1]
    sampler.down.add(index)
    victim.kill()
    await victim.wait()
    report.books[index].restarted = True
    note(f"worker {index} killed with SIGKILL")
    await trio.sleep(2.0)
    args = [*victim.args]
    args[args.index("--port") + 1] = ws_port
    args[args.index("--system-port") + 1] = system_port
    await start_child(victim, args)
    sampler.down.discard(index)
    note(f"worker {index} started again on its ports")
    await at(0.7)
    update = {"model": MODEL, "active_decode_blocks_threshold": FREE_THRESHOLD}
    reply = await ask(frontend_url, "POST", "/busy_threshold", update)
    note(f"decode threshold changed to {FREE_THRESHOLD}: HTTP {reply.status}")
    if reply.status != 200:
        report.fail(f"POST /busy_threshold answered {reply.status}")


async def _settle(sampler: Sampler, options: Options) -> bool:
    """Wait until every gauge is back to 0; False if they are not within the settle time."""
    with trio.move_on_after(options.settle):
        while True:
            await sampler.sample_once()
            busy = [
                book.index
                for book in sampler.report.books
                if book.last.get("dynamo_engine_request", 0)
                or book.last.get("dynamo_request_queue", 0)
            ]
            if not busy and not sampler.frontend_metrics.get("dynamo_frontend_inflight_requests"):
                return True
            await trio.sleep(0.1)
    return False


@contextlib.asynccontextmanager
async def _processes(children: list[Child]) -> AsyncIterator[None]:
    try:
        yield
    finally:
        with trio.CancelScope(shield=True):
            for child in children:
                await child.stop()


async def run(options: Options) -> Report:
    report = Report(
        seconds=options.seconds,
        workers=options.workers,
        engine_request_limit=options.engine_request_limit,
        queue_limit=options.queue_limit,
        seed=options.seed,
    )
    report.books = [WorkerBook(index) for index in range(options.workers)]
    env = clean_env(DYN_DYNAMO_REQUEST_QUEUE_LIMIT=str(options.queue_limit))
    logs, frontend_log = _open_logs(options)
    workers = [
        Child(_worker_args(options, i), env, name=f"worker {i}", log=logs[i])
        for i in range(options.workers)
    ]
    frontend = Child([], env, name="frontend", log=frontend_log)
    phase = trio.current_time()

    def note(text: str) -> None:
        nonlocal phase
        now = trio.current_time()
        report.events.append(f"{text} (took {now - phase:.1f} s)")
        phase = now

    try:
        async with _processes([frontend, *workers]):
            async with trio.open_nursery() as starting:
                for worker in workers:
                    starting.start_soon(start_child, worker)
            frontend_args = [
                sys.executable, "-m", "frontend_shim", "--http-port", "0",
                "--migration-limit", "1",
                *(arg for worker in workers for arg in ("--worker", worker.addresses["ws"])),
            ]  # fmt: skip
            url = (await start_child(frontend, frontend_args))["http"]
            for _ in range(600):
                health = (await ask(url, "GET", "/health")).json()
                if health["workers_connected"] == options.workers:
                    break
                await trio.sleep(0.05)
            else:
                raise RuntimeError("the frontend never connected to every worker")
            note("started")
            report.capacity_rps = await calibrate(url, options, report)
            report.offered_rps = options.overload * report.capacity_rps
            report.frontend_counted_before = sums(
                (await ask(url, "GET", "/metrics")).body.decode()
            ).get("dynamo_frontend_requests_total", 0.0)
            note("calibrated")
            sampler = Sampler(workers, frontend, options, report)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sampler.run)

                async def remember_warm_memory() -> None:
                    await trio.sleep(options.warmup * options.seconds)
                    report.frontend_rss_start = memory(frontend.pid).resident
                    for book, worker in zip(report.books, workers, strict=True):
                        book.rss_start = memory(worker.pid).resident

                nursery.start_soon(remember_warm_memory)
                nursery.start_soon(_faults, workers, url, sampler, options, report)
                # Returns once every client is done (each is bounded by its answer timeout).
                await generate_load(url, report.offered_rps, options.seconds, options, report)
                note("load sent, every client done")
                nursery.cancel_scope.cancel()
            settled = await _settle(sampler, options)
            note("settled" if settled else "did not settle")
            if not settled:
                for book in report.books:
                    running = book.last.get("dynamo_engine_request", 0)
                    queued = book.last.get("dynamo_request_queue", 0)
                    if running or queued:
                        report.fail(
                            f"worker {book.index}: {running:.0f} slots and {queued:.0f} queue "
                            f"places still held {options.settle} s after the load stopped"
                        )
                inflight = sampler.frontend_metrics.get("dynamo_frontend_inflight_requests", 0)
                if inflight:
                    report.fail(f"frontend: {inflight:.0f} requests still in flight")
            report.frontend_counted = (
                sampler.frontend_metrics.get("dynamo_frontend_requests_total", 0.0)
                - report.frontend_counted_before
            )
            report.frontend_rss_end = memory(frontend.pid).resident
            for book, worker in zip(report.books, workers, strict=True):
                book.rss_end = memory(worker.pid).resident
    finally:
        for file in (*logs, frontend_log):
            file.close()
    _judge(report, options)
    return report


def _worker_args(options: Options, index: int) -> list[str]:
    return [
        sys.executable, "-m", "worker_ingress", "--port", "0", "--system-port", "0",
        "--worker-id", f"soak-{index}",
        "--engine-request-limit", str(options.engine_request_limit),
        "--speedup-ratio", str(options.speedup_ratio),
        *MOCKER_FLAGS,
    ]  # fmt: skip


def _open_logs(options: Options) -> tuple[list[IO[bytes]], IO[bytes]]:
    """The log files of the children; the caller closes them."""
    options.logs.mkdir(parents=True, exist_ok=True)
    names = [f"worker-{i}.log" for i in range(options.workers)]
    files: list[IO[bytes]] = [(options.logs / name).open("ab") for name in names]
    frontend: IO[bytes] = (options.logs / "frontend.log").open("ab")
    return files, frontend


def _judge(report: Report, options: Options) -> None:
    unanswered = {
        kind: count
        for kind, count in report.outcomes.items()
        if kind not in ("answered", "shed", "clean-error", "abandoned")
    }
    if unanswered:
        report.fail(f"requests with neither an answer nor a clean error: {unanswered}")
    # A request abandoned before any answer may not have reached the frontend at all.
    least = report.requests - report.abandoned_before_answer
    if not least <= report.frontend_counted <= report.requests:
        report.fail(
            f"the frontend counted {report.frontend_counted:.0f} requests, the clients sent "
            f"{report.requests} ({report.abandoned_before_answer} abandoned before an answer)"
        )
    if report.outcomes["answered"] == 0 or report.outcomes["shed"] == 0:
        report.fail("the run did not both serve and shed: no overload was reached")
    mib = 1024 * 1024

    def judge_memory(name: str, start: int, end: int) -> None:
        allowed = options.memory_margin_mb * mib + options.memory_margin_share * start
        if start and end - start > allowed:
            report.fail(
                f"{name}: resident memory grew from {start / mib:.1f} to {end / mib:.1f} MiB "
                f"after warm-up (allowed {allowed / mib:.1f} MiB)"
            )

    judge_memory("frontend", report.frontend_rss_start, report.frontend_rss_end)
    for book in report.books:
        if not book.restarted:
            judge_memory(f"worker {book.index}", book.rss_start, book.rss_end)


def parse_options(argv: Sequence[str]) -> tuple[Options, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="load phase (default 300)")
    parser.add_argument("--workers", type=int, default=3, choices=range(2, 5))
    parser.add_argument("--engine-request-limit", type=int, default=4, help="N of each worker")
    parser.add_argument("--queue-limit", type=int, default=4, help="Q of each worker")
    parser.add_argument("--overload", type=float, default=3.0, help="offered load / capacity")
    parser.add_argument("--disconnect-share", type=float, default=0.1)
    parser.add_argument("--speedup-ratio", type=float, default=0.25, help="mocker speed")
    parser.add_argument("--max-tokens", type=int, default=24, help="mean tokens per request")
    parser.add_argument("--sample-interval", type=float, default=0.25)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--answer-timeout", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=0.2, help="share of the run")
    parser.add_argument("--memory-margin-mb", type=float, default=16.0)
    parser.add_argument("--memory-margin-share", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--logs", type=Path, default=None, help="directory for process logs")
    parser.add_argument("--json", type=Path, default=None, help="write the report here too")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="soak-logs-"))
    options = Options(
        seconds=args.seconds,
        workers=args.workers,
        engine_request_limit=args.engine_request_limit,
        queue_limit=args.queue_limit,
        overload=args.overload,
        disconnect_share=args.disconnect_share,
        speedup_ratio=args.speedup_ratio,
        max_tokens=args.max_tokens,
        sample_interval=args.sample_interval,
        settle=args.settle,
        answer_timeout=args.answer_timeout,
        warmup=args.warmup,
        memory_margin_mb=args.memory_margin_mb,
        memory_margin_share=args.memory_margin_share,
        seed=seed,
        logs=logs,
    )
    return options, args.json


def main(argv: Sequence[str] | None = None) -> None:
    options, json_path = parse_options(sys.argv[1:] if argv is None else argv)
    print(f"soak: logs in {options.logs}", file=sys.stderr, flush=True)
    started = time.monotonic()
    report = trio.run(run, options)
    print(report.text())
    print(f"(wall time {time.monotonic() - started:.0f} s)")
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json(), indent=2, default=str))
    raise SystemExit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
