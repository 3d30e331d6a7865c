"""What the reports of a worker still count of the requests that ended there (pure).

A request that ended is gone from this frontend's picture at once (:mod:`frontend_shim._load`
rule 1), but the worker's last report may have been produced while it ran, and its next one may
be read only later. Its :class:`~frontend_shim._free_sets.Release` takes it off every report of
its rank produced within its window:

1. Window. The worker's final frame names it in its event ``seq`` (``started_seq``,
   ``first_output_seq``, ``ended_seq``); from a worker that names none, it is the reports applied
   after the request was sent (and, for the prompt, until its first output arrived) up to the
   next report after its end. A report past the window ends the release.
2. Size. Its blocks (prompt and output) come off a report produced while it held its slot, its
   prompt tokens off one produced before its first output: the larger of this frontend's count
   and the worker's own (an ``End``'s prompt and completion tokens). The worker held no more
   blocks than those tokens fill, however this frontend tokenised the prompt, and output read
   with the ``End`` is in the worker's count.
3. Cost. A release is added in O(1) (:func:`add`); the releases of a worker are fitted to its
   newest reports once per applied batch (:func:`fit`), which drops those that are over. At most
   :data:`MAX_RELEASES` are kept per worker (the oldest goes first: that many requests would
   have to end within one of the worker's publish intervals before it reported again).
4. The gauges. Of the releases, those the worker's newest event counts among its running
   requests are counted (:attr:`~frontend_shim._free_sets.WorkerLoad.released_requests`), so
   the gauges' share of L (:func:`~frontend_shim._free_sets.load_cost`) leaves out only those.
"""

from __future__ import annotations

from typing import Final

from frontend_shim._free_sets import FreeSets, Release, WorkerLoad, load_cost
from frontend_shim._sequences import InFlight, blocks_of
from shim_common import wire

__all__ = ["MAX_RELEASES", "add", "fit", "release_of"]

#: Finished requests per worker whose release waits for a newer report (rule 3).
MAX_RELEASES: Final = 1024


def release_of(
    worker: WorkerLoad, in_flight: InFlight, final: wire.End | wire.Failed | None
) -> Release | None:
    """The release of a request that ended (rules 1 and 2), or ``None`` when no report this
    frontend holds or will read can count it any more."""
    if final is not None and final.ended_seq is not None:
        ended = final.ended_seq
        started = ended if final.started_seq is None else final.started_seq
        first = ended if final.first_output_seq is None else final.first_output_seq
    else:
        started, ended = in_flight.sent_seq, worker.last_seq
        first = ended if in_flight.first_output_seq is None else in_flight.first_output_seq
    rank = worker.ranks[in_flight.rank]
    if not rank.reported or rank.report_seq > ended:
        return None
    prompt = in_flight.prompt_tokens
    tokens = prompt + in_flight.output_tokens
    if isinstance(final, wire.End):
        prompt = max(prompt, final.prompt_tokens)
        tokens = max(tokens, final.prompt_tokens + final.completion_tokens)
    blocks = blocks_of(tokens, worker.config.block_size)
    return Release(in_flight.rank, blocks, prompt, started, first, ended)


def fit(worker: WorkerLoad, sets: FreeSets) -> None:
    """Fit the worker's releases to its newest reports (rules 1 and 4): drop those that are
    over, and take the rest off each rank's report; the changed ranks are recomputed."""
    ranks = worker.ranks
    released = [[0, 0] for _ in ranks]
    kept: list[Release] = []
    gauged = 0
    last = worker.last_seq
    for release in worker.releases:
        seq = ranks[release.rank].report_seq
        if seq > release.ended:
            continue
        kept.append(release)
        if seq > release.started:
            figures = released[release.rank]
            figures[0] += release.blocks
            if seq <= release.first_output:
                figures[1] += release.prefill
        gauged += release.started < last <= release.ended
    worker.releases = kept
    worker.released_requests = gauged
    for rank, (blocks, prefill) in zip(ranks, released, strict=True):
        if (blocks, prefill) != (rank.released_blocks, rank.released_prefill):
            rank.released_blocks, rank.released_prefill = blocks, prefill
            sets.recompute_rank(worker, rank)
    worker.load_cost = load_cost(worker)


def add(worker: WorkerLoad, release: Release, sets: FreeSets) -> None:
    """One more release, taken off the report it applies to at once (rule 3: O(1), a full
    :func:`fit` only when the oldest must go)."""
    worker.releases.append(release)
    if len(worker.releases) > MAX_RELEASES:
        del worker.releases[0]
        fit(worker, sets)
        return
    rank = worker.ranks[release.rank]
    seq = rank.report_seq
    if release.started < seq:
        rank.released_blocks += release.blocks
        if seq <= release.first_output:
            rank.released_prefill += release.prefill
        sets.recompute_rank(worker, rank)
    if release.started < worker.last_seq <= release.ended:
        worker.released_requests += 1
    worker.load_cost = load_cost(worker)
