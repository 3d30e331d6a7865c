"""Who holds the worker's event-plane places, and whose place a newcomer takes (pure).

Without a worker token, anything that reaches the port may subscribe, so the places are shared
by rules under which a frontend that has linked keeps its place, and one that links finds a
place, however other clients come and go (each frontend holds one place of each of its
workers). A client cannot be told from a frontend by what it sends, only by where it comes
from, how many places its address holds, and whether it behaves as a frontend does: a frontend
sends a ``subscribe`` as soon as it has read the hello, and then reads what it is sent.

Words: a subscriber is a *reader* while it has sent a ``subscribe`` and nothing the worker
sent it (an event batch, a keepalive ping) has waited on it for ``grace`` seconds; a
*squatter* has sent no ``subscribe`` within ``grace`` seconds of being accepted. A subscriber
that is neither (accepted less than ``grace`` ago and not subscribed yet, or subscribed and
stalled) is *taken before readers*, like a squatter.

Rules:

1. An event-plane handshake claims a place (:meth:`SubscriberPlaces.claim`) before it is
   answered, and gives it back when its connection ends (:meth:`SubscriberPlaces.release`); a
   place counts from its claim, so handshakes under way at once cannot overshoot the bounds.
2. One address holds at most ``per_address`` places: a newcomer from an address that holds as
   many takes the place of that address's oldest subscriber that is not a reader (rule 4); if
   every one is a reader, the newcomer is refused. A newcomer has sent nothing yet, so it never
   takes a reader's place from its own address: a frontend that subscribed and reads keeps its
   place however often other clients of its host come back.
3. At most ``cap`` places are held in all. A newcomer at the cap takes the place of the oldest
   squatter, wherever it is; with none, a place of the address holding the most places, the
   newcomer counted with its own address (of several such addresses, the one with the oldest
   subscriber): its oldest subscriber that is not a reader, else, when that address is not the
   newcomer's own, its oldest reader; else the newcomer is refused. So a newcomer from an
   address that holds fewer places than another always gets one, a squatter that comes back
   takes its own address's place, never that of a frontend on an address holding fewer, and
   never a reader's of its own address.
4. Of one address's places, a squatter goes before any other, then any other that is not a
   reader, oldest first; a reader only last, and only to a newcomer of another address. Only a
   place whose handshake has been answered (:attr:`Place.connection` set) can be taken; a place
   taken counts no more at once (the caller closes its connection), and its release is then a
   no-op. A newcomer that finds nothing to take is refused.

What a legitimate fleet looks like: one frontend per address (the usual), or a few frontends on
one host; each holds one place of each worker, well within ``per_address``, and keeps it: no
newcomer of its own host takes a reader's place (rule 2), and one of another address takes it
only from an address holding more places than its own, which a squatting address, always
holding more, is. What these rules cannot do is tell a frontend from a client of the same
address that subscribes and reads as one does: such clients holding every place of that address
keep a new frontend of it out (refused, until one of them leaves) without taking the place of
any frontend already linked. Only a worker token keeps them out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

__all__ = ["PeerWaits", "Place", "SubscriberPlaces", "Subscriber"]


class Subscriber(Protocol):
    """What the places need of a subscriber's connection."""

    def squatting(self, now: float, grace: float) -> bool:
        """Whether it has sent no ``subscribe`` in the ``grace`` seconds since it was accepted."""
        ...

    def reading(self, now: float, grace: float) -> bool:
        """Whether it has sent a ``subscribe`` and nothing sent to it has waited ``grace``
        seconds on it (a batch being written, a ping without its pong)."""
        ...


S = TypeVar("S", bound=Subscriber)


