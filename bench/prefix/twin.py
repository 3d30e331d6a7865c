"""A trace replayed on a virtual clock through the frontend's routing core and the mockers'
schedulers: where cache-aware routing pays, measured in seconds and free of the machine's load.

No process, socket or task: one event loop over a heap of timed events drives

- per worker, the mocker's sans-IO scheduler
  (:class:`~worker_ingress.engines._mock_scheduler.RankScheduler`, one data-parallel rank), its
  step times from the mocker's GPU model, its prefix cache and its KV events;
- the frontend's picture of the fleet as the real frontend keeps it
  (:class:`~frontend_shim._load.Fleet`: load events, the router's own count charged at the pick
  and released at the end, and the :class:`~frontend_shim._kv_index.KvIndex` fed by KV events
  and by the router's own guesses), and its :class:`~frontend_shim._router.Router` in the mode
  asked.

What travels between them is delayed as on a real link: a request reaches its worker
``hop`` seconds after the pick, and its first token and its end reach the frontend ``hop``
seconds after the step that produced them; a worker publishes its load (and KV events) at most
once every ``publish_interval`` seconds, latest wins, as the worker's event plane does, and the
frontend reads it ``read_delay`` seconds later (its read pacer's tick). TTFT is from the
request's arrival at the frontend to its first token there; the hit rate is the prompt tokens
the workers found cached over all prompt tokens, as a client reads ``cached_tokens``.

This is a model of the real processes, not a substitute: ``bench/bench_prefix.py`` replays the
same window through them (``docs/performance.md`` has both side by side).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, Final

from bench.kit.stats import percentile
from frontend_shim._kv_cost import CostWeights, KvScorer, Prompt
from frontend_shim._kv_index import KvIndex
from frontend_shim._load import Fleet
from frontend_shim._router import Routed, Router, RouterMode
from frontend_shim._sequences import InFlight
from shim_common import wire
from shim_common.prefix import block_names
from shim_common.wire import BusyThresholds
from worker_ingress.engines._kv_pool import STORED, PoolEvent
from worker_ingress.engines._mock_scheduler import MockSequence, RankScheduler, ScheduledStep

__all__ = ["Link", "Replayed", "Request", "TwinResult", "replay"]

MODEL: Final = "mock-model"
#: The mocker's defaults for what the twin does not vary.
MAX_NUM_SEQS: Final = 256
MAX_NUM_BATCHED_TOKENS: Final = 8192


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of the window: when it arrives, its prompt's length, the tokens it asks for,
    and an id for each full block of its prompt: two prompts whose first ``i`` ids are equal
    share their first ``i`` blocks (ids are token ids, in ``[0, 2**32)``)."""

    arrival: float
    prompt_tokens: int
    max_tokens: int
    block_ids: tuple[int, ...]

    def tokens(self, block_size: int) -> list[int]:
        """The prompt as token ids: each full block's tokens its id, the partial last block's 0.

        Both sides name these tokens' blocks as the real frontend and mocker do
        (:func:`shim_common.prefix.block_names`), so equal ids make equal names.
        """
        tail = self.prompt_tokens - len(self.block_ids) * block_size
        return [block for block in self.block_ids for _ in range(block_size)] + [0] * tail


@dataclasses.dataclass(frozen=True)
class Link:
    """The delays between the frontend and its workers (seconds)."""

    hop: float = 0.0005
    publish_interval: float = 0.1
    read_delay: float = 0.005


@dataclasses.dataclass(frozen=True)
class TwinResult:
    """What a replay measured."""

    ttft_p50: float
    ttft_p90: float
    hit_rate: float
    busiest_share: float
    completed: int
    #: Requests the router answered without a worker (none is expected: no threshold is set).
    unrouted: int


class _Worker:
    __slots__ = ("config", "dirty", "last_publish", "publish_due", "rank", "seq", "step", "wid")

    def __init__(self, wid: str, rank: RankScheduler, config: wire.RuntimeConfig) -> None:
        self.wid = wid
        self.rank = rank
        self.config = config
        self.seq = 0
        self.step: ScheduledStep | None = None
        self.last_publish = -math.inf
        self.publish_due = False
        self.dirty = False


