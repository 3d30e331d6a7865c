"""The gate timed alone: requests in a row in one task, admitted or rejected, against the same
loop without a gate; and a gate held full for the rejections. ``bench_admission`` times FIFO
requests with them, ``bench_classes`` compares requests with priorities and tenants to them.
"""

from __future__ import annotations

import time

import trio
import trio.testing

from worker_ingress._admission import AdmissionGate, Rejection
from worker_ingress._watch import ChangeSignal

__all__ = ["full_gate", "loop_admitted", "loop_rejected"]


async def loop_admitted(gate: AdmissionGate | None, count: int) -> float:
    """Seconds per request for ``count`` requests in a row in one task (no gate if ``None``)."""
    checkpoint = trio.lowlevel.checkpoint
    started = time.perf_counter()
    if gate is None:
        for _ in range(count):
            await checkpoint()
    else:
        for _ in range(count):
            async with gate.slot():
                await checkpoint()
    return (time.perf_counter() - started) / count


async def loop_rejected(gate: AdmissionGate | None, count: int) -> float:
    """Seconds per rejection of ``count`` tries in a row on a full gate (bare loop if ``None``)."""
    started = time.perf_counter()
    if gate is None:
        for _ in range(count):
            pass
    else:
        for _ in range(count):
            try:
                async with gate.slot():
                    raise AssertionError("the gate is full: nothing may be admitted")
            except Rejection:
                pass
    return (time.perf_counter() - started) / count


async def full_gate(task_status: trio.TaskStatus[AdmissionGate]) -> None:
    """Hold a gate of N=1, Q=2 full (1 running, 2 queued) until cancelled."""
    gate = AdmissionGate(engine_slots=1, queue_limit=2, on_change=ChangeSignal().bump)

    async def hold() -> None:
        async with gate.slot():
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        if (gate.running, gate.queued) != (1, 2):
            raise RuntimeError(f"gate not full: {gate.running} running, {gate.queued} queued")
        task_status.started(gate)
