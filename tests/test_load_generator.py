"""Tests of ``examples/load_generator.py``: the closed loop against a shedding server on loopback,
its progress and final table, its bounds, and the trace replay (reading Mooncake and Azure
traces, the window, the scaling, the open and closed loops against a prefix-cache server).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio
from example_scripts import ScriptedServer, load_example
from rich.console import Console

from shim_common._httpserver import (
    Handler,
    HTTPRequest,
    HTTPResponder,
    json_headers,
    serve_http,
)

loadgen = load_example("load_generator")


async def _main_against(handler: Handler, *args: str) -> int:
    """The script's exit code, run as from the command line against ``handler`` on loopback."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, handler, "127.0.0.1", 0)
            argv = ["--url", f"http://127.0.0.1:{port}", *args]
            code: int = await trio.to_thread.run_sync(loadgen.main, argv)
            nursery.cancel_scope.cancel()
    return code


async def test_load_generator_counts_every_request_and_reconnects_after_a_shed() -> None:
    server = ScriptedServer(shed_every=3)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, server.handle, "127.0.0.1", 0)
            target = loadgen.parse_target(f"http://127.0.0.1:{port}", "/v1/chat/completions")
            report = await loadgen.run_load(
                target,
                {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                clients=4,
                duration=15.0,
                max_requests=60,
                request_timeout=5.0,
            )
            nursery.cancel_scope.cancel()
    assert report.total == 60 == server.requests
    assert report.statuses[529] == 20
    assert report.statuses[200] == 40
    assert len(report.ok_latencies) == 40
    assert report.retry_after == {"1": 20}
    summary = report.summary()
    assert "529" in summary
    assert "p99" in summary


async def test_load_generator_stops_at_its_duration_when_nothing_listens() -> None:
    with trio.fail_after(10):
        # Bind then close a listener: the port is (almost certainly) refused afterwards.
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        for listener in listeners:
            await listener.aclose()
        report = await loadgen.run_load(
            loadgen.Target("127.0.0.1", port, "/v1/completions"),
            {"model": "m", "prompt": "hi"},
            clients=2,
            duration=0.3,
            max_requests=1000,
            request_timeout=1.0,
        )
    # Stopped by its 0.3 s duration (fail_after bounds the wait), not by max_requests.
    assert report.statuses[200] == 0
    assert 0 < report.total < 1000


async def test_load_generator_reports_progress_and_once_more_at_the_end() -> None:
    server = ScriptedServer(shed_every=4)
    seen: list[tuple[int, float]] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, server.handle, "127.0.0.1", 0)
            report = await loadgen.run_load(
                loadgen.Target("127.0.0.1", port, "/v1/completions"),
                {"model": "m", "prompt": "hi"},
                clients=3,
                duration=15.0,
                max_requests=40,
                request_timeout=5.0,
                progress=lambda r, elapsed: seen.append((r.total, elapsed)),
                progress_interval=0.01,
            )
            nursery.cancel_scope.cancel()
    assert seen
    assert seen[-1] == (40, report.elapsed)  # the last call sees the finished report
    totals = [total for total, _ in seen]
    assert totals == sorted(totals)


def _render(renderable: Any) -> list[str]:
    """Lines of a rich renderable as plain text, the way a pipe receives them."""
    buffer = io.StringIO()
    Console(file=buffer, width=100, color_system=None, force_terminal=False).print(renderable)
    text = buffer.getvalue()
    assert "\x1b[" not in text
    return [line.rstrip() for line in text.splitlines()]


def _cells(lines: list[str], first: str) -> list[str]:
    """The cells of the table row whose first cell is ``first``."""
    for line in lines:
        cells = [cell.strip() for cell in re.split(r"[│┃|]", line)[1:-1]]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n" + "\n".join(lines))


