"""The kinds of number taken from outside (shim_common._numbers): each kind's range, its check,
and that the msgspec types of the wire apply the same range as the check."""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim_common._client_text import quote
from shim_common._numbers import (
    COUNT,
    FRACTION,
    MAX_COUNT,
    RANKS,
    RATIO,
    SECONDS,
    Count,
    Fraction,
    Kind,
    NumberError,
    Ratio,
    Seconds,
)

#: Each kind with the msgspec type a wire field of that kind is annotated with.
TYPED: list[tuple[Kind[Any], Any]] = [
    (COUNT, Count),
    (FRACTION, Fraction),
    (RATIO, Ratio),
    (SECONDS, Seconds),
]


@pytest.mark.parametrize(
    ("kind", "good", "bad"),
    [
        (COUNT, [0, 1, MAX_COUNT], [-1, MAX_COUNT + 1, 2**64, 1.0, True, "1", None]),
        (FRACTION, [0, 0.0, 0.5, 1, 1.0], [-0.1, 1.0000001, math.nan, math.inf, False]),
        (RATIO, [0.0, 1e6, 3], [1e6 + 1, 1e308, -math.inf, math.nan]),
        (SECONDS, [0.0, 30, 1e9], [1e9 + 1, -1.0, math.inf, 10**400]),
        (RANKS, [1, 1024], [0, 1025, 2**63, 1.0]),
    ],
)
def test_each_kind_takes_its_range_and_nothing_else(
    kind: Kind[Any], good: list[object], bad: list[object]
) -> None:
    for value in good:
        checked = kind.check(value)
        assert checked == value
        assert type(checked) is kind.python_type
    for value in bad:
        with pytest.raises(NumberError, match=f"^must be {re.escape(kind.text)}, got "):
            kind.check(value)
        if value is not None:
            with pytest.raises(ValueError, match=f"^Must be {re.escape(kind.text)}\\.$"):
                kind.validator(value)
    kind.validator(None)  # a flag not given


def test_a_refusal_quotes_the_value_by_the_one_quoting_rule() -> None:
    for value in (1.5, -1, 10**60, 10**70, 10**10_000, "x" * 1_000_000):
        with pytest.raises(NumberError) as refused:
            COUNT.check(value)
        assert str(refused.value) == f"must be {COUNT.text}, got {quote(value)}"
        assert len(str(refused.value)) < 150


_ANY_NUMBER = st.one_of(
    st.floats(),
    st.integers(),
    st.integers(min_value=2**53 - 4, max_value=2**53 + 4),
    st.floats(min_value=-1.0, max_value=2.0),
    st.booleans(),
)


@given(value=_ANY_NUMBER)
def test_the_wire_types_agree_with_the_check(value: object) -> None:
    for kind, typed in TYPED:
        try:
            kind.check(value)
            accepted = True
        except NumberError:
            accepted = False
        try:
            msgspec.convert(value, typed)
            decoded = True
        except msgspec.ValidationError:
            decoded = False
        assert accepted == decoded, (kind, value)
