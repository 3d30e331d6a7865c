"""How fast the frontend's load state and router are on a 1,024-worker x 4-rank fleet.

Prints medians over several rounds of:

- load events applied per second (one rank's LoadEvent each, random workers and values, a
  threshold configured so busy bits really flip), and heartbeats (4 ranks each) per second;
- selections per second for each router mode, with about half of the fleet busy;
- the ratio of kv to round-robin picks, measured side by side in the same run;
- class-aware picks on a fleet whose every worker is marked overloaded for a batch class (no
  worker free), for an interactive request that beats those marks: the bounded look at marked
  workers, against round-robin picks over the free set in the same rounds;
- the ``kv`` router with its index full: every rank's cache holds ``--kv-blocks`` block names
  (16,384 by default: 1,024 x 4 x 16,384 is 67 million), some of them the prefixes of the
  prompts picked for. The index's memory (resident bytes of the process before and after it is
  filled, over the blocks it holds) and ``kv`` picks per second for prompts of
  ``--prompt-blocks`` blocks whose prefix one rank holds, side by side with round-robin picks.
  ``--kv-blocks 0`` skips it (it needs about 6 GB at the default size);
- ``--compare-tree``: the index's layout (a set of names per rank: hashed chains) against a
  shared radix tree over the same names (a node per distinct block, its children and holders),
  on the same caches, distinct per rank and sharing half their blocks: bytes per block held
  and microseconds per prefix lookup;
- KV events decoded and applied per second (the link's decode of a ``kv`` message and the
  index's apply), as a full cache churns: each event stores a chain of 4 new blocks or removes 4
  old ones, 16 events a message;
- what ``kv`` adds to each request before its pick: the chat body's prompt read as token ids
  (the mocker's word tokeniser, or ``--tokenizer``'s ``tokenizer.json``) and cut into named
  blocks of 16 tokens, in microseconds per request at 1,000 and 12,000 tokens.

Run: ``python bench/bench_router.py`` (``--workers``, ``--ranks``, ``--rounds`` to change the
shape). Figures depend on the machine; compare ratios, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.proc import memory
from frontend_shim._kv_cost import KvScorer, Prompt
from frontend_shim._kv_index import KvIndex
from frontend_shim._load import Fleet
from frontend_shim._router import Routed, Router, RouterMode
from shim_common import wire
from shim_common.prefix import (
    FileTokenizer,
    PromptTokenizer,
    WordTokenizer,
    block_names,
    prompt_token_ids,
)
from shim_common.wire import BusyThresholds

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


def pick_prompts(router: Router, prompts: Sequence[Prompt], now: float) -> None:
    pick = router.pick
    for prompt in prompts:
        outcome = pick(MODEL, now, prompt=prompt)
        assert isinstance(outcome, Routed)


def resident_bytes() -> int:
    """This process's resident memory now (Linux), in bytes."""
    return memory(os.getpid()).resident


def fill_index(
    fleet: Fleet, blocks: int, prompt_blocks: int, rng: random.Random
) -> tuple[KvIndex, list[Prompt], int]:
    """An index whose every rank holds ``blocks`` names: the chains of a few conversations (so
    that picks find prefixes) and random names for the rest; the prompts to pick for; and the
    names the index holds (those stored, less those its caps turned away)."""
    index = KvIndex()
    workers = list(fleet.workers(MODEL))
    conversations = []
    for _ in range(min(4096, len(workers) * 4)):
        tokens = [rng.randrange(50_000) for _ in range(prompt_blocks * 16)]
        conversations.append((tokens, block_names(tokens, 16)))
    prompts: list[Prompt] = []
    stored = 0
    for worker_index, worker in enumerate(workers):
        config = worker.config
        index.add_worker(config, 0.0, events=True)
        ranks = []
        for rank in range(config.data_parallel_size):
            tokens, names = conversations[(worker_index * 4 + rank) % len(conversations)]
            held = names[: rng.randrange(1, len(names) + 1)]
            filler = [rng.getrandbits(63) for _ in range(blocks - len(held))]
            ranks.append(held + filler)
            stored += len(ranks[-1])
        index.apply(config.worker_id, [wire.KvSnapshot(seq=0, ranks=ranks)], 0.0)
    for tokens, _ in conversations:
        prompt = Prompt([*tokens, *(rng.randrange(50_000) for _ in range(8))])
        prompt.names(16)  # named before the timing: picks/s is the scoring alone
        prompts.append(prompt)
    return index, prompts, stored - index.stats.overflow


