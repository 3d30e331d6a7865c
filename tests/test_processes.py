"""A frontend of several processes, end to end: one port, one ready line, one picture, one
``/metrics``, a killed process restarted, SIGTERM draining every process; and several frontends
on one worker, one of them killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from test_e2e import MODEL, call, clean_env, metric, wait_connected, worker_cmd

pytestmark = pytest.mark.e2e

TIMEOUT = 60.0
#: A slow mocker with a small cache: about 40 ms per decode step, 4 tokens a block.
SLOW = ("--speedup-ratio", "0.2", "--num-gpu-blocks", "64", "--block-size", "4")
_ID = re.compile(rb'"id":"(?:chat)?cmpl-([0-9a-f]{16})')


class Frontend:
    """A ``frontend-shim`` process run by a test: its URL, its pid, what it printed."""

    def __init__(self, process: trio.Process, url: str) -> None:
        self.process = process
        self.url = url
        self.lines: list[bytes] = []

    def http_processes(self) -> list[int]:
        """The pids of its HTTP processes."""
        kids: list[int] = []
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"_http_process" in cmdline:
                    kids.append(int(pid))
        return kids


@asynccontextmanager
async def frontend(*flags: str) -> AsyncIterator[Frontend]:
    """Run ``frontend-shim`` with ``flags`` until the block ends; reads all it prints."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "frontend_shim", "--http-port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=clean_env(),
    )
    assert process.stdout is not None
    output = b""
    try:
        with trio.fail_after(30):
            while b"\n" not in output and len(output) < 4096:
                chunk = await process.stdout.receive_some(4096)
                if not chunk:
                    break
                output += chunk
        match = re.search(rb"http=(\S+)", output)
        assert match is not None, output
        running = Frontend(process, match[1].decode())
        async with trio.open_nursery() as nursery:

            async def read_rest() -> None:
                assert process.stdout is not None
                nonlocal output
                while chunk := await process.stdout.receive_some(4096):
                    output += chunk

            nursery.start_soon(read_rest)
            try:
                yield running
            finally:
                running.lines = output.splitlines()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
                with trio.move_on_after(10):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


async def chat(url: str, max_tokens: int = 2, *, stream: bool = False) -> tuple[int, bytes]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "one two three four"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return await call(url, "POST", "/v1/chat/completions", body)


async def wait_processes(running: Frontend, count: int) -> list[int]:
    for _ in range(500):
        pids = running.http_processes()
        if len(pids) == count:
            return pids
        await trio.sleep(0.02)
    raise AssertionError(f"never {count} HTTP processes")


async def test_processes_serve_one_port_with_one_ready_line_and_one_metrics() -> None:
    with trio.fail_after(TIMEOUT):
        async with frontend("--processes", "2", "--local-workers", "1") as running:
            await wait_connected(running.url)
            seen: set[bytes] = set()
            for _ in range(24):  # a new connection each: the kernel spreads them
                status, body = await chat(running.url)
                assert status == 200, body
                match = _ID.search(body)
                assert match is not None
                seen.add(match[1])
            assert len(seen) == 2, "both processes answered"
            # One /metrics for the whole frontend, from whichever process is asked.
            for _ in range(4):
                _, text = await call(running.url, "GET", "/metrics")
                assert metric(text, "dynamo_frontend_requests_total") == 24
            assert len(await wait_processes(running, 2)) == 2
        assert sum(b" ready " in line for line in running.lines) == 1, running.lines


async def test_a_killed_process_is_started_again_and_counts_never_go_back() -> None:
    with trio.fail_after(TIMEOUT):
        async with frontend("--processes", "2", "--local-workers", "1") as running:
            await wait_connected(running.url)
            for _ in range(6):
                assert (await chat(running.url))[0] == 200
            _, text = await call(running.url, "GET", "/metrics")
            before = metric(text, "dynamo_frontend_requests_total")
            assert before == 6
            victim = (await wait_processes(running, 2))[0]
            os.kill(victim, signal.SIGKILL)
            for _ in range(500):
                pids = running.http_processes()
                if len(pids) == 2 and victim not in pids:
                    break
                await trio.sleep(0.02)
            else:
                raise AssertionError("the killed process was not started again")
            await wait_connected(running.url)
            for _ in range(6):
                status, body = await chat(running.url)
                assert status in (200, 503), body  # 503: its links not up yet
            _, text = await call(running.url, "GET", "/metrics")
            # What the dead process counted is kept up to its last snapshot (taken at the
            # scrape above): never less than before.
            assert metric(text, "dynamo_frontend_requests_total") >= before


