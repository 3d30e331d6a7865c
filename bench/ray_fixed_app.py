"""The fixed engine's model of work served by Ray Serve, for ``bench/bench_goodput.py``.

Run (the benchmark does it): ``python bench/ray_fixed_app.py --port P [--slots 4]
[--service-seconds 0.2] [--queue 4]``. Needs Ray Serve: ``pip install -e '.[ray]'``.

One replica of one deployment whose handler reads the JSON body, then holds one of ``--slots``
places of an asyncio semaphore for ``--service-seconds`` and answers a small chat completion, as
:mod:`bench.kit.fixed_engine` does. Ray Serve's own admission is set to the same N and Q as the
worker's gate: ``max_ongoing_requests=slots`` and ``max_queued_requests=queue``; beyond them its
proxy answers 503. Everything stays on loopback (Ray's node address is 127.0.0.1) and usage
reporting is off.

Prints ``ray-fixed ready http=http://127.0.0.1:P`` once the application answers, then serves
until SIGTERM or SIGINT, when it shuts Serve and Ray down.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray advertises the host's first non-loopback address unless it believes it runs on a single
# machine without a cluster; this switch makes it use 127.0.0.1 for every component.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray
from ray import serve


class FixedWork:
    """Each request holds one of ``slots`` places for ``service_seconds``."""

    def __init__(self, slots: int, service_seconds: float) -> None:
        self._slots = asyncio.Semaphore(slots)
        self._service_seconds = service_seconds

    async def __call__(self, request: Any) -> dict[str, Any]:
        body = await request.json()
        async with self._slots:
            await asyncio.sleep(self._service_seconds)
        return {
            "object": "chat.completion",
            "model": body.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " done"},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }


def _wait_answering(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--service-seconds", type=float, default=0.2)
    parser.add_argument("--queue", type=int, default=4)
    parser.add_argument("--start-timeout", type=float, default=180.0)
    options = parser.parse_args()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="ray") as scratch:
        ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=1,
            _temp_dir=scratch,
            log_to_driver=False,
        )
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": options.port})
            deployment = serve.deployment(
                num_replicas=1,
                max_ongoing_requests=options.slots,
                max_queued_requests=options.queue,
                ray_actor_options={"num_cpus": 0},
            )(FixedWork)
            serve.run(
                deployment.bind(options.slots, options.service_seconds),
                route_prefix="/v1/chat/completions",
            )
            url = f"http://127.0.0.1:{options.port}"
            _wait_answering(url + "/-/healthz", time.monotonic() + options.start_timeout)
            print(f"ray-fixed ready http={url}", flush=True)
            while not stop.wait(0.5):
                pass
        finally:
            serve.shutdown()
            ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
