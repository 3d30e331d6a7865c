"""The admission gate's queue discipline: strict priority, then least attained service per tenant.

A pure policy object (no clock, no tasks, no knowledge of slots): :class:`FairQueue` holds the
requests waiting in the gate's overflow channel and answers two questions, *which one starts
next* and *whom does an arrival at a full queue displace*. The gate's state
(:mod:`worker_ingress._admission_state`) owns the slots, the dispatcher's hand and the counters,
and asks this module only those two.

Rules of the discipline
=======================

1. **Priority first.** An entry has an integer priority; a lower value starts first. Between
   priorities the order is strict: nothing of priority ``p + 1`` starts while anything of
   priority ``p`` waits.
2. **Then the tenant with the least attained service.** Within one priority (a *band*), each
   tenant with entries waiting there is a *flow*. The next to start is the oldest entry of the
   flow whose tenant has the smallest service counter; ties go to the tenant that attained less
   service in fact (its counter before any lift: a tenant lifted on arrival is usually the
   light one), then to the flow that became backlogged first. A tenant's counter is its
   attained service divided by its weight, as in Virtual Token Counter fair queuing, by the one
   rule of :func:`service_tokens`: prompt tokens (an entry's ``start_cost``, charged when it is
   chosen to start) plus :data:`GENERATED_TOKEN_COST` per generated token (charged by the gate
   as output arrives).
3. **No credit for idle time, none for a new name.** A flow that becomes backlogged in a band
   lifts its tenant's counter (never lowers it) to the smallest counter among the flows already
   backlogged there or to the band's *clock*, whichever is larger. The clock is the largest
   counter a tenant of the band had right after it was chosen to start (its charge included):
   the service already attained there. So a tenant that was idle cannot then monopolise the
   band to "catch up", a heavy tenant that is always backlogged cannot starve a light one (the
   difference between the counters of two backlogged tenants stays within a bound set by the
   largest single charge), and tenants that come and go under ever new names cannot hold the
   band's counters still: each one served moves the clock on by its charge, so a tenant that
   stays is served again once the clock passes its counter (with equal charges, at least every
   other start while it is backlogged).
4. **Equal priorities and one tenant are FIFO**, as the gate was before this module.
5. **Displacement at a full queue** (:meth:`FairQueue.victim`): an arrival whose priority is
   strictly lower (better) than the worst priority waiting displaces the most recently queued
   entry of that worst priority. An arrival *of* the worst priority waiting whose tenant holds
   fewer places in that band than the tenant holding the most displaces that tenant's most
   recently queued entry, except that an arrival of a tenant new to the gate (no request of it
   queued or running, and not among the last ``max_tenants`` tenants that were served and left:
   :meth:`FairQueue.is_new`) never takes another tenant's only place: it displaces only from a
   tenant holding two places or more. So names made up per request cannot turn a queue of one
   place per tenant into a displacement per arrival, while a tenant that comes back keeps its
   right to a place. Otherwise nobody is displaced (the gate rejects the arrival).
6. **Tenant state is bounded.** A :class:`Tenant` record lives while its tenant has a request in
   the gate (queued or running) and is forgotten when the last one leaves (so idle tenants cost
   nothing). At most ``max_tenants`` records exist; tenants beyond that share one overflow record
   (they are treated as one tenant until records free up).
7. **Every operation terminates.** Each loop here walks a finite structure and removes or
   refreshes one item of it per turn (the lazy deletions below, the refresh of a stale heap
   key, which happens at most once per item and look); the heap walk is written as a bounded
   loop. Weights are in [:data:`MIN_TENANT_WEIGHT`, :data:`MAX_TENANT_WEIGHT`], so service
   counters are finite numbers, never NaN, and their comparisons mean what they say.

Costs: every operation is O(log n) in the number of waiting entries (amortized; heaps for the
bands and for the flows of a band, deques per flow and per band), never a scan of the queue.
Removal from the middle (a cancel, a timeout) is lazy: the entry is marked and skipped when it
reaches the end of a heap or deque; structures are compacted once their dead weight exceeds
their live size, so memory stays proportional to what is queued.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Final

__all__ = [
    "GENERATED_TOKEN_COST",
    "MAX_TENANT_WEIGHT",
    "MIN_TENANT_WEIGHT",
    "DISPLACED_BY_PRIORITY",
    "DISPLACED_BY_SHARE",
    "OVERFLOW_TENANT",
    "FairQueue",
    "QueueEntry",
    "Tenant",
    "service_tokens",
]

#: How :meth:`FairQueue.victim` says why it chose its victim.
DISPLACED_BY_PRIORITY: Final = "priority"
DISPLACED_BY_SHARE: Final = "share"

#: Name of the record that tenants beyond ``max_tenants`` share. It is never a key of
#: :attr:`FairQueue.tenants`, so a client that sends this name gets a record of its own.
OVERFLOW_TENANT: Final = "\x00overflow"

#: The range of a tenant's weight. Its inverse is then in the same range, so the service one
#: request adds to a counter (a token count, at most 2**53, times the inverse) is below 1e22: the
#: counters stay finite for any run a process can live, and never NaN (0 times an infinite
#: inverse, which a weight of 1e-310 gave, made every comparison of rule 2 false).
MIN_TENANT_WEIGHT: Final = 1e-6
MAX_TENANT_WEIGHT: Final = 1e6

#: Service a generated token costs, in prompt tokens (rule 2): decoding a token occupies the
#: engine longer than prefilling one.
GENERATED_TOKEN_COST: Final = 2

#: Slack before a lazily cleaned structure is compacted (entries beyond twice the live ones).
_COMPACT_SLACK: Final = 16


def service_tokens(prompt_tokens: int = 0, generated_tokens: int = 0) -> int:
    """The service a request's tokens cost its tenant, unweighted: the one charge rule.

    Every charge of a tenant's counter here and of its account in the gate's ledger is a value
    of it: a request's start cost, from its prompt, computed once by the gate on arrival and
    carried on its entry (:attr:`QueueEntry.start_cost`), and its generated tokens as they come.
    """
    return prompt_tokens + GENERATED_TOKEN_COST * generated_tokens


class Tenant:
    """The state kept for one tenant while it has requests in the gate.

    Attributes:
        name: The tenant's name (``""`` is the shared tenant of requests that name none).
        weight: Its share: service counts divided by this.
        service: Attained service divided by the weight, lifted by rule 3 (the fair-queuing
            counter).
        attained: The same without lifts (the tie-break of rule 2).
        requests: Requests of the tenant in the gate now (queued or running).
    """

    __slots__ = ("attained", "inverse_weight", "name", "requests", "service", "weight")

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.weight = weight
        self.inverse_weight = 1.0 / weight
        self.service = 0.0
        self.attained = 0.0
        self.requests = 0

    def __repr__(self) -> str:
        return f"<Tenant {self.name!r} service={self.service:g} requests={self.requests}>"


class QueueEntry:
    """What the queue needs of a waiting request (the gate's ticket extends it).

    Attributes:
        number: Arrival order, increasing (the tie-break of last resort).
        priority: Lower starts first.
        tenant: The tenant's record (from :meth:`FairQueue.tenant`).
        start_cost: What starting it costs the tenant (:func:`service_tokens` of its prompt),
            charged when the entry is chosen to start.
    """

    __slots__ = ("_flow", "number", "priority", "start_cost", "tenant")

    def __init__(self, number: int, priority: int, tenant: Tenant, start_cost: int) -> None:
        self.number = number
        self.priority = priority
        self.tenant = tenant
        self.start_cost = start_cost
        #: The flow holding this entry while it is queued; ``None`` otherwise.
        self._flow: _Flow | None = None


class _Flow:
    """One tenant's entries waiting in one band, oldest first (dead entries skipped lazily)."""

    __slots__ = ("entries", "live", "tenant")

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self.entries: deque[QueueEntry] = deque()
        self.live = 0


class _Band:
    """Everything waiting at one priority."""

    __slots__ = ("by_places", "clock", "flows", "heap", "most", "order", "priority", "size")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        #: The largest counter a tenant of the band had right after it was chosen to start
        #: (rule 3); a newly backlogged flow starts from it at least.
        self.clock = 0.0
        #: Backlogged flows by tenant.
        self.flows: dict[Tenant, _Flow] = {}
        #: (service and attained service when pushed, tie-break, flow): least service on top;
        #: an entry is stale when its flow left the band or its tenant's service has grown
        #: since (attained service grows only with service, so it is never stale alone).
        self.heap: list[tuple[float, float, int, _Flow]] = []
        #: Every entry of the band in arrival order (for "the most recently queued").
        self.order: deque[QueueEntry] = deque()
        #: Flows by how many places they hold (the count buckets of an LFU): ``most`` is the
        #: largest non-empty bucket, kept exact in O(1) as counts move by one.
        self.by_places: dict[int, dict[_Flow, None]] = {}
        self.most = 0
        self.size = 0


class FairQueue:
    """The waiting requests of one gate, ordered by the rules at the top of this module.

    Args:
        weights: Tenant name to weight, from :data:`MIN_TENANT_WEIGHT` to
            :data:`MAX_TENANT_WEIGHT`; tenants not named weigh 1.
        max_tenants: Tenant records kept at most (>= 1); beyond, tenants share one record.

    Raises:
        ValueError: A weight out of its range (NaN included), or ``max_tenants < 1``.
    """

    __slots__ = (
        "_bands",
        "_best",
        "_known",
        "_overflow",
        "_spare",
        "_tick",
        "_weights",
        "_worst",
        "max_tenants",
        "size",
        "tenants",
        "version",
    )

    def __init__(
        self, *, weights: Mapping[str, float] | None = None, max_tenants: int = 4096
    ) -> None:
        weights = dict(weights or {})
        for name, weight in weights.items():
            if not MIN_TENANT_WEIGHT <= weight <= MAX_TENANT_WEIGHT:
                raise ValueError(
                    f"tenant weight must be a number from {MIN_TENANT_WEIGHT:g} to"
                    f" {MAX_TENANT_WEIGHT:g}, got {name}={weight}"
                )
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self._weights = weights
        #: Records of the tenants with requests in the gate, by name.
        self.tenants: dict[str, Tenant] = {}
        self.max_tenants: Final = max_tenants
        self._overflow = Tenant(OVERFLOW_TENANT, 1.0)
        # The record forgotten last, reused (reset: forgotten is forgotten) when the same
        # tenant comes back: one tenant sending one request at a time allocates nothing.
        self._spare: Tenant | None = None
        # Names of tenants that were served and have left the gate, least recently left first
        # (at most max_tenants): a tenant that comes back is not new (rule 5).
        self._known: dict[str, None] = {}
        self._bands: dict[int, _Band] = {}
        # Priorities of the bands: a min-heap (best first) and a max-heap (negated: worst
        # first), both with lazy deletion (a priority whose band is gone is skipped).
        self._best: list[int] = []
        self._worst: list[int] = []
        #: Entries queued.
        self.size = 0
        #: Bumped by every change of what is queued (push, pop, remove): a decision that
        #: depends only on the queue holds while it stays the same.
        self.version = 0
        self._tick = 0

    def __len__(self) -> int:
        return self.size

    # -- tenants --------------------------------------------------------------------------------

    def tenant(self, name: str) -> Tenant:
        """The record of tenant ``name``, created if needed; the caller counts a request on it.

        Args:
            name: The tenant's name.

        Returns:
            Its record (the overflow record when ``max_tenants`` records exist already). Its
            ``requests`` is incremented: release it with :meth:`release` when the request
            leaves the gate.
        """
        record = self.tenants.get(name)
        if record is None:
            if len(self.tenants) >= self.max_tenants:
                record = self._overflow
            else:
                spare = self._spare
                if spare is not None and spare.name == name:
                    self._spare = None
                    spare.service = spare.attained = 0.0
                    record = spare
                else:
                    record = Tenant(name, self._weights.get(name, 1.0))
                self.tenants[name] = record
        record.requests += 1
        return record

    def release(self, tenant: Tenant) -> None:
        """One request of ``tenant`` left the gate; forget the tenant when it was the last."""
        tenant.requests -= 1
        if tenant.requests == 0 and tenant is not self._overflow:
            name = tenant.name
            del self.tenants[name]
            self._spare = tenant
            if tenant.attained > 0:
                known = self._known
                known.pop(name, None)
                known[name] = None
                if len(known) > self.max_tenants:
                    del known[next(iter(known))]

    def is_new(self, name: str) -> bool:
        """Whether tenant ``name`` is new to the gate (rule 5): no request of it queued or
        running, and not among the last ``max_tenants`` tenants served that left."""
        return name not in self.tenants and name not in self._known

    @staticmethod
    def charge(tenant: Tenant, tokens: float) -> None:
        """Add ``tokens`` of service (from :func:`service_tokens`), divided by the weight."""
        cost = tokens * tenant.inverse_weight
        tenant.service += cost
        tenant.attained += cost

    # -- entries --------------------------------------------------------------------------------

    def push(self, entry: QueueEntry) -> None:
        """Queue an entry (rules 2 and 3: a newly backlogged flow is lifted)."""
        band = self._bands.get(entry.priority)
        if band is None:
            band = self._new_band(entry.priority)
        tenant = entry.tenant
        flow = band.flows.get(tenant)
        if flow is None:
            flow = _Flow(tenant)
            if band.flows:
                floor = max(self._least_service(band), band.clock)
                if tenant.service < floor:
                    tenant.service = floor
            band.flows[tenant] = flow
            self._tick += 1
            heapq.heappush(band.heap, (tenant.service, tenant.attained, self._tick, flow))
            if len(band.heap) > 2 * len(band.flows) + _COMPACT_SLACK:
                self._compact_heap(band)
        else:
            self._leave_bucket(band, flow)
        flow.entries.append(entry)
        flow.live += 1
        self._enter_bucket(band, flow)
        band.order.append(entry)
        band.size += 1
        self.size += 1
        self.version += 1
        entry._flow = flow

    def pop(self) -> QueueEntry | None:
        """Take the entry that starts next out of the queue, charging its start cost to its
        tenant.

        Returns:
            The entry, or ``None`` when nothing waits.
        """
        if not self.size:
            return None
        band = self._best_band()
        flow = self._least_served_flow(band)
        entries = flow.entries
        entry = entries.popleft()
        while entry._flow is None:  # skip entries removed from the middle
            entry = entries.popleft()
        self._unlink(band, flow, entry)
        order = band.order
        while order and order[0]._flow is None:
            order.popleft()
        tenant = entry.tenant
        self.charge(tenant, entry.start_cost)
        if tenant.service > band.clock:
            band.clock = tenant.service
        return entry

    def remove(self, entry: QueueEntry) -> bool:
        """Take a queued entry out (cancelled, timed out, displaced); lazy, O(1) amortized.

        Returns:
            True if the entry was queued here; False if it was not (nothing changes).
        """
        flow = entry._flow
        if flow is None:
            return False
        band = self._bands[entry.priority]
        self._unlink(band, flow, entry)
        if flow.live and len(flow.entries) > 2 * flow.live + _COMPACT_SLACK:
            flow.entries = deque(e for e in flow.entries if e._flow is not None)
        if band.size and len(band.order) > 2 * band.size + _COMPACT_SLACK:
            band.order = deque(e for e in band.order if e._flow is not None)
        return True

    def victim(
        self, priority: int, tenant: Tenant | None, *, new: bool | None = None
    ) -> tuple[QueueEntry, str] | None:
        """Whom an arrival at a full queue displaces (rule 5), without changing anything.

        Args:
            priority: The arrival's priority.
            tenant: The arrival's tenant record, or ``None`` if it has none yet (it then holds
                no place).
            new: Whether the tenant is new to the gate (:meth:`is_new`); ``None``: new when it
                has no record.

        Returns:
            ``(entry, DISPLACED_BY_PRIORITY or DISPLACED_BY_SHARE)``, or ``None``.
        """
        if not self.size:
            return None
        band = self._worst_band()
        if priority < band.priority:
            return self._newest(band.order), DISPLACED_BY_PRIORITY
        if priority > band.priority:
            return None
        own = band.flows.get(tenant) if tenant is not None else None
        places = own.live if own is not None else 0
        # A tenant new to the gate counts as holding one place more (rule 5): it never takes
        # another tenant's only place.
        if places + (tenant is None if new is None else new) >= band.most:
            return None
        heaviest = next(iter(band.by_places[band.most]))
        return self._newest(heaviest.entries), DISPLACED_BY_SHARE

    # -- views ----------------------------------------------------------------------------------

    def sizes_by_priority(self) -> Iterator[tuple[int, int]]:
        """``(priority, entries waiting)`` for every band, best first (for metrics)."""
        for priority in sorted(self._bands):
            yield priority, self._bands[priority].size

    def ahead(self, priority: int) -> int:
        """Entries an arrival of ``priority`` would start behind: those of it or a better one.
        O(priorities queued), never a scan of the entries."""
        ahead = 0
        for band, size in self.sizes_by_priority():
            if band > priority:
                break
            ahead += size
        return ahead

    def ahead_by_priority(self, hand: int | None, limit: int) -> list[tuple[int, int]]:
        """For each priority waiting, best first (the best ``limit``): what an arrival of it
        would start behind, counting also an entry held apart to start next, whatever its
        priority (``hand``: that entry's priority; ``None``: none, and then nothing waits)."""
        if hand is None:
            return []
        sizes = dict(self.sizes_by_priority())
        sizes.setdefault(hand, 0)
        ahead = 1
        figures: list[tuple[int, int]] = []
        for priority in sorted(sizes)[:limit]:
            ahead += sizes[priority]
            figures.append((priority, ahead))
        return figures

    def entries(self) -> list[QueueEntry]:
        """Every queued entry, by priority then arrival (for tests and debugging).

        With one tenant per priority this is the order in which they start; across tenants the
        start order also depends on service charged later. O(n log n): never on a hot path.
        """
        live = [e for band in self._bands.values() for e in band.order if e._flow is not None]
        return sorted(live, key=lambda e: (e.priority, e.number))

    # -- internals ------------------------------------------------------------------------------

    def _new_band(self, priority: int) -> _Band:
        band = _Band(priority)
        self._bands[priority] = band
        heapq.heappush(self._best, priority)
        heapq.heappush(self._worst, -priority)
        if len(self._best) > 2 * len(self._bands) + _COMPACT_SLACK:
            self._best = sorted(self._bands)
            self._worst = sorted(-p for p in self._bands)
        return band

    def _best_band(self) -> _Band:
        best, bands = self._best, self._bands
        while True:
            band = bands.get(best[0])
            if band is not None:
                return band
            heapq.heappop(best)

    def _worst_band(self) -> _Band:
        worst, bands = self._worst, self._bands
        while True:
            band = bands.get(-worst[0])
            if band is not None:
                return band
            heapq.heappop(worst)

    def _least_served_flow(self, band: _Band) -> _Flow:
        # The heap's top is right once it names a flow still in the band at its current service
        # (services only grow, so a stale key is too small: refresh it and look again).
        # Termination (rule 7): each turn pops an item of a flow that left the band, or gives
        # a live flow's only item its tenant's current service, which nothing changes during
        # this call, so that item is never refreshed twice. Hence at most 2 * len(heap) turns
        # before the top is fresh, and the bound below is never reached.
        heap, flows = band.heap, band.flows
        for _ in range(2 * len(heap) + 1):
            service, _, _, flow = heap[0]
            tenant = flow.tenant
            if flows.get(tenant) is not flow:
                heapq.heappop(heap)
            elif service < tenant.service:
                self._tick += 1
                heapq.heapreplace(heap, (tenant.service, tenant.attained, self._tick, flow))
            else:
                return flow
        raise AssertionError("the band's heap kept changing under one look (rule 7)")

    def _least_service(self, band: _Band) -> float:
        return self._least_served_flow(band).tenant.service

    def _compact_heap(self, band: _Band) -> None:
        live = [item for item in band.heap if band.flows.get(item[3].tenant) is item[3]]
        heapq.heapify(live)
        band.heap = live

    @staticmethod
    def _newest(entries: deque[QueueEntry]) -> QueueEntry:
        while entries[-1]._flow is None:
            entries.pop()
        return entries[-1]

    def _unlink(self, band: _Band, flow: _Flow, entry: QueueEntry) -> None:
        entry._flow = None
        self.version += 1
        self._leave_bucket(band, flow)
        flow.live -= 1
        band.size -= 1
        self.size -= 1
        if flow.live:
            self._enter_bucket(band, flow)
        else:
            del band.flows[flow.tenant]
            flow.entries.clear()
        if not band.size:
            del self._bands[band.priority]

    @staticmethod
    def _enter_bucket(band: _Band, flow: _Flow) -> None:
        places = flow.live
        bucket = band.by_places.get(places)
        if bucket is None:
            band.by_places[places] = {flow: None}
        else:
            bucket[flow] = None
        if places > band.most:
            band.most = places

    @staticmethod
    def _leave_bucket(band: _Band, flow: _Flow) -> None:
        places = flow.live
        bucket = band.by_places[places]
        del bucket[flow]
        if not bucket:
            del band.by_places[places]
            if band.most == places:
                # Counts move by one: the flow that alone held the most is about to hold one
                # fewer (or, at one place, to leave the band, which then holds at most one).
                band.most = places - 1
