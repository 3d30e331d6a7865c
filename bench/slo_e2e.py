"""The load generator of bench_slo's end-to-end mode, run as a process of its own pinned to a CPU
of its own (``bench/slo/e2e.py`` starts it), so that the client's work does not slow the servers
it measures.

``python bench/slo_e2e.py loadgen URL BODY_JSON open ARRIVALS_JSON`` plays one streamed
completion (``BODY_JSON``) at each arrival offset, each on its own connection;
``... loadgen URL BODY_JSON closed CLIENTS SECONDS`` keeps ``CLIENTS`` of them going back to back
for ``SECONDS``. It prints ``[[sent, ttft, status], ...]`` as JSON: the offset each request was
sent at, the time from sending it to its first streamed token (NaN when none came) and its
status (-1 when the connection failed or the request took past 30 s).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import trio

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.http import HTTP_ERRORS, Reply, fetch

__all__ = ["main"]

#: Seconds a request may take at the client before it counts as failed.
REQUEST_TIMEOUT: Final = 30.0


async def _one(url: str, body: bytes, origin: float, out: list[list[Any]]) -> None:
    sent = trio.current_time()
    ttft = math.nan
    reply = Reply()

    def first_token(data: bytes) -> None:
        nonlocal ttft
        if reply.status == 200 and math.isnan(ttft) and b'"text"' in data:
            ttft = trio.current_time() - sent

    try:
        with trio.fail_after(REQUEST_TIMEOUT):
            await fetch(url, "POST", "/v1/completions", body, reply=reply, on_data=first_token)
        status = reply.status
    except (*HTTP_ERRORS, trio.TooSlowError):
        status = -1
    out.append([sent - origin, ttft, status])


async def _open_loop(url: str, body: bytes, arrivals: Sequence[float]) -> list[list[Any]]:
    out: list[list[Any]] = []
    async with trio.open_nursery() as nursery:
        origin = trio.current_time()
        for offset in arrivals:
            await trio.sleep_until(origin + offset)
            nursery.start_soon(_one, url, body, origin, out)
    return out


async def _closed_loop(url: str, body: bytes, clients: int, seconds: float) -> list[list[Any]]:
    out: list[list[Any]] = []
    origin = trio.current_time()

    async def client() -> None:
        while trio.current_time() - origin < seconds:
            await _one(url, body, origin, out)

    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``loadgen URL BODY_JSON open ARRIVALS_JSON`` or ``loadgen URL BODY_JSON closed CLIENTS
    SECONDS`` (see the module's docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "loadgen":
        raise SystemExit("usage: python -m bench.bench_slo --mode e2e (this is its load generator)")
    url, body, mode = args[1], args[2].encode(), args[3]
    if mode == "open":
        records = trio.run(_open_loop, url, body, json.loads(args[4]))
    else:
        records = trio.run(_closed_loop, url, body, int(args[4]), float(args[5]))
    json.dump(records, sys.stdout)


if __name__ == "__main__":
    main()
