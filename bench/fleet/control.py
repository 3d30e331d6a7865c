"""The benchmark's side of a fleet simulator's control protocol (``bench/fleet_sim.py`` and
``bench/lean_sim.py`` speak it on their standard input and output, one line a command): wait for
``fleet-sim ready workers=K ports=P1,P2,...``, flip the fleet ``busy`` or ``free`` (each answers
``ok MODE T``, ``T`` the ``time.monotonic()`` at which it had applied the flip), and ask for its
``stats`` (``stats {json}``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from bench.kit.children import Child

__all__ = ["Simulator", "fleet_stats", "flip_acks", "flip_fleet"]


class Simulator:
    """One simulator process (``fleet_sim.py`` or ``lean_sim.py``), started with ``control``."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.ports: list[int] = []

    async def ready(self) -> None:
        """Read lines until the ready line; note the workers' ports. The caller bounds the
        wait."""
        ready = await self.child.ready()
        self.ports = [int(port) for port in ready.get("ports", "").split(",") if port]

    async def answer(self, prefix: str) -> str:
        line = await self.child.readline()
        if not line.startswith(prefix):
            raise RuntimeError(f"{self.child.name}: expected {prefix!r}, got {line!r}")
        return line

    async def stats(self) -> dict[str, float]:
        await self.child.send("stats")
        line = await self.answer("stats ")
        stats: dict[str, float] = json.loads(line.split(" ", 1)[1])
        return stats


async def fleet_stats(sims: Sequence[Simulator]) -> dict[str, float]:
    """Every simulator's ``stats``, summed."""
    total: dict[str, float] = {}
    for sim in sims:
        for key, value in (await sim.stats()).items():
            total[key] = total.get(key, 0.0) + value
    return total


async def flip_fleet(sims: Sequence[Simulator], mode: str) -> None:
    """Tell every simulator to flip to ``mode`` (``busy`` or ``free``)."""
    for sim in sims:
        await sim.child.send(mode)


async def flip_acks(sims: Sequence[Simulator], mode: str) -> float:
    """Read every simulator's answer to a flip; return the latest ``time.monotonic()`` at which
    one of them had applied it."""
    applied = 0.0
    for sim in sims:
        line = await sim.answer(f"ok {mode}")
        applied = max(applied, float(line.split()[2]))
    return applied
