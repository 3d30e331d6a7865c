"""Where cache-aware routing pays: a trace window replayed on a virtual clock
(``bench/prefix/twin.py``) at several rates and prompt lengths, in round-robin, ``kv`` and
``kv`` without prefix caching.

Run from the repository's root::

    python -m bench.bench_kv_twin --trace PATH/conversation_trace.jsonl \\
        --trace-duration 600 --length-scales 0.125,0.5 --time-scales 0.25,0.2 \\
        [--scales 1,4,16] [--workers 4] [--cache-share 0.333]

The window is cut, scaled and sized as ``bench/bench_prefix.py`` does it
(``bench/prefix/window.py``: the same load generator functions, the caches of all workers
together holding ``--cache-share`` of the window's distinct blocks), so a row here and the
same row through real processes can be read side by side. Each ``--scales`` value adds ``kv``
rows with that ``--router-prefill-load-scale``. The whole grid runs in seconds to minutes of
one core, and gives the same figures on any machine.

Per row: TTFT p50 / p90 (arrival at the frontend to first token there), the hit rate
(``cached_tokens`` over prompt tokens), the busiest worker's share of requests, and ``kv``'s
TTFT p50 over round-robin's and over ``kv`` without caching at the same scale.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.prefix.twin import Request, TwinResult, replay
from bench.prefix.window import TRACE_WANTED, Window, load_generator, plan_of, window_items
from frontend_shim._kv_cost import CostWeights
from shim_common.prefix import MAX_TOKEN_ID


def requests_of(items: Sequence[Any]) -> list[Request]:
    """The twin's requests for the load generator's replay items.

    A full block's id is the trace's block id; a block the trace does not name gets an id of
    its request's own (from the top of the token ids down), shared with no other request.
    """
    out = []
    for item in items:
        full = item.prompt_tokens // item.block_tokens
        own = MAX_TOKEN_ID - item.index
        ids = tuple(item.hash_ids[b] if b < len(item.hash_ids) else own for b in range(full))
        out.append(Request(item.arrival, item.prompt_tokens, item.max_tokens, ids))
    return out


def _row(label: str, result: TwinResult) -> str:
    return (
        f"| {label} | {result.hit_rate:.3f} | {result.ttft_p50 * 1000:.1f} |"
        f" {result.ttft_p90 * 1000:.1f} | {result.busiest_share:.0%} |"
    )


def run_regime(
    generator: ModuleType,
    window: Window,
    trace: Any,
    *,
    workers: int,
    share: float,
    scales: Sequence[float],
) -> list[str]:
    """The table of one window and scale: round-robin, then ``kv`` at each prefill scale.

    ``trace`` is the trace file already read (``generator.read_trace``).
    """
    items = window_items(generator, window, trace)
    plan = plan_of(generator, items, workers, share, None)
    requests = requests_of(items)
    run = functools.partial(
        replay,
        requests,
        workers=workers,
        block_size=plan.block_tokens,
        num_blocks=plan.blocks_per_worker,
    )
    lines = [
        f"length x {window.length_scale:g}, time x {window.time_scale:g}:"
        f" {plan.requests} requests, {plan.requests / max(plan.span, 1e-9):.1f} req/s,"
        f" {plan.block_tokens} tokens a block, {workers} workers x {plan.blocks_per_worker}"
        f" blocks; unbounded cache {plan.unbounded_hit_rate:.3f}, one LRU cache of all"
        f" {plan.pooled_hit_rate:.3f}",
        "",
        "| mode | hit rate | TTFT p50 (ms) | TTFT p90 (ms) | busiest worker |",
        "|---|---|---|---|---|",
    ]
    rr = run(mode="round-robin")
    lines.append(_row("round-robin", rr))
    ratios = []
    for scale in scales:
        weights = CostWeights(prefill_load_scale=scale)
        kv = run(mode="kv", weights=weights)
        off = run(mode="kv", weights=weights, prefix_caching=False)
        lines.append(_row(f"kv, scale {scale:g}", kv))
        lines.append(_row(f"kv, scale {scale:g}, no prefix caching", off))
        ratios.append(
            f"scale {scale:g}: kv TTFT p50 / round-robin's {kv.ttft_p50 / rr.ttft_p50:.2f},"
            f" / kv without caching {kv.ttft_p50 / off.ttft_p50:.2f};"
            f" hit rate / round-robin's {kv.hit_rate / max(rr.hit_rate, 1e-9):.2f},"
            f" / unbounded {kv.hit_rate / max(plan.unbounded_hit_rate, 1e-9):.2f}"
        )
    return [*lines, "", *ratios, ""]


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True, help=TRACE_WANTED)
    parser.add_argument("--trace-start", type=float, default=0.0)
    parser.add_argument("--trace-duration", type=float, default=600.0)
    parser.add_argument("--time-scales", default="0.25", help="comma-separated")
    parser.add_argument("--length-scales", default="0.125", help="comma-separated")
    parser.add_argument("--scales", default="1", help="kv's prefill load scales, comma-separated")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--cache-share", type=float, default=1.0 / 3)
    options = parser.parse_args(argv)
    if not options.trace.is_file():
        parser.error(f"--trace {options.trace}: no such file; want {TRACE_WANTED}")
    generator = load_generator()
    trace = generator.read_trace(options.trace)
    for length_scale in _floats(options.length_scales):
        for time_scale in _floats(options.time_scales):
            window = Window(
                options.trace,
                start=options.trace_start,
                duration=options.trace_duration,
                time_scale=time_scale,
                length_scale=length_scale,
            )
            lines = run_regime(
                generator,
                window,
                trace,
                workers=options.workers,
                share=options.cache_share,
                scales=_floats(options.scales),
            )
            print("\n".join(lines), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
