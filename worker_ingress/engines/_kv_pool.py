"""The KV-block pool of one mocker rank, with its prefix cache (sans-IO).

A block is *held* while a running sequence uses it, and *cached* while it has a name (the chained
hash of the prompt prefix it ends, :func:`shim_common.prefix.block_names`). The pool counts both
and says what enters and leaves the cache; :class:`~worker_ingress.engines._mock_scheduler.
RankScheduler` decides who gets blocks.

Rules of the pool:

1. Capacity. ``held + evictable <= num_blocks``, where ``held`` counts each block held by any
   number of sequences once, and ``evictable`` counts the cached blocks nobody holds. The space a
   new block may take is ``num_blocks - held`` (:attr:`KvBlockPool.free`): a cached block nobody
   holds is free capacity, and is evicted when its space is needed (rule 7 says whose). A held
   block is never evicted.
2. Anonymous and named blocks. A sequence's blocks are first anonymous (being filled);
   :meth:`KvBlockPool.commit` names one once its tokens are computed and it ends a full prompt
   block. A name already cached (a sequence computed the same prefix at the same time) is shared
   instead, and the anonymous block goes back to the pool.
3. Reuse. :meth:`KvBlockPool.match` finds a prompt's longest cached prefix without changing
   anything; :meth:`KvBlockPool.acquire` then holds those blocks (a cached block nobody held
   becomes held, so it takes space again).
4. Release. :meth:`KvBlockPool.release` lets a sequence's named blocks go, the last first, so
   a chain is evicted from its end: a cached block's parent is always cached too (the cache is
   closed under prefixes), which is what a router's index of it assumes.
5. Events. Every name that enters the cache is reported as stored (with its parent), every name
   that leaves as removed, in order (:meth:`KvBlockPool.take_events`). With caching off nothing is
   ever named, matched or reported, and the pool counts anonymous blocks only.
6. Bounds. The cache holds at most ``num_blocks`` names, and the pending events at most what the
   caller has not taken since its last call (the mocker takes them after every step). The
   tenants the pool keeps anything for are those that own a cached block, so at most
   ``num_blocks`` of them.

Whose blocks are evicted (tenants share the cache as they share the queue, in the spirit of the
admission gate's fair queue, ``worker_ingress/_fair_queue.py``):

7. Every cached block is *owned* by one tenant: the tenant of the sequence that named it
   (:meth:`~KvBlockPool.commit`), and from then on the tenant of the sequence whose release left
   it held by nobody (:meth:`~KvBlockPool.release`): a block several tenants' prompts share
   belongs to the last one that used it, so whoever keeps a shared prefix warm pays for it, and
   it is never counted twice. A tenant's *usage* is the cached blocks it owns, held or not.
   When space is needed, the block evicted is the least recently released block of the tenant
   whose usage is the largest among the tenants that own a block nobody holds (ties: the tenant
   whose usage changed first). With equal weights the fair share of every tenant is the same,
   so this evicts from the tenant that most exceeds it: a tenant flooding the cache with unique
   prompts evicts its own blocks once it holds more than the others, and a tenant using less
   than any other keeps all it has while another has something to give back (max-min
   fairness of the cache; held blocks, which no rule may evict, are the limit).
8. One tenant (the shared tenant ``""`` of requests that name none, or any single name) is
   plain LRU over the whole cache, exactly as before tenants were known: the order of eviction
   is the order of release. A tenant is a name, not a proof: many made-up names each look
   small, as they do to the fair queue, so names must come from a trusted gateway for the
   shares to mean anything (docs/configuration.md, who may claim a class).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

__all__ = ["KvBlockPool", "PoolEvent", "STORED", "REMOVED", "SHARED_TENANT"]

#: Kinds of :data:`PoolEvent`.
STORED: Final = "stored"
REMOVED: Final = "removed"
#: The tenant of a sequence that names none (the wire's default tenant).
SHARED_TENANT: Final = ""

#: ``(STORED, parent, names)`` for a chain that entered the cache (``parent`` ``None``: it starts
#: a prompt), or ``(REMOVED, None, names)`` for names that left it.
PoolEvent = tuple[str, int | None, list[int]]


class KvBlockPool:
    """Blocks of one rank: held counts, the cache of named blocks, whose they are, and the order
    they are evicted in (see rules).

    Args:
        num_blocks: Blocks of the rank.
        caching: Whether blocks are named and reused (``--enable-prefix-caching``).
    """

    __slots__ = (
        "_events",
        "_evictable",
        "_heap",
        "_lrus",
        "_order",
        "_owner",
        "_parents",
        "_refs",
        "_usage",
        "caching",
        "held",
        "num_blocks",
    )

    def __init__(self, num_blocks: int, *, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        #: Distinct blocks held by running sequences (rule 1).
        self.held = 0
        #: Holders of each cached name (0: evictable, then also in its owner's LRU).
        self._refs: dict[int, int] = {}
        #: The parent of each cached name (``None``: it starts a prompt).
        self._parents: dict[int, int | None] = {}
        #: The tenant each cached name belongs to (rule 7).
        self._owner: dict[int, str] = {}
        #: Cached names each tenant owns, held or not (rule 7's usage); no entry at 0.
        self._usage: dict[str, int] = {}
        #: Per tenant owning any, its cached names nobody holds, least recently released first.
        self._lrus: dict[str, OrderedDict[int, None]] = {}
        self._evictable = 0
        #: With two tenants or more in ``_lrus``: ``(-usage, order, tenant)`` entries, one of
        #: them current for each such tenant, the stale ones dropped as they surface (rule 7).
        self._heap: list[tuple[int, int, str]] = []
        self._order = itertools.count()
        self._events: list[PoolEvent] = []

    # --- inspection --------------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Space new blocks may take: nobody's blocks, cached ones included (rule 1)."""
        return self.num_blocks - self.held

    @property
    def evictable(self) -> int:
        """Cached blocks nobody holds."""
        return self._evictable

    @property
    def cached(self) -> int:
        """Named blocks in the cache, held or not."""
        return len(self._refs)

    def names(self) -> list[int]:
        """Every cached name (for a snapshot of the cache)."""
        return list(self._refs)

    def parent_of(self, name: int) -> int | None:
        """The parent of a cached name."""
        return self._parents[name]

    def holders(self, name: int) -> int:
        """How many sequences hold a name (0 when evictable or not cached)."""
        return self._refs.get(name, 0)

    def owner_of(self, name: int) -> str:
        """The tenant a cached name belongs to (rule 7)."""
        return self._owner[name]

    def usage(self, tenant: str) -> int:
        """Cached blocks ``tenant`` owns, held or not (rule 7)."""
        return self._usage.get(tenant, 0)

    # --- reuse -------------------------------------------------------------------------------

    def match(self, names: Sequence[int], limit: int) -> tuple[int, int]:
        """The longest cached prefix of ``names``, at most ``limit`` blocks long.

        Returns:
            ``(blocks, revived)``: how many leading names are cached, and how many of those
            nobody holds now (holding them takes that much space).
        """
        if not self.caching:
            return 0, 0
        refs = self._refs
        blocks = 0
        revived = 0
        for name in names[: max(limit, 0)]:
            holders = refs.get(name)
            if holders is None:
                break
            blocks += 1
            revived += holders == 0
        return blocks, revived

    def acquire(self, names: Sequence[int]) -> None:
        """Hold cached names (a prefix :meth:`match` found; the caller checked the space).

        Whose they are does not change here: it changes when they are let go (rule 7).
        """
        refs = self._refs
        for name in names:
            holders = refs[name]
            if holders == 0:
                self._unlist(name)
                self.held += 1
            refs[name] = holders + 1

    # --- blocks coming and going -------------------------------------------------------------

    def allocate(self, count: int) -> None:
        """Take ``count`` anonymous blocks, evicting cached ones nobody holds as needed.

        Raises:
            ValueError: fewer than ``count`` blocks are free (rule 1: the caller checks first).
        """
        if count > self.free:
            raise ValueError(f"{count} blocks asked for, {self.free} free")
        self.held += count
        overflow = self.held + self._evictable - self.num_blocks
        if overflow > 0:
            self._evict(overflow)

    def free_anonymous(self, count: int) -> None:
        """Give back ``count`` anonymous blocks."""
        self.held -= count

    def commit(self, parent: int | None, name: int, tenant: str = SHARED_TENANT) -> None:
        """Name one of the caller's anonymous blocks ``name`` (its parent ``parent``), owned by
        ``tenant``, or share the block already cached under that name and give the anonymous
        one back (rules 2 and 7)."""
        holders = self._refs.get(name)
        if holders is None:
            self._refs[name] = 1
            self._parents[name] = parent
            self._owner[name] = tenant
            usage = self._usage
            usage[tenant] = usage.get(tenant, 0) + 1
            if len(self._lrus) > 1 and tenant in self._lrus:
                self._push(tenant)
            self._report_stored(parent, name)
            return
        self.held -= 1
        self.acquire((name,))

    def release(self, names: Sequence[int], tenant: str = SHARED_TENANT) -> None:
        """Stop holding ``names`` (a prefix chain a sequence of ``tenant`` held), the last first
        (rule 4); a name nobody holds any more becomes ``tenant``'s (rule 7)."""
        refs = self._refs
        owner = self._owner
        lru: OrderedDict[int, None] | None = None
        freed = 0
        for name in reversed(names):
            holders = refs[name] - 1
            refs[name] = holders
            if holders:
                continue
            previous = owner[name]
            if previous != tenant:
                owner[name] = tenant
                self._add_usage(previous, -1)
                self._add_usage(tenant, 1)
            if lru is None:
                lru = self._lru_of(tenant)
            lru[name] = None
            freed += 1
        self.held -= freed
        self._evictable += freed

    def take_events(self) -> list[PoolEvent]:
        """What entered and left the cache since the last call, in order."""
        events = self._events
        self._events = []
        return events

    # --- internals ---------------------------------------------------------------------------

    def _lru_of(self, tenant: str) -> OrderedDict[int, None]:
        """``tenant``'s order of eviction, made when it has none (the caller lists a name)."""
        lrus = self._lrus
        lru = lrus.get(tenant)
        if lru is None:
            lru = lrus[tenant] = OrderedDict()
            if len(lrus) == 2:
                self._rebuild_heap()
            elif len(lrus) > 2:
                self._push(tenant)
        return lru

    def _unlist(self, name: int) -> None:
        """``name`` is held again: out of its owner's order of eviction."""
        tenant = self._owner[name]
        lru = self._lrus[tenant]
        del lru[name]
        self._evictable -= 1
        if not lru:
            self._drop_lru(tenant)

    def _drop_lru(self, tenant: str) -> None:
        lrus = self._lrus
        del lrus[tenant]
        if len(lrus) < 2:
            self._heap.clear()  # one tenant or none: plain LRU (rule 8), no heap

    def _add_usage(self, tenant: str, delta: int) -> None:
        usage = self._usage.get(tenant, 0) + delta
        if usage:
            self._usage[tenant] = usage
        else:
            del self._usage[tenant]
        if len(self._lrus) > 1 and tenant in self._lrus:
            self._push(tenant)

    def _push(self, tenant: str) -> None:
        heap = self._heap
        if len(heap) > 4 * len(self._lrus) + 64:
            self._rebuild_heap()  # mostly stale entries: start over (amortised O(1) a push)
            return
        heapq.heappush(heap, (-self._usage[tenant], next(self._order), tenant))

    def _rebuild_heap(self) -> None:
        usage = self._usage
        order = self._order
        self._heap = [(-usage[tenant], next(order), tenant) for tenant in self._lrus]
        heapq.heapify(self._heap)

    def _victim(self) -> str:
        """The tenant whose block is evicted next (rule 7): the largest usage with something
        evictable; with one such tenant, that one (rule 8)."""
        lrus = self._lrus
        if len(lrus) == 1:
            return next(iter(lrus))
        heap = self._heap
        usage = self._usage
        while True:
            negative, _, tenant = heap[0]
            if tenant in lrus and usage[tenant] == -negative:
                return tenant
            heapq.heappop(heap)

    def _evict(self, count: int) -> None:
        removed: list[int] = []
        lrus = self._lrus
        refs = self._refs
        parents = self._parents
        owner = self._owner
        while count:
            tenant = self._victim()
            lru = lrus[tenant]
            # One tenant to evict from (rule 8): as many as it has in one go; else one block,
            # then the victim is chosen again (rule 7).
            take = min(count, len(lru)) if len(lrus) == 1 else 1
            for _ in range(take):
                name, _ignored = lru.popitem(last=False)
                del refs[name]
                del parents[name]
                del owner[name]
                removed.append(name)
            count -= take
            self._evictable -= take
            if not lru:
                self._drop_lru(tenant)
            self._add_usage(tenant, -take)
        events = self._events
        if events and events[-1][0] == REMOVED:
            events[-1][2].extend(removed)
        else:
            events.append((REMOVED, None, removed))

    def _report_stored(self, parent: int | None, name: int) -> None:
        # A chain stored block after block is one event: the last event continues when this
        # block's parent is the last name it stored.
        events = self._events
        if events:
            kind, _, names = events[-1]
            if kind == STORED and names[-1] == parent:
                names.append(name)
                return
        events.append((STORED, parent, [name]))
