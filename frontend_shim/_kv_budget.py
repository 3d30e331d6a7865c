"""What one worker's KV events may cost this frontend: bytes and CPU a second (sans-IO).

A worker's KV events are decoded and applied on the frontend's one thread, beside HTTP and every
other worker's events. The size of one message is bounded by the hello check
(:func:`~frontend_shim._worker_hello.event_message_bound`); this bounds how many of them a
worker may send, so that a worker cannot buy the frontend's core, however large a cache it
claims. Rules of :class:`KvBudget`:

1. Each worker link has one budget per session. Every KV message it reads is charged: its bytes,
   and the CPU seconds its decoding and applying took (the link measures them with the thread's
   CPU clock, so time the process spent descheduled is not charged to the worker).
2. Two buckets, each refilled at a fixed rate and holding at most its burst: bytes at
   :data:`BYTES_PER_SECOND` (the protocol's rate of a worker that sends parts,
   ``wire.KV_BYTES_PER_SECOND``, which such a worker keeps to by itself) with
   :data:`BURST_BYTES`; CPU at :data:`CPU_SHARE` of a core with :data:`BURST_CPU`. Neither
   depends on what the worker's hello announces. Both start full.
3. A charge that takes a bucket below zero is over budget: :meth:`KvBudget.charge` returns the
   reason, in words for the log and the close frame. The link then ends the session (close code
   :data:`CLOSE_OVER_BUDGET` with the reason), counts it, and takes no KV events from that worker
   for :data:`REFUSAL_SECONDS` (its next sessions are routed on the router's own guesses, rule 2
   of :mod:`frontend_shim._kv_index`), so a worker that floods costs at most a burst every that
   many seconds.
4. What an honest worker costs, measured (docs/reliability.md): a full cache of 65,536 blocks in
   parts, 590 KB, at the protocol's rate, uses about 2 s of the byte rate's time and about 1 %
   of a core while it lasts; its steady churn is a small fraction of either.
"""

from __future__ import annotations

from typing import Final

from shim_common import wire

__all__ = [
    "BURST_BYTES",
    "BURST_CPU",
    "BYTES_PER_SECOND",
    "CLOSE_OVER_BUDGET",
    "CPU_SHARE",
    "REFUSAL_SECONDS",
    "KvBudget",
]

#: Bytes a second of KV messages a worker may send on average (rule 2).
BYTES_PER_SECOND: Final = wire.KV_BYTES_PER_SECOND
#: Bytes a worker may send at once above the rate: the jitter of the network and of this
#: frontend's reads, and an older worker's messages (at most 256 KiB each), with room.
BURST_BYTES: Final = 1024 * 1024
#: Share of one core a worker's KV events may use on average (rule 2): five times what an
#: honest worker at the byte rate costs on a loaded machine.
CPU_SHARE: Final = 0.05
#: CPU seconds a worker's KV events may use at once above the share.
BURST_CPU: Final = 0.5
#: The close code of a session ended over budget (RFC 6455's policy violation).
CLOSE_OVER_BUDGET: Final = 1008
#: Seconds after a session ended over budget during which no KV events are asked of that worker.
REFUSAL_SECONDS: Final = 60.0


class KvBudget:
    """One worker's budget for KV events in one session (rules at the top of the module).

    Args:
        now: When the session came up (the buckets start full then).
        bytes_per_second: The byte rate.
        burst_bytes: The bytes held at most.
        cpu_share: The CPU rate, in seconds a second.
        burst_cpu: The CPU seconds held at most.
    """

    __slots__ = ("_at", "_burst_bytes", "_burst_cpu", "_bytes", "_bytes_rate", "_cpu", "_cpu_rate")

    def __init__(
        self,
        now: float,
        *,
        bytes_per_second: float = BYTES_PER_SECOND,
        burst_bytes: float = BURST_BYTES,
        cpu_share: float = CPU_SHARE,
        burst_cpu: float = BURST_CPU,
    ) -> None:
        if not (bytes_per_second > 0 and burst_bytes > 0 and cpu_share > 0 and burst_cpu > 0):
            raise ValueError("a KV budget's rates and bursts must be > 0")
        self._bytes_rate = float(bytes_per_second)
        self._burst_bytes = float(burst_bytes)
        self._cpu_rate = float(cpu_share)
        self._burst_cpu = float(burst_cpu)
        self._bytes = self._burst_bytes
        self._cpu = self._burst_cpu
        self._at = now

    def charge(self, *, now: float, size: int, cpu: float) -> str | None:
        """Charge one read's KV messages: ``size`` bytes and ``cpu`` seconds (rule 1).

        Returns:
            ``None`` within the budget; else why not (rule 3).
        """
        elapsed = max(0.0, now - self._at)
        self._at = max(self._at, now)
        self._bytes = min(self._burst_bytes, self._bytes + elapsed * self._bytes_rate) - size
        self._cpu = min(self._burst_cpu, self._cpu + elapsed * self._cpu_rate) - cpu
        if self._bytes < 0:
            return (
                f"KV events past {self._bytes_rate / 1024:.0f} KiB a second "
                f"(a burst of {self._burst_bytes / 1024:.0f} KiB)"
            )
        if self._cpu < 0:
            return (
                f"KV events past {self._cpu_rate:.0%} of a core "
                f"(a burst of {self._burst_cpu * 1000:.0f} ms)"
            )
        return None
