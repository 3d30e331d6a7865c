"""One request's life in the frontend: the dispatch's actions, and every charge undone once.

The dispatch is driven here with no socket and no task: events in (a pick's answer, the worker's
first reply, outputs, the end, the client gone), actions out. The property test drives many
requests at once in random orders of events over a real fleet, router and ``kv`` index, and
checks that the picture is back to nothing in flight, with every ticket closed exactly once.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from worker_configs import runtime_config

from frontend_shim._accounting import CLIENT_CLOSED, Exchange
from frontend_shim._dispatch import Answer, Dispatch, Fail, Pick, Send, Serve
from frontend_shim._kv_index import KvIndex
from frontend_shim._kv_routing import KvMetrics, KvRouting
from frontend_shim._load import Fleet
from frontend_shim._metrics import FrontendMetrics
from frontend_shim._picture import LocalPicture, LocalTicket, NoRoute, PickQuery, Ticket
from frontend_shim._router import RejectionKind, Router, RouterMode
from shim_common import wire
from shim_common.prefix import WordTokenizer

#: Trio's clock starts far from zero; so do these tests' times.
T0 = 52_000.0


def _chunk(tokens: int) -> wire.Chunk:
    return wire.Chunk(request_id=1, text="x", tokens=tokens)


def _started(prompt_tokens: int = 40) -> wire.Started:
    return wire.Started(request_id=1, prompt_tokens=prompt_tokens)


def _sample(metrics: FrontendMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model": "m"})
    return 0.0 if value is None else value


def _own(fleet: Fleet, worker_id: str = "w-1") -> list[tuple[int, int]]:
    worker = fleet.worker(worker_id)
    assert worker is not None
    return [(rank.own.blocks, rank.own.prefill) for rank in worker.ranks]


class _CountingFleet(Fleet):
    """A fleet that keeps the balance of requests queued at each worker and first replies."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.queued_balance = 0

    def request_pending(self, worker_id: str, now: float, priority: int = 0) -> None:
        self.queued_balance += 1
        super().request_pending(worker_id, now, priority)

    def request_answered(self, worker_id: str, now: float, priority: int = 0) -> None:
        self.queued_balance -= 1
        super().request_answered(worker_id, now, priority)


def _picture(
    workers: int = 1, *, ranks: int = 1, mode: RouterMode = RouterMode.ROUND_ROBIN, **fleet: Any
) -> LocalPicture:
    state = _CountingFleet(**fleet)
    for index in range(workers):
        state.register(runtime_config(f"w-{index + 1}", data_parallel_size=ranks), now=T0)
    kv = None
    if mode is RouterMode.KV:
        kv = KvRouting(KvIndex(), WordTokenizer(), KvMetrics(CollectorRegistry()))
    router = Router(state, mode, migration_limit=1, rng=random.Random(7))
    return LocalPicture(state, router, kv)


def _dispatch(
    picture: LocalPicture,
    metrics: FrontendMetrics | None = None,
    *,
    prompt: str = "",
    migration_limit: int = 1,
    **query: Any,
) -> Dispatch:
    body = {"model": "m", "prompt": prompt}
    ask = PickQuery(
        query.pop("model", "m"),
        query.pop("priority", 0),
        query.pop("tenant", ""),
        query.pop("exempt", False),
        picture.prompt("completions", body),
    )
    assert not query
    exchange = Exchange("completions", "m", T0)
    return Dispatch(ask, migration_limit, exchange, metrics or FrontendMetrics(lambda: ()))


def _pick(dispatch: Dispatch, picture: LocalPicture, now: float = T0) -> Any:
    action = dispatch.start()
    assert isinstance(action, Pick)
    return dispatch.picked(picture.pick(action.query, now), now)


# ----------------------------------------------------------------------------- the path


