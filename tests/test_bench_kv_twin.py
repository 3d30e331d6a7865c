"""``bench/prefix/twin.py`` and ``bench/bench_kv_twin.py``: the virtual-clock replay through the
frontend's routing core and the mockers' schedulers (no process, no socket)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_kv_twin
from bench.prefix.twin import Link, Request, replay
from frontend_shim._kv_cost import CostWeights


def conversations(count: int, turns: int, *, gap: float, blocks: int) -> list[Request]:
    """``count`` conversations of ``turns`` turns, each turn resending the history and adding
    ``blocks`` blocks, the conversations' turns interleaved ``gap`` seconds apart."""
    out = []
    for turn in range(turns):
        for conversation in range(count):
            names = tuple(1000 * conversation + b + 1 for b in range(blocks * (turn + 1)))
            arrival = gap * (turn * count + conversation)
            out.append(Request(arrival, 16 * len(names) + 5, 4, names))
    return out


def test_every_request_is_answered_once_and_the_picture_ends_empty() -> None:
    requests = conversations(6, 3, gap=0.05, blocks=2)
    for mode in ("round-robin", "random", "kv"):
        result = replay(requests, block_size=16, num_blocks=400, mode=mode)
        assert result.completed == len(requests), mode
        assert result.unrouted == 0
        assert 0.0 < result.ttft_p50 <= result.ttft_p90


def test_kv_sends_a_conversations_next_turn_where_its_history_is_cached() -> None:
    # Turns far enough apart for the first to finish: round-robin's rotation (6 conversations,
    # 4 workers) sends most next turns elsewhere; kv follows the cache.
    requests = conversations(6, 3, gap=0.3, blocks=2)
    rr = replay(requests, block_size=16, num_blocks=400, mode="round-robin")
    kv = replay(requests, block_size=16, num_blocks=400, mode="kv")
    off = replay(requests, block_size=16, num_blocks=400, mode="kv", prefix_caching=False)
    assert off.hit_rate == 0.0
    assert kv.hit_rate > 2 * rr.hit_rate
    # Every next turn found its whole history: 2 + 4 blocks of the 2 + 4 + 6 sent per
    # conversation after the first turn, the partial last block never counted.
    prompt = sum(r.prompt_tokens for r in requests)
    assert kv.hit_rate == pytest.approx(6 * 16 * (2 + 4) / prompt)


def test_the_credit_at_zero_ignores_the_cache() -> None:
    requests = conversations(6, 3, gap=0.3, blocks=2)
    blind = replay(
        requests, block_size=16, num_blocks=400, mode="kv", weights=CostWeights(credit=0.0)
    )
    kv = replay(requests, block_size=16, num_blocks=400, mode="kv")
    assert blind.hit_rate < kv.hit_rate


def test_a_replay_is_the_same_every_time() -> None:
    requests = conversations(5, 3, gap=0.02, blocks=3)
    link = Link(hop=0.001, publish_interval=0.05, read_delay=0.01)
    first = replay(requests, block_size=16, num_blocks=200, mode="kv", link=link)
    assert replay(requests, block_size=16, num_blocks=200, mode="kv", link=link) == first


def test_the_command_prints_a_table_per_regime(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {
            "timestamp": 100 * n,
            "input_length": 600 + 512 * (n % 3),
            "output_length": 32,
            "hash_ids": [0, *range(1 + 10 * (n % 2), 2 + 10 * (n % 2) + n % 3)],
        }
        for n in range(12)
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    bench_kv_twin.main(
        [
            "--trace",
            str(trace),
            "--time-scales",
            "0.5,1",
            "--length-scales",
            "0.0625",
            "--scales",
            "1,8",
            "--workers",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert out.count("| round-robin |") == 2
    assert out.count("| kv, scale 8, no prefix caching |") == 2
    assert "kv TTFT p50 / round-robin's" in out


def test_the_command_refuses_a_missing_trace(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_kv_twin.main(["--trace", str(tmp_path / "none.jsonl")])
    assert exit_info.value.code == 2
