"""Formatting worker replies: the OpenAI objects, and no routing state behind them."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec

import frontend_shim._responses as responses
from frontend_shim._responses import ResponseShape
from shim_common import wire

#: What formatting must not reach: routing, load state, the links, the books.
_ROUTING = {
    "frontend_shim._accounting",
    "frontend_shim._fleet_bridge",
    "frontend_shim._free_sets",
    "frontend_shim._links",
    "frontend_shim._load",
    "frontend_shim._metrics",
    "frontend_shim._pool",
    "frontend_shim._router",
    "frontend_shim._waiting",
}


def test_the_formatter_imports_no_routing_state() -> None:
    tree = ast.parse(Path(responses.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert not imported & _ROUTING


def test_a_streamed_chat_chunk_is_the_envelope_around_its_choice() -> None:
    shape = ResponseShape("chat_completions", {"model": "m", "stream": True})
    first = msgspec.json.decode(shape.chunk(wire.Chunk(request_id=1, text="hi"), first=True))
    assert first["id"] == shape.id
    assert first["id"].startswith("chatcmpl-")
    assert first["object"] == "chat.completion.chunk"
    assert first["model"] == "m"
    assert first["choices"] == [
        {"index": 0, "delta": {"content": "hi", "role": "assistant"}, "finish_reason": None}
    ]
    later = msgspec.json.decode(
        shape.chunk(wire.Chunk(request_id=1, text="!", finish_reason="stop", index=1), first=False)
    )
    assert later["choices"] == [{"index": 1, "delta": {"content": "!"}, "finish_reason": "stop"}]


def test_a_whole_text_completion_lists_its_choices_with_usage() -> None:
    shape = ResponseShape("completions", {"model": "m", "stream_options": {"include_usage": True}})
    assert shape.include_usage
    end = wire.End(request_id=1, prompt_tokens=3, completion_tokens=2)
    whole = msgspec.json.decode(shape.whole({0: ("ab", None), 1: ("c", "length")}, end))
    assert whole["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "ab", "stop"),
        (1, "c", "length"),
    ]
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert msgspec.json.decode(shape.usage_chunk(end))["choices"] == []


def test_response_ids_are_unique_per_request() -> None:
    ids = {ResponseShape("completions", {"model": "m"}).id for _ in range(100)}
    assert len(ids) == 100