def bench_kv(fleet: Fleet, args: argparse.Namespace, rng: random.Random) -> None:
    before = resident_bytes()
    start = time.perf_counter()
    index, prompts, held = fill_index(fleet, args.kv_blocks, args.prompt_blocks, rng)
    filled = time.perf_counter() - start
    # The prompts (their tokens and names) are not the index's: counted out.
    prompt_bytes = sum(len(p.tokens) * 8 + len(p.names(16)) * 44 for p in prompts)
    grown = resident_bytes() - before - prompt_bytes
    print(
        f"kv index: {held:,} blocks held ({args.workers} x {args.ranks} ranks x "
        f"{args.kv_blocks:,}), filled in {filled:.1f} s; resident +{grown / 2**30:.2f} GiB, "
        f"{grown / held:.1f} bytes per block, {grown / args.workers / 2**20:.1f} MiB per worker"
    )
    kv = Router(fleet, RouterMode.KV, kv=KvScorer(index, rng=random.Random(1)))
    plain = Router(fleet, RouterMode.ROUND_ROBIN)
    picks = prompts[: args.picks // 10]
    kv_rates: list[float] = []
    ratios: list[float] = []
    for _ in range(args.rounds):  # side by side in each round
        kv_rate = per_second(len(picks), functools.partial(pick_prompts, kv, picks, 0.7))
        rr_rate = per_second(args.picks, functools.partial(pick_many, plain, args.picks, 0.7))
        kv_rates.append(kv_rate)
        ratios.append(kv_rate / rr_rate)
    hits = [kv.pick(MODEL, 0.7, prompt=p) for p in picks[:200]]
    cached = [h.kv.cached_blocks for h in hits if isinstance(h, Routed) and h.kv is not None]
    print(
        f"kv picks with the index full ({args.prompt_blocks}-block prompts): "
        f"{statistics.median(kv_rates):,.0f} /s, {statistics.median(ratios):.4f} x round-robin "
        f"(median per round); mean cached prefix chosen {statistics.mean(cached):.1f} blocks"
    )


class RadixNode:
    """A node of the radix tree compared with (one per distinct block name)."""

    __slots__ = ("children", "holders")

    def __init__(self) -> None:
        self.children: dict[int, RadixNode] = {}
        self.holders: set[int] = set()


def tree_insert(root: RadixNode, names: Sequence[int], holder: int) -> None:
    node = root
    for name in names:
        child = node.children.get(name)
        if child is None:
            child = node.children[name] = RadixNode()
        child.holders.add(holder)
        node = child


def tree_depth(root: RadixNode, names: Sequence[int], holder: int) -> int:
    node, depth = root, 0
    for name in names:
        child = node.children.get(name)
        if child is None or holder not in child.holders:
            break
        node, depth = child, depth + 1
    return depth


def _set_lookups(sets: list[dict[int, None]], queries: list[tuple[int, list[int]]]) -> None:
    for rank, names in queries:
        len(list(itertools.takewhile(sets[rank].__contains__, names)))


def _tree_lookups(root: RadixNode, queries: list[tuple[int, list[int]]]) -> None:
    for rank, names in queries:
        tree_depth(root, names, rank)


def compare_tree(ranks: int, blocks: int, rounds: int, rng: random.Random) -> None:
    """Hashed chains (a set per rank) against a radix tree, on the same chains of 64 blocks."""
    for shared in (False, True):
        common = [rng.getrandbits(63) for _ in range(64)]
        caches = []
        for _ in range(ranks):
            chains = []
            for chain in range(blocks // 64):
                names = [rng.getrandbits(63) for _ in range(64)]
                if shared and chain % 2 == 0:
                    names = common[:32] + names[32:]  # half the blocks under one shared prefix
                chains.append(names)
            caches.append(chains)
        queries = [(r, caches[r][rng.randrange(len(caches[r]))]) for r in range(ranks)] * 8
        before = resident_bytes()
        # As the index keeps them: a dict without values per rank (its rule 1).
        sets = [dict.fromkeys(name for chain in chains for name in chain) for chains in caches]
        set_bytes = resident_bytes() - before
        before = resident_bytes()
        root = RadixNode()
        for holder, chains in enumerate(caches):
            for names in chains:
                tree_insert(root, names, holder)
        tree_bytes = resident_bytes() - before
        held = sum(len(held) for held in sets)

        set_lookups = functools.partial(_set_lookups, sets, queries)
        tree_lookups = functools.partial(_tree_lookups, root, queries)
        set_us = statistics.median(
            1e6 / per_second(len(queries), set_lookups) for _ in range(rounds)
        )
        tree_us = statistics.median(
            1e6 / per_second(len(queries), tree_lookups) for _ in range(rounds)
        )
        kind = "half shared" if shared else "distinct"
        print(
            f"layout ({kind}, {held:,} blocks held): sets {set_bytes / held:.0f} B/block, "
            f"{set_us:.1f} us/lookup; radix tree {tree_bytes / held:.0f} B/block, "
            f"{tree_us:.1f} us/lookup (64-block prompts, fully held)"
        )


def bench_kv_events(rounds: int) -> None:
    config = build_fleet(1, 4).worker("worker-0")
    assert config is not None
    batches = []
    seq = 0
    for n in range(2_000):
        events: list[wire.KvEvent] = []
        for k in range(8):
            base = (n * 8 + k) * 4
            seq += 1
            events.append(
                wire.KvStored(
                    seq=seq, dp_rank=k % 4, parent=None, blocks=list(range(base, base + 4))
                )
            )
            seq += 1
            old = base - 4000
            events.append(wire.KvRemoved(seq=seq, dp_rank=k % 4, blocks=list(range(old, old + 4))))
        batches.append(wire.encode(wire.KvBatch(events=events)))
    rates = []
    for _ in range(rounds):
        index = KvIndex()
        index.add_worker(config.config, 0.0, events=True)
        start = time.perf_counter()
        for data in batches:
            message = wire.decode_event_message(data)
            assert isinstance(message, wire.KvBatch)
            index.apply("worker-0", message.events, 0.0)
        rates.append(seq / (time.perf_counter() - start))
    print(
        f"KV events decoded and applied: {statistics.median(rates):,.0f} /s "
        f"({1e6 / statistics.median(rates):.1f} us each; 16 a message, 4 blocks each)"
    )


def bench_tokenise(tokenizer: PromptTokenizer, rounds: int, rng: random.Random) -> None:
    words = [f"w{rng.randrange(30_000)}" for _ in range(12_000)]
    for count in (1_000, 12_000):
        system, user = " ".join(words[: count // 2]), " ".join(words[count // 2 : count])
        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]
        }
        repeat = max(1, 200_000 // count)
        costs = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(repeat):
                block_names(prompt_token_ids("chat_completions", body, tokenizer), 16)
            costs.append((time.perf_counter() - start) / repeat)
        tokens = len(prompt_token_ids("chat_completions", body, tokenizer))
        print(
            f"tokenise and name ({type(tokenizer).__name__}, {tokens:,} tokens): "
            f"{statistics.median(costs) * 1e6:,.0f} us per request (median of {rounds})"
        )


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
    parser.add_argument("--kv-blocks", type=int, default=TOTAL_BLOCKS)
    parser.add_argument("--prompt-blocks", type=int, default=64)
    parser.add_argument("--compare-tree", action="store_true")
    parser.add_argument("--tokenizer", help="a tokenizer.json to time besides the word tokeniser")
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
    if args.compare_tree:
        compare_tree(256, 4096, args.rounds, rng)
    bench_kv_events(args.rounds)
    bench_tokenise(WordTokenizer(), args.rounds, rng)
    if args.tokenizer:
        bench_tokenise(FileTokenizer(args.tokenizer), args.rounds, rng)
    if args.kv_blocks > 0:
        # An idle fleet: the cache decides, and every rank is scored.
        bench_kv(build_fleet(args.workers, args.ranks), args, rng)


if __name__ == "__main__":
    main()
