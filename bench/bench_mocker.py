"""Can the mocker keep up with its own simulated GPU? Wall-clock cost per engine step.

Run: ``python bench/bench_mocker.py [--concurrency C] [--prompt-words P] [--max-tokens M]
[--rounds R] [--speedups 10,100] [--caching off,on]``.

Each round starts C concurrent requests (P prompt words, M generated tokens, every token read by
its client task) on a default-shaped mocker and runs them to the end in real time, once per
speedup ratio and prefix-caching setting, side by side in one ``trio.run``. Every request has a
prompt of its own (its words numbered apart from the others'), so with caching on the cache is
looked up, filled and evicted but never hit: the rows compare what the cache's bookkeeping
costs. It prints, as medians over the rounds:

- ``cpu/step``: this process's CPU time (user + system, as the kernel counts it) divided by the
  steps run: the step loop's work, the wake-ups and the clients reading their tokens (the engine
  keeps no timer of its own; steps are counted where the loop asks its rank for one);
- ``wall/step``: elapsed wall time divided by the steps run, everything included (the clients
  reading their tokens too);
- ``sim/step``: the simulated step time after the speedup ratio (what the loop sleeps);
- ``keep-up``: simulated time / elapsed time. 1.0 means the mocker runs as fast as the GPU it
  models divided by the speedup ratio; below 1.0 the Python work per step is the bottleneck.

Figures are wall-clock on a shared machine: compare them within one run, not across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import aclosing

import trio

from worker_ingress._config import MockerSettings
from worker_ingress.engines._base import PreparedRequest
from worker_ingress.engines._mocker import MockerEngine


class _Result:
    __slots__ = ("cpu_per_step", "keep_up", "sim_per_step", "steps", "wall_per_step")

    def __init__(self, steps: int, cpu: float, elapsed: float, simulated: float) -> None:
        self.steps = steps
        self.cpu_per_step = cpu / max(steps, 1)
        self.wall_per_step = elapsed / max(steps, 1)
        self.sim_per_step = simulated / max(steps, 1)
        self.keep_up = simulated / elapsed if elapsed > 0 else 0.0


async def _one_run(
    speedup: float, caching: bool, concurrency: int, prompt_words: int, max_tokens: int
) -> _Result:
    engine = MockerEngine(MockerSettings(speedup_ratio=speedup, enable_prefix_caching=caching))
    requests = [
        engine.prepare(
            "completions",
            {
                "prompt": " ".join(f"c{client}w{word}" for word in range(prompt_words)),
                "max_tokens": max_tokens,
            },
        )
        for client in range(concurrency)
    ]
    simulated_total = 0.0
    steps = 0
    original_schedule = engine.ranks[0].schedule

    def schedule_and_account() -> object:
        # Count the steps and sum the simulated time the loop sleeps, to compare with the wall
        # time and the CPU time they took.
        nonlocal simulated_total, steps
        step = original_schedule()
        if step is not None:
            steps += 1
            simulated_total += step.duration / speedup
        return step

    engine.ranks[0].schedule = schedule_and_account  # type: ignore[method-assign,assignment]

    async def client(request: PreparedRequest) -> None:
        async with aclosing(engine.generate(request)) as stream:
            async for _ in stream:
                pass

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        started, cpu = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as clients:
            for request in requests:
                clients.start_soon(client, request)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        nursery.cancel_scope.cancel()
    return _Result(steps, cpu, elapsed, simulated_total)


async def _main(args: argparse.Namespace) -> None:
    speedups = [float(s) for s in args.speedups.split(",")]
    cachings = [part.strip() == "on" for part in args.caching.split(",") if part.strip()]
    results: dict[tuple[float, bool], list[_Result]] = {
        (s, c): [] for s in speedups for c in cachings
    }
    for _ in range(args.rounds):
        for speedup, caching in results:
            result = await _one_run(
                speedup, caching, args.concurrency, args.prompt_words, args.max_tokens
            )
            results[speedup, caching].append(result)
    print(
        f"concurrency={args.concurrency} prompt_words={args.prompt_words} "
        f"max_tokens={args.max_tokens} rounds={args.rounds} (medians)"
    )
    columns = ("speedup", "cache", "steps", "cpu/step", "wall/step", "sim/step", "keep-up")
    widths = (8, 5, 6, 10, 10, 10, 8)
    print(" ".join(f"{name:>{width}}" for name, width in zip(columns, widths, strict=True)))
    for (speedup, caching), runs in results.items():
        print(
            f"{speedup:>8g} {'on' if caching else 'off':>5} "
            f"{statistics.median(r.steps for r in runs):>6g} "
            f"{statistics.median(r.cpu_per_step for r in runs) * 1e6:>8.0f}us "
            f"{statistics.median(r.wall_per_step for r in runs) * 1e6:>8.0f}us "
            f"{statistics.median(r.sim_per_step for r in runs) * 1e6:>8.0f}us "
            f"{statistics.median(r.keep_up for r in runs):>8.2f}"
        )


def main() -> None:
    """Parse the arguments and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speedups", default="10,100")
    parser.add_argument("--caching", default="off,on", help="prefix caching: off, on or both")
    trio.run(_main, parser.parse_args())


if __name__ == "__main__":
    main()
