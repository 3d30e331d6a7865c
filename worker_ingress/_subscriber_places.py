"""Who holds the worker's event-plane places, and whose place a newcomer takes (pure).

Without a worker token, anything that reaches the port may subscribe, so the places are shared
by rules under which a frontend can always link, however many places other clients hold (each
frontend holds one place of each of its workers). A client cannot be told from a frontend by
what it sends, only by where it comes from and how many places its address holds.

Rules:

1. An event-plane handshake claims a place (:meth:`SubscriberPlaces.claim`) before it is
   answered, and gives it back when its connection ends (:meth:`SubscriberPlaces.release`); a
   place counts from its claim, so handshakes under way at once cannot overshoot the bounds.
2. One address holds at most ``per_address`` places: a newcomer from an address that holds as
   many takes the place of that address's oldest subscriber, whatever its age.
3. At most ``cap`` places are held in all. A newcomer at the cap takes the place of the oldest
   subscriber that has sent no ``subscribe`` within ``grace`` seconds of being accepted (a
   squatter: a frontend subscribes as soon as it has read the hello); with none, that of the
   oldest subscriber of the address holding the most places, whatever its age, the newcomer
   counted with its own address (of several such addresses, the one with the oldest
   subscriber). So a newcomer from an address that holds fewer places than another always gets
   one, and a squatter that comes back takes its own address's place, never that of a frontend
   on an address holding fewer.
4. In rules 2 and 3, a squatter of the chosen address goes before its other subscribers. Only a
   place whose handshake has been answered (:attr:`Place.connection` set) can be taken; a
   place taken counts no more at once (the caller closes its connection), and its release is
   then a no-op. A newcomer that finds nothing to take is refused.

What a legitimate fleet looks like: one frontend per address (the usual), or a few frontends on
one host; each holds one place of each worker, well within ``per_address``, and keeps it as long
as no address holding fewer places than its own comes to take one, which a squatting address,
always holding more, cannot do.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

__all__ = ["Place", "SubscriberPlaces", "Subscriber"]


class Subscriber(Protocol):
    """What the places need of a subscriber's connection."""

    def squatting(self, now: float, grace: float) -> bool:
        """Whether it has sent no ``subscribe`` in the ``grace`` seconds since it was accepted."""
        ...


S = TypeVar("S", bound=Subscriber)


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
        grace: Seconds a subscriber has to send its ``subscribe`` before it is a squatter.
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
            taken = self._oldest(own, now)
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

    def _oldest(self, places: list[Place[S]], now: float) -> Place[S] | None:
        """Of one address's places (oldest first), its oldest squatter, else its oldest answered
        place (rule 4)."""
        answered = [place for place in places if place.connection is not None]
        squatters = [place for place in answered if self._squatting(place, now)]
        first = squatters or answered
        return first[0] if first else None

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
        for holder, places in self._places.items():
            answered = [place for place in places if place.connection is not None]
            if not answered:
                continue
            key = (len(places) + (holder == address), -answered[0].order)
            if best is None or key > best:
                best, chosen = key, places
        return self._oldest(chosen, now)
