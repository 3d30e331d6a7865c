"""A well-behaved client's share when another client lies about its class, checkouts side by side.

Run: ``python -m bench.bench_hostile_classes [--trees before=PATH,after=.] [--seconds S]`` from
the repository's root.

Per checkout (``label=path``: a tree of this repository each) and per setup, one
``worker-ingress`` serving :mod:`bench.fixed_engine` (4 slots, 0.1 s per request: 40 requests/s
whatever the gate does; N = 4, Q = 8) behind one ``frontend-shim``, both from that tree. Two
clients send Poisson arrivals over fresh HTTP connections for ``--seconds``:

- the well-behaved one: 10 requests/s as tenant ``good``, no priority (0);
- the attacker: 80 requests/s (twice the capacity on its own), either claiming priority -1000
  (``priority`` attack) or a new ``x-dynamo-tenant`` on every request (``tenants`` attack).

Setups: ``defaults`` (no flag); ``clamped`` (``--max-client-priority 0`` on the frontend);
``gateway`` (that, and ``DYN_GATEWAY_TOKEN``: the good client's requests carry the token, as
a trusted gateway in front would add it, the attacker's do not). Checkouts whose frontend does
not know the flag run ``defaults`` only. It prints, per attack and setup,
each client's completed requests per second, the share of the good client's requests that
completed, and the worker's displacements per second (queued requests pushed out by an
arrival). A fair gate serves the good client's 10/s whole (its fair share is half of 40/s);
first come, first served would give it 40 * 10/90 = 4.4/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import h11
import trio

from bench.trio_servers import http_get, started

SLOTS: Final = 4
SERVICE_SECONDS: Final = 0.1
QUEUE_LIMIT: Final = 8
GOOD_RATE: Final = 10.0
ATTACK_RATE: Final = 80.0
ATTACKS: Final = ("priority", "tenants")
#: Setup name -> frontend flags, and whether a gateway token is set (the good client's
#: requests then carry it, as a gateway in front of the frontend would add it; the attacker's
#: do not).
SETUPS: Final = {
    "defaults": ((), False),
    "clamped": (("--max-client-priority", "0"), False),
    "gateway": (("--max-client-priority", "0"), True),
}
GATEWAY_TOKEN: Final = "bench-gateway-token"


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


def _env(tree: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
    env["PYTHONPATH"] = str(tree)
    env.update(extra)
    return env


async def _post(url: str, headers: Sequence[tuple[str, str]]) -> int:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    body = json.dumps({"model": "mock-model", "prompt": "one two", "max_tokens": 1}).encode()
    head = [("host", parts.netloc), ("content-length", str(len(body))), *headers]
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="POST", target="/v1/completions", headers=head)
        await stream.send_all(conn.send(request) + conn.send(h11.Data(data=body)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        status = 0
        for _ in range(10_000):
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return status
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status
    return status


def _displaced(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith('dynamo_rejection_request_by_reason_total{reason="displaced"} '):
            return float(line.split()[-1])
    return 0.0


async def _wait_connected(url: str) -> None:
    for _ in range(300):
        if json.loads(await http_get(url, "/health") or "{}").get("workers_connected") == 1:
            return
        await trio.sleep(0.05)
    raise RuntimeError("the frontend never connected to its worker")


async def _client(
    url: str,
    rate: float,
    seconds: float,
    headers_of: object,
    tally: Tally,
    rng: random.Random,
) -> None:
    assert callable(headers_of)
    deadline = trio.current_time() + seconds
    async with trio.open_nursery() as nursery:
        number = 0
        while trio.current_time() < deadline:
            await trio.sleep(rng.expovariate(rate))
            headers = headers_of(number)
            number += 1
            tally.sent += 1

            async def one(headers: Sequence[tuple[str, str]] = headers) -> None:
                try:
                    with trio.fail_after(30):
                        status = await _post(url, headers)
                except (OSError, trio.TooSlowError, h11.RemoteProtocolError):
                    status = 0
                tally.statuses[status] = tally.statuses.get(status, 0) + 1
                if status == 200:
                    tally.completed += 1

            nursery.start_soon(one)


async def _phase(
    tree: Path,
    frontend_flags: Sequence[str],
    gateway: bool,
    attack: str,
    seconds: float,
    seed: int,
) -> tuple[Tally, Tally, float]:
    worker_env = _env(
        tree,
        BENCH_FIXED_SLOTS=str(SLOTS),
        BENCH_FIXED_SERVICE_SECONDS=str(SERVICE_SECONDS),
        DYN_DYNAMO_REQUEST_QUEUE_LIMIT=str(QUEUE_LIMIT),
    )
    worker_args = [
        *(sys.executable, "-m", "worker_ingress", "--engine", "bench.fixed_engine:create"),
        *("--engine-request-limit", str(SLOTS), "--port", "0", "--system-port", "0"),
        *("--log-level", "error"),
    ]
    async with started(worker_args, worker_env, cwd=tree) as (ws, system):
        frontend_args = [
            *(sys.executable, "-m", "frontend_shim", "--http-port", "0", "--worker", ws),
            *("--log-level", "error", *frontend_flags),
        ]
        frontend_env = _env(tree, **({"DYN_GATEWAY_TOKEN": GATEWAY_TOKEN} if gateway else {}))
        async with started(frontend_args, frontend_env, cwd=tree) as (url,):
            await _wait_connected(url)
            good, bad = Tally(), Tally()

            def good_headers(number: int) -> list[tuple[str, str]]:
                if gateway:
                    return [("x-dynamo-tenant", "good"), ("x-dynamo-gateway-token", GATEWAY_TOKEN)]
                return [("x-dynamo-tenant", "good")]

            def bad_headers(number: int) -> list[tuple[str, str]]:
                if attack == "priority":
                    return [("x-dynamo-priority", "-1000"), ("x-dynamo-tenant", "attacker")]
                return [("x-dynamo-tenant", f"fresh-{number}")]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    _client, url, GOOD_RATE, seconds, good_headers, good, random.Random(seed)
                )
                nursery.start_soon(
                    _client, url, ATTACK_RATE, seconds, bad_headers, bad, random.Random(seed + 1)
                )
            return good, bad, _displaced(await http_get(system, "/metrics"))


def _knows_flag(tree: Path, flag: str) -> bool:
    result = subprocess.run(
        [sys.executable, "-m", "frontend_shim", "--help"],
        capture_output=True,
        env=_env(tree),
        cwd=str(tree),
        timeout=60,
        check=False,
    )
    return flag.encode() in result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="this=.", help="label=path,... (a checkout each)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    trees = [
        (label, Path(path).resolve())
        for label, path in (item.split("=", 1) for item in args.trees.split(","))
    ]

    async def run() -> None:
        print(
            f"capacity {SLOTS / SERVICE_SECONDS:g}/s; good client {GOOD_RATE:g}/s, attacker"
            f" {ATTACK_RATE:g}/s; {args.seconds:g} s per phase"
        )
        print(
            f"{'attack':9} {'tree':10} {'setup':9} {'good/s':>7} {'good %':>7}"
            f" {'attack/s':>9} {'displaced/s':>11}"
        )
        for attack in ATTACKS:
            for label, tree in trees:
                for setup, (flags, gateway) in SETUPS.items():
                    if flags and not _knows_flag(tree, flags[0]):
                        continue
                    good, bad, displaced = await _phase(
                        tree, flags, gateway, attack, args.seconds, args.seed
                    )
                    share = 100 * good.completed / good.sent if good.sent else 0.0
                    print(
                        f"{attack:9} {label:10} {setup:9} {good.completed / args.seconds:7.2f}"
                        f" {share:6.1f}% {bad.completed / args.seconds:9.2f}"
                        f" {displaced / args.seconds:11.2f}",
                        flush=True,
                    )

    trio.run(run)


if __name__ == "__main__":
    main()