class Replayed:
    """One request on its way: where it went and what the frontend charged for it."""

    __slots__ = (
        "first_at", "first_seq", "in_flight", "prompt", "request", "sequence", "started_seq", "wid",
    )  # fmt: skip

    def __init__(
        self, request: Request, prompt: Prompt, wid: str, in_flight: InFlight | None
    ) -> None:
        self.request = request
        self.prompt = prompt
        self.wid = wid
        self.in_flight = in_flight
        self.sequence: MockSequence | None = None
        self.first_at: float | None = None
        self.started_seq = 0
        self.first_seq = 0


class _Twin:
    def __init__(
        self,
        requests: Sequence[Request],
        *,
        workers: int,
        block_size: int,
        num_blocks: int,
        mode: str,
        weights: CostWeights,
        prefix_caching: bool,
        link: Link,
        seed: int,
    ) -> None:
        self.requests = requests
        self.link = link
        self.block_size = block_size
        self.fleet = Fleet(default_thresholds=BusyThresholds())
        self.index = KvIndex()
        self.router = Router(
            self.fleet,
            RouterMode.KV if mode == "kv" else RouterMode(mode),
            rng=random.Random(seed),
            kv=KvScorer(self.index, weights, random.Random(seed)),
        )
        self.workers: dict[str, _Worker] = {}
        for n in range(workers):
            wid = f"w{n}"
            config = wire.RuntimeConfig(
                worker_id=wid,
                model=MODEL,
                kv_total_blocks=num_blocks,
                block_size=block_size,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                max_num_seqs=MAX_NUM_SEQS,
                data_parallel_size=1,
                engine_request_limit=None,
                request_queue_limit=40000,
                heartbeat_interval=10.0,
            )
            rank = RankScheduler(
                num_blocks=num_blocks,
                block_size=block_size,
                max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                prefix_caching=prefix_caching,
            )
            self.workers[wid] = _Worker(wid, rank, config)
            self.fleet.register(config, 0.0)
            if mode == "kv":
                self.index.add_worker(config, 0.0, events=True)
                self.index.apply(wid, [wire.KvSnapshot(seq=0, ranks=[[]])], 0.0)
        self.kv_events = mode == "kv"
        self.kv_seq = dict.fromkeys(self.workers, 0)
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._by_sequence: dict[MockSequence, Replayed] = {}
        self.ttfts: list[float] = []
        self.cached_tokens = 0
        self.started = dict.fromkeys(self.workers, 0)
        self.unrouted = 0

    # --- the loop ----------------------------------------------------------------------------

    def at(self, when: float, action: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._order), action, args))

    def run(self) -> TwinResult:
        for request in self.requests:
            self.at(request.arrival, self.arrive, request)
        while self._heap:
            now, _, action, args = heapq.heappop(self._heap)
            action(now, *args)
        prompt_tokens = sum(r.prompt_tokens for r in self.requests)
        return TwinResult(
            ttft_p50=percentile(self.ttfts, 0.5),
            ttft_p90=percentile(self.ttfts, 0.9),
            hit_rate=self.cached_tokens / prompt_tokens if prompt_tokens else 0.0,
            busiest_share=max(self.started.values()) / max(1, len(self.requests)),
            completed=len(self.ttfts),
            unrouted=self.unrouted,
        )

    # --- the frontend ------------------------------------------------------------------------

    def arrive(self, now: float, request: Request) -> None:
        prompt = Prompt(request.tokens(self.block_size))
        routed = self.router.pick(MODEL, now, prompt=prompt)
        if not isinstance(routed, Routed):
            self.unrouted += 1
            return
        names = routed.kv.names if routed.kv is not None else ()
        in_flight = self.fleet.request_sent(
            routed.worker_id, request.prompt_tokens, routed.dp_rank, names
        )
        if routed.kv is not None:
            self.index.predict(routed.worker_id, routed.kv.dp_rank, routed.kv.names, now)
        replayed = Replayed(request, prompt, routed.worker_id, in_flight)
        self.started[routed.worker_id] += 1
        self.at(now + self.link.hop, self.deliver, replayed)

    def first_token(self, now: float, replayed: Replayed) -> None:
        self.ttfts.append(now - replayed.request.arrival)
        if replayed.in_flight is not None:
            self.fleet.request_output(replayed.wid, replayed.in_flight, 1)

    def end(self, now: float, replayed: Replayed, end: wire.End) -> None:
        if replayed.in_flight is not None:
            self.fleet.request_finished(replayed.wid, replayed.in_flight, end)

    def read(self, now: float, wid: str, event: wire.LoadEvent, kv: list[wire.KvEvent]) -> None:
        self.fleet.apply(wid, event, now)
        if kv and self.index.apply(wid, kv, now):
            raise AssertionError("the twin's KV events have no gap")

    # --- a worker ----------------------------------------------------------------------------

    def deliver(self, now: float, replayed: Replayed) -> None:
        worker = self.workers[replayed.wid]
        request = replayed.request
        # The worker names the blocks of the tokens it was sent, as the mocker does.
        sequence = MockSequence(
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            block_names=block_names(replayed.prompt.tokens, self.block_size),
        )
        replayed.sequence = sequence
        replayed.started_seq = worker.seq
        self._by_sequence[sequence] = replayed
        worker.rank.add(sequence)
        self.changed(now, worker)
        self.kick(now, worker)

    def kick(self, now: float, worker: _Worker) -> None:
        if worker.step is not None:
            return
        step = worker.rank.schedule()
        if step is None:
            return
        worker.step = step
        self.changed(now, worker)
        self.at(now + step.duration, self.step_done, worker)

    def step_done(self, now: float, worker: _Worker) -> None:
        step = worker.step
        assert step is not None
        worker.step = None
        for sequence in worker.rank.complete(step):
            replayed = self._by_sequence[sequence]
            if replayed.first_at is None:
                replayed.first_at = now
                replayed.first_seq = worker.seq
                self.cached_tokens += sequence.cached_tokens or 0
                self.at(now + self.link.hop, self.first_token, replayed)
            if sequence.done:
                del self._by_sequence[sequence]
                end = wire.End(
                    request_id=0,
                    prompt_tokens=sequence.prompt_tokens,
                    completion_tokens=sequence.generated,
                    cached_tokens=sequence.cached_tokens or 0,
                    started_seq=replayed.started_seq,
                    first_output_seq=replayed.first_seq,
                    ended_seq=worker.seq,
                )
                self.at(now + self.link.hop, self.end, replayed, end)
        self.changed(now, worker)
        self.kick(now, worker)

    def changed(self, now: float, worker: _Worker) -> None:
        worker.dirty = True
        if worker.publish_due:
            return
        worker.publish_due = True
        self.at(max(now, worker.last_publish + self.link.publish_interval), self.publish, worker)

    def publish(self, now: float, worker: _Worker) -> None:
        worker.publish_due = False
        worker.last_publish = now
        if not worker.dirty:
            return
        worker.dirty = False
        worker.seq += 1
        event = wire.LoadEvent(
            seq=worker.seq,
            ts=now,
            load=worker.rank.load(0),
            engine_requests=worker.rank.live_sequences,
            queued_requests=0,
        )
        kv = self._kv_events(worker, worker.rank.take_kv_events()) if self.kv_events else []
        self.at(now + self.link.read_delay, self.read, worker.wid, event, kv)

    def _kv_events(self, worker: _Worker, events: list[PoolEvent]) -> list[wire.KvEvent]:
        out: list[wire.KvEvent] = []
        for kind, parent, names in events:
            self.kv_seq[worker.wid] += 1
            seq = self.kv_seq[worker.wid]
            if kind == STORED:
                out.append(wire.KvStored(seq=seq, dp_rank=0, parent=parent, blocks=names))
            else:
                out.append(wire.KvRemoved(seq=seq, dp_rank=0, blocks=names))
        return out


def replay(
    requests: Sequence[Request],
    *,
    workers: int = 4,
    block_size: int,
    num_blocks: int,
    mode: str = "kv",
    weights: CostWeights | None = None,
    prefix_caching: bool = True,
    link: Link | None = None,
    seed: int = 0,
) -> TwinResult:
    """Replay ``requests`` through ``workers`` simulated workers and the frontend's router.

    Args:
        requests: In arrival order; their ``block_ids`` stand for their prompts' full blocks
            of ``block_size`` tokens.
        workers: Mockers, one rank each.
        block_size: Tokens per KV block.
        num_blocks: KV blocks per mocker.
        mode: ``round-robin``, ``random`` or ``kv``.
        weights: The ``kv`` cost rule's knobs (its defaults when ``None``).
        prefix_caching: The mockers' prefix cache on or off.
        link: The delays between frontend and workers.
        seed: For the router's draws.
    """
    twin = _Twin(
        requests,
        workers=workers,
        block_size=block_size,
        num_blocks=num_blocks,
        mode=mode,
        weights=weights or CostWeights(),
        prefix_caching=prefix_caching,
        link=link or Link(),
        seed=seed,
    )
    return twin.run()
