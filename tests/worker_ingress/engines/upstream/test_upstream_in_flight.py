"""The load the ``openai`` engine has put on its upstream, as running totals (sans-IO)."""

from __future__ import annotations

import math

import hypothesis.strategies as st
from hypothesis import given, settings

from worker_ingress.engines.upstream._in_flight import InFlightLoad


def test_in_flight_load_rules() -> None:
    load = InFlightLoad(block_size=4)
    first = load.start(5)
    assert (load.prefill_tokens, load.blocks) == (5, 2)
    second = load.start(3)
    assert (load.prefill_tokens, load.blocks) == (8, 3)
    assert load.first_output(first) is True
    assert load.first_output(first) is False
    assert load.prefill_tokens == 3
    assert load.generated(first, 3) is False  # 8 tokens: still 2 blocks
    assert load.generated(first, 1) is True  # 9 tokens: 3 blocks
    assert load.blocks == 4
    load.finish(second)  # still prefilling: its prompt leaves the prefill count
    assert (load.prefill_tokens, load.blocks) == (0, 3)
    load.finish(first)
    assert (load.prefill_tokens, load.blocks, len(load)) == (0, 0, 0)


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(st.sampled_from(["start", "first", "gen", "finish"]), st.integers(0, 50)),
        max_size=60,
    )
)
def test_in_flight_load_matches_recount(operations: list[tuple[str, int]]) -> None:
    load = InFlightLoad(block_size=16)
    model: dict[int, list[int]] = {}
    for operation, number in operations:
        keys = sorted(model)
        if operation == "start":
            model[load.start(number)] = [number, 0, 1]
            continue
        if not keys:
            continue
        key = keys[number % len(keys)]
        if operation == "first":
            load.first_output(key)
            model[key][2] = 0
        elif operation == "gen":
            load.generated(key, number)
            model[key][1] += number
        else:
            load.finish(key)
            del model[key]
        assert load.prefill_tokens == sum(p for p, _, prefilling in model.values() if prefilling)
        assert load.blocks == sum(math.ceil((p + g) / 16) for p, g, _ in model.values())