async def test_sigterm_drains_every_process() -> None:
    with trio.fail_after(TIMEOUT):
        async with frontend("--processes", "2", "--local-workers", "1", *SLOW) as running:
            await wait_connected(running.url)
            results: list[tuple[int, bytes]] = []

            async def long_stream() -> None:
                results.append(await chat(running.url, max_tokens=25, stream=True))

            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(long_stream)
                await trio.sleep(0.3)  # all four are streaming
                running.process.send_signal(signal.SIGTERM)
            assert len(results) == 4
            for status, body in results:
                assert status == 200
                assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
            with trio.move_on_after(20):
                await running.process.wait()
            assert running.process.returncode == 0


async def test_a_threshold_set_in_one_process_is_in_force_in_all() -> None:
    with trio.fail_after(TIMEOUT):
        async with frontend("--processes", "3", "--local-workers", "1") as running:
            await wait_connected(running.url)
            update = {"model": MODEL, "active_decode_blocks_threshold": 0.25}
            status, _ = await call(running.url, "POST", "/busy_threshold", update)
            assert status == 200
            for _ in range(12):  # new connections, over every process
                status, body = await call(running.url, "GET", "/busy_threshold")
                assert status == 200
                (entry,) = json.loads(body)["thresholds"]
                assert entry["active_decode_blocks_threshold"] == 0.25


async def test_a_back_to_back_client_never_hears_busy_from_an_idle_fleet() -> None:
    """One request makes the worker busy (every block counts, threshold 0); each next request,
    on a new connection and so maybe another process, comes once the last answer is in."""
    with trio.fail_after(TIMEOUT):
        flags = ("--processes", "2", "--local-workers", "1", "--speedup-ratio", "100")
        async with frontend(*flags, "--active-decode-blocks-threshold", "0.0") as running:
            await wait_connected(running.url)
            statuses = [(await chat(running.url))[0] for _ in range(40)]
            assert statuses == [200] * 40


async def test_a_killed_frontend_leaves_nothing_counted_in_another() -> None:
    """Two frontends of one worker (the worker's events are what each knows of the other):
    once the first is killed, its requests leave the second's picture with the worker's next
    events, and the second routes again."""
    with trio.fail_after(TIMEOUT):
        worker = await trio.lowlevel.open_process(
            [*worker_cmd(*SLOW)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=clean_env(),
        )  # fmt: skip
        try:
            assert worker.stdout is not None
            line = await worker.stdout.receive_some(4096)
            url = re.search(rb"ws=(\S+)", line)
            assert url is not None
            ws = url[1].decode()
            threshold = ("--active-decode-blocks-threshold", "0.0")
            async with (
                frontend("--worker", ws) as first,
                frontend("--worker", ws, *threshold) as second,
            ):
                await wait_connected(first.url)
                await wait_connected(second.url)
                async with trio.open_nursery() as nursery:

                    async def hold() -> None:
                        # Its frontend is killed under it: the connection breaks.
                        with contextlib.suppress(Exception):
                            await chat(first.url, 200)

                    for _ in range(3):
                        nursery.start_soon(hold)
                    for _ in range(200):
                        status, _ = await chat(second.url)
                        if status == 529:
                            break  # the second sees the first's requests, through the worker
                        await trio.sleep(0.02)
                    else:
                        raise AssertionError("the second frontend never saw the load")
                    first.process.kill()
                    for _ in range(250):
                        status, _ = await chat(second.url)
                        if status == 200:
                            break
                        await trio.sleep(0.02)
                    else:
                        raise AssertionError("the killed frontend's load stayed counted")
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                worker.kill()
                await worker.wait()
