"""What the kv index's map of first block names costs (rule 7 of frontend_shim/_kv_index.py).

Run: ``python bench/bench_kv_first_names.py [--trees a=.,b=PATH]``.

For each tree (a checkout; its index is imported in a process of its own) and each number of
holders (1, 2, 4, 8): 16 workers x 4 ranks whose caches hold 65,536 first block names, each
name held by that many ranks; the router asks about every name once, filling the map to its
bound. Printed: the bytes the map took (``tracemalloc``, per name and in all), and how long
forgetting a worker that holds none of them takes (what every reconnect of such a worker costs).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import sys
import time
import tracemalloc

WORKERS = 16
RANKS = 4
HOLDERS = (1, 2, 4, 8)


def measure(holders: int) -> tuple[float, float]:
    """(bytes the map took, ms to forget a worker named for nothing) with ``holders`` a name."""
    from frontend_shim._kv_index import MAX_FIRST_NAMES, KvIndex
    from shim_common import wire

    def config(worker_id: str, blocks: int) -> wire.RuntimeConfig:
        return wire.RuntimeConfig(
            worker_id=worker_id,
            model="m",
            kv_total_blocks=blocks,
            block_size=16,
            max_num_batched_tokens=8192,
            max_num_seqs=256,
            data_parallel_size=RANKS,
            engine_request_limit=None,
            request_queue_limit=40000,
            heartbeat_interval=1.0,
        )

    rng = random.Random(1)
    names = [rng.getrandbits(63) for _ in range(MAX_FIRST_NAMES)]
    per_rank: list[list[int]] = [[] for _ in range(WORKERS * RANKS)]
    for number, name in enumerate(names):
        for offset in range(holders):
            per_rank[(number + offset) % len(per_rank)].append(name)
    index = KvIndex()
    for worker in range(WORKERS):
        index.add_worker(config(f"w{worker}", MAX_FIRST_NAMES), 0.0, events=True)
        ranks = per_rank[worker * RANKS : (worker + 1) * RANKS]
        index.apply(f"w{worker}", [wire.KvSnapshot(seq=0, ranks=ranks)], 0.0)
    index.add_worker(config("idle", 100), 0.0, events=True)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for name in names:
        index.holders(name, 1.0)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    started = time.perf_counter()
    index.remove_worker("idle")
    return grown, (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="this=.", help="label=path,... (a checkout each)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        grown, forget = measure(args.one)
        print(f"{grown} {forget}")
        return
    print("| tree | holders a name | bytes a name | map MB | forget an idle worker, ms |")
    print("|---|---|---|---|---|")
    for label, path in (item.split("=", 1) for item in args.trees.split(",")):
        tree = os.path.abspath(path)
        for holders in HOLDERS:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one", str(holders)],
                env={**os.environ, "PYTHONPATH": tree},
                cwd=tree,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            grown, forget = float(out[0]), float(out[1])
            print(
                f"| {label} | {holders} | {grown / 65536:.0f} | {grown / 1e6:.1f} | {forget:.2f} |"
            )


if __name__ == "__main__":
    main()