def test_final_table_shows_answers_by_status_rate_and_latency_percentiles() -> None:
    report = loadgen.LoadReport()
    report.statuses.update({200: 90, 529: 9, 0: 1})
    report.ok_latencies.extend(ms / 1000 for ms in range(90, 0, -1))  # 1..90 ms, unsorted
    report.elapsed = 10.0
    report.retry_after["2"] = 9
    lines = _render(loadgen.final_table(report))
    assert lines[0] == "100 requests in 10.00 s"
    assert _cells(lines, "status") == ["status", "answers", "share", "rate (req/s)"]
    assert _cells(lines, "no answer") == ["no answer", "1", "1.0%", "0.1"]
    assert _cells(lines, "200") == ["200", "90", "90.0%", "9.0"]
    assert _cells(lines, "529") == ["529", "9", "9.0%", "0.9"]
    assert _cells(lines, "all") == ["all", "100", "100.0%", "10.0"]
    # Nearest rank over 1..90 ms: p50 is the 45th value, p90 the 81st, p99 the 90th.
    assert _cells(lines, "p50") == ["p50", "p90", "p99", "max"]
    assert _cells(lines, "45.0") == ["45.0", "81.0", "90.0", "90.0"]
    assert lines[-1] == "Retry-After seen: 2 s x9"


def test_final_table_of_a_run_that_got_nothing() -> None:
    lines = _render(loadgen.final_table(loadgen.LoadReport()))
    assert lines[0] == "0 requests in 0.00 s"
    assert _cells(lines, "all") == ["all", "0", "-", "-"]
    assert _cells(lines, "-") == ["-", "-", "-", "-"]


async def test_load_generator_prints_plain_lines_when_not_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("FORCE_COLOR", "TTY_INTERACTIVE", "TTY_COMPATIBLE"):
        monkeypatch.delenv(name, raising=False)
    server = ScriptedServer(shed_every=3)
    code = await _main_against(
        server.handle,
        *("--clients", "2", "--duration", "15", "--max-requests", "30", "--timeout", "5"),
    )
    assert code == 0
    out, err = capsys.readouterr()
    assert "\x1b[" not in out + err  # no cursor movement or colour for a pipe
    progress = err.splitlines()
    assert progress
    assert all(re.fullmatch(r"\[ *[\d.]+ s\] \d+ requests, .*", line) for line in progress)
    assert progress[-1].endswith("200: 20  529: 10")
    lines = [line.rstrip() for line in out.splitlines()]
    assert _cells(lines, "all")[:2] == ["all", "30"]
    assert _cells(lines, "529")[:3] == ["529", "10", "33.3%"]


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert loadgen.percentile(values, 0.5) == 50.0
    assert loadgen.percentile(values, 0.99) == 99.0
    assert loadgen.percentile(values, 1.0) == 100.0
    assert loadgen.percentile(values, 0.0) == 1.0
    assert loadgen.percentile([7.0], 0.99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        loadgen.percentile([], 0.5)


def test_load_generator_stays_on_loopback_unless_told() -> None:
    target = loadgen.parse_target("http://127.0.0.1:8000", "/v1/completions")
    assert target == loadgen.Target("127.0.0.1", 8000, "/v1/completions")
    assert loadgen.parse_target("http://localhost:9", "/x").host == "localhost"
    with pytest.raises(ValueError, match="loopback"):
        loadgen.parse_target("http://10.1.2.3:8000", "/v1/completions")
    assert loadgen.parse_target("http://10.1.2.3:8000", "/x", allow_remote=True).port == 8000
    with pytest.raises(ValueError, match="http://"):
        loadgen.parse_target("https://127.0.0.1", "/x")


def test_load_generator_refuses_unbounded_runs() -> None:
    with pytest.raises(ValueError, match="positive"):
        trio.run(
            lambda: loadgen.run_load(
                loadgen.Target("127.0.0.1", 1, "/"),
                {},
                clients=1,
                duration=float("nan"),  # not > 0
                max_requests=1,
                request_timeout=1.0,
            )
        )


# ----------------------------------------------------------------------------- trace replay

#: A tiny Mooncake trace: two conversations sharing a system prompt (block 0), a lone request,
#: and one conversation's turns resending their history. Block 512 tokens; the last partial.
_MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 1200, "output_length": 40, "hash_ids": [0, 1, 2]},
    {"timestamp": 100, "input_length": 700, "output_length": 10, "hash_ids": [0, 3]},
    {"timestamp": 250, "input_length": 1800, "output_length": 64, "hash_ids": [0, 1, 4, 5]},
    {"timestamp": 300, "input_length": 90, "output_length": 1, "hash_ids": [6]},
    {"timestamp": 400, "input_length": 2100, "output_length": 20, "hash_ids": [0, 1, 4, 7, 8]},
    {"timestamp": 500, "input_length": 1024, "output_length": 5, "hash_ids": [0, 3]},
]


