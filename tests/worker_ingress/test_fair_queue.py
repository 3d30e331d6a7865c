"""Unit tests of the queue discipline (worker_ingress/_fair_queue.py), one rule at a time."""

from __future__ import annotations

import itertools
import math

import pytest

from worker_ingress._fair_queue import (
    DISPLACED_BY_PRIORITY,
    DISPLACED_BY_SHARE,
    MAX_TENANT_WEIGHT,
    MIN_TENANT_WEIGHT,
    FairQueue,
    QueueEntry,
)


def _queue(queue: FairQueue, entries: list[tuple[int, str, int]]) -> list[QueueEntry]:
    made = []
    for number, (priority, tenant, prompt) in enumerate(entries):
        entry = QueueEntry(number, priority, queue.tenant(tenant), prompt)
        queue.push(entry)
        made.append(entry)
    return made


def _drain(queue: FairQueue) -> list[int]:
    order = []
    while (entry := queue.pop()) is not None:
        order.append(entry.number)
        queue.release(entry.tenant)
    return order


def test_lower_priority_value_starts_first_and_fifo_within_one() -> None:
    queue = FairQueue()
    _queue(queue, [(5, "", 1), (0, "", 1), (5, "", 1), (-3, "", 1), (0, "", 1)])
    assert _drain(queue) == [3, 1, 4, 0, 2]
    assert not queue.tenants


def test_one_tenant_one_priority_is_fifo() -> None:
    queue = FairQueue()
    _queue(queue, [(0, "a", n) for n in (9, 1, 5, 3)])
    assert _drain(queue) == [0, 1, 2, 3]


def test_a_light_tenant_behind_a_heavy_one_is_interleaved() -> None:
    # An operator's case: six of a heavy tenant queued ahead of a light one's three.
    queue = FairQueue()
    _queue(queue, [(0, "heavy", 10)] * 6 + [(0, "light", 10)] * 3)
    order = _drain(queue)
    # The light tenant's three start within the first six, alternating with the heavy one.
    assert [n >= 6 for n in order[:6]] == [False, True, False, True, False, True]


def test_weights_share_starts_in_proportion() -> None:
    queue = FairQueue(weights={"big": 3.0})
    _queue(queue, [(0, "big", 10)] * 12 + [(0, "small", 10)] * 12)
    first = _drain(queue)[:8]
    assert sum(n < 12 for n in first) == 6  # 3:1 of the first eight


def test_a_newly_backlogged_tenant_gets_no_credit_for_idle_time() -> None:
    queue = FairQueue()
    heavy = _queue(queue, [(0, "heavy", 10)] * 4)
    for _ in range(2):
        entry = queue.pop()
        assert entry is not None
    # heavy has 20 tokens of service; a newcomer is lifted to it, not left at 0.
    late = QueueEntry(10, 0, queue.tenant("late"), 10)
    queue.push(late)
    assert late.tenant.service == heavy[0].tenant.service == 20
    # So they alternate, not late, late, ...: the tie goes to the tenant that attained less.
    assert [e.number for e in (queue.pop(), queue.pop())] == [10, 2]  # type: ignore[union-attr]
    assert queue.pop().number == 3  # type: ignore[union-attr]


def test_remove_from_the_middle_keeps_the_order() -> None:
    queue = FairQueue()
    entries = _queue(queue, [(0, "", 1)] * 5)
    assert queue.remove(entries[2])
    assert not queue.remove(entries[2])
    assert len(queue) == 4
    assert _drain(queue) == [0, 1, 3, 4]


def test_victim_by_priority_is_the_newest_of_the_worst_priority() -> None:
    queue = FairQueue()
    _queue(queue, [(2, "a", 1), (7, "a", 1), (7, "b", 1), (0, "b", 1)])
    found = queue.victim(1, None)
    assert found is not None
    assert (found[0].number, found[1]) == (2, DISPLACED_BY_PRIORITY)
    assert queue.victim(7, queue.tenants["b"]) is None  # equal shares: nobody
    assert queue.victim(9, None) is None  # worse than everything waiting


def test_victim_by_share_is_the_newest_of_the_tenant_holding_the_most() -> None:
    queue = FairQueue()
    _queue(queue, [(0, "hog", 1), (0, "hog", 1), (0, "x", 1), (0, "hog", 1)])
    found = queue.victim(0, None)
    assert found is not None
    assert (found[0].number, found[1]) == (3, DISPLACED_BY_SHARE)
    assert queue.victim(0, queue.tenants["x"]) is not None  # one place against three
    assert queue.victim(0, queue.tenants["hog"]) is None  # the hog itself displaces nobody


