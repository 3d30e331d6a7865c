"""A well-behaved client's share when another client lies about its class, checkouts side by side.

Run: ``python -m bench.bench_hostile_classes [--trees before=PATH,after=.] [--seconds S]`` from
the repository's root.

Per checkout (``label=path``: a tree of this repository each) and per setup, one
``worker-ingress`` serving :mod:`bench.kit.fixed_engine` (4 slots, 0.1 s per request: 40 requests/s
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
import random
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import trio

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.children import Child
from bench.kit.fixed_engine import SERVICE_ENV, SLOTS_ENV
from bench.kit.http import HTTP_ERRORS, fetch, wait_connected_trio
from bench.kit.metrics import metric_sum
from bench.kit.processes import clean_env
from bench.kit.shim import frontend_command, worker_command

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
COMPLETION: Final = json.dumps({"model": "mock-model", "prompt": "one two", "max_tokens": 1})


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


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
                        reply = await fetch(
                            url, "POST", "/v1/completions", COMPLETION.encode(), headers=headers
                        )
                    status = reply.status
                except (*HTTP_ERRORS, trio.TooSlowError):
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
    worker_env = clean_env(
        tree,
        **{SLOTS_ENV: str(SLOTS), SERVICE_ENV: str(SERVICE_SECONDS)},
        DYN_DYNAMO_REQUEST_QUEUE_LIMIT=str(QUEUE_LIMIT),
    )
    worker_args = worker_command(
        *("--engine", "bench.kit.fixed_engine:create", "--engine-request-limit", str(SLOTS)),
        *("--log-level", "error"),
    )
    async with Child(worker_args, worker_env, cwd=tree, grace=5.0) as worker:
        frontend_args = frontend_command(
            "--worker", worker.addresses["ws"], "--log-level", "error", *frontend_flags
        )
        frontend_env = clean_env(tree, **({"DYN_GATEWAY_TOKEN": GATEWAY_TOKEN} if gateway else {}))
        async with Child(frontend_args, frontend_env, cwd=tree, grace=5.0) as frontend:
            url = frontend.addresses["http"]
            with trio.fail_after(15):
                await wait_connected_trio(url)
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
            metrics = await fetch(worker.addresses["system"], "GET", "/metrics")
            displaced = metric_sum(
                metrics.body.decode(),
                "dynamo_rejection_request_by_reason_total",
                reason="displaced",
            )
            return good, bad, displaced


def _knows_flag(tree: Path, flag: str) -> bool:
    result = subprocess.run(
        [sys.executable, "-m", "frontend_shim", "--help"],
        capture_output=True,
        env=clean_env(tree),
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
