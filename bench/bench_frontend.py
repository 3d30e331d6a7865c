"""Frontend benchmark: shedding rate, completion rate and the latency the frontend adds.

Run: ``python bench/bench_frontend.py [--seconds 5] [--connections 64]`` (needs ``wrk``).

Processes (servers pinned to core 0, wrk to core 1 with ``taskset`` when there are 2+ cores):

- a mocker worker holding one long request, behind frontend B whose decode threshold is 0.0:
  the fleet is busy, so every completion B gets is answered 529 before its body is read;
- an instant-engine worker (zero work per token) behind frontend A with no thresholds.

Figures, all measured in this one run, side by side:

1. 529 answers/s from B, answered from the request head (the small body is dropped unparsed and
   the connection kept), against B's own ``GET /live`` rate on keep-alive connections.
2. completions/s through A and the instant worker, against ``GET /live`` on the worker's own
   system port (the same HTTP server, no routing and no request plane): an upper bound.
3. Latency on one connection: median and p99 of a completion through A, against ``GET /live``
   on A; the difference is what routing and the request plane add.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.http import kept_busy
from bench.kit.shim import shim
from bench.kit.wrk import SERVER_CPU, Wrk, need_wrk

COMPLETION = '{"model":"mock-model","prompt":"one two","max_tokens":1}'
#: One long request makes the busy fleet busy (it holds KV blocks for minutes).
LONG = '{"model":"mock-model","prompt":"a b c","max_tokens":2000,"stream":true}'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=64)
    options = parser.parse_args()
    need_wrk()
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        wrk = Wrk(options.seconds, options.connections, Path(scratch))
        frontend_flags = ["--log-level", "warning"]
        busy = stack.enter_context(
            shim(
                ["--speedup-ratio", "0.02"],
                [*frontend_flags, "--active-decode-blocks-threshold", "0.0"],
                cpu=SERVER_CPU,
            )
        ).url
        free = stack.enter_context(shim(["--engine", "instant"], frontend_flags, cpu=SERVER_CPU))
        with kept_busy(busy, "/v1/completions", LONG, "{}"):
            live_busy = wrk.run(busy + "/live")
            shed = wrk.run(busy + "/v1/completions", body=COMPLETION)
        through = wrk.run(free.url + "/v1/completions", body=COMPLETION)
        direct = wrk.run(free.worker.addresses["system"] + "/live")
        one_completion = wrk.run(free.url + "/v1/completions", body=COMPLETION, connections=1)
        one_live = wrk.run(free.url + "/live", connections=1)
    print(f"wrk: {options.connections} connections, {options.seconds:.0f} s per figure")
    print(f"busy fleet: GET /live (keep-alive)       {live_busy['rps']:10.0f} /s")
    print(
        f"busy fleet: 529 answers (keep-alive)     {shed['rps']:10.0f} /s"
        f"   ratio to /live {shed['rps'] / live_busy['rps']:.2f}"
        f"   ({shed['non_2xx']:.0f} of {shed['requests']:.0f} were non-2xx)"
    )
    print(f"completions through frontend + worker    {through['rps']:10.0f} /s")
    print(
        f"worker system port GET /live (direct)    {direct['rps']:10.0f} /s"
        f"   ratio {through['rps'] / direct['rps']:.2f}"
    )
    added_p50 = one_completion["p50_ms"] - one_live["p50_ms"]
    added_p99 = one_completion["p99_ms"] - one_live["p99_ms"]
    print(
        f"one connection: completion p50 {one_completion['p50_ms']:.2f} ms"
        f" p99 {one_completion['p99_ms']:.2f} ms; /live p50 {one_live['p50_ms']:.2f} ms"
        f" p99 {one_live['p99_ms']:.2f} ms; added p50 {added_p50:.2f} ms p99 {added_p99:.2f} ms"
    )


if __name__ == "__main__":
    main()
