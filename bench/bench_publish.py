"""A worker's cost of publishing its load, as its engine steps faster.

Run: ``python bench/bench_publish.py [--seconds 5] [--speedups 1,10,100] [--interval 0.1]``.

For each speedup ratio, a mocker worker (4 data-parallel ranks, N = 64) runs in this process
with one event-plane subscriber, while 48 streaming completions run back to back on its request
plane; every step of the mocker changes some rank's load. Printed per speedup, side by side with
the same worker publishing every change (``--load-publish-interval 0``): event batches a second
the subscriber received, load events in them, and the worker process's CPU share. With the
bound, batches per second stay at about ``1 / interval`` however fast the engine steps.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.table import Table
from frontend_shim._links import LinkSettings, WorkerLink
from shim_common import wire
from worker_ingress._config import MockerSettings, WorkerSettings
from worker_ingress._server import Worker
from worker_ingress.engines._mocker import create

BODY: dict[str, Any] = {"prompt": "one two three four five six seven eight", "max_tokens": 64}


class Counter:
    """A fleet listener that counts what the link hands over."""

    def __init__(self) -> None:
        self.batches = 0
        self.events = 0

    def worker_up(self, key: str, config: wire.RuntimeConfig, now: float) -> None:
        pass

    def worker_events(self, key: str, events: Sequence[wire.WorkerEvent], now: float) -> None:
        self.batches += 1
        self.events += len(events)

    def worker_lagging(self, key: str, lagging: bool, now: float) -> None:
        pass

    def worker_down(self, key: str, now: float) -> None:
        pass

    def thresholds(self, model: str) -> wire.BusyThresholds | None:
        return None


async def _measure(speedup: float, interval: float, seconds: float) -> tuple[float, float, float]:
    settings = WorkerSettings(
        port=0,
        system_port=0,
        worker_id="w",
        engine_request_limit=64,
        load_publish_interval=interval,
        mocker=MockerSettings(data_parallel_size=4, speedup_ratio=speedup),
    )
    worker = Worker(settings, create(settings))
    counter = Counter()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(worker.serve)
        link = WorkerLink(
            address.ws_url, counter, LinkSettings(keepalive_interval=60), rng=random.Random(1)
        )
        await nursery.start(link.run)
        await link.wait_connected()

        async def client() -> None:
            while True:
                async with link.request("completions", BODY) as stream:
                    if isinstance(await stream.first(), wire.Started):
                        async for _ in stream:
                            pass

        for _ in range(48):
            nursery.start_soon(client)
        await trio.sleep(1.0)  # warm up
        batches, events, cpu = counter.batches, counter.events, time.process_time()
        await trio.sleep(seconds)
        result = (
            (counter.batches - batches) / seconds,
            (counter.events - events) / seconds,
            (time.process_time() - cpu) / seconds,
        )
        nursery.cancel_scope.cancel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--speedups", default="1,10,100")
    parser.add_argument("--interval", type=float, default=0.1)
    args = parser.parse_args()
    table = Table(
        "speedup", "batches/s bounded", "load events/s bounded", "process CPU bounded",
        "batches/s unbounded", "load events/s unbounded", "process CPU unbounded",
    )  # fmt: skip
    print(table.head)
    for speedup in (float(s) for s in args.speedups.split(",")):
        bounded = trio.run(_measure, speedup, args.interval, args.seconds)
        unbounded = trio.run(_measure, speedup, 0.0, args.seconds)
        print(
            table.row(
                f"{speedup:g}",
                *(f"{bounded[0]:.0f}", f"{bounded[1]:.0f}", f"{bounded[2]:.0%}"),
                *(f"{unbounded[0]:.0f}", f"{unbounded[1]:.0f}", f"{unbounded[2]:.0%}"),
            )
        )


if __name__ == "__main__":
    main()