def _write_mooncake(path: Path, rows: list[dict[str, Any]] = _MOONCAKE_ROWS) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _write_azure(path: Path) -> Path:
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:46.9805900,1000,1\n"
        "2023-11-16 18:15:48.0000000,20,0\n"
    )
    return path


def test_read_trace_reads_both_formats(tmp_path: Path) -> None:
    mooncake = loadgen.read_trace(_write_mooncake(tmp_path / "t.jsonl"))
    assert len(mooncake) == 6
    assert mooncake[1] == loadgen.TraceRequest(0.1, 700, 10, (0, 3))
    azure = loadgen.read_trace(_write_azure(tmp_path / "t.csv"))
    assert [r.input_tokens for r in azure] == [374, 1000, 20]
    assert [r.hash_ids for r in azure] == [(), (), ()]
    assert azure[1].arrival == pytest.approx(0.3, abs=1e-6)
    assert azure[2].arrival == pytest.approx(1.31941, abs=1e-6)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "t.jsonl:2: not JSON"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}', "need 2"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash id"),
    ],
)
def test_read_trace_names_the_line_it_refuses(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_MOONCAKE_ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        loadgen.read_trace(path)


def test_read_trace_refuses_a_csv_that_is_not_azure(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="header"):
        loadgen.read_trace(path)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n")
    with pytest.raises(ValueError, match=re.escape("t.csv:2: not a timestamp")):
        loadgen.read_trace(path)


def test_window_by_time_or_count_starts_at_zero(tmp_path: Path) -> None:
    trace = loadgen.read_trace(_write_mooncake(tmp_path / "t.jsonl"))
    window = loadgen.select_window(trace, start=0.2, duration=0.25)
    assert [r.input_tokens for r in window] == [1800, 90, 2100]
    assert [round(r.arrival, 3) for r in window] == [0.0, 0.05, 0.15]
    assert len(loadgen.select_window(trace, count=2)) == 2
    assert loadgen.select_window(trace, start=9.0) == []


def test_scaling_keeps_the_block_structure(tmp_path: Path) -> None:
    trace = loadgen.read_trace(_write_mooncake(tmp_path / "t.jsonl"))
    items = loadgen.scale_requests(trace, time_scale=0.5, length_scale=1 / 32)
    assert {item.block_tokens for item in items} == {16}
    # 1200 tokens = 2 full blocks + 176 -> 2 x 16 + round(176 / 32) = 38 words.
    assert [item.prompt_tokens for item in items] == [38, 22, 56, 3, 66, 32]
    assert [item.max_tokens for item in items] == [1, 1, 2, 1, 1, 1]
    assert items[2].arrival == pytest.approx(0.125)
    words = [loadgen.prompt_text(item).split() for item in items]
    assert [len(w) for w in words] == [item.prompt_tokens for item in items]
    # Equal hash ids, equal words; the first differing id, different words from there on.
    assert words[0][:32] == words[2][:32]
    assert words[0][32:38] != words[2][32:38]
    assert words[2][:48] == words[4][:48]
    assert words[2][48:56] != words[4][48:56]
    # A partial block's words are the first words of the same block when it is full.
    assert words[1][:16] == words[0][:16]
    assert words[1][16:22] == words[5][16:22]
    assert all(re.fullmatch(r"w\d{1,3}", word) for w in words for word in w)
    assert all(int(word[1:]) < loadgen.VOCABULARY for w in words for word in w)


def test_prompts_without_blocks_share_nothing(tmp_path: Path) -> None:
    trace = loadgen.read_trace(_write_azure(tmp_path / "t.csv"))
    items = loadgen.scale_requests(trace, length_scale=0.1, output_scale=1.0)
    assert [item.prompt_tokens for item in items] == [37, 100, 2]
    assert [item.max_tokens for item in items] == [44, 1, 1]
    first, second = (loadgen.prompt_text(item).split() for item in items[:2])
    assert first[:16] != second[:16]
    assert loadgen.unbounded_hit_rate(items) == 0.0
    with pytest.raises(ValueError, match="no token"):
        loadgen.scale_requests(trace, length_scale=1e-4)


def test_unbounded_hit_rate_counts_the_longest_seen_prefix_of_full_blocks(
    tmp_path: Path,
) -> None:
    trace = loadgen.read_trace(_write_mooncake(tmp_path / "t.jsonl"))
    items = loadgen.scale_requests(trace, length_scale=1 / 32)
    # Hits in full 16-word blocks: r1 block 0; r2 blocks 0-1; r4 blocks 0-2 (r2 stored id 4);
    # r5 block 0 only: its block 3 is full, but was partial, so never stored, in r1.
    cached = 16 + 32 + 48 + 16
    total = 38 + 22 + 56 + 3 + 66 + 32
    assert loadgen.unbounded_hit_rate(items) == pytest.approx(cached / total)
    assert loadgen.distinct_blocks(items) == 5  # the full blocks 0, 1, 3, 4, 7


class _PrefixCacheServer:
    """Streams chat answers and reports, as an engine with an unbounded prefix cache would, the
    longest prefix of full ``block``-word blocks it has seen; sheds every ``shed_every``-th."""

    def __init__(self, block: int, shed_every: int = 0) -> None:
        self.block = block
        self.shed_every = shed_every
        self.stored: set[tuple[str, ...]] = set()
        self.requests = 0
        self.prompts: list[list[str]] = []

    async def handle(self, request: HTTPRequest, responder: HTTPResponder) -> None:
        self.requests += 1
        body = json.loads(await request.read_body())
        if self.shed_every and self.requests % self.shed_every == 0:
            await responder.send(529, json_headers((b"retry-after", b"1")), b"{}")
            return
        words = body["messages"][0]["content"].split()
        self.prompts.append(words)
        full = len(words) // self.block
        hits = 0
        while hits < full and tuple(words[: (hits + 1) * self.block]) in self.stored:
            hits += 1
        self.stored.update(tuple(words[: (k + 1) * self.block]) for k in range(full))
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        await responder.start_stream(200, [(b"content-type", b"text/event-stream")])
        for index in range(body["max_tokens"]):
            await trio.sleep(0.001)
            delta = {"content": f" t{index}"} if index else {"role": "assistant", "content": "t0"}
            chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            await responder.send_chunk(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {
            "prompt_tokens": len(words),
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": hits * self.block},
        }
        tail = json.dumps({"choices": [], "usage": usage}).encode()
        await responder.send_chunk(b"data: " + tail + b"\n\ndata: [DONE]\n\n")
        await responder.end_stream()


async def test_replay_reads_the_hit_rate_the_prompts_block_structure_allows(
    tmp_path: Path,
) -> None:
    trace = loadgen.read_trace(_write_mooncake(tmp_path / "t.jsonl"))
    items = loadgen.scale_requests(trace, length_scale=1 / 32, output_scale=0.1)
    server = _PrefixCacheServer(block=16)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, server.handle, "127.0.0.1", 0)
            target = loadgen.parse_target(f"http://127.0.0.1:{port}", "/v1/chat/completions")
            report = await loadgen.run_replay(
                target,
                loadgen.PromptShape("chat", "m"),
                items,
                request_timeout=5.0,
                clients=1,  # one after the other: the server sees the trace's order
            )
            nursery.cancel_scope.cancel()
    summary = report.summary(ttft_objective=10.0, itl_objective=10.0)
    assert summary["sent"] == summary["ok"] == 6 == server.requests
    # The server knows only the words; the trace's hash ids give the same figure.
    assert summary["hit_rate"] == pytest.approx(loadgen.unbounded_hit_rate(items))
    assert summary["cached_tokens"] == 112
    assert summary["usage_missing"] == 0
    assert summary["shed_rate"] == 0.0
    assert summary["goodput_share"] == 1.0
    assert [len(words) for words in server.prompts] == [item.prompt_tokens for item in items]
    records = sorted(report.records, key=lambda r: r.index)
    assert [r.output_tokens for r in records] == [item.max_tokens for item in items]
    assert all(r.ttft is not None and 0 < r.ttft <= r.latency for r in records)
    assert records[2].itl is not None  # 6 tokens: 5 gaps
    assert summary["ttft_s"]["p50"] is not None
    assert summary["itl_s"]["p50"] is not None


async def test_replay_open_loop_sends_each_request_once_and_counts_sheds(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 10 * i, "input_length": 600, "output_length": 64, "hash_ids": [0, i + 1]}
        for i in range(30)
    ]
    trace = loadgen.read_trace(_write_mooncake(tmp_path / "t.jsonl", rows))
    items = loadgen.scale_requests(trace, time_scale=0.5, length_scale=1 / 32)
    server = _PrefixCacheServer(block=16, shed_every=5)
    seen: list[int] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, server.handle, "127.0.0.1", 0)
            target = loadgen.parse_target(f"http://127.0.0.1:{port}", "/v1/chat/completions")
            report = await loadgen.run_replay(
                target,
                loadgen.PromptShape("chat", "m", {"user": "replay"}),
                items,
                request_timeout=5.0,
                max_in_flight=4,
                progress=lambda r, _: seen.append(r.total),
                progress_interval=0.01,
            )
            nursery.cancel_scope.cancel()
    assert sorted(r.index for r in report.records) == list(range(30))
    assert server.requests == 30
    assert report.statuses == {200: 24, 529: 6}
    summary = report.summary(ttft_objective=10.0, itl_objective=10.0)
    assert summary["shed_rate"] == pytest.approx(0.2)
    assert summary["goodput_share"] == pytest.approx(0.8)
    # Block 0 is shared by all, but a shed request's blocks are never stored: 23 of 24 hit it.
    assert summary["cached_tokens"] == 23 * 16
    assert seen[-1] == 30


