"""Admission classes under overload: tenant shares and priorities against plain FIFO, one run.

Run: ``python bench/bench_classes.py [--seconds S] [--rounds R]`` from the repository's root.

One ``worker-ingress`` process serves :mod:`bench.kit.fixed_engine` (4 slots, 0.1 s per request:
a capacity of 40 requests/s that does not depend on the gate) with N = 4 and Q = 8, pinned to
CPU 0; this process, on CPU 1, speaks the request plane to it directly (the gate is what is
measured, not a frontend's routing). Phases, each with the same seeded Poisson arrivals:

- idle: one request at a time, for the time to first token of an idle worker;
- tenants: 2x capacity, tenant ``heavy`` sending 10 times as many requests as ``light``, all of
  priority 0; once sent as plain requests (no class: the gate is FIFO), once with the tenants;
- priorities: 2x capacity, 10% ``interactive`` at priority 0 and 90% ``batch`` at priority 5,
  one tenant; once plain (FIFO), once with the priorities.

It prints, per phase and side by side, each group's share of its requests that completed and
its p50/p99 time to first token (send to first chunk), and the rejections by reason; then the
gate's own cost per decision, measured in this process on the gate alone, for FIFO requests
(``bench/bench_admission.py``'s loops) and for requests with priorities and tenants: admitted
at once, rejected at a full queue, and queued then started. Targets: the light tenant
completes >= 95% (FIFO about half) with p99 TTFT within 2x of idle; the interactive class's p99
TTFT within 2x of idle; the gate's cost per decision within 2x of FIFO's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import msgspec
import trio
import trio.testing
from trio_websocket import open_websocket_url

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.admission.loops import full_gate, loop_admitted, loop_rejected
from bench.kit.children import Child
from bench.kit.fixed_engine import SERVICE_ENV, SLOTS_ENV
from bench.kit.processes import clean_env, pin
from bench.kit.shim import worker_command
from bench.kit.stats import percentile
from shim_common import wire
from worker_ingress._admission import AdmissionGate, AdmissionState, GateRefusal, Rejection
from worker_ingress._watch import ChangeSignal

ROOT: Final = Path(__file__).resolve().parent.parent
SLOTS: Final = 4
SERVICE_SECONDS: Final = 0.1
QUEUE_LIMIT: Final = 8
CAPACITY: Final = SLOTS / SERVICE_SECONDS


@dataclass
class Outcome:
    group: str
    sent: float
    first_chunk: float | None = None
    rejected: str | None = None


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)

    def groups(self) -> list[str]:
        return sorted({outcome.group for outcome in self.outcomes})

    def share_completed(self, group: str) -> float:
        mine = [o for o in self.outcomes if o.group == group]
        return sum(o.first_chunk is not None for o in mine) / max(len(mine), 1)

    def ttft(self, group: str | None = None) -> list[float]:
        return sorted(
            o.first_chunk - o.sent
            for o in self.outcomes
            if o.first_chunk is not None and (group is None or o.group == group)
        )

    def reasons(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for outcome in self.outcomes:
            if outcome.rejected is not None:
                key = wire.RejectReason.parse(outcome.rejected).key
                counts[key] = counts.get(key, 0) + 1
        return counts


#: The worker: the fixed engine behind the gate, N = 4 and Q = 8.
WORKER: Final = worker_command(
    *("--engine", "bench.kit.fixed_engine:create", "--engine-request-limit", str(SLOTS)),
    *("--log-level", "error"),
)


def _binary(message: str | bytes) -> bytes:
    if isinstance(message, str):
        raise RuntimeError("the worker sent a text message: the protocol is binary")
    return message


Chooser = Callable[[random.Random], tuple[str, int, str]]


async def _drive(
    ws_url: str, phase: Phase, rate: float, seconds: float, choose: Chooser, classes: bool
) -> None:
    """Poisson arrivals at ``rate`` for ``seconds`` on one request-plane connection."""
    rng = random.Random(16)
    open_requests: dict[int, Outcome] = {}
    done = trio.Event()
    sending = True
    async with open_websocket_url(ws_url + wire.REQUESTS_PATH) as ws:
        hello = msgspec.msgpack.decode(_binary(await ws.get_message()))
        assert hello["type"] == "hello"

        async def receive() -> None:
            while sending or open_requests:
                message = wire.decode_worker_message(_binary(await ws.get_message()))
                now = trio.current_time()
                request_id = getattr(message, "request_id", None)
                outcome = open_requests.get(request_id) if request_id is not None else None
                if outcome is None:
                    continue
                if isinstance(message, wire.Rejected):
                    outcome.rejected = message.reason
                    del open_requests[request_id]  # type: ignore[arg-type]
                elif isinstance(message, wire.Chunk) and outcome.first_chunk is None:
                    outcome.first_chunk = now
                elif isinstance(message, wire.End | wire.Failed):
                    del open_requests[request_id]  # type: ignore[arg-type]
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            body = {"model": "fixed", "prompt": "one two three", "max_tokens": 1}
            deadline = trio.current_time() + seconds
            next_at = trio.current_time()
            request_id = 0
            while next_at < deadline:
                await trio.sleep_until(next_at)
                group, priority, tenant = choose(rng)
                request_id += 1
                outcome = Outcome(group, trio.current_time())
                phase.outcomes.append(outcome)
                open_requests[request_id] = outcome
                generate = wire.Generate(
                    request_id=request_id,
                    endpoint="completions",
                    body=body,
                    priority=priority if classes else 0,
                    tenant=tenant if classes else "",
                )
                await ws.send_message(wire.encode(generate))
                next_at += rng.expovariate(rate)
            sending = False
            with trio.fail_after(60):
                await done.wait()


def _tenants(rng: random.Random) -> tuple[str, int, str]:
    return ("light", 0, "light") if rng.random() < 1 / 11 else ("heavy", 0, "heavy")


def _priorities(rng: random.Random) -> tuple[str, int, str]:
    return ("interactive", 0, "") if rng.random() < 0.1 else ("batch", 5, "")


def _idle(rng: random.Random) -> tuple[str, int, str]:
    return ("idle", 0, "")


# ----------------------------------------------------------------------------- the gate alone


async def _loop_admitted_classes(gate: AdmissionGate, count: int) -> float:
    checkpoint = trio.lowlevel.checkpoint
    tenants = ("heavy", "light")
    started = time.perf_counter()
    for index in range(count):
        async with gate.slot(index & 1, tenants[index & 1], 10):
            await checkpoint()
    return (time.perf_counter() - started) / count


async def _loop_rejected_classes(gate: AdmissionGate, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        try:
            async with gate.slot(9, "heavy", 10):
                raise AssertionError("the gate is full: nothing may be admitted")
        except Rejection:
            pass
    return (time.perf_counter() - started) / count


async def _full_classes_gate(task_status: trio.TaskStatus[AdmissionGate]) -> None:
    """N=1, Q=8 held full: heavy holds the most places at the worst priority (9)."""
    gate = AdmissionGate(engine_slots=1, queue_limit=8, on_change=ChangeSignal().bump)

    async def hold(priority: int, tenant: str) -> None:
        async with gate.slot(priority, tenant, 10):
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        for priority, tenant in [(0, "a")] * 2 + [(5, "b")] * 2 + [(9, "heavy")] * 5:
            nursery.start_soon(hold, priority, tenant)
            await trio.testing.wait_all_tasks_blocked()
        task_status.started(gate)


def _queued_decisions(count: int, tenants: int, priorities: int) -> float:
    """Seconds per (arrive into the queue + start from it), on the sans-IO state alone."""
    state = AdmissionState(engine_slots=1, queue_limit=count + 2)
    first = state.arrive(now=0.0)
    assert not isinstance(first, GateRefusal)
    names = [f"t{i}" for i in range(tenants)]
    started = time.perf_counter()
    for index in range(count):
        state.arrive(index % priorities, names[index % tenants], 10 + index % 7, now=0.0)
    running = first
    for _ in range(count):
        nxt = state.finish(running, now=0.0)
        assert nxt is not None
        running = nxt
    return (time.perf_counter() - started) / count


async def _gate_round(count: int) -> dict[str, float]:
    open_gate = AdmissionGate(engine_slots=count, queue_limit=2, on_change=ChangeSignal().bump)
    figures = {
        "bare": await loop_admitted(None, count),
        "fifo_admit": await loop_admitted(open_gate, count),
        "classes_admit": await _loop_admitted_classes(open_gate, count),
        "bare_loop": await loop_rejected(None, count),
    }
    async with trio.open_nursery() as nursery:
        fifo = await nursery.start(full_gate)
        classes = await nursery.start(_full_classes_gate)
        figures["fifo_reject"] = await loop_rejected(fifo, count)
        figures["classes_reject"] = await _loop_rejected_classes(classes, count)
        nursery.cancel_scope.cancel()
    figures["fifo_queued"] = _queued_decisions(count, 1, 1)
    figures["classes_queued"] = _queued_decisions(count, 64, 4)
    return figures


# ----------------------------------------------------------------------------- report


def _report(phases: dict[str, Phase], idle_p99: float) -> None:
    print(
        f"idle worker: p50 TTFT {percentile(phases['idle'].ttft(), 0.5) * 1e3:.0f} ms, "
        f"p99 {idle_p99 * 1e3:.0f} ms"
    )
    for scenario in ("tenants", "priorities"):
        print(
            f"\n{scenario}: 2x capacity ({2 * CAPACITY:.0f}/s offered, capacity {CAPACITY:.0f}/s)"
        )
        print(
            f"{'':12}{'group':>13}{'completed':>11}{'p50 TTFT':>10}{'p99 TTFT':>10}"
            f"{'p99/idle':>9}  rejections by reason"
        )
        for mode in ("fifo", "classes"):
            phase = phases[f"{scenario}-{mode}"]
            for index, group in enumerate(phase.groups()):
                ttft = phase.ttft(group)
                p99 = percentile(ttft, 0.99)
                reasons = phase.reasons() if index == 0 else ""
                print(
                    f"{mode if index == 0 else '':12}{group:>13}"
                    f"{phase.share_completed(group) * 100:>10.1f}%"
                    f"{percentile(ttft, 0.5) * 1e3:>8.0f}ms{p99 * 1e3:>8.0f}ms"
                    f"{p99 / idle_p99:>9.2f}  {reasons}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds per loaded phase")
    parser.add_argument("--idle", type=float, default=6.0, help="seconds of the idle phase")
    parser.add_argument("--requests", type=int, default=20_000, help="decisions per gate round")
    parser.add_argument("--rounds", type=int, default=7, help="gate rounds (medians printed)")
    args = parser.parse_args()
    phases: dict[str, Phase] = {}
    # This process on CPU 1, the worker on CPU 0.
    pin(1)
    env = clean_env(
        ROOT,
        **{SLOTS_ENV: str(SLOTS), SERVICE_ENV: str(SERVICE_SECONDS)},
        DYN_DYNAMO_REQUEST_QUEUE_LIMIT=str(QUEUE_LIMIT),
    )

    async def run() -> None:
        async with Child(WORKER, env, name="the worker", cpu=0, cwd=ROOT) as worker:
            ws = worker.addresses["ws"]
            # A quarter of capacity over four slots: no request waits for another.
            phases["idle"] = Phase("idle")
            await _drive(ws, phases["idle"], CAPACITY / 4, args.idle, _idle, False)
            for scenario, choose in (("tenants", _tenants), ("priorities", _priorities)):
                for mode in ("fifo", "classes"):
                    phase = phases[f"{scenario}-{mode}"] = Phase(f"{scenario}-{mode}")
                    await _drive(ws, phase, 2 * CAPACITY, args.seconds, choose, mode == "classes")
                    await trio.sleep(0.5)  # let the queue empty between phases

    trio.run(run)
    idle_p99 = percentile(phases["idle"].ttft(), 0.99)
    _report(phases, idle_p99)

    rounds: list[dict[str, float]] = []

    async def gate_rounds() -> None:
        await _gate_round(1000)  # warm-up
        for _ in range(args.rounds):
            rounds.append(await _gate_round(args.requests))

    trio.run(gate_rounds)

    def extra_us(key: str, base: str) -> float:
        return statistics.median(r[key] - r[base] for r in rounds) * 1e6

    def median_us(key: str) -> float:
        return statistics.median(r[key] for r in rounds) * 1e6

    print(f"\nthe gate alone, {args.requests} decisions per round, median of {args.rounds}:")
    print(f"{'':34}{'FIFO':>10}{'classes':>10}{'ratio':>8}")
    rows = [
        (
            "admitted at once (gate adds)",
            extra_us("fifo_admit", "bare"),
            extra_us("classes_admit", "bare"),
        ),
        (
            "rejected at a full queue",
            extra_us("fifo_reject", "bare_loop"),
            extra_us("classes_reject", "bare_loop"),
        ),
        ("queued, then started (state)", median_us("fifo_queued"), median_us("classes_queued")),
    ]
    for label, fifo_us, classes_us in rows:
        print(f"{label:34}{fifo_us:>8.2f}us{classes_us:>8.2f}us{classes_us / fifo_us:>8.2f}")
    print(
        "(FIFO: default class, one tenant; classes: 2 tenants and 2 priorities admitted, a full "
        "queue of 3 priorities rejecting the worst, 64 tenants over 4 priorities queued)"
    )


if __name__ == "__main__":
    main()
