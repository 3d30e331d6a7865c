"""A window of a trace, as the load generator replays it, and the caches sized for it.

The window (:class:`Window`) is the part of a trace replayed and how it is scaled in time and
length, given to ``examples/load_generator.py`` as its flags; read and scaled the same way here
(:func:`window_items`), it gives the :class:`Plan`: what the window holds (requests, distinct
blocks, what an unbounded cache and one pooled LRU cache would hit) and the blocks per worker
chosen so that all the workers' caches together hold a share of its distinct blocks.
``bench/bench_prefix.py`` replays the window through real processes, ``bench/bench_kv_twin.py``
on a virtual clock; both size the same way, so their rows can be read side by side.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Final

__all__ = [
    "DEFAULT_BLOCKS",
    "LOAD_GENERATOR",
    "TRACE_WANTED",
    "Plan",
    "Window",
    "blocks_per_worker",
    "load_generator",
    "lru_hit_rate",
    "make_plan",
    "plan_of",
    "window_items",
]

#: The load generator of ``examples/`` (a script, not a package).
LOAD_GENERATOR: Final = Path(__file__).resolve().parents[2] / "examples" / "load_generator.py"
#: What ``--trace`` names, said when it is missing: the two public traces this replays.
TRACE_WANTED: Final = (
    "a Mooncake (JSONL) or Azure (CSV) trace, e.g. conversation_trace.jsonl of the"
    " kvcache-ai/Mooncake repository's FAST25 release (FAST25-release/traces/) or"
    " data/AzureLLMInferenceTrace_conv.csv of Azure/AzurePublicDataset"
)
#: The mockers' own default ``--num-gpu-blocks``, for a window with no block to share.
DEFAULT_BLOCKS: Final = 16384


def load_generator() -> ModuleType:
    """The load generator of ``examples/`` (a script, not a package), loaded from its path."""
    spec = importlib.util.spec_from_file_location("examples_load_generator", LOAD_GENERATOR)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {LOAD_GENERATOR}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass(frozen=True)
class Window:
    """The part of the trace replayed and how it is scaled (the load generator's flags)."""

    trace: Path
    start: float = 0.0
    duration: float | None = None
    requests: int | None = None
    time_scale: float = 1.0
    length_scale: float = 1.0 / 32
    output_scale: float | None = None

    def flags(self) -> list[str]:
        """The load generator's arguments for this window."""
        flags = ["--trace", str(self.trace), "--trace-start", f"{self.start:g}"]
        if self.duration is not None:
            flags += ["--trace-duration", f"{self.duration:g}"]
        if self.requests is not None:
            flags += ["--trace-requests", str(self.requests)]
        flags += [
            "--time-scale",
            f"{self.time_scale:g}",
            "--length-scale",
            f"{self.length_scale:g}",
        ]
        if self.output_scale is not None:
            flags += ["--output-scale", f"{self.output_scale:g}"]
        return flags


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the window holds and the fleet's sizes chosen for it.

    Attributes:
        requests: Requests of the window.
        span: Replay seconds from its first arrival to its last.
        block_tokens: Tokens per block (the mockers' ``--block-size``).
        distinct_blocks: Distinct full blocks of the window's prompts.
        unbounded_hit_rate: Prompt tokens an unbounded single cache would find.
        pooled_hit_rate: Prompt tokens one LRU cache of all the workers' blocks together would
            find: the ceiling for caches that size, wherever the router sends a prompt.
        largest_blocks: Blocks the largest request holds at its peak.
        blocks_per_worker: The mockers' ``--num-gpu-blocks``.
        workers: Mockers.
    """

    requests: int
    span: float
    block_tokens: int
    distinct_blocks: int
    unbounded_hit_rate: float
    pooled_hit_rate: float
    largest_blocks: int
    blocks_per_worker: int
    workers: int


def blocks_per_worker(distinct: int, workers: int, largest: int, share: float) -> int:
    """Blocks per mocker so that all together hold ``share`` of ``distinct`` blocks.

    Never fewer than ``largest`` + 1 (a request must fit one rank's cache, or the mocker refuses
    it; the one more leaves room for its first generated token). A window without block names
    (Azure: nothing to share) gets the mockers' default of :data:`DEFAULT_BLOCKS`.
    """
    if workers < 1 or not share > 0:
        raise ValueError("workers and share must be positive")
    if distinct == 0:
        return max(largest + 1, DEFAULT_BLOCKS)
    return max(largest + 1, math.ceil(distinct * share / workers))


def lru_hit_rate(items: Sequence[Any], capacity: int) -> float:
    """The share of prompt tokens one LRU cache of ``capacity`` blocks finds, in arrival order.

    As :func:`unbounded_hit_rate` of the load generator, but a prompt's full blocks, once looked
    up, become the most recent, and the least recent leave when more than ``capacity`` are held
    (a running request's blocks are not pinned here: an upper bound, not a mocker).
    """
    cache: OrderedDict[int, None] = OrderedDict()
    cached = total = 0
    for item in items:
        total += item.prompt_tokens
        full = item.hash_ids[: item.prompt_tokens // item.block_tokens]
        hits = 0
        while hits < len(full) and full[hits] in cache:
            hits += 1
        cached += hits * item.block_tokens
        for name in full:
            cache[name] = None
            cache.move_to_end(name)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return cached / total if total else 0.0


def make_plan(
    generator: ModuleType, window: Window, workers: int, share: float, blocks: int | None
) -> Plan:
    """Read and scale the window (as the load generator will) and size the caches for it."""
    return plan_of(generator, window_items(generator, window), workers, share, blocks)


def window_items(generator: ModuleType, window: Window, trace: Any = None) -> list[Any]:
    """The window's requests as the load generator replays them, scaled.

    Args:
        generator: the load generator's module.
        window: the window and its scales.
        trace: the trace already read (``generator.read_trace``); ``None``: read it now.

    Raises:
        ValueError: no request falls in the window.
    """
    if trace is None:
        trace = generator.read_trace(window.trace)
    chosen = generator.select_window(
        trace, start=window.start, duration=window.duration, count=window.requests
    )
    items: list[Any] = generator.scale_requests(
        chosen,
        time_scale=window.time_scale,
        length_scale=window.length_scale,
        output_scale=window.output_scale,
    )
    if not items:
        raise ValueError(f"no request of {window.trace} falls in the window")
    return items


def plan_of(
    generator: ModuleType, items: Sequence[Any], workers: int, share: float, blocks: int | None
) -> Plan:
    """The plan of a window's scaled requests: the caches sized for them (``blocks`` per
    worker when given) and what an unbounded cache and one pooled LRU cache would hit."""
    block = items[0].block_tokens
    largest = max(math.ceil((i.prompt_tokens + i.max_tokens) / block) for i in items)
    distinct = generator.distinct_blocks(items)
    per_worker = blocks or blocks_per_worker(distinct, workers, largest, share)
    return Plan(
        requests=len(items),
        span=items[-1].arrival,
        block_tokens=block,
        distinct_blocks=distinct,
        unbounded_hit_rate=generator.unbounded_hit_rate(items),
        pooled_hit_rate=lru_hit_rate(items, per_worker * workers),
        largest_blocks=largest,
        blocks_per_worker=per_worker,
        workers=workers,
    )
