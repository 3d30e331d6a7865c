"""The board in shared memory that lets every HTTP process shed from a request's head.

With ``--processes N`` the picture of the fleet is the host's, but the cheapest answer, the 529
sent from a request's head when no model has a free worker, must not cost a question to the
host. The host writes that verdict on a small board in shared memory and each HTTP process
reads it; one writer per region:

- the header, written by the host only: whether a request may be shed unread now, whether every
  available worker is marked (the answer's reason), the fleet's slot share (``Retry-After``), and
  how many ticket closes of all the HTTP processes the verdict has taken in;
- one slot per HTTP process, written by that process only: how many tickets it has closed
  (counted before the close is sent to the host; the count of a slot only grows, across
  restarts of its process).

Rules:

1. A finished request is gone at once, in every process: an HTTP process sheds from the head
   only when the verdict says so and the sum of the slots equals the closes the verdict took in.
   A close not yet taken in (one process's request ended an instant ago, its close on the way to
   the host) makes every process ask the host instead, whose answer takes that close in first
   (:mod:`frontend_shim._picker`, rule 3).
2. Reads are consistent: the host's writes are framed by a sequence number (odd while it
   writes); a reader that sees it odd, or changed under it, reads again (a few times at most,
   then it does not shed, which is always safe).
3. The board lives in an anonymous memory file the host creates and hands to each HTTP process
   by descriptor; it is as large as the header and ``processes`` slots, fixed at the start.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Final, NamedTuple

__all__ = ["BoardVerdict", "ShedBoard"]

# seq, flags, slot share, closes taken in.
_HEADER: Final = struct.Struct("<QQdQ")
_SLOT: Final = struct.Struct("<Q")
_MAY_SHED: Final = 1
_EVERY_MARKED: Final = 2
#: Times a reader retries a header the host was writing (rule 2).
_READ_TRIES: Final = 4


class BoardVerdict(NamedTuple):
    """What a process may answer from a head, as read off the board."""

    #: No model has a free worker and no close is on its way (rule 1).
    may_shed: bool
    #: Every available worker is marked (the shed's reason is ``marked``, not ``busy``).
    every_marked: bool
    #: The fleet's effective limits over what it runs, for ``Retry-After``.
    slot_share: float


_NO_SHED: Final = BoardVerdict(False, False, 1.0)


class ShedBoard:
    """A view of the board (rules at the top of the module).

    Args:
        memory: the mapped board.
        processes: the HTTP processes it has slots for.
        fd: the descriptor of its memory file (the host's, to hand over; ``-1`` in a process).
    """

    __slots__ = ("_memory", "_seq", "fd", "processes")

    def __init__(self, memory: mmap.mmap, processes: int, fd: int = -1) -> None:
        self._memory = memory
        self.processes = processes
        self.fd = fd
        self._seq = 0

    @staticmethod
    def size(processes: int) -> int:
        """Bytes of a board with ``processes`` slots."""
        return _HEADER.size + processes * _SLOT.size

    @classmethod
    def create(cls, processes: int) -> ShedBoard:
        """The host's board: a new memory file, its descriptor inheritable by children."""
        fd = os.memfd_create("frontend-shed-board", 0)
        size = cls.size(processes)
        os.ftruncate(fd, size)
        os.set_inheritable(fd, True)
        return cls(mmap.mmap(fd, size), processes, fd)

    @classmethod
    def attach(cls, fd: int, processes: int) -> ShedBoard:
        """An HTTP process's view of the board its host handed it."""
        memory = mmap.mmap(fd, cls.size(processes))
        os.close(fd)
        return cls(memory, processes)

    def close(self) -> None:
        """Unmap the board (and close the host's descriptor)."""
        self._memory.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------------ the host's region

    def publish(
        self, may_shed: bool, every_marked: bool, slot_share: float, closes_taken_in: int
    ) -> None:
        """Write the verdict (the host only)."""
        flags = (_MAY_SHED if may_shed else 0) | (_EVERY_MARKED if every_marked else 0)
        memory = self._memory
        self._seq += 1
        _SLOT.pack_into(memory, 0, self._seq * 2 - 1)  # odd: being written
        _HEADER.pack_into(memory, 0, self._seq * 2 - 1, flags, slot_share, closes_taken_in)
        _SLOT.pack_into(memory, 0, self._seq * 2)

    def closes_of(self, index: int) -> int:
        """The closes counted in a process's slot (the host reads it when the process died)."""
        (closes,) = _SLOT.unpack_from(self._memory, _HEADER.size + index * _SLOT.size)
        return int(closes)

    # ------------------------------------------------------------------ a process's region

    def note_close(self, index: int) -> None:
        """Count one ticket closed by process ``index`` (that process only), before it is sent."""
        offset = _HEADER.size + index * _SLOT.size
        memory = self._memory
        (closes,) = _SLOT.unpack_from(memory, offset)
        _SLOT.pack_into(memory, offset, closes + 1)

    def verdict(self) -> BoardVerdict:
        """What a process may answer from a head now (rules 1 and 2)."""
        memory = self._memory
        for _ in range(_READ_TRIES):
            seq, flags, share, taken_in = _HEADER.unpack_from(memory, 0)
            if seq & 1:
                continue
            closes = sum(
                _SLOT.unpack_from(memory, _HEADER.size + i * _SLOT.size)[0]
                for i in range(self.processes)
            )
            if _SLOT.unpack_from(memory, 0)[0] != seq:
                continue
            return BoardVerdict(
                bool(flags & _MAY_SHED) and closes == taken_in,
                bool(flags & _EVERY_MARKED),
                share,
            )
        return _NO_SHED
