"""Tests of the request-reading helpers every engine shares, and of the engines agreeing on them."""

from __future__ import annotations

from typing import Any

import pytest

from shim_common.wire import Chunk, Endpoint
from worker_ingress._config import MockerSettings
from worker_ingress.engines._base import (
    DEFAULT_MAX_TOKENS,
    Engine,
    EngineConfig,
    EngineInputError,
    EngineOutput,
    chat_texts,
    count_words,
    prompt_texts,
    prompt_words,
    requested_max_tokens,
)
from worker_ingress.engines._instant import InstantEngine
from worker_ingress.engines._mocker import MockerEngine
from worker_ingress.engines.upstream._client import Origin
from worker_ingress.engines.upstream._engine import OpenAIUpstreamEngine

CONFIG = EngineConfig(
    kv_total_blocks=1000,
    block_size=4,
    max_num_batched_tokens=512,
    max_num_seqs=8,
    data_parallel_size=1,
)

# ----------------------------------------------------------------------------- outputs


def test_an_output_becomes_the_wire_chunk_with_every_field_they_share() -> None:
    # A field added to both and forgotten in EngineOutput.chunk would be lost on the wire.
    output = EngineOutput(
        text="a b", tokens=2, finish_reason="stop", embedding=[0.5], index=3, cached_tokens=4
    )
    chunk = output.chunk(7)
    shared = set(EngineOutput.__struct_fields__) & set(Chunk.__struct_fields__)
    assert shared == set(Chunk.__struct_fields__) - {"request_id"}
    assert chunk.request_id == 7
    assert {name: getattr(chunk, name) for name in shared} == {
        name: getattr(output, name) for name in shared
    }


# ----------------------------------------------------------------------------- max tokens


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        ("chat_completions", {}, DEFAULT_MAX_TOKENS),
        ("chat_completions", {"max_tokens": 5}, 5),
        ("chat_completions", {"max_completion_tokens": 7}, 7),
        # The newer name wins, whichever order the body lists them in.
        ("chat_completions", {"max_tokens": 5, "max_completion_tokens": 7}, 7),
        ("chat_completions", {"max_completion_tokens": 7, "max_tokens": 5}, 7),
        ("chat_completions", {"max_completion_tokens": 0, "max_tokens": 5}, 0),
        ("chat_completions", {"max_completion_tokens": None, "max_tokens": 5}, 5),
        (
            "chat_completions",
            {"max_completion_tokens": None, "max_tokens": None},
            DEFAULT_MAX_TOKENS,
        ),
        ("completions", {}, DEFAULT_MAX_TOKENS),
        ("completions", {"max_tokens": 0}, 0),
        ("completions", {"max_tokens": 9}, 9),
        ("completions", {"max_tokens": None}, DEFAULT_MAX_TOKENS),
        # Not a completions field: ignored, even when ill-typed.
        ("completions", {"max_completion_tokens": 3}, DEFAULT_MAX_TOKENS),
        ("completions", {"max_tokens": 4, "max_completion_tokens": "x"}, 4),
        ("embeddings", {"max_tokens": 9}, 0),
    ],
)
def test_requested_max_tokens(endpoint: Endpoint, body: dict[str, Any], expected: int) -> None:
    assert requested_max_tokens(endpoint, body) == expected


def test_requested_max_tokens_default_is_the_callers() -> None:
    assert requested_max_tokens("completions", {}, default=3) == 3
    assert requested_max_tokens("chat_completions", {"max_tokens": None}, default=0) == 0
    assert requested_max_tokens("completions", {"max_tokens": 2}, default=3) == 2