def test_a_started_request_is_charged_moves_with_output_and_is_released_once() -> None:
    picture = _picture(ranks=2)
    metrics = FrontendMetrics(lambda: ())
    dispatch = _dispatch(picture, metrics)
    assert _pick(dispatch, picture) == Send("w-1", None)
    assert dispatch.first(_started(40), T0 + 0.01) == Serve(0)
    # Charged to the rank with the fewest own blocks (ties: the lowest): 3 blocks of 16.
    assert _own(picture.fleet) == [(3, 40), (0, 0)]
    dispatch.output(_chunk(tokens=1))
    dispatch.output(_chunk(tokens=1))
    assert _own(picture.fleet) == [(3, 0), (0, 0)]  # prefill is over at the first output
    # The time to first token is taken when the first token is written, once.
    assert _sample(metrics, "dynamo_frontend_time_to_first_token_seconds_count") == 0
    dispatch.written(T0 + 0.5)
    dispatch.written(T0 + 0.6)
    assert _sample(metrics, "dynamo_frontend_time_to_first_token_seconds_count") == 1
    assert _sample(metrics, "dynamo_frontend_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    dispatch.status = 200
    assert dispatch.exchange.status == 200
    dispatch.ended(wire.End(request_id=1, prompt_tokens=40, completion_tokens=2))
    assert _own(picture.fleet) == [(0, 0), (0, 0)]  # gone before the answer's last bytes
    dispatch.completed(T0 + 1.0)
    assert _sample(metrics, "dynamo_frontend_request_duration_seconds_count") == 1
    dispatch.close(T0 + 1.0)
    dispatch.close(T0 + 1.0)
    assert _own(picture.fleet) == [(0, 0), (0, 0)]


def test_output_blocks_are_charged_with_track_output_blocks() -> None:
    picture = _picture(ranks=2, track_output_blocks=True)
    dispatch = _dispatch(picture)
    _pick(dispatch, picture)
    dispatch.first(_started(16), T0)
    dispatch.output(_chunk(tokens=17))
    assert _own(picture.fleet)[0] == (3, 0)  # 33 tokens in blocks of 16
    dispatch.close(T0)
    assert _own(picture.fleet)[0] == (0, 0)


def test_a_worker_gone_before_the_start_charges_nothing_and_ttft_still_counts() -> None:
    picture = _picture()
    metrics = FrontendMetrics(lambda: ())
    dispatch = _dispatch(picture, metrics)
    _pick(dispatch, picture)
    picture.fleet.remove("w-1")
    dispatch.first(_started(40), T0)
    dispatch.written(T0)  # nothing was output yet: no time to first token
    dispatch.output(_chunk(tokens=3))
    dispatch.written(T0 + 0.2)
    dispatch.close(T0)
    assert _sample(metrics, "dynamo_frontend_time_to_first_token_seconds_count") == 1


def test_a_refusal_marks_the_worker_and_the_request_migrates_once() -> None:
    picture = _picture(workers=2)
    dispatch = _dispatch(picture)
    first = _pick(dispatch, picture)
    assert isinstance(first, Send)
    refused = wire.Rejected.of(1, wire.RejectReason.OVERLOADED)
    again = dispatch.first(refused, T0)
    assert isinstance(again, Pick)
    assert again.query.exclude == {first.worker_id}
    second = dispatch.picked(picture.pick(again.query, T0), T0)
    assert isinstance(second, Send)
    assert second.worker_id != first.worker_id
    # The second refusal is past the migration limit (1): the overload answer, by reason.
    assert dispatch.first(refused, T0) == Answer(RejectionKind.OVERLOADED, "queue_full")
    dispatch.close(T0)
    assert all(_own(picture.fleet, w) == [(0, 0)] for w in ("w-1", "w-2"))
    assert all(not state.pending.get(0) for state in picture.fleet.workers())


def test_migration_never_returns_to_a_worker_that_refused() -> None:
    picture = _picture(workers=3)
    dispatch = _dispatch(picture, migration_limit=2)
    action = _pick(dispatch, picture)
    seen = []
    refused = wire.Rejected.of(1, wire.RejectReason.OVERLOADED)
    while isinstance(action, Send):
        seen.append(action.worker_id)
        action = dispatch.first(refused, T0)
        if isinstance(action, Pick):
            action = dispatch.picked(picture.pick(action.query, T0), T0)
    assert sorted(seen) == ["w-1", "w-2", "w-3"]
    # The third refusal used up a limit of 2 retries.
    assert action == Answer(RejectionKind.OVERLOADED, "queue_full")


def test_migration_limit_zero_means_no_retry_and_the_worker_is_marked() -> None:
    picture = _picture(workers=2)
    dispatch = _dispatch(picture, migration_limit=0)
    sent = _pick(dispatch, picture)
    refused = wire.Rejected.of(1, wire.RejectReason.OVERLOADED)
    assert dispatch.first(refused, T0) == Answer(RejectionKind.OVERLOADED, "queue_full")
    worker = picture.fleet.worker(sent.worker_id)
    assert worker is not None
    assert worker.marked


def test_a_refusal_it_cannot_place_is_not_migrated_and_draining_takes_a_worker_out() -> None:
    picture = _picture(workers=2)
    other = _dispatch(picture, migration_limit=5)
    _pick(other, picture)
    unknown = wire.Rejected(request_id=1, reason="Unknown: x")
    assert other.first(unknown, T0) == Answer(RejectionKind.UNAVAILABLE, "other")
    draining = _dispatch(picture, migration_limit=5)
    sent = _pick(draining, picture)
    again = draining.first(wire.Rejected.of(1, wire.RejectReason.DRAINING), T0)
    assert isinstance(again, Pick)
    routed = {_pick(_dispatch(picture), picture).worker_id for _ in range(4)}
    assert sent.worker_id not in routed


def test_a_failure_before_the_start_is_answered_and_not_retried() -> None:
    picture = _picture(workers=2)
    dispatch = _dispatch(picture)
    _pick(dispatch, picture)
    failed = wire.Failed(request_id=1, kind="bad_request", message="no")
    assert dispatch.first(failed, T0) == Fail(failed)
    dispatch.close(T0)


def test_a_worker_without_a_link_is_passed_over_without_a_migration_then_no_workers() -> None:
    picture = _picture(workers=2)
    dispatch = _dispatch(picture)
    first = _pick(dispatch, picture)
    again = dispatch.unreachable(T0)
    assert isinstance(again, Pick)
    second = dispatch.picked(picture.pick(again.query, T0), T0)
    assert isinstance(second, Send)
    assert second.worker_id != first.worker_id
    third = dispatch.unreachable(T0)
    assert isinstance(third, Pick)
    # Both went away before the request reached them: nothing drains, no worker can take it.
    assert dispatch.picked(picture.pick(third.query, T0), T0) == Answer(
        RejectionKind.UNAVAILABLE, "no_workers"
    )
    # Neither worker is marked: the request never reached them.
    assert all(not state.marked for state in picture.fleet.workers())


def test_no_route_answers() -> None:
    picture = _picture()
    unknown = _dispatch(picture, model="nope")
    assert _pick(unknown, picture) == Answer(None, "")
    assert unknown.exchange.status == CLIENT_CLOSED
    picture.fleet.mark_draining("w-1")
    assert _pick(_dispatch(picture), picture) == Answer(RejectionKind.UNAVAILABLE, "no_workers")


# ----------------------------------------------------------------------------- every charge once


class _CountingTicket:
    """A ticket that counts the calls that close it."""

    def __init__(self, inner: LocalTicket, closes: dict[int, int]) -> None:
        self._inner = inner
        self._closes = closes
        closes[id(self)] = 0
        self.worker_id = inner.worker_id
        self.dp_rank = inner.dp_rank

    def _closed(self) -> None:
        self._closes[id(self)] += 1

    def started(self, prompt_tokens: int, label: str, now: float) -> None:
        self._inner.started(prompt_tokens, label, now)

    def output(self, tokens: int) -> None:
        self._inner.output(tokens)

    def finished(self, final: wire.End | wire.Failed | None) -> None:
        self._closed()
        self._inner.finished(final)

    def refused(
        self, reason: wire.RejectReason, priority: int, tenant: str, bound: int | None, now: float
    ) -> RejectionKind:
        self._closed()
        return self._inner.refused(reason, priority, tenant, bound, now)

    def failed(self, now: float) -> None:
        self._closed()
        self._inner.failed(now)

    def unsent(self, now: float) -> None:
        self._closed()
        self._inner.unsent(now)


_EVENTS = ("advance", "started", "rejected", "slo", "unavailable", "failed", "unreachable",
           "output", "end", "fail_after_start", "gone", "load", "remove")  # fmt: skip


def _run_script(
    mode: RouterMode, script: list[tuple[str, int, int]], make: Callable[..., Dispatch]
) -> tuple[LocalPicture, dict[int, int]]:
    """Drive requests by ``script`` (event, request, size); every request ends closed."""
    picture = _picture(workers=3, ranks=2, mode=mode, track_output_blocks=mode is RouterMode.KV)
    closes: dict[int, int] = {}
    live: dict[int, tuple[Dispatch, Any]] = {}
    now = T0
    seqs = {f"w-{i}": 0 for i in (1, 2, 3)}

    class Counting:
        def pick(self, query: PickQuery, at: float) -> Ticket | NoRoute:
            pick = picture.pick(query, at)
            return pick if isinstance(pick, NoRoute) else _CountingTicket(pick, closes)

    counting = Counting()

    def step(dispatch: Dispatch, action: Any) -> Any:
        while isinstance(action, Pick):
            action = dispatch.picked(counting.pick(action.query, now), now)
        return action

    for event, index, size in script:
        now += 0.01
        if event == "load":
            worker_id = f"w-{index % 3 + 1}"
            load = wire.RankLoad(
                dp_rank=size % 2, active_decode_blocks=size, active_prefill_tokens=size,
                kv_used_blocks=size,
            )  # fmt: skip
            seqs[worker_id] += 1
            event_ = wire.LoadEvent(
                seq=seqs[worker_id], ts=0.0, load=load, engine_requests=size % 5,
                queued_requests=size % 3,
            )  # fmt: skip
            picture.fleet.apply(worker_id, event_, now)
            continue
        if event == "remove":
            worker_id = f"w-{index % 3 + 1}"
            if picture.fleet.remove(worker_id):
                picture.fleet.register(runtime_config(worker_id, data_parallel_size=2), now)
            continue
        if index not in live:
            dispatch = make(picture, prompt=" ".join(f"w{i}" for i in range(size * 7)))
            live[index] = (dispatch, step(dispatch, dispatch.start()))
            continue
        dispatch, action = live[index]
        if event == "gone" or isinstance(action, Answer | Fail):
            dispatch.close(now)
            del live[index]
            continue
        if isinstance(action, Send):
            if event == "unreachable":
                action = step(dispatch, dispatch.unreachable(now))
            elif event in ("started", "output", "end", "fail_after_start"):
                action = dispatch.first(_started(size), now)
            elif event == "rejected":
                refusal = wire.Rejected.of(1, wire.RejectReason.OVERLOADED)
                action = step(dispatch, dispatch.first(refusal, now))
            elif event == "slo":
                refusal = wire.Rejected.of(1, wire.RejectReason.SLO, queue_bound=size)
                action = step(dispatch, dispatch.first(refusal, now))
            elif event == "unavailable":
                failed = wire.Failed(request_id=1, kind="unavailable", message="x")
                action = step(dispatch, dispatch.first(failed, now))
            elif event == "failed":
                failed = wire.Failed(request_id=1, kind="engine", message="x")
                action = dispatch.first(failed, now)
            live[index] = (dispatch, action)
        elif isinstance(action, Serve):
            if event == "output":
                dispatch.output(_chunk(size))
                dispatch.written(now)
            elif event == "end":
                dispatch.ended(wire.End(request_id=1, prompt_tokens=size, completion_tokens=1))
                dispatch.completed(now)
                dispatch.close(now)
                del live[index]
            elif event == "fail_after_start":
                dispatch.ended(wire.Failed(request_id=1, kind="engine", message="x"))
                dispatch.close(now)
                del live[index]
    for dispatch, _ in live.values():
        dispatch.close(now + 1)
    return picture, closes


def _check_nothing_in_flight(picture: LocalPicture, closes: dict[int, int]) -> None:
    assert all(count == 1 for count in closes.values()), "a ticket closed twice or never"
    fleet = picture.fleet
    # Each request counted as queued at a worker got its first reply once (the fleet's own
    # per-worker figures restart at every event, so the balance is kept apart).
    assert isinstance(fleet, _CountingFleet)
    assert fleet.queued_balance == 0
    for worker in fleet.workers():
        assert len(worker.sequences) == 0
        for rank in worker.ranks:
            assert (rank.own.blocks, rank.own.prefill, rank.own.names) == (0, 0, {})


_scripts = st.lists(
    st.tuples(st.sampled_from(_EVENTS), st.integers(0, 7), st.integers(0, 40)), max_size=120
)


@settings(max_examples=150, deadline=None)
@given(mode=st.sampled_from([RouterMode.ROUND_ROBIN, RouterMode.KV]), script=_scripts)
def test_every_charge_is_undone_exactly_once_on_every_path(
    mode: RouterMode, script: list[tuple[str, int, int]]
) -> None:
    _check_nothing_in_flight(*_run_script(mode, script, _dispatch))


class _LeakyDispatch(Dispatch):
    """A planted leak: a request whose client leaves while it streams keeps its charge."""

    def close(self, now: float) -> None:
        if not self._started:
            super().close(now)


def test_the_property_catches_a_planted_leak() -> None:
    # One request started and streaming when its client leaves: the leaky dispatch never
    # releases it, and the check above must say so.
    script = [("started", 0, 20), ("started", 0, 20), ("output", 0, 3), ("gone", 0, 0)]
    _check_nothing_in_flight(*_run_script(RouterMode.KV, script, _dispatch))
    picture, closes = _run_script(RouterMode.KV, script, _leaky)
    with pytest.raises(AssertionError):
        _check_nothing_in_flight(picture, closes)


def _leaky(picture: LocalPicture, **kwargs: Any) -> Dispatch:
    plain = _dispatch(picture, **kwargs)
    return _LeakyDispatch(plain.query, 1, plain.exchange, FrontendMetrics(lambda: ()))
