"""The pure parts of ``bench/bench_dynamo.py``: the tiny model folder (``bench/kit/dynamo.py``)
and the report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.bench_dynamo import CHAT, LONG, UNKNOWN, median_figures, report
from bench.kit.dynamo import WORDS, write_model_folder


def test_model_folder_has_the_files_dynamo_reads(tmp_path: Path) -> None:
    write_model_folder(tmp_path / "model")
    names = sorted(path.name for path in (tmp_path / "model").iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tokenizer = json.loads((tmp_path / "model" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(len(vocab)))
    assert {token["content"]: token["id"] for token in tokenizer["added_tokens"]} == {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
    }
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["vocab_size"] == len(vocab)
    assert config["hidden_size"] % config["num_attention_heads"] == 0
    settings = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    assert "{% for message in messages %}" in settings["chat_template"]


def test_every_prompt_word_is_in_the_vocabulary(tmp_path: Path) -> None:
    write_model_folder(tmp_path)
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    for body in (CHAT, UNKNOWN, LONG):
        for message in json.loads(body)["messages"]:
            assert set(message["content"].split()) <= set(WORDS) <= set(vocab)


def test_the_tokenizer_loads_where_the_tokenizers_package_is(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    write_model_folder(tmp_path)
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    encoding = tokenizer.encode("user : one two")
    assert 0 not in encoding.ids
    assert tokenizer.decode(encoding.ids) == "user : one two"


def _figure(rps: float, non_2xx: float = 0.0) -> dict[str, float]:
    return {"rps": rps, "requests": rps * 5, "non_2xx": non_2xx, "p50_ms": 1.0, "p99_ms": 2.0}


def test_report_puts_systems_side_by_side_with_ratios() -> None:
    run = {
        "live": _figure(1000.0),
        "shed": _figure(800.0, 4000.0),
        "chat": _figure(200.0),
        "unknown": _figure(900.0, 4500.0),
        "chat1": {**_figure(100.0), "p50_ms": 3.0},
        "live1": _figure(500.0),
    }
    slower = {name: {**figure, "rps": figure["rps"] / 2} for name, figure in run.items()}
    columns = {"ours": median_figures([run, slower, run]), "theirs": median_figures([slower])}
    table = report(columns)
    assert "| chat answered 529, fleet busy (req/s) | 800 | 400 | 100% / 100% |" in table
    assert "| 529s / GET /live | 0.80 | 0.80 |" in table
    assert "| one connection: chat p50 - /live p50 | 2.00 ms | 2.00 ms |" in table
    assert "| ratio, ours / theirs (same run) | requests/s |" in table
    assert "| chat answered 529, fleet busy | 2.00 |" in table
    assert not math.isnan(columns["ours"]["live"]["rps"])


def test_report_shows_streams_cpu_and_inter_token_latency() -> None:
    stream = {**_figure(100.0), "frontend_us_per_token": 10.0, "worker_us_per_token": 12.5}
    itl = {"itl_p50_ms": 0.2, "gap_p99_ms": 1.0, "ttft_p50_ms": 3.0, "events": 256.0}
    run = {
        "live": _figure(1000.0),
        "shed": {**_figure(800.0, 4000.0), "frontend_us_per_request": 50.0},
        "chat": _figure(200.0),
        "unknown": _figure(900.0, 4500.0),
        "chat1": _figure(100.0),
        "live1": _figure(500.0),
        "stream": stream,
        "itl": itl,
    }
    theirs = {**run, "stream": {**stream, "rps": 50.0}, "itl": {**itl, "itl_p50_ms": 0.4}}
    table = report({"ours": median_figures([run]), "theirs": median_figures([theirs])})
    assert "| streamed chat, mocker at 10,000x (req/s) | 100 | 50 | 0% / 0% |" in table
    assert (
        "| CPU per streamed token, mocker 10,000x, frontend + worker (us) | 10.0 + 12.5 |" in table
    )
    assert "| streamed chat, mocker at 10,000x | 2.00 |" in table
    assert "| one connection, streamed: inter-token p50 (lower is better) | 0.50 |" in table
    # A figure one system lacks shows as a dash, and has no ratio.
    assert "| streamed chat, instant engine (req/s) | - | - |" in table
    assert "CPU per 529, frontend + worker (us) | 50.0 + nan" in table
