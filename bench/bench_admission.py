"""What the admission gate costs per request, measured against the same work without a gate.

Run: ``python bench/bench_admission.py [--requests K] [--rounds R]``.

Each round runs, side by side in one process and one ``trio.run``:

- baseline: K tasks started with ``nursery.start_soon``, each running a trivial engine (one
  checkpoint);
- admitted: the same K tasks, each wrapping the engine in ``async with gate.slot()`` on a gate with
  room for all of them (the direct path: admission, on_change, release);
- rejected: K tasks that each try ``gate.slot()`` on a full gate and catch the ``Rejection``
  (against a baseline of K tasks that do nothing).

A second pair measures the gate alone, in one task and without spawning: K times
``async with gate.slot(): await checkpoint()`` against K bare checkpoints, and K rejections against
K bare loop turns.

It prints the median over the rounds of the cost per request (microseconds), the gate's extra
cost per request, and the ratio. Figures are wall-clock on a shared machine: compare them within
one run, not across runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.admission.loops import full_gate, loop_admitted, loop_rejected
from worker_ingress._admission import AdmissionGate, Rejection
from worker_ingress._watch import ChangeSignal


async def _engine() -> None:
    await trio.lowlevel.checkpoint()


async def _bare_request() -> None:
    await _engine()


async def _nothing() -> None:
    return


def _admitting_request(gate: AdmissionGate) -> Callable[[], Awaitable[None]]:
    async def request() -> None:
        async with gate.slot():
            await _engine()

    return request


def _rejected_request(gate: AdmissionGate) -> Callable[[], Awaitable[None]]:
    async def request() -> None:
        try:
            async with gate.slot():
                raise AssertionError("the gate is full: nothing may be admitted")
        except Rejection:
            pass

    return request


async def _run_batch(request: Callable[[], Awaitable[None]], count: int) -> float:
    """Start ``count`` tasks running ``request`` and wait for them; seconds per request."""
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(request)
    return (time.perf_counter() - started) / count


async def _round(count: int) -> dict[str, float]:
    # The event plane's real on_change is a ChangeSignal bump: measure with it.
    open_gate = AdmissionGate(engine_slots=count, queue_limit=2, on_change=ChangeSignal().bump)
    figures = {
        "baseline": await _run_batch(_bare_request, count),
        "admitted": await _run_batch(_admitting_request(open_gate), count),
        "loop_bare": await loop_admitted(None, count),
        "loop_admitted": await loop_admitted(open_gate, count),
    }
    if open_gate.in_flight or open_gate.rejected_total:
        raise RuntimeError("the open gate leaked a slot or rejected a request")
    async with trio.open_nursery() as nursery:
        full = await nursery.start(full_gate)
        figures["baseline_empty"] = await _run_batch(_nothing, count)
        figures["rejected"] = await _run_batch(_rejected_request(full), count)
        figures["loop_bare_rejected"] = await loop_rejected(None, count)
        figures["loop_rejected"] = await loop_rejected(full, count)
        if full.rejected_total != 2 * count:
            raise RuntimeError(f"{full.rejected_total} of {2 * count} were rejected")
        nursery.cancel_scope.cancel()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000, help="requests per batch")
    parser.add_argument("--rounds", type=int, default=9, help="rounds (medians are printed)")
    args = parser.parse_args()

    rounds: list[dict[str, float]] = []

    async def run_all() -> None:
        await _round(1000)  # warm-up
        for _ in range(args.rounds):
            rounds.append(await _round(args.requests))

    trio.run(run_all)

    def median_us(key: str) -> float:
        return statistics.median(r[key] for r in rounds) * 1e6

    def median_diff_us(key: str, base: str) -> float:
        return statistics.median(r[key] - r[base] for r in rounds) * 1e6

    def median_ratio(key: str, base: str) -> float:
        return statistics.median(r[key] / r[base] for r in rounds)

    print(f"admission gate, {args.requests} requests per batch, median of {args.rounds} rounds")
    print(f"{'':28}{'per request':>14}{'gate adds':>12}{'ratio':>8}")
    print(f"{'baseline (start_soon+engine)':28}{median_us('baseline'):>11.2f} us")
    print(
        f"{'admitted through the gate':28}{median_us('admitted'):>11.2f} us"
        f"{median_diff_us('admitted', 'baseline'):>9.2f} us"
        f"{median_ratio('admitted', 'baseline'):>8.2f}"
    )
    print(f"{'baseline (start_soon, empty)':28}{median_us('baseline_empty'):>11.2f} us")
    print(
        f"{'rejected by the gate':28}{median_us('rejected'):>11.2f} us"
        f"{median_diff_us('rejected', 'baseline_empty'):>9.2f} us"
        f"{median_ratio('rejected', 'baseline_empty'):>8.2f}"
    )
    print("in one task, no spawning (the gate alone):")
    print(f"{'bare checkpoint':28}{median_us('loop_bare'):>11.2f} us")
    print(
        f"{'admitted through the gate':28}{median_us('loop_admitted'):>11.2f} us"
        f"{median_diff_us('loop_admitted', 'loop_bare'):>9.2f} us"
        f"{median_ratio('loop_admitted', 'loop_bare'):>8.2f}"
    )
    print(f"{'bare loop turn':28}{median_us('loop_bare_rejected'):>11.2f} us")
    print(
        f"{'rejected by the gate':28}{median_us('loop_rejected'):>11.2f} us"
        f"{median_diff_us('loop_rejected', 'loop_bare_rejected'):>9.2f} us"
    )


if __name__ == "__main__":
    main()