async def test_replay_from_the_command_line_writes_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_mooncake(tmp_path / "t.jsonl")
    server = _PrefixCacheServer(block=16)
    figures = tmp_path / "figures.json"
    code = await _main_against(
        server.handle,
        *("--trace", str(trace), "--time-scale", "0.1", "--length-scale", "0.03125"),
        *("--trace-requests", "4", "--closed-loop", "--clients", "1", "--timeout", "5"),
        *("--json", str(figures)),
    )
    assert code == 0
    summary = json.loads(figures.read_text())
    assert summary["planned"] == summary["ok"] == 4
    assert summary["block_tokens"] == 16
    assert summary["hit_rate"] == pytest.approx(summary["unbounded_hit_rate"])
    out = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    assert _cells(out, "200")[:3] == ["200", "4", "100.0%"]
    assert _cells(out, "TTFT")[0] == "TTFT"
    assert _cells(out, "shed rate (529s)") == ["shed rate (529s)", "0.0%"]


def test_replay_refuses_bad_arguments_before_it_sends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_mooncake(tmp_path / "t.jsonl")
    url = ("--url", "http://127.0.0.1:9")
    assert loadgen.main([*url, "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert loadgen.main([*url, "--trace", str(trace), "--trace-start", "99"]) == 2
    assert "no request" in capsys.readouterr().err
    assert loadgen.main([*url, "--trace", str(trace), "--extra-body", "[1]"]) == 2
    assert "JSON object" in capsys.readouterr().err
    assert loadgen.main([*url, "--trace", str(trace), "--time-scale", "0"]) == 2


def test_replay_plot_draws_a_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = loadgen.ReplayReport(planned=2)
    report.add(loadgen.ReplayRecord(0, 200, 0.0, 0.0, ttft=0.01, prompt_tokens=10, cached_tokens=4))
    report.add(loadgen.ReplayRecord(1, 529, 0.1, 0.1))
    loadgen.plot_replay(report, tmp_path / "replay.png")
    assert (tmp_path / "replay.png").stat().st_size > 0
