"""What hostile request bodies cost the frontend: memory (RSS) and the latency of a small request.

Run from the repository's root:
``python -m bench.bench_bodies [--bodies 6] [--keys 1000000] [--long-prompt BYTES] [TREE ...]``

Each TREE (a checkout of this repository; default: this one) runs in turn, in this one
invocation, so the figures compare side by side: a frontend with one local mocker worker
(pinned to core 0 when there are 2+ cores; the load runs on core 1), then

1. its RSS after a few small completions (the baseline);
2. ``--bodies`` concurrent bodies of ``--keys`` one-character keys (a 12 MB JSON object for a
   million keys, under the 16 MiB body cap), or with ``--long-prompt BYTES`` plausible ones (one
   long prompt string), while one small completion is sent every 50 ms;
3. its peak RSS (``VmHWM``), its RSS a second after the bodies were answered, the statuses the
   bodies got, and the median and worst latency of the small completions meanwhile.

Memory figures are the frontend's own process (not its worker's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.http import post, wait_connected
from bench.kit.proc import memory
from bench.kit.processes import clean_env, pin, serve
from bench.kit.wrk import LOAD_CPU, SERVER_CPU

MODEL = "mock-model"
SMALL = json.dumps({"model": MODEL, "prompt": "one two", "max_tokens": 1}).encode()
MIB = 1 << 20


def hostile_body(keys: int) -> bytes:
    """A completion body with ``keys`` extra members of one character each (``"k0":1, ...``)."""
    members = b",".join(b'"k%d":1' % index for index in range(keys))
    return b'{"model":"%s","prompt":"x","max_tokens":1,' % MODEL.encode() + members + b"}"


def long_prompt_body(size: int) -> bytes:
    """A plausible large body: one prompt string of ``size`` bytes (about ``size / 6`` words)."""
    words = b"hello " * (size // 6)
    return b'{"model":"%s","max_tokens":1,"prompt":"' % MODEL.encode() + words + b'"}'


def _post(url: str, body: bytes) -> tuple[int, float]:
    """Post a completion; its status and the seconds it took."""
    started = time.perf_counter()
    status = post(url, "/v1/completions", body, timeout=120.0)
    return status, time.perf_counter() - started


def measure(tree: Path, bodies: int, body: bytes) -> dict[str, object]:
    frontend = [sys.executable, "-m", "frontend_shim", "--local-workers", "1", "--http-port", "0"]
    with serve(frontend, clean_env(tree), cpu=SERVER_CPU, cwd=tree, grace=15.0) as server:
        url = server.addresses["http"]
        wait_connected(url)
        # The frontend's own pid: the child of taskset is the exec'd interpreter itself.
        pid = server.pid
        for _ in range(20):
            assert _post(url, SMALL)[0] == 200
        baseline = memory(pid).resident
        statuses: list[int] = []
        small: list[float] = []
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                small.append(_post(url, SMALL)[1])
                time.sleep(0.05)

        def hostile() -> None:
            statuses.append(_post(url, body)[0])

        prober = threading.Thread(target=probe)
        prober.start()
        senders = [threading.Thread(target=hostile) for _ in range(bodies)]
        started = time.perf_counter()
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        elapsed = time.perf_counter() - started
        done.set()
        prober.join()
        time.sleep(1.0)
        after = memory(pid)
        return {
            "tree": str(tree),
            "body_mb": len(body) / 1e6,
            "statuses": sorted(statuses),
            "rss_baseline_mb": baseline / MIB,
            "rss_peak_mb": after.peak / MIB,
            "rss_after_mb": after.resident / MIB,
            "bodies_answered_s": elapsed,
            "small_p50_ms": statistics.median(small) * 1000 if small else float("nan"),
            "small_max_ms": max(small) * 1000 if small else float("nan"),
            "small_requests": len(small),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", type=Path, default=[Path(__file__).parent.parent])
    parser.add_argument("--bodies", type=int, default=6, help="hostile bodies sent at once")
    parser.add_argument("--keys", type=int, default=1_000_000, help="members of each body")
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        metavar="BYTES",
        help="send a plausible body instead: one prompt string of this many bytes",
    )
    args = parser.parse_args()
    body = long_prompt_body(args.long_prompt) if args.long_prompt else hostile_body(args.keys)
    pin(LOAD_CPU)
    results = [measure(tree.resolve(), args.bodies, body) for tree in args.trees]
    for result in results:
        print(json.dumps(result))
    if len(results) == 2:
        before, after = results
        for key in ("rss_peak_mb", "rss_after_mb", "small_max_ms"):
            ratio = float(before[key]) / max(float(after[key]), 1e-9)  # type: ignore[arg-type]
            print(f"{key}: {before[key]:.1f} -> {after[key]:.1f} ({ratio:.1f}x)")


if __name__ == "__main__":
    main()