@pytest.mark.parametrize(
    ("endpoint", "body", "field"),
    [
        ("completions", {"max_tokens": -1}, "max_tokens"),
        ("completions", {"max_tokens": 1.5}, "max_tokens"),
        ("completions", {"max_tokens": "4"}, "max_tokens"),
        ("completions", {"max_tokens": True}, "max_tokens"),
        ("completions", {"max_tokens": False}, "max_tokens"),
        ("chat_completions", {"max_completion_tokens": -3}, "max_completion_tokens"),
        ("chat_completions", {"max_completion_tokens": [1]}, "max_completion_tokens"),
        # Both given: a bad older field is still a bad request.
        ("chat_completions", {"max_completion_tokens": 3, "max_tokens": -1}, "max_tokens"),
        ("chat_completions", {"max_tokens": True}, "max_tokens"),
    ],
)
def test_requested_max_tokens_refuses(endpoint: Endpoint, body: dict[str, Any], field: str) -> None:
    with pytest.raises(EngineInputError) as caught:
        requested_max_tokens(endpoint, body)
    assert str(caught.value).startswith(f"'{field}' must be a non-negative integer, got ")


def test_unknown_endpoint_is_refused() -> None:
    unknown: Any = "images"
    for helper in (requested_max_tokens, prompt_texts, prompt_words):
        with pytest.raises(EngineInputError, match="unsupported endpoint 'images'"):
            helper(unknown, {"prompt": "a"})


# ----------------------------------------------------------------------------- prompt


def test_count_words_splits_on_any_whitespace() -> None:
    assert count_words("") == 0
    assert count_words("  one\ttwo\n three  ") == 3


def test_chat_texts_reads_strings_text_parts_and_null() -> None:
    messages = [
        {"role": "system", "content": "be  brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "one two"},
                {"type": "image_url", "image_url": {"url": "data:"}},
                {"text": "untyped part"},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "assistant", "tool_calls": []},
    ]
    assert chat_texts(messages) == ["be  brief", "one two", "untyped part"]
    body = {"messages": messages}
    assert prompt_texts("chat_completions", body) == chat_texts(messages)
    assert prompt_words("chat_completions", body) == 6


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (None, "'messages' must be a non-empty list"),
        ([], "'messages' must be a non-empty list"),
        ("hi", "'messages' must be a non-empty list"),
        (["hi"], "messages[0] must be an object"),
        ([{"content": "a"}, {"role": "user"}], "messages[1] has no 'content'"),
        ([{"content": 5}], "messages[0].content must be a string, a list of parts or null"),
        ([{"content": ["a"]}], "messages[0].content[0] must be an object"),
        ([{"content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text must be"),
        ([{"content": [{"type": "text"}]}], "messages[0].content[0].text must be"),
    ],
)
def test_chat_texts_refuses(messages: object, message: str) -> None:
    with pytest.raises(EngineInputError) as caught:
        chat_texts(messages)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("endpoint", "field"), [("completions", "prompt"), ("embeddings", "input")]
)
def test_prompt_texts_of_completions_and_embeddings(endpoint: Endpoint, field: str) -> None:
    assert prompt_texts(endpoint, {field: "a b"}) == ["a b"]
    assert prompt_texts(endpoint, {field: ["a b", "", "c"]}) == ["a b", "", "c"]
    assert prompt_words(endpoint, {field: ["a b", "", "c"]}) == 3
    assert prompt_words(endpoint, {field: ""}) == 0
    for missing in ({}, {field: None}):
        with pytest.raises(EngineInputError, match=f"'{field}' is required"):
            prompt_texts(endpoint, missing)
    for bad in (3, [], ["a", 1], [[1, 2]], {"text": "a"}):
        with pytest.raises(EngineInputError, match=f"'{field}' must be a string or a non-empty"):
            prompt_words(endpoint, {field: bad})


@pytest.mark.parametrize(
    ("endpoint", "field"), [("completions", "prompt"), ("embeddings", "input")]
)
def test_prompt_words_with_token_ids(endpoint: Endpoint, field: str) -> None:
    def count(value: object) -> int:
        return prompt_words(endpoint, {field: value}, allow_token_ids=True)

    assert count("a b c") == 3
    assert count([5, 6, 7]) == 3
    assert count([[1, 2, 3], "a b", [4]]) == 6
    assert count([[]]) == 0
    with pytest.raises(EngineInputError, match=f"'{field}' is required"):
        count(None)
    for bad in (3, [], [True], [1.5], [[1, "a"]], [{"a": 1}]):
        with pytest.raises(EngineInputError, match=f"'{field}' must be a string or a non-empty"):
            count(bad)


