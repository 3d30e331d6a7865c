"""The ``kv`` router's choice (frontend_shim._kv_cost through frontend_shim._router), no I/O."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_shim._kv_cost import MAX_PROMPT_BLOCKS, CostWeights, KvScorer, Prompt
from frontend_shim._kv_index import KvIndex
from frontend_shim._load import Fleet
from frontend_shim._router import Routed, Router, RouterMode
from shim_common import wire
from shim_common.prefix import block_names
from shim_common.wire import BusyThresholds

MODEL = "m"
BLOCK = 4


def config(worker_id: str, ranks: int = 1) -> wire.RuntimeConfig:
    return wire.RuntimeConfig(
        worker_id=worker_id,
        model=MODEL,
        kv_total_blocks=1000,
        block_size=BLOCK,
        max_num_batched_tokens=1000,
        max_num_seqs=256,
        data_parallel_size=ranks,
        engine_request_limit=None,
        request_queue_limit=40000,
        heartbeat_interval=100.0,
    )


class Setup:
    def __init__(self, workers: int, ranks: int = 1, thresholds: BusyThresholds | None = None):
        self.fleet = Fleet(default_thresholds=thresholds or BusyThresholds())
        self.index = KvIndex()
        self.seq: dict[str, int] = {}
        for n in range(workers):
            worker_id = f"w{n}"
            self.fleet.register(config(worker_id, ranks), 0.0)
            self.index.add_worker(config(worker_id, ranks), 0.0, events=True)
            self.seq[worker_id] = 0

    def router(self, weights: CostWeights | None = None, seed: int = 0) -> Router:
        scorer = KvScorer(self.index, weights or CostWeights(), random.Random(seed))
        return Router(self.fleet, RouterMode.KV, kv=scorer)

    def load(self, worker_id: str, rank: int, decode: int, prefill: int = 0) -> None:
        self.seq[worker_id] += 1
        load = wire.RankLoad(
            dp_rank=rank,
            active_decode_blocks=decode,
            active_prefill_tokens=prefill,
            kv_used_blocks=0,
        )
        event = wire.LoadEvent(
            seq=self.seq[worker_id], ts=0.0, load=load, engine_requests=0, queued_requests=0
        )
        self.fleet.apply(worker_id, event, 0.0)

    def cache(self, worker_id: str, rank: int, names: list[int]) -> None:
        kept = self.index.worker(worker_id)
        assert kept is not None
        seq = kept.last_seq + 1
        stored = wire.KvStored(seq=seq, dp_rank=rank, parent=None, blocks=names)
        assert not self.index.apply(worker_id, [stored], 0.0)


def tokens(count: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 50_000 for i in range(count)]


def test_the_docs_example_is_chosen_as_dynamo_chooses_it() -> None:
    # Dynamo's documented example (credit 1): W1 8 + 10 = 18, W2 5 + 5 = 10, W3 2 + 9 = 11.
    setup = Setup(3)
    prompt = Prompt(tokens(10 * BLOCK))
    names = prompt.names(BLOCK)
    for worker_id, cached, decode in (("w0", 2, 10), ("w1", 5, 5), ("w2", 8, 9)):
        setup.cache(worker_id, 0, names[:cached])
        setup.load(worker_id, 0, decode)
    routed = setup.router().pick(MODEL, 0.0, prompt=prompt)
    assert isinstance(routed, Routed)
    assert routed.worker_id == "w1"
    assert routed.kv is not None
    assert (routed.kv.cached_blocks, routed.kv.cost) == (5, 10.0)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    workers=st.integers(1, 5),
    ranks=st.integers(1, 3),
    credit=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    scale=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
)
def test_the_choice_is_a_rank_of_least_cost(
    data: st.DataObject, workers: int, ranks: int, credit: float, scale: float
) -> None:
    setup = Setup(workers, ranks)
    prompt = Prompt(tokens(data.draw(st.integers(0, 12 * BLOCK + 3), label="prompt tokens")))
    names = prompt.names(BLOCK)
    expected: dict[tuple[str, int], float] = {}
    for n in range(workers):
        worker_id = f"w{n}"
        for rank in range(ranks):
            cached = data.draw(st.integers(0, len(names)), label="cached")
            decode = data.draw(st.integers(0, 30), label="decode")
            prefill = data.draw(st.integers(0, 40), label="prefill")
            setup.cache(worker_id, rank, names[:cached])
            setup.load(worker_id, rank, decode, prefill)
            uncached = (len(prompt.tokens) + prefill) / BLOCK - credit * cached
            expected[worker_id, rank] = scale * max(0.0, uncached) + decode
    router = setup.router(CostWeights(credit=credit, prefill_load_scale=scale))
    routed = router.pick(MODEL, 0.0, prompt=prompt)
    assert isinstance(routed, Routed)
    assert routed.kv is not None
    chosen = (routed.worker_id, routed.kv.dp_rank)
    assert expected[chosen] == pytest.approx(min(expected.values()))
    assert routed.kv.cost == pytest.approx(expected[chosen])


def test_ties_rotate() -> None:
    setup = Setup(3)
    router = setup.router()
    prompt = Prompt(tokens(8))
    picks = Counter(router.pick(MODEL, 0.0, prompt=prompt) for _ in range(30))
    assert picks == {Routed("w0"): 10, Routed("w1"): 10, Routed("w2"): 10}


def test_a_busy_rank_of_a_free_worker_is_not_chosen() -> None:
    setup = Setup(1, ranks=2, thresholds=BusyThresholds(active_prefill_tokens=10))
    prompt = Prompt(tokens(8 * BLOCK))
    setup.cache("w0", 0, prompt.names(BLOCK))
    setup.load("w0", 0, 0, prefill=11)  # busy, though it holds the whole prompt
    setup.load("w0", 1, 0, prefill=0)
    routed = setup.router().pick(MODEL, 0.0, prompt=prompt)
    assert isinstance(routed, Routed)
    assert routed.dp_rank == 1


def test_a_temperature_draws_cheap_ranks_more_often_and_every_rank_sometimes() -> None:
    setup = Setup(3)
    prompt = Prompt(tokens(10 * BLOCK))
    setup.cache("w0", 0, prompt.names(BLOCK))
    setup.load("w2", 0, 40)
    router = setup.router(CostWeights(temperature=0.5), seed=3)
    picks = Counter(router.pick(MODEL, 0.0, prompt=prompt) for _ in range(600))
    # Normalised costs 0 (w0), 0.2 (w1), 1 (w2): weights 1, 0.67, 0.14.
    assert picks[Routed("w0")] > picks[Routed("w1")] > picks[Routed("w2")] > 0


def test_credit_zero_ignores_the_cache() -> None:
    setup = Setup(2)
    prompt = Prompt(tokens(10 * BLOCK))
    setup.cache("w0", 0, prompt.names(BLOCK))
    setup.load("w0", 0, 3)
    routed = setup.router(CostWeights(credit=0.0)).pick(MODEL, 0.0, prompt=prompt)
    assert routed == Routed("w1")
    routed = setup.router(CostWeights(credit=1.0)).pick(MODEL, 0.0, prompt=prompt)
    assert routed == Routed("w0")


def test_the_routers_guess_keeps_a_burst_of_one_conversation_together() -> None:
    # Without any event from the workers, the second turn follows the first: the router's own
    # guess of what it sent is the only thing that can tell.
    setup = Setup(4)
    router = setup.router()
    first = Prompt(tokens(20 * BLOCK, seed=5))
    routed = router.pick(MODEL, 0.0, prompt=first)
    assert isinstance(routed, Routed)
    assert routed.kv is not None
    setup.index.predict(routed.worker_id, routed.kv.dp_rank, routed.kv.names, 0.0)
    second = Prompt([*first.tokens, *tokens(6 * BLOCK, seed=6)])
    for _ in range(4):  # whatever the cursor
        again = router.pick(MODEL, 0.1, prompt=second)
        assert again == Routed(routed.worker_id)
        assert again.kv is not None
        assert again.kv.cached_blocks == 20


def test_a_prefix_its_requests_in_flight_hold_is_not_counted_again_on_that_rank() -> None:
    # Under load a conversation's next turn arrives while the last is still queued there: the
    # rank already holds the history for it, so it adds only the new blocks (Dynamo's projected
    # decode blocks), where counting the history twice would send the turn away from it.
    setup = Setup(2)
    history = Prompt(tokens(12 * BLOCK, seed=3))
    in_flight = setup.fleet.request_sent("w0", len(history.tokens), 0, history.names(BLOCK))
    assert in_flight is not None
    setup.fleet.request_output("w0", in_flight, 1)  # decoding: no prefill left to wait for
    setup.load("w1", 0, 8)  # fewer active blocks than w0's 12
    turn = Prompt([*history.tokens, *tokens(4 * BLOCK, seed=4)])
    routed = setup.router(CostWeights(credit=0.0)).pick(MODEL, 0.0, prompt=turn)
    assert isinstance(routed, Routed)
    assert routed.kv is not None
    # w0: 16 prompt blocks + its 12 active - the 12 of them this prompt shares = 16; w1: 24.
    assert (routed.worker_id, routed.kv.cost) == ("w0", 16.0)
    setup.fleet.request_finished("w0", in_flight)
    alone = setup.router(CostWeights(credit=0.0)).pick(MODEL, 0.0, prompt=turn)
    assert alone == Routed("w0")  # nothing in flight: 16 + 0 against 16 + 8
    assert alone.kv is not None
    assert alone.kv.cost == 16.0


def test_a_prompt_the_router_could_not_read_is_chosen_by_load_alone() -> None:
    setup = Setup(2)
    setup.load("w0", 0, 5)
    assert setup.router().pick(MODEL, 0.0) == Routed("w1")


def test_names_are_computed_once_per_block_size() -> None:
    prompt = Prompt(tokens(33))
    assert prompt.names(BLOCK) is prompt.names(BLOCK)
    assert prompt.names(BLOCK) == block_names(prompt.tokens, BLOCK)
    assert len(prompt.names(16)) == 2


def test_a_huge_prompt_is_named_only_as_far_as_the_bound() -> None:
    prompt = Prompt([7] * ((MAX_PROMPT_BLOCKS + 3) * BLOCK))
    assert len(prompt.names(BLOCK)) == MAX_PROMPT_BLOCKS


def test_bad_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="credit"):
        CostWeights(credit=-1.0)
    with pytest.raises(ValueError, match="temperature"):
        CostWeights(temperature=float("nan"))
