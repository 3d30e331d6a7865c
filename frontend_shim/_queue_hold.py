"""A refusal that proves only a long queue, held by the depth of the queue (pure).

Two of a worker's refusals do not say that it is full, only that a request of that class would
have waited too long behind its queue: an objective's (``slo``) and a queue timeout's
(``queue_timeout``). Marking the worker for the refused class until its next event, as a full
queue is marked, would refuse on its behalf requests it would take (the queue may be short
again, or the refused request may have spent its time elsewhere). So such a refusal holds the
worker back only at the depth it was refused at, judged on this frontend's picture of the queue:

1. The depth. The worker refuses for its objective an arrival of priority ``p`` that would start
   behind B or more queued requests (what it calls ``queued_ahead(p)``: the request about to
   start, and those queued of priority ``p`` or better), and its refusal names B
   (:attr:`~shim_common.wire.Rejected.queue_bound`). A queue timeout names no depth, nor does an
   older worker's objective refusal: the depth is then the picture's at the refusal (the worker
   let a request of that class wait out its time with that many ahead). At least 1.
2. The picture at priority ``p``: from the worker's newest event, its
   :attr:`~shim_common.wire.LoadEvent.queue_ahead` (exact for the priorities it lists; past the
   last one listed, the last one's figure, which is no more than the truth), plus the requests
   this frontend sent it since that event of priority ``p`` or better, less those that got a
   first reply since (:func:`pending`, :func:`answered`). A worker that lists no figures (an
   older one) is pictured by its whole queue and every request sent since. Requests of a worse
   priority are left out: one of them may become the next to start at the worker and count,
   so the picture may fall short of the worker's figure, never exceed it by them.
3. The hold. For one lease from the latest such refusal, the worker is marked, for the best
   refused priority and worse (every tenant), exactly while the picture at that priority is at
   least the depth. Each event, each request sent and each first reply re-judges it
   (:func:`judge`), so a worker whose queue went down is routed to again at once, not after the
   lease. An ordinary mark in force is left as it is (it covers more); an ordinary refusal
   replaces the hold's mark (:meth:`~frontend_shim._load.Fleet.mark_overloaded`).

Since the worker refuses an arrival of priority ``q >= p`` behind ``queued_ahead(q) >=
queued_ahead(p)`` requests, a hold at ``p`` never refuses a request the worker would take, as
far as the picture is true: at most the frontend's own ``marked`` answers the worker's refusals.
"""

from __future__ import annotations

from frontend_shim._free_sets import WorkerLoad

__all__ = ["answered", "judge", "note_refusal", "pending", "picture"]


def picture(worker: WorkerLoad, priority: int) -> int:
    """The queued requests an arrival of ``priority`` would start behind, as pictured (rule 2)."""
    bands = worker.queue_ahead
    if bands is None:
        return max(0, worker.queued_requests + sum(worker.pending.values()))
    ahead = 1 if bands else 0  # the request about to start, whatever its priority
    for band, figure in bands:
        if band > priority:
            break
        ahead = figure
    sent = worker.pending
    if sent:
        ahead += sum(count for sent_priority, count in sent.items() if sent_priority <= priority)
    return max(0, ahead)


def pending(worker: WorkerLoad, priority: int) -> None:
    """A request of ``priority`` goes to the worker: queued there until its first reply."""
    worker.pending[priority] = worker.pending.get(priority, 0) + 1


def answered(worker: WorkerLoad, priority: int) -> None:
    """The worker's first reply to a request of ``priority`` (started, refused or failed)."""
    worker.pending[priority] = worker.pending.get(priority, 0) - 1


def note_refusal(
    worker: WorkerLoad, now: float, lease: float, priority: int, depth: int | None
) -> None:
    """A refusal of ``priority`` that proves a long queue (rule 1: ``depth`` is the worker's B,
    ``None`` when it names none); the caller then calls :func:`judge`."""
    bound = max(1, picture(worker, priority) if depth is None else depth)
    if worker.hold_bound is None or worker.hold_until <= now:
        worker.hold_priority = priority
    else:
        worker.hold_priority = min(worker.hold_priority, priority)
    worker.hold_bound = bound
    worker.hold_until = now + lease


def judge(worker: WorkerLoad, now: float) -> bool:
    """Rule 3: set or lift the hold's mark by the picture now.

    Returns:
        Whether a mark was set that the fleet's lease heap does not hold yet (the caller pushes
        it); the caller updates the worker's membership.
    """
    bound = worker.hold_bound
    if bound is None:
        return False
    if worker.hold_until <= now:
        worker.hold_bound = None
        if worker.hold_marks:
            worker.hold_marks = False
            worker.mark_until = None
        return False
    holds = picture(worker, worker.hold_priority) >= bound
    if holds and worker.mark_until is None:
        worker.hold_marks = True
        worker.mark_until = worker.hold_until
        worker.mark_priority, worker.mark_tenants = worker.hold_priority, None
        return not worker.queued_for_mark
    if worker.hold_marks and not holds:
        worker.hold_marks = False
        worker.mark_until = None
    elif worker.hold_marks:
        worker.mark_until = worker.hold_until
        worker.mark_priority = worker.hold_priority
    return False
