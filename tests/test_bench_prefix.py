"""``bench/bench_prefix.py``: its pure parts (the plan of a window and the sizing, in
``bench/prefix/window.py``; the report) and one tiny run of our side through real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_prefix
from bench.kit.dynamo import write_model_folder
from bench.prefix import window as windows

generator = windows.load_generator()

#: Three turns of one conversation, another conversation sharing its system prompt, a lone one.
ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 64, "hash_ids": [0, 1, 2]},
    {"timestamp": 200, "input_length": 1600, "output_length": 64, "hash_ids": [0, 1, 3, 4]},
    {"timestamp": 400, "input_length": 600, "output_length": 32, "hash_ids": [0, 5]},
    {"timestamp": 600, "input_length": 2100, "output_length": 64, "hash_ids": [0, 1, 3, 6, 7]},
    {"timestamp": 800, "input_length": 300, "output_length": 32, "hash_ids": [8]},
    {"timestamp": 1000, "input_length": 1100, "output_length": 64, "hash_ids": [0, 5, 9]},
]


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def test_the_plan_reads_the_window_as_the_load_generator_replays_it(tmp_path: Path) -> None:
    window = windows.Window(_trace(tmp_path), time_scale=0.5, length_scale=1 / 32)
    plan = windows.make_plan(generator, window, workers=2, share=1 / 3, blocks=None)
    assert plan.requests == 6
    assert plan.span == pytest.approx(0.5)
    assert plan.block_tokens == 16
    # Full blocks: 0 1 | 0 1 3 | 0 | 0 1 3 6 | - | 0 5: the ids 0, 1, 3, 5, 6.
    assert plan.distinct_blocks == 5
    # Hits: r1 blocks 0-1, r2 block 0, r3 blocks 0-2, r5 block 0 (5 was partial in r2).
    prompts = [34, 50, 19, 66, 9, 34]
    assert plan.unbounded_hit_rate == pytest.approx(16 * (2 + 1 + 3 + 1) / sum(prompts))
    # The largest request, 66 words + 2 generated, spans 5 blocks: a cache must fit it.
    assert plan.largest_blocks == 5
    assert plan.blocks_per_worker == 6
    sized = windows.make_plan(generator, window, workers=2, share=1 / 3, blocks=40)
    assert sized.blocks_per_worker == 40
    assert sized.pooled_hit_rate == pytest.approx(plan.unbounded_hit_rate)  # 80 blocks: no miss


def test_a_pooled_lru_cache_loses_what_it_evicted(tmp_path: Path) -> None:
    window = windows.Window(_trace(tmp_path), length_scale=1 / 32)
    items = generator.scale_requests(generator.read_trace(window.trace), length_scale=1 / 32)
    unbounded = generator.unbounded_hit_rate(items)
    assert windows.lru_hit_rate(items, 100) == pytest.approx(unbounded)
    prompts = 34 + 50 + 19 + 66 + 9 + 34
    # Two blocks: r1 finds 0 1 and keeps 1 3; r2 misses 0; r3 finds 0 (r2's) but not 1; r5
    # misses 0, pushed out by r3's 1 3 6.
    assert windows.lru_hit_rate(items, 2) == pytest.approx((32 + 16) / prompts)
    # Three: r1 finds 0 1; r2 finds 0; r3 finds 0 1 3; r5 misses 0, the least recent at r3's 6.
    assert windows.lru_hit_rate(items, 3) == pytest.approx((32 + 16 + 48) / prompts)
    assert unbounded == pytest.approx((32 + 16 + 48 + 16) / prompts)


def test_window_flags_are_the_load_generators(tmp_path: Path) -> None:
    window = windows.Window(tmp_path / "t.jsonl", 5.0, 60.0, 100, 0.25, 0.0625, 0.5)
    args = generator._parse_args(["--url", "http://127.0.0.1:1", *window.flags()])
    assert (args.trace, args.trace_start, args.trace_duration) == (tmp_path / "t.jsonl", 5, 60)
    assert (args.trace_requests, args.time_scale) == (100, 0.25)
    assert (args.length_scale, args.output_scale) == (0.0625, 0.5)


def test_caches_together_hold_the_share_asked_for() -> None:
    assert windows.blocks_per_worker(12_000, 4, largest=100, share=1 / 3) == 1000
    assert windows.blocks_per_worker(12_001, 4, largest=100, share=1 / 3) == 1001
    assert windows.blocks_per_worker(300, 4, largest=100, share=1 / 3) == 101
    # Nothing to share (an Azure window): the mockers' default, not a cache of one request.
    assert windows.blocks_per_worker(0, 4, largest=20, share=1 / 3) == 16384
    with pytest.raises(ValueError, match="positive"):
        windows.blocks_per_worker(300, 0, largest=1, share=1 / 3)


def test_the_prompts_words_are_words_of_dynamos_tiny_tokenizer(tmp_path: Path) -> None:
    write_model_folder(tmp_path)
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert {f"w{i}" for i in range(generator.VOCABULARY)} <= set(vocab)


def _run(hit: float, ttft: float, rps: float, shares: list[float]) -> dict[str, object]:
    return {
        "hit_rate": hit,
        "ttft_s": {"p50": ttft, "p90": ttft * 2, "p99": ttft * 3},
        "throughput_rps": rps,
        "shed_rate": 0.01,
        "worker_shares": shares,
        "usage_missing": 0,
    }


def test_report_rows_and_each_systems_kv_over_its_own_round_robin(tmp_path: Path) -> None:
    plan = windows.Plan(
        requests=100, span=60.0, block_tokens=16, distinct_blocks=3000,
        unbounded_hit_rate=0.4, pooled_hit_rate=0.3, largest_blocks=50, blocks_per_worker=250,
        workers=4,
    )  # fmt: skip
    ours = {
        "round-robin": bench_prefix.median_run([_run(0.1, 0.2, 5.0, [0.25] * 4)]),
        "kv": bench_prefix.median_run(
            [
                _run(0.3, 0.1, 5.0, [0.4, 0.2, 0.2, 0.2]),
                _run(0.32, 0.12, 5.5, [0.2, 0.3, 0.3, 0.2]),
                _run(0.34, 0.3, 6.0, [0.25] * 4),
            ]
        ),
        "kv-nocache": bench_prefix.median_run([_run(0.0, 0.24, 5.0, [0.25] * 4)]),
    }
    theirs = {
        "round-robin": bench_prefix.median_run([_run(0.1, 0.2, 5.0, [0.25] * 4)]),
        "kv": bench_prefix.median_run([_run(0.2, 0.15, 5.0, [0.25] * 4)]),
    }
    table = bench_prefix.report(plan, {"ours": ours, "theirs": theirs})
    assert "4 workers x 250 blocks (33% of the distinct blocks)" in table
    assert (
        "unbounded single cache: hit rate 0.400; one LRU cache of all 1000 blocks: 0.300" in table
    )
    assert (
        "| ours | kv | 0.320 | 120.0 | 240.0 | 5.50 | 1.0% | 30% | 30% / 25% / 20% / 20% |" in table
    )
    assert "| ours | 3.20 | 0.80 | 0.60 | 0.50 | 1.10 |" in table
    assert "| theirs | 2.00 | 0.50 | 0.75 | - | 1.00 |" in table


@pytest.mark.e2e
def test_a_tiny_replay_through_our_frontend_and_two_mockers(tmp_path: Path) -> None:
    window = windows.Window(
        _trace(tmp_path), time_scale=0.2, length_scale=1 / 32, output_scale=1 / 16
    )
    plan = windows.make_plan(generator, window, workers=2, share=1 / 3, blocks=64)
    results = {}
    for mode in ("round-robin", "kv"):
        with bench_prefix.shim_fleet(mode, plan, speedup=10.0) as fleet:
            results[mode] = bench_prefix.measure(
                fleet, window, plan, tmp_path, timeout=20.0, max_in_flight=8
            )
    for figures in results.values():
        assert figures["sent"] == figures["ok"] == 6
        assert sum(figures["worker_shares"]) == pytest.approx(1.0)
        assert len(figures["worker_shares"]) == 2
        assert figures["ttft_s"]["p50"] is not None
    assert results["round-robin"]["worker_shares"] == [0.5, 0.5]


def test_the_aiperf_window_scales_time_only(tmp_path: Path) -> None:
    window = windows.Window(_trace(tmp_path), start=0.3, duration=0.5, time_scale=0.5)
    bench_prefix.aiperf_trace(window, tmp_path / "window.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "window.jsonl").read_text().splitlines()]
    assert [row["timestamp"] for row in rows] == [0, 100]  # 400 and 600 ms, from 400, x 0.5
    assert rows[1] == {**ROWS[3], "timestamp": 100}


def test_the_aiperf_tokenizer_is_a_model_cache_entry(tmp_path: Path) -> None:
    name, env = bench_prefix.aiperf_tokenizer(tmp_path)
    entry = Path(env["HF_HUB_CACHE"]) / ("models--" + name.replace("/", "--"))
    revision = (entry / "refs" / "main").read_text()
    assert (entry / "snapshots" / revision / "tokenizer.json").is_file()
    assert env["HF_HUB_OFFLINE"] == "1"


def _record(start: int, end: int, ttft_ms: float, prompt: int, cached: int) -> dict[str, object]:
    return {
        "metadata": {"request_start_ns": start, "request_end_ns": end},
        "metrics": {
            "time_to_first_token": {"value": ttft_ms, "unit": "ms"},
            "usage_prompt_tokens": {"value": prompt, "unit": "tokens"},
            "usage_prompt_cache_read_tokens": {"value": cached, "unit": "tokens"},
        },
    }


def test_aiperf_records_give_the_same_figures() -> None:
    records: list[dict[str, object]] = [
        _record(0, 1_000_000_000, 100.0, 1000, 500),
        _record(500_000_000, 2_000_000_000, 300.0, 1000, 0),
        _record(600_000_000, 1_000_000_000, 200.0, 2000, 1500),
        {
            "metadata": {"request_start_ns": 700_000_000, "request_end_ns": 800_000_000},
            "metrics": {},
            "error": {"code": 529, "type": "Overloaded", "message": "busy"},
        },
    ]
    figures = bench_prefix.aiperf_figures(records)
    assert figures["hit_rate"] == pytest.approx(2000 / 4000)
    assert figures["ttft_s"]["p50"] == pytest.approx(0.2)
    assert figures["ttft_s"]["p90"] == pytest.approx(0.3)
    assert figures["throughput_rps"] == pytest.approx(3 / 2.0)
    assert figures["shed_rate"] == pytest.approx(0.25)
    assert (figures["sent"], figures["ok"], figures["usage_missing"]) == (4, 3, 0)