def test_tenant_records_are_bounded_and_forgotten_when_idle() -> None:
    queue = FairQueue(max_tenants=2)
    a, b, c = queue.tenant("a"), queue.tenant("b"), queue.tenant("c")
    assert set(queue.tenants) == {"a", "b"}
    assert c.name not in queue.tenants
    assert queue.tenant("d") is c
    queue.release(a)
    assert set(queue.tenants) == {"b"}
    assert queue.tenant("e").name == "e"
    queue.release(b)


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf"), 1e-310, 1e-7, 1e7])
def test_bad_weights_are_refused(weight: float) -> None:
    with pytest.raises(ValueError, match="weight must be a number from 1e-06 to 1e"):
        FairQueue(weights={"a": weight})


@pytest.mark.parametrize("weight", [MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT])
def test_weights_at_the_edges_keep_every_counter_finite_and_every_pop_ends(weight: float) -> None:
    # Empty prompts (0 tokens) and the largest count a prompt may claim, interleaved with a
    # tenant of weight 1: what a weight of 1e-310 turned into NaN and an endless pop.
    queue = FairQueue(weights={"edge": weight})
    for tokens in (0, 2**53, 0, 1, 0):
        entries = _queue(queue, [(0, "edge", tokens), (0, "plain", tokens), (0, "edge", 0)])
        popped = [queue.pop() for _ in entries]
        assert sorted(id(e) for e in popped) == sorted(id(e) for e in entries)
        for name in ("edge", "plain"):
            service = queue.tenants[name].service
            assert math.isfinite(service)
            assert service < 1e23


def test_a_pop_ends_even_if_a_counter_were_not_a_number() -> None:
    # The weight range keeps NaN out; the heap walk is bounded all the same (rule 7).
    queue = FairQueue()
    entries = _queue(queue, [(0, "a", 0), (0, "b", 0), (0, "a", 0)])
    queue.tenants["a"].service = math.nan
    assert {id(queue.pop()) for _ in entries} == {id(e) for e in entries}
    assert queue.pop() is None


def test_many_cancellations_keep_memory_proportional_to_what_is_queued() -> None:
    queue = FairQueue()
    keep = _queue(queue, [(0, "a", 1)])
    for number in range(1, 5000):
        entry = QueueEntry(number, 0, queue.tenant("b"), 1)
        queue.push(entry)
        queue.remove(entry)
        queue.release(entry.tenant)
    band = queue._bands[0]
    assert len(band.order) < 64
    assert len(band.heap) < 64
    assert _drain(queue) == [keep[0].number]


def test_a_tenant_new_to_the_gate_never_takes_another_tenants_only_place() -> None:
    queue = FairQueue()
    _queue(queue, [(0, f"once-{n}", 10) for n in range(4)])
    # Every tenant holds one place: a made-up name per request displaces nobody.
    assert queue.victim(0, None) is None
    # A tenant the gate knows (a request of it running, none queued here) still may.
    known = queue.tenant("known")
    found = queue.victim(0, known)
    assert found is not None
    assert found[1] == DISPLACED_BY_SHARE
    # From a tenant holding two places, a newcomer takes one (the light-tenant case).
    _queue(queue, [(0, "once-0", 10)])
    found = queue.victim(0, None)
    assert found is not None
    assert found[0].tenant.name == "once-0"


def test_tenants_under_ever_new_names_cannot_starve_one_that_stays() -> None:
    # A tenant that stays backlogged, against a stream of tenants each sending one request
    # under a new name: the band's clock moves on with each of them served, so the one that
    # stays is served at least every other start (equal prompts).
    queue = FairQueue()
    stays = queue.tenant("stays")
    stays.service = stays.attained = 1000.0  # it has been served before
    for number in range(4):
        queue.push(QueueEntry(number, 0, stays, 10))
    starts: list[str] = []
    for number in range(4, 60):
        queue.push(QueueEntry(number, 0, queue.tenant(f"new-{number}"), 10))
        entry = queue.pop()
        assert entry is not None
        starts.append(entry.tenant.name)
        queue.release(entry.tenant)
        if entry.tenant is stays:
            queue.push(QueueEntry(1000 + number, 0, stays, 10))
            queue.tenant("stays")  # the record counts the new request
    # Each newcomer is lifted to the one that stays (the floor) and would win the tie on
    # attained service every time; the clock lifts the next one past it instead.
    served = [name == "stays" for name in starts]
    assert all(a or b for a, b in itertools.pairwise(served))
    assert sum(served) >= len(served) // 2


def test_a_tenant_served_before_is_not_new_when_it_comes_back_and_the_memory_is_bounded() -> None:
    queue = FairQueue(max_tenants=2)
    for name in ("a", "b", "c"):
        record = queue.tenant(name)
        queue.charge(record, 5)  # served
        queue.release(record)
    never_served = queue.tenant("d")
    queue.release(never_served)
    assert [queue.is_new(name) for name in "abcd"] == [True, False, False, True]
    # Back with nothing queued here: it still may displace from a tenant's only place.
    _queue(queue, [(0, f"once-{n}", 10) for n in range(3)])
    assert queue.victim(0, None, new=queue.is_new("c")) is not None
    assert queue.victim(0, None, new=queue.is_new("a")) is None
