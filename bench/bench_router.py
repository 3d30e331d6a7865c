"""How fast the frontend's load state and router are on a 1,024-worker x 4-rank fleet.

Prints medians over several rounds of:

- load events applied per second (one rank's LoadEvent each, random workers and values, a
  threshold configured so busy bits really flip), and heartbeats (4 ranks each) per second;
- selections per second for each router mode, with about half of the fleet busy;
- the ratio of kv to round-robin picks, measured side by side in the same run;
- class-aware picks on a fleet whose every worker is marked overloaded for a batch class (no
  worker free), for an interactive request that beats those marks: the bounded look at marked
  workers, against round-robin picks over the free set in the same rounds.

Run: ``python bench/bench_router.py`` (``--workers``, ``--ranks``, ``--rounds`` to change the
shape). Figures depend on the machine; compare ratios, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence

from frontend_shim._load import Fleet
from frontend_shim._router import Routed, Router, RouterMode
from shim_common import wire
from shim_common._busy import BusyThresholds

MODEL = "bench-model"
TOTAL_BLOCKS = 16384
MAX_BATCHED = 8192


def build_fleet(workers: int, ranks: int) -> Fleet:
    fleet = Fleet(
        default_thresholds=BusyThresholds(active_decode_blocks=0.85, active_prefill_tokens=4096),
        track_output_blocks=True,
    )
    for index in range(workers):
        config = wire.RuntimeConfig(
            worker_id=f"worker-{index}",
            model=MODEL,
            kv_total_blocks=TOTAL_BLOCKS,
            block_size=16,
            max_num_batched_tokens=MAX_BATCHED,
            max_num_seqs=256,
            data_parallel_size=ranks,
            engine_request_limit=None,
            request_queue_limit=40000,
            heartbeat_interval=1.0,
        )
        fleet.register(config, 0.0)
    return fleet


def make_events(
    workers: int, ranks: int, count: int, rng: random.Random
) -> list[tuple[str, wire.LoadEvent]]:
    """Random load events; about half of the values cross a threshold."""
    seq = [0] * workers
    events = []
    for _ in range(count):
        index = rng.randrange(workers)
        seq[index] += 1
        busy = rng.random() < 0.5
        load = wire.RankLoad(
            dp_rank=rng.randrange(ranks),
            active_decode_blocks=rng.randrange(int(TOTAL_BLOCKS * (0.9 if busy else 0.5))),
            active_prefill_tokens=rng.randrange(8192 if busy else 2048),
            kv_used_blocks=rng.randrange(TOTAL_BLOCKS // 2),
        )
        event = wire.LoadEvent(
            seq=seq[index], ts=0.0, load=load, engine_requests=0, queued_requests=0
        )
        events.append((f"worker-{index}", event))
    return events


def make_heartbeats(
    workers: int, ranks: int, count: int, rng: random.Random, first_seq: int
) -> list[tuple[str, wire.Heartbeat]]:
    beats = []
    for n in range(count):
        index = rng.randrange(workers)
        loads = [
            wire.RankLoad(
                dp_rank=r,
                active_decode_blocks=rng.randrange(TOTAL_BLOCKS),
                active_prefill_tokens=rng.randrange(8192),
                kv_used_blocks=0,
            )
            for r in range(ranks)
        ]
        beat = wire.Heartbeat(
            seq=first_seq + n, ts=0.0, loads=loads, engine_requests=0, queued_requests=0
        )
        beats.append((f"worker-{index}", beat))
    return beats


def per_second(count: int, run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return count / (time.perf_counter() - start)


def apply_all(fleet: Fleet, items: Sequence[tuple[str, wire.WorkerEvent]], now: float) -> None:
    apply = fleet.apply
    for worker_id, event in items:
        apply(worker_id, event, now)


def pick_many(router: Router, count: int, now: float) -> None:
    pick = router.pick
    for _ in range(count):
        outcome = pick(MODEL, now)
        assert isinstance(outcome, Routed)


def pick_past_marks(router: Router, count: int, now: float) -> None:
    pick = router.pick_class
    for _ in range(count):
        outcome = pick(MODEL, now, 0, "interactive")
        assert isinstance(outcome, Routed)


def marked_fleet(workers: int, ranks: int, now: float) -> Fleet:
    """Every worker marked, for priority 10 of one tenant, at ``now``."""
    fleet = build_fleet(workers, ranks)
    for index in range(workers):
        fleet.mark_overloaded(f"worker-{index}", now, 10, "batch")
    return fleet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--picks", type=int, default=20_000)
    args = parser.parse_args()
    rng = random.Random(42)

    events = make_events(args.workers, args.ranks, args.events, rng)
    fleet = build_fleet(args.workers, args.ranks)
    event_rates: list[float] = []
    beat_rates: list[float] = []
    seq_base = 10**9  # heartbeats after every event: their seq must be newer
    for round_index in range(args.rounds):
        # A fresh fleet each round, so the seq of the same pre-made events is new again.
        fleet = build_fleet(args.workers, args.ranks)
        event_rates.append(
            per_second(len(events), functools.partial(apply_all, fleet, events, 0.5))
        )
        beats = make_heartbeats(
            args.workers, args.ranks, args.events // 4, rng, seq_base + round_index * args.events
        )
        beat_rates.append(per_second(len(beats), functools.partial(apply_all, fleet, beats, 0.6)))

    free = fleet.free_workers(MODEL, 0.6)
    free_count = len(free) if free is not None else 0
    print(f"fleet: {args.workers} workers x {args.ranks} ranks, {free_count} free after the load")
    print(
        f"load events applied: {statistics.median(event_rates):,.0f} /s (median of {args.rounds})"
    )
    print(
        f"heartbeats applied:  {statistics.median(beat_rates):,.0f} /s "
        f"({statistics.median(beat_rates) * args.ranks:,.0f} rank loads/s)"
    )

    pick_rates: dict[RouterMode, list[float]] = {mode: [] for mode in RouterMode}
    routers = {mode: Router(fleet, mode, rng=random.Random(1)) for mode in RouterMode}
    for _ in range(args.rounds):
        for mode, router in routers.items():  # side by side in each round
            picks = args.picks if mode is not RouterMode.KV else args.picks // 10
            run = functools.partial(pick_many, router, picks, 0.7)
            pick_rates[mode].append(per_second(picks, run))
    for mode in RouterMode:
        print(f"selections ({mode.value:>11}): {statistics.median(pick_rates[mode]):,.0f} /s")
    ratios = [
        kv / rr
        for kv, rr in zip(
            pick_rates[RouterMode.KV], pick_rates[RouterMode.ROUND_ROBIN], strict=True
        )
    ]
    print(f"kv / round-robin selection rate: {statistics.median(ratios):.3f} (median per round)")

    marked = Router(marked_fleet(args.workers, args.ranks, 0.7), RouterMode.KV)
    plain = routers[RouterMode.ROUND_ROBIN]
    class_rates: list[float] = []
    class_ratios: list[float] = []
    for _ in range(args.rounds):  # side by side in each round
        class_rate = per_second(
            args.picks, functools.partial(pick_past_marks, marked, args.picks, 0.7)
        )
        plain_rate = per_second(args.picks, functools.partial(pick_many, plain, args.picks, 0.7))
        class_rates.append(class_rate)
        class_ratios.append(class_rate / plain_rate)
    print(
        f"class picks past marks (every worker marked): {statistics.median(class_rates):,.0f} /s, "
        f"{statistics.median(class_ratios):.3f} x round-robin (median per round)"
    )


if __name__ == "__main__":
    main()