def test_token_ids_do_not_change_how_chat_is_read() -> None:
    body = {"messages": [{"role": "user", "content": "a b"}]}
    assert prompt_words("chat_completions", body, allow_token_ids=True) == 2
    with pytest.raises(EngineInputError, match="'messages'"):
        prompt_words("chat_completions", {"messages": []}, allow_token_ids=True)


# ----------------------------------------------------------------------------- the engines agree


def engines() -> list[Engine]:
    return [
        MockerEngine(
            MockerSettings(
                num_gpu_blocks=1000,
                block_size=4,
                max_num_seqs=8,
                max_num_batched_tokens=512,
                data_parallel_size=1,
                speedup_ratio=1.0,
            )
        ),
        InstantEngine(CONFIG),
        OpenAIUpstreamEngine(Origin("127.0.0.1", 1), CONFIG, model="m"),
    ]


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        (
            "chat_completions",
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "one two three"}]},
                ],
                "max_tokens": 5,
                "max_completion_tokens": 7,
            },
            (5, 7),
        ),
        ("chat_completions", {"messages": [{"content": "a"}], "max_tokens": 4}, (1, 4)),
        ("completions", {"prompt": ["a b", "c"], "max_tokens": 3}, (3, 3)),
        ("completions", {"prompt": "a b", "max_completion_tokens": 3}, (2, DEFAULT_MAX_TOKENS)),
        ("embeddings", {"input": ["x y", "z"]}, (3, 0)),
    ],
)
def test_every_engine_counts_a_body_the_same_way(
    endpoint: Endpoint, body: dict[str, Any], expected: tuple[int, int]
) -> None:
    for engine in engines():
        prepared = engine.prepare(endpoint, {"model": "m", **body})
        assert (prepared.prompt_tokens, prepared.max_tokens) == expected, type(engine).__name__


@pytest.mark.parametrize(
    ("endpoint", "body", "message"),
    [
        ("chat_completions", {"messages": ["hi"]}, "messages[0] must be an object"),
        ("chat_completions", {"messages": [{"role": "user"}]}, "messages[0] has no 'content'"),
        ("completions", {}, "'prompt' is required"),
        ("completions", {"prompt": "a", "max_tokens": -1}, "'max_tokens' must be"),
        (
            "chat_completions",
            {"messages": [{"content": "a"}], "max_completion_tokens": 1.5},
            "'max_completion_tokens' must be",
        ),
        ("embeddings", {"input": 5}, "'input' must be"),
    ],
)
def test_every_engine_refuses_a_bad_body_the_same_way(
    endpoint: Endpoint, body: dict[str, Any], message: str
) -> None:
    for engine in engines():
        with pytest.raises(EngineInputError) as caught:
            engine.prepare(endpoint, body)
        assert message in str(caught.value), type(engine).__name__


@pytest.mark.parametrize("n", [2, 128, 0, "3"])
def test_the_one_choice_engines_refuse_several_choices_and_the_upstream_passes_them_on(
    n: object,
) -> None:
    body = {"model": "m", "prompt": "a b", "max_tokens": 1, "n": n}
    mocker, instant, upstream = engines()
    for engine in (mocker, instant):
        with pytest.raises(EngineInputError) as caught:
            engine.prepare("completions", body)
        assert "one choice per request" in str(caught.value), type(engine).__name__
    if n == 2:
        upstream.prepare("completions", body)  # the upstream server answers n itself
    for engine in (mocker, instant):
        engine.prepare("completions", {**body, "n": 1})
        engine.prepare("embeddings", {"model": "m", "input": "x", "n": 2})
