"""The KV index (frontend_shim._kv_index) against a model of it, without I/O."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_shim._kv_index import (
    EVENTS_PREDICTION_TTL,
    MAX_BLOCKS_PER_WORKER,
    MAX_FIRST_NAMES,
    SNAPSHOT_RETRY,
    KvIndex,
    KvStreamError,
    RankBlocks,
)
from shim_common import wire

RANKS = 2
#: A small universe of names, so that stores, removals and prompts overlap often.
NAMES = st.integers(min_value=1, max_value=12)


def config(worker_id: str = "w", *, ranks: int = RANKS, blocks: int = 1000) -> wire.RuntimeConfig:
    return wire.RuntimeConfig(
        worker_id=worker_id,
        model="m",
        kv_total_blocks=blocks,
        block_size=4,
        max_num_batched_tokens=1000,
        max_num_seqs=256,
        data_parallel_size=ranks,
        engine_request_limit=None,
        request_queue_limit=40000,
        heartbeat_interval=1.0,
    )


class Worker:
    """The truth: what a worker's ranks hold, and the KV events it numbers."""

    def __init__(self, ranks: int = RANKS) -> None:
        self.held: list[set[int]] = [set() for _ in range(ranks)]
        self.seq = 0

    def stored(self, rank: int, names: list[int]) -> wire.KvStored:
        self.seq += 1
        self.held[rank].update(names)
        return wire.KvStored(seq=self.seq, dp_rank=rank, parent=None, blocks=names)

    def removed(self, rank: int, names: list[int]) -> wire.KvRemoved:
        self.seq += 1
        self.held[rank].difference_update(names)
        return wire.KvRemoved(seq=self.seq, dp_rank=rank, blocks=names)

    def cleared(self, rank: int) -> wire.KvCleared:
        self.seq += 1
        self.held[rank].clear()
        return wire.KvCleared(seq=self.seq, dp_rank=rank)

    def snapshot(self) -> wire.KvSnapshot:
        return wire.KvSnapshot(seq=self.seq, ranks=[sorted(names) for names in self.held])


def model_depth(held: set[int], prompt: list[int]) -> int:
    depth = 0
    for name in prompt:
        if name not in held:
            break
        depth += 1
    return depth


OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("stored"), st.integers(0, RANKS - 1), st.lists(NAMES, max_size=5)),
        st.tuples(st.just("removed"), st.integers(0, RANKS - 1), st.lists(NAMES, max_size=5)),
        st.tuples(st.just("cleared"), st.integers(0, RANKS - 1), st.just([])),
        st.tuples(st.just("lost"), st.integers(0, RANKS - 1), st.lists(NAMES, max_size=5)),
        st.tuples(st.just("snapshot"), st.just(0), st.just([])),
    ),
    max_size=40,
)
PROMPTS = st.lists(st.lists(NAMES, min_size=1, max_size=6), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(operations=OPERATIONS, prompts=PROMPTS)
def test_the_index_follows_the_worker_and_asks_for_a_snapshot_after_a_gap(
    operations: list[tuple[str, int, list[int]]], prompts: list[list[int]]
) -> None:
    index = KvIndex()
    worker = Worker()
    assert index.add_worker(config(), 0.0, events=True)
    assert not index.apply("w", [worker.snapshot()], 0.0)
    in_step = True  # no event lost since the last snapshot
    now = 0.0
    for kind, rank, names in operations:
        now += 1.0
        if kind == "snapshot":
            assert not index.apply("w", [worker.snapshot()], now)
            in_step = True
        elif kind == "lost":
            worker.stored(rank, names)  # the event never reaches the frontend
            if in_step:
                noticed = False
            in_step = False
        else:
            event = getattr(worker, kind)(rank, *([names] if kind != "cleared" else []))
            asked = index.apply("w", [event], now)
            if in_step:
                assert not asked
            elif not noticed:
                # The first event after a loss shows the gap: a snapshot is asked for.
                assert asked
                noticed = True
        if in_step:
            for r in range(RANKS):
                assert index.worker("w").ranks[r].cached.keys() == worker.held[r]  # type: ignore[union-attr]
                for prompt in prompts:
                    assert index.depth("w", r, prompt, now) == model_depth(worker.held[r], prompt)
        kept = index.worker("w")
        assert kept is not None
        for prompt in prompts:
            # Rule 7: the holders of a first name never miss a rank that holds it.
            holding = {rank for rank in kept.ranks if rank.depth(prompt, now) > 0}
            assert holding <= set(index.holders(prompt[0], now))
        if kind == "lost" and names:
            index.predict("w", rank, names, now)  # the router's guesses count as held too


def test_a_gap_asks_once_then_again_only_after_the_retry_delay() -> None:
    index = KvIndex()
    worker = Worker()
    index.add_worker(config(), 0.0, events=True)
    index.apply("w", [worker.snapshot()], 0.0)
    worker.stored(0, [1])  # lost
    assert index.apply("w", [worker.stored(0, [2])], 1.0)
    worker.stored(0, [3])  # lost again, while the snapshot is awaited
    assert not index.apply("w", [worker.stored(0, [4])], 2.0)
    worker.stored(0, [5])
    assert index.apply("w", [worker.stored(0, [6])], 2.0 + SNAPSHOT_RETRY)
    assert index.stats.gaps == 3
    # Events after the gap were applied all the same; the snapshot then makes it exact.
    assert index.depth("w", 0, [6], 3.0) == 1
    index.apply("w", [worker.snapshot()], 9.0)
    assert index.worker("w").ranks[0].cached.keys() == {1, 2, 3, 4, 5, 6}  # type: ignore[union-attr]
    # An event the snapshot covered is skipped.
    assert not index.apply("w", [wire.KvCleared(seq=worker.seq, dp_rank=0)], 9.0)
    assert index.stats.skipped == 1
    assert index.depth("w", 0, [1, 2, 3], 9.0) == 3


def test_an_event_for_a_rank_the_worker_lacks_is_ignored_and_loses_nothing() -> None:
    index = KvIndex()
    worker = Worker()
    index.add_worker(config(), 0.0, events=True)
    events = [
        worker.stored(0, [1, 2]),
        wire.KvStored(seq=worker.seq + 1, dp_rank=RANKS, parent=None, blocks=[9]),
    ]
    worker.seq += 1
    events.append(worker.stored(1, [3]))
    assert not index.apply("w", events, 0.0)
    assert index.stats.invalid == 1
    assert index.depth("w", 0, [1, 2], 0.0) == 2
    assert index.depth("w", 1, [3], 0.0) == 1


def test_a_rank_keeps_at_most_its_cache_size() -> None:
    index = KvIndex()
    index.add_worker(config(blocks=3), 0.0, events=True)
    index.apply("w", [wire.KvStored(seq=1, dp_rank=0, parent=None, blocks=[1, 2, 3, 4, 5])], 0.0)
    assert index.worker("w").ranks[0].cached.keys() == {1, 2, 3}  # type: ignore[union-attr]
    assert index.stats.overflow == 2
    index.apply("w", [wire.KvSnapshot(seq=1, ranks=[list(range(100)), []])], 0.0)
    assert len(index.worker("w").ranks[0].cached) == 3  # type: ignore[union-attr]
    # Whatever the hello claims, a worker costs at most MAX_BLOCKS_PER_WORKER names per layer.
    index.add_worker(config("big", ranks=4, blocks=10**9), 0.0, events=True)
    assert index.worker("big").cap * 4 <= MAX_BLOCKS_PER_WORKER  # type: ignore[union-attr]
    # Guesses too.
    index.predict("w", 1, list(range(10)), 0.0)
    assert len(index.worker("w").ranks[1].predicted) == 3  # type: ignore[union-attr]


def test_guesses_expire_after_their_ttl_and_removals_drop_them() -> None:
    index = KvIndex(prediction_ttl=60.0)
    index.add_worker(config("events"), 0.0, events=True)
    index.add_worker(config("silent"), 0.0, events=False)
    for worker_id in ("events", "silent"):
        index.predict(worker_id, 0, [1, 2, 3], 0.0)
        assert index.depth(worker_id, 0, [1, 2, 3, 4], 1.0) == 3
    # A worker that sends events has its guesses believed briefly; one that does not, for the TTL.
    assert index.depth("events", 0, [1, 2], EVENTS_PREDICTION_TTL + 0.1) == 0
    assert index.depth("silent", 0, [1, 2], EVENTS_PREDICTION_TTL + 0.1) == 2
    assert index.depth("silent", 0, [1, 2], 60.1) == 0
    # The worker's removal is newer than the guess.
    index.predict("events", 0, [1, 2, 3], 100.0)
    index.apply("events", [wire.KvRemoved(seq=1, dp_rank=0, blocks=[2])], 100.0)
    assert index.depth("events", 0, [1, 2, 3], 100.0) == 1
    index.apply("events", [wire.KvCleared(seq=2, dp_rank=0)], 100.0)
    assert index.depth("events", 0, [1], 100.0) == 0


def test_without_events_no_worker_is_subscribed() -> None:
    index = KvIndex(use_events=False, prediction_ttl=5.0)
    assert not index.add_worker(config(), 0.0, events=True)
    index.predict("w", 0, [1], 0.0)
    assert index.depth("w", 0, [1], 4.9) == 1
    assert index.depth("w", 0, [1], 5.0) == 0


def test_a_reconnected_worker_starts_empty_and_a_removed_one_is_forgotten() -> None:
    index = KvIndex()
    index.add_worker(config(), 0.0, events=True)
    index.apply("w", [wire.KvSnapshot(seq=4, ranks=[[1], [2]])], 0.0)
    assert (index.depth("w", 0, [1], 0.0), index.depth("w", 1, [2], 0.0)) == (1, 1)
    index.add_worker(config(), 1.0, events=True)
    assert (index.depth("w", 0, [1], 1.0), index.depth("w", 1, [2], 1.0)) == (0, 0)
    assert index.worker("w").last_seq == 0  # type: ignore[union-attr]
    index.remove_worker("w")
    assert index.worker("w") is None
    assert not index.apply("w", [wire.KvCleared(seq=1, dp_rank=0)], 2.0)
    assert index.depth("w", 0, [1], 2.0) == 0


def test_a_bad_ttl_is_refused() -> None:
    with pytest.raises(ValueError, match="prediction_ttl"):
        KvIndex(prediction_ttl=0.0)


def test_what_a_rank_holds_is_out_of_the_garbage_collectors_sight() -> None:
    # A full collection walks every tracked container: with 67 million names in sets it took
    # seconds. Dicts of integers (and of floats) are not tracked.
    import gc

    index = KvIndex()
    index.add_worker(config(), 0.0, events=True)
    index.apply("w", [wire.KvSnapshot(seq=1, ranks=[[1, 2, 3], [4]])], 0.0)
    index.apply("w", [wire.KvStored(seq=2, dp_rank=1, parent=4, blocks=[5, 6])], 0.0)
    index.predict("w", 0, [1, 2, 9], 0.0)
    for rank in index.worker("w").ranks:  # type: ignore[union-attr]
        assert not gc.is_tracked(rank.cached)
        assert not gc.is_tracked(rank.predicted)


# ----------------------------------------------------------------------------- snapshot parts


def test_a_snapshot_in_parts_is_put_in_use_whole_with_its_last_part() -> None:
    index = KvIndex()
    index.add_worker(config(), 0.0, events=True)
    index.apply("w", [wire.KvSnapshot(seq=3, ranks=[[1], [2]])], 0.0)
    index.apply("w", [wire.KvSnapshot(seq=9, ranks=[[5, 6]], more=True)], 1.0)
    # While the parts come in, routing sees the snapshot before, whole.
    assert index.depth("w", 0, [1], 1.0) == 1
    assert index.depth("w", 0, [5], 1.0) == 0
    assert index.worker("w").last_seq == 3  # type: ignore[union-attr]
    index.apply("w", [wire.KvSnapshot(seq=9, ranks=[[7], [8]], more=True)], 1.0)
    index.apply("w", [wire.KvSnapshot(seq=9, ranks=[[], [9]])], 1.0)
    assert [set(rank.cached) for rank in index.worker("w").ranks] == [{5, 6, 7}, {8, 9}]  # type: ignore[union-attr]
    assert index.worker("w").last_seq == 9  # type: ignore[union-attr]
    assert (index.stats.snapshots, index.stats.snapshot_parts) == (2, 4)
    assert not index.apply("w", [wire.KvStored(seq=10, dp_rank=0, parent=7, blocks=[10])], 2.0)


@pytest.mark.parametrize(
    "intruder",
    [
        wire.KvStored(seq=10, dp_rank=0, parent=None, blocks=[1]),
        wire.KvCleared(seq=10, dp_rank=0),
        wire.KvSnapshot(seq=12, ranks=[[1]]),
    ],
)
def test_anything_but_the_next_part_inside_a_snapshots_parts_breaks_the_stream(
    intruder: wire.KvEvent,
) -> None:
    index = KvIndex()
    index.add_worker(config(), 0.0, events=True)
    index.apply("w", [wire.KvSnapshot(seq=9, ranks=[[5]], more=True)], 0.0)
    with pytest.raises(KvStreamError, match="inside the parts of snapshot 9"):
        index.apply("w", [intruder], 0.0)


def test_a_part_costs_its_names_whatever_the_cache_claimed() -> None:
    # A worker claiming a huge cache sends parts; each part is stored under the cap, and a name
    # over the cap is counted, not kept, while the parts come in too.
    index = KvIndex()
    index.add_worker(config(blocks=3, ranks=1), 0.0, events=True)
    index.apply("w", [wire.KvSnapshot(seq=1, ranks=[[1, 2]], more=True)], 0.0)
    index.apply("w", [wire.KvSnapshot(seq=1, ranks=[[3, 4, 5]])], 0.0)
    assert set(index.worker("w").ranks[0].cached) == {1, 2, 3}  # type: ignore[union-attr]
    assert index.stats.overflow == 2


# ----------------------------------------------------------------------------- rule 7's map


def test_forgetting_a_worker_costs_what_its_ranks_are_named_for_not_the_whole_map(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, every reconnect walked all the remembered first names (up to 65,536) for every
    # worker, whatever it held.
    index = KvIndex()
    index.add_worker(config("big", blocks=70_000, ranks=1), 0.0, events=True)
    index.add_worker(config("small", ranks=2), 0.0, events=True)
    names = list(range(100, 100 + MAX_FIRST_NAMES))
    index.apply("big", [wire.KvSnapshot(seq=1, ranks=[names])], 0.0)
    index.apply("small", [wire.KvSnapshot(seq=1, ranks=[[names[0]], [7]])], 0.0)
    for name in names:
        index.holders(name, 1.0)
    small = index.worker("small")
    assert small is not None
    dropped: list[int] = []
    drop = index._drop_holder
    def counted(name: int, rank: object) -> None:
        dropped.append(name)
        drop(name, rank)  # type: ignore[arg-type]

    monkeypatch.setattr(index, "_drop_holder", counted)
    index.add_worker(config("small", ranks=2), 2.0, events=True)  # a reconnect
    assert dropped == [names[0]]
    # And what it was named for no longer names it.
    assert all(rank not in index.holders(names[0], 2.0) for rank in small.ranks)
    assert len(index.holders(names[0], 2.0)) == 1
    dropped.clear()
    index.remove_worker("big")
    assert len(dropped) == MAX_FIRST_NAMES
    assert not any(index.holders(name, 3.0) for name in names[:100])


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["store", "ask", "predict", "remove", "reconnect", "snapshot"]),
            st.integers(0, 2),
            st.lists(NAMES, max_size=4),
        ),
        max_size=40,
    )
)
def test_holders_never_miss_a_rank_and_never_name_a_forgotten_one(
    steps: list[tuple[str, int, list[int]]],
) -> None:
    index = KvIndex()
    ids = ["a", "b", "c"]
    seqs = dict.fromkeys(ids, 0)
    for worker_id in ids:
        index.add_worker(config(worker_id), 0.0, events=True)
        index.apply(worker_id, [wire.KvSnapshot(seq=0, ranks=[[], []])], 0.0)
    gone: set[RankBlocks] = set()  # the ranks of forgotten workers (kept: no id is reused)
    now = 1.0
    for kind, which, names in steps:
        worker_id = ids[which]
        worker = index.worker(worker_id)
        assert worker is not None
        if kind == "store":
            seqs[worker_id] += 1
            stored = wire.KvStored(seq=seqs[worker_id], dp_rank=0, parent=None, blocks=names)
            index.apply(worker_id, [stored], now)
        elif kind == "ask":
            for name in names:
                index.holders(name, now)
        elif kind == "predict":
            index.predict(worker_id, 1, names, now)
        elif kind == "snapshot":
            snapshot = wire.KvSnapshot(seq=seqs[worker_id], ranks=[names, names[:1]])
            index.apply(worker_id, [snapshot], now)
        else:
            gone.update(worker.ranks)
            if kind == "remove":
                index.remove_worker(worker_id)
            index.add_worker(config(worker_id), now, events=True)
            seqs[worker_id] = 0
            index.apply(worker_id, [wire.KvSnapshot(seq=0, ranks=[[], []])], now)
        for name in range(1, 13):
            named = index.holders(name, now)
            assert not set(named) & gone
            for other in ids:
                kept = index.worker(other)
                assert kept is not None
                for rank in kept.ranks:
                    if rank.holds(name, now):
                        assert rank in named
                    # Each rank's own list of names agrees with the map.
                    for first in rank.firsts:
                        assert rank in index.holders(first, now) or not rank.holds(first, now)


def test_the_map_of_first_names_costs_what_the_docs_say_under_tracemalloc() -> None:
    # 65,536 remembered names, each held by one rank of 64: about 80 bytes a name (5 MB), where
    # a set per name cost 256 bytes (17 MB); the docs quote both.
    import gc
    import random
    import tracemalloc

    rng = random.Random(1)
    index = KvIndex()
    names = [rng.getrandbits(63) for _ in range(MAX_FIRST_NAMES)]
    for w in range(16):
        index.add_worker(config(f"w{w}", blocks=16384, ranks=4), 0.0, events=True)
        ranks = [names[(w * 4 + r) :: 64] for r in range(4)]
        index.apply(f"w{w}", [wire.KvSnapshot(seq=0, ranks=ranks)], 0.0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for name in names:
            index.holders(name, 1.0)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.remembered == MAX_FIRST_NAMES
    assert grown / MAX_FIRST_NAMES < 120
