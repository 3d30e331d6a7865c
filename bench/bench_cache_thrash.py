"""What one tenant's flood of unique prompts costs another tenant's cached prefix, in the mocker.

Run: ``python -m bench.bench_cache_thrash [--blocks 1024,16384] [--turns 20]``.

Sans-IO and deterministic: one mocker rank (:class:`RankScheduler`, 4 requests at once, as
behind a gate of N = 4) on the simulated clock of its GPU model. A victim holds a conversation
(a 1,024-token system prompt, 64 tokens more each turn); between two of its turns an attacker
sends 32 unique prompts of a sixteenth of the cache each (twice the cache). Each turn arrives
either in the middle of the flood (behind half of it in the rank's queue) or once it is over.

Printed per cache size and arrival: the victim's cached share (cached prompt tokens over
prompt tokens, the first turn left out), without the flood, under it with the attacker in the
victim's own tenant (one tenant: plain LRU, what every engine did before tenants were known),
and under it from another tenant (the pool's rule 7); and the victim's time to first token on
the simulated clock, p50 / p99, in each case.
"""

from __future__ import annotations

import argparse
import random
import statistics

from shim_common.prefix import block_names
from worker_ingress.engines._mock_scheduler import MockSequence, RankScheduler

BLOCK = 16
RUNNING = 4
SYSTEM = 1024
TURN = 64
FLOOD = 32


def run(
    num_blocks: int, turns: int, attacker: str | None, mid_flood: bool
) -> tuple[float, list[float]]:
    """The victim's cached share and its TTFTs (simulated ms); ``attacker`` None: no flood."""
    rng = random.Random(1)
    rank = RankScheduler(
        num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=RUNNING, max_num_batched_tokens=8192
    )
    clock = 0.0
    first_output: dict[MockSequence, float] = {}

    def until_idle() -> None:
        nonlocal clock
        while (step := rank.schedule()) is not None:
            clock += step.duration
            for seq in rank.complete(step):
                first_output.setdefault(seq, clock)

    conversation = [rng.randrange(50_000) for _ in range(SYSTEM)]
    cached = prompted = 0
    ttfts: list[float] = []
    for turn in range(turns):
        conversation += [rng.randrange(50_000) for _ in range(TURN)]
        flood = [
            MockSequence(
                prompt_tokens=num_blocks // 16 * BLOCK,
                max_tokens=1,
                block_names=[rng.getrandbits(63) for _ in range(num_blocks // 16)],
                tenant=attacker or "",
            )
            for _ in range(FLOOD if attacker is not None else 0)
        ]
        victim = MockSequence(
            prompt_tokens=len(conversation),
            max_tokens=8,
            block_names=block_names(conversation, BLOCK),
            tenant="victim",
        )
        half = len(flood) // 2 if mid_flood else len(flood)
        for seq in flood[:half]:
            rank.add(seq)
        if not mid_flood:
            until_idle()
        arrived = clock
        rank.add(victim)
        for seq in flood[half:]:
            rank.add(seq)
        until_idle()
        assert victim.cached_tokens is not None
        if turn:
            cached += victim.cached_tokens
            prompted += victim.prompt_tokens
            ttfts.append((first_output[victim] - arrived) * 1000)
    return cached / prompted, ttfts


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="1024,16384", help="cache sizes, comma-separated")
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args()
    print("| blocks | arrival | case | victim cached share | TTFT p50 / p99 (simulated ms) |")
    print("|---|---|---|---|---|")
    for blocks in (int(b) for b in args.blocks.split(",")):
        for mid_flood in (True, False):
            arrival = "mid-flood" if mid_flood else "after it"
            for case, attacker in (
                ("no flood", None),
                ("flood, one tenant (LRU)", "victim"),
                ("flood, another tenant", "attacker"),
            ):
                share, ttfts = run(blocks, args.turns, attacker, mid_flood)
                print(
                    f"| {blocks:,} | {arrival} | {case} | {share:.3f} "
                    f"| {statistics.median(ttfts):.1f} / {p99(ttfts):.1f} |"
                )


if __name__ == "__main__":
    main()
