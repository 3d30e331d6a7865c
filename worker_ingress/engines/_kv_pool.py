"""The KV-block pool of one mocker rank, with its prefix cache (sans-IO).

A block is *held* while a running sequence uses it, and *cached* while it has a name (the chained
hash of the prompt prefix it ends, :func:`shim_common.prefix.block_names`). The pool counts both
and says what enters and leaves the cache; :class:`~worker_ingress.engines._mock_scheduler.
RankScheduler` decides who gets blocks.

Rules of the pool:

1. Capacity. ``held + evictable <= num_blocks``, where ``held`` counts each block held by any
   number of sequences once, and ``evictable`` counts the cached blocks nobody holds. The space a
   new block may take is ``num_blocks - held`` (:attr:`KvBlockPool.free`): a cached block nobody
   holds is free capacity, and is evicted when its space is needed, least recently released
   first. A held block is never evicted.
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
   caller has not taken since its last call (the mocker takes them after every step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

__all__ = ["KvBlockPool", "PoolEvent", "STORED", "REMOVED"]

#: Kinds of :data:`PoolEvent`.
STORED: Final = "stored"
REMOVED: Final = "removed"

#: ``(STORED, parent, names)`` for a chain that entered the cache (``parent`` ``None``: it starts
#: a prompt), or ``(REMOVED, None, names)`` for names that left it.
PoolEvent = tuple[str, int | None, list[int]]


class KvBlockPool:
    """Blocks of one rank: held counts, the cache of named blocks, its LRU order (see rules).

    Args:
        num_blocks: Blocks of the rank.
        caching: Whether blocks are named and reused (``--enable-prefix-caching``).
    """

    __slots__ = ("_events", "_lru", "_parents", "_refs", "caching", "held", "num_blocks")

    def __init__(self, num_blocks: int, *, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        #: Distinct blocks held by running sequences (rule 1).
        self.held = 0
        #: Holders of each cached name (0: evictable, then also in ``_lru``).
        self._refs: dict[int, int] = {}
        #: The parent of each cached name (``None``: it starts a prompt).
        self._parents: dict[int, int | None] = {}
        #: Cached names nobody holds, least recently released first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._events: list[PoolEvent] = []

    # --- inspection --------------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Space new blocks may take: nobody's blocks, cached ones included (rule 1)."""
        return self.num_blocks - self.held

    @property
    def evictable(self) -> int:
        """Cached blocks nobody holds."""
        return len(self._lru)

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
        """Hold cached names (a prefix :meth:`match` found; the caller checked the space)."""
        refs = self._refs
        for name in names:
            holders = refs[name]
            if holders == 0:
                del self._lru[name]
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
        overflow = self.held + len(self._lru) - self.num_blocks
        if overflow > 0:
            self._evict(overflow)

    def free_anonymous(self, count: int) -> None:
        """Give back ``count`` anonymous blocks."""
        self.held -= count

    def commit(self, parent: int | None, name: int) -> None:
        """Name one of the caller's anonymous blocks ``name`` (its parent ``parent``), or share
        the block already cached under that name and give the anonymous one back (rule 2)."""
        holders = self._refs.get(name)
        if holders is None:
            self._refs[name] = 1
            self._parents[name] = parent
            self._report_stored(parent, name)
            return
        self.held -= 1
        self.acquire((name,))

    def release(self, names: Sequence[int]) -> None:
        """Stop holding ``names`` (a prefix chain a sequence held), the last first (rule 4)."""
        refs = self._refs
        lru = self._lru
        for name in reversed(names):
            holders = refs[name] - 1
            refs[name] = holders
            if holders == 0:
                lru[name] = None
                self.held -= 1

    def take_events(self) -> list[PoolEvent]:
        """What entered and left the cache since the last call, in order."""
        events = self._events
        self._events = []
        return events

    # --- internals ---------------------------------------------------------------------------

    def _evict(self, count: int) -> None:
        removed: list[int] = []
        lru = self._lru
        for _ in range(count):
            name, _ignored = lru.popitem(last=False)
            del self._refs[name]
            del self._parents[name]
            removed.append(name)
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
