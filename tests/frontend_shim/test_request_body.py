"""What the frontend reads of a completion body, and how it refuses one."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_shim._request_body import (
    MAX_BODY_DEPTH,
    MAX_BODY_VALUES,
    MAX_CHOICES,
    MAX_EMBEDDING_INPUTS,
    BadRequest,
    parse_completion_body,
)
from shim_common._client_text import quote, shorten


def test_a_well_formed_body_comes_back_whole() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 3}'
    body = parse_completion_body(raw, "chat_completions")
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 3}


@pytest.mark.parametrize(
    ("raw", "endpoint", "says"),
    [
        (b"{", "completions", "not valid JSON"),
        (b"[1]", "completions", "JSON object"),
        (b'{"prompt": "x"}', "completions", "`model`"),
        (b'{"model": ""}', "completions", "`model`"),
        (b'{"model": "m", "stream": "yes"}', "completions", "`stream`"),
        (b'{"model": "m", "messages": []}', "chat_completions", "`messages`"),
    ],
)
def test_a_malformed_body_is_a_400_naming_what_is_wrong(
    raw: bytes, endpoint: str, says: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_completion_body(raw, endpoint)  # type: ignore[arg-type]
    assert refused.value.status == 400
    assert not refused.value.admin
    assert says in str(refused.value)


def _nested(depth: int) -> bytes:
    return b"[" * (depth - 1) + b"[1]" + b"]" * (depth - 1)


def test_nesting_is_accepted_to_the_bound_and_refused_past_it() -> None:
    body = b'{"model": "m", "x": ' + _nested(MAX_BODY_DEPTH - 1) + b"}"
    assert parse_completion_body(body, "completions")["model"] == "m"
    # 100,000 deep is past what the parser itself can nest: refused the same way, not a crash.
    for depth in (MAX_BODY_DEPTH, 1000, 100_000):
        with pytest.raises(BadRequest) as refused:
            parse_completion_body(b'{"model": "m", "x": ' + _nested(depth) + b"}", "completions")
        assert refused.value.status == 400
        assert f"more than {MAX_BODY_DEPTH} levels" in str(refused.value)


def test_integers_past_64_bits_and_non_finite_numbers_are_400() -> None:
    for literal in (b"9223372036854775808", b"-9223372036854775809", b"1" + b"0" * 40):
        with pytest.raises(BadRequest) as refused:
            parse_completion_body(b'{"model": "m", "max_tokens": ' + literal + b"}", "completions")
        assert refused.value.status == 400
        assert len(str(refused.value)) < 200
    for literal in (b"1e999", b"-1e400"):
        with pytest.raises(BadRequest):
            parse_completion_body(b'{"model": "m", "temperature": ' + literal + b"}", "completions")
    edge = b'{"model": "m", "seed": 9223372036854775807, "x": -9223372036854775808}'
    assert parse_completion_body(edge, "completions")["seed"] == 2**63 - 1


def test_too_many_values_are_refused_before_parsing_and_the_bound_itself_is_parsed() -> None:
    def keys(count: int) -> bytes:
        members = b",".join(b'"k%d":1' % index for index in range(count - 2))
        return b'{"model":"m","prompt":"x",' + members + b"}"

    assert len(parse_completion_body(keys(MAX_BODY_VALUES), "completions")) == MAX_BODY_VALUES
    with pytest.raises(BadRequest) as refused:
        parse_completion_body(keys(MAX_BODY_VALUES + 1), "completions")
    assert refused.value.status == 413
    assert str(MAX_BODY_VALUES) in str(refused.value)
    # A large body of few values (one long string) is not counted against the bound.
    long_prompt = b'{"model":"m","prompt":"' + b"x" * 600_000 + b'"}'
    assert len(parse_completion_body(long_prompt, "completions")["prompt"]) == 600_000


@pytest.mark.parametrize("n", [0, -1, 129, 10_000, 1.5, True, "2"])
def test_n_out_of_its_bound_is_400(n: object) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_completion_body(msgspec.json.encode({"model": "m", "n": n}), "completions")
    assert refused.value.status == 400
    assert f"from 1 to {MAX_CHOICES}" in str(refused.value)


def test_n_within_its_bound_and_embedding_inputs_to_their_bound_pass() -> None:
    for n in (1, MAX_CHOICES, None):
        parse_completion_body(msgspec.json.encode({"model": "m", "n": n}), "completions")
    inputs = ["w"] * MAX_EMBEDDING_INPUTS
    parse_completion_body(msgspec.json.encode({"model": "m", "input": inputs}), "embeddings")
    with pytest.raises(BadRequest) as refused:
        parse_completion_body(
            msgspec.json.encode({"model": "m", "input": [*inputs, "w"]}), "embeddings"
        )
    assert f"at most {MAX_EMBEDDING_INPUTS}" in str(refused.value)


def test_error_messages_quote_a_short_prefix_only() -> None:
    long = "x" * (1 << 20)
    assert len(shorten(long)) < 100
    assert shorten("short") == "short"
    assert len(quote(long)) < 100
    with pytest.raises(BadRequest) as refused:
        parse_completion_body(msgspec.json.encode({"model": "m", "n": long}), "completions")
    assert len(str(refused.value)) < 200


_ABSURD_NUMBERS = st.one_of(
    st.integers(min_value=-(2**200), max_value=2**200),
    st.sampled_from([2**63, 2**64, 2**64 + 1, -(2**63) - 1, 10**40]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["1e999", "-1e999", "1e-999", "-0.0", "1E308", "1" + "0" * 30]),
)


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(
        ["max_tokens", "max_completion_tokens", "seed", "n", "temperature", "top_p", "logprobs"]
    ),
    number=_ABSURD_NUMBERS,
    endpoint=st.sampled_from(["completions", "chat_completions", "embeddings"]),
)
def test_absurd_numbers_in_a_completion_body_are_accepted_within_bounds_or_400(
    field: str, number: int | float | str, endpoint: str
) -> None:
    literal = number.encode() if isinstance(number, str) else json.dumps(number).encode()
    raw = (
        b'{"model": "m", "prompt": "x", "input": "x", '
        b'"messages": [{"role": "user", "content": "x"}], "'
        + field.encode()
        + b'": '
        + literal
        + b"}"
    )
    refusal: BadRequest | None = None
    try:
        body = parse_completion_body(raw, endpoint)  # type: ignore[arg-type]
    except BadRequest as refused:
        refusal = refused
    if refusal is not None:
        assert refusal.status == 400
        assert len(str(refusal)) < 300
        return
    # Accepted: what the worker's protocol must carry encodes, and every number is in range.
    msgspec.msgpack.encode(body)
    value = body[field]
    if isinstance(value, int):
        assert -(2**63) <= value < 2**63
    else:
        assert math.isfinite(value)