class PeerWaits:
    """Since when each of a connection's sends waits on its peer (an event batch being written,
    a ping's pong): what says whether a subscriber reads what it is sent (a reader, above)."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}

    @contextmanager
    def waiting(self, what: str, now: float) -> Iterator[None]:
        """Note that ``what`` waits on the peer from ``now`` for as long as the block runs."""
        self._since[what] = now
        try:
            yield
        finally:
            del self._since[what]

    def longest(self, now: float) -> float:
        """Seconds the oldest wait under way has lasted at ``now`` (0 with none)."""
        return now - min(self._since.values(), default=now)


class Place(Generic[S]):
    """One place, from the claim of a handshake to the end of its connection.

    Attributes:
        address: The client's address.
        order: The claim's rank among all claims (the lower, the older).
        connection: The subscriber once its handshake is answered (set by the caller).
        taken: Whether a newcomer took it (its connection is to close).
    """

    __slots__ = ("address", "connection", "order", "taken")

    def __init__(self, address: str, order: int) -> None:
        self.address = address
        self.order = order
        self.connection: S | None = None
        self.taken = False


class SubscriberPlaces(Generic[S]):
    """The event-plane places of one worker (rules 1-4).

    Args:
        cap: Places in all; at least 1.
        per_address: Places one address may hold; at least 1.
        grace: Seconds a subscriber has to send its ``subscribe`` before it is a squatter, and
            that what is sent to it may wait on it while it is a reader.
    """

    def __init__(self, cap: int, per_address: int, grace: float) -> None:
        if cap < 1 or per_address < 1:
            raise ValueError(f"need cap and per_address >= 1, got {cap}, {per_address}")
        self.cap = cap
        self.per_address = per_address
        self.grace = grace
        # Per address, its places in the order they were claimed (oldest first).
        self._places: dict[str, list[Place[S]]] = {}
        self._held = 0
        self._claims = 0

    @property
    def held(self) -> int:
        """Places held now (taken ones no more)."""
        return self._held

    def held_by(self, address: str) -> int:
        """Places one address holds now."""
        return len(self._places.get(address, ()))

    def claim(self, address: str, now: float) -> tuple[Place[S] | None, Place[S] | None]:
        """A handshake from ``address`` at ``now`` asks for a place (rules 1-4).

        Returns:
            ``(its place, the place it took)``: its place is ``None`` when it is refused, the
            place taken ``None`` when there was room; the caller closes the connection of the
            place taken.
        """
        own = self._places.get(address, [])
        taken: Place[S] | None
        if len(own) >= self.per_address:
            taken = self._first_to_go(own, now, readers=False)
        elif self._held >= self.cap:
            taken = self._oldest_squatter(now) or self._from_the_largest(address, now)
        else:
            return self._add(address), None
        if taken is None:
            return None, None
        self._remove(taken)
        taken.taken = True
        return self._add(address), taken

    def release(self, place: Place[S]) -> None:
        """The connection of ``place`` ended (a no-op for a place taken, rule 4)."""
        if not place.taken:
            self._remove(place)

    def _add(self, address: str) -> Place[S]:
        self._claims += 1
        place: Place[S] = Place(address, self._claims)
        self._places.setdefault(address, []).append(place)
        self._held += 1
        return place

    def _remove(self, place: Place[S]) -> None:
        places = self._places[place.address]
        places.remove(place)
        if not places:
            del self._places[place.address]
        self._held -= 1

    def _squatting(self, place: Place[S], now: float) -> bool:
        connection = place.connection
        return connection is not None and connection.squatting(now, self.grace)

    def _first_to_go(self, places: list[Place[S]], now: float, *, readers: bool) -> Place[S] | None:
        """Of one address's places (oldest first), the one a newcomer takes (rule 4): its
        oldest squatter, else its oldest answered place that is not a reader, else, when
        ``readers`` allows, its oldest reader."""
        answered = [place for place in places if place.connection is not None]
        for place in answered:
            if self._squatting(place, now):
                return place
        grace = self.grace
        for place in answered:
            assert place.connection is not None
            if not place.connection.reading(now, grace):
                return place
        return answered[0] if readers and answered else None

    def _oldest_squatter(self, now: float) -> Place[S] | None:
        squatters = [
            place
            for places in self._places.values()
            for place in places
            if self._squatting(place, now)
        ]
        return min(squatters, key=lambda place: place.order, default=None)

    def _from_the_largest(self, address: str, now: float) -> Place[S] | None:
        """The place a newcomer from ``address`` takes at the cap with no squatter (rule 3)."""
        best: tuple[int, int] | None = None  # (places held, minus the oldest place's order)
        chosen: list[Place[S]] = []
        holder_of_chosen = ""
        for holder, places in self._places.items():
            answered = [place for place in places if place.connection is not None]
            if not answered:
                continue
            key = (len(places) + (holder == address), -answered[0].order)
            if best is None or key > best:
                best, chosen, holder_of_chosen = key, places, holder
        return self._first_to_go(chosen, now, readers=holder_of_chosen != address)
