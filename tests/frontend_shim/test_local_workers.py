"""``--local-workers``: child processes started, reported ready, and stopped on cancellation.

Most tests use a tiny shell script in place of the interpreter (so they test the supervision,
not the worker); one starts a real ``python -m worker_ingress`` child.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import random
import re
import signal
import ssl
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
import trustme

from frontend_shim._links import LinkSettings, WorkerLink
from frontend_shim._local import (
    LocalWorkerError,
    parse_ready_line,
    run_local_workers,
    worker_command,
)
from shim_common import wire

READY = "worker-ingress ready ws=ws://127.0.0.1:{port} system=http://127.0.0.1:{system}"


def test_parse_ready_line() -> None:
    assert parse_ready_line(READY.format(port=9100, system=9101)) == (
        "ws://127.0.0.1:9100",
        "http://127.0.0.1:9101",
    )
    assert parse_ready_line("worker-ingress ready ws=ws://[::1]:1 system=http://[::1]:2\n") == (
        "ws://[::1]:1",
        "http://[::1]:2",
    )
    assert parse_ready_line("frontend-shim ready http=http://127.0.0.1:8000") is None
    assert parse_ready_line("worker-ingress ready") is None


def test_worker_command_asks_for_free_ports_and_passes_flags_through() -> None:
    assert worker_command(["--engine-request-limit", "4"], "py") == [
        "py",
        "-m",
        "worker_ingress",
        "--port",
        "0",
        "--system-port",
        "0",
        "--stop-on-stdin-eof",
        "--engine-request-limit",
        "4",
    ]


def fake_python(tmp_path: Path, body: str) -> str:
    """A script that stands in for the interpreter: it records its pid, then runs ``body``."""
    script = tmp_path / "fake-python"
    script.write_text(f'#!/bin/sh\necho $$ >> "{tmp_path}/pids"\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def pids(tmp_path: Path) -> list[int]:
    return [int(line) for line in (tmp_path / "pids").read_text().split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_children_are_reported_ready_and_stopped_on_cancel(tmp_path: Path) -> None:
    python = fake_python(
        tmp_path,
        'echo "starting up"\n'
        'echo "worker-ingress ready ws=ws://127.0.0.1:$$ system=http://127.0.0.1:2"\n'
        "exec sleep 30",
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                functools.partial(run_local_workers, 2, ["--x"], python=python)
            )
            children = pids(tmp_path)
            # Each fake names its own pid in its URL; the children start in any order.
            assert sorted(urls) == sorted(f"ws://127.0.0.1:{pid}" for pid in children)
            assert all(alive(pid) for pid in children)
            nursery.cancel_scope.cancel()
    assert not any(alive(pid) for pid in children)


async def test_a_child_that_exits_before_ready_fails_the_start(tmp_path: Path) -> None:
    python = fake_python(tmp_path, 'echo "bad flag" >&2\nexit 3')
    with trio.fail_after(10), pytest.raises(LocalWorkerError, match="exited with status 3"):
        await run_local_workers(1, [], python=python)


async def test_a_silent_child_times_out_and_is_stopped(tmp_path: Path) -> None:
    python = fake_python(tmp_path, "exec sleep 30")
    with trio.fail_after(10), pytest.raises(LocalWorkerError, match="no ready line within"):
        await run_local_workers(1, [], python=python, ready_timeout=0.3)
    assert not alive(pids(tmp_path)[0])


async def test_a_child_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    python = fake_python(
        tmp_path,
        "trap '' TERM\n"
        'echo "worker-ingress ready ws=ws://127.0.0.1:1 system=http://127.0.0.1:2"\n'
        "i=0; while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done",
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(run_local_workers, 1, [], python=python, stop_timeout=0.3)
            )
            nursery.cancel_scope.cancel()
    assert not alive(pids(tmp_path)[0])


async def test_a_child_that_dies_later_is_restarted_on_its_ports(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The first run dies after its ready line; the restarted one stays up.
    python = fake_python(
        tmp_path,
        f'echo "$@" >> "{tmp_path}/args"\n'
        'echo "worker-ingress ready ws=ws://127.0.0.1:41 system=http://127.0.0.1:42"\n'
        f'if [ -e "{tmp_path}/ran" ]; then exec sleep 30; fi\n'
        f'touch "{tmp_path}/ran"\nsleep 0.1\nexit 7',
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(run_local_workers, 1, ["--x"], python=python))
            for _ in range(500):
                if "restarted (pid" in caplog.text:
                    break
                await trio.sleep(0.01)
            children = pids(tmp_path)
            assert len(children) == 2
            assert alive(children[1])
            nursery.cancel_scope.cancel()
    assert "exited with status 7; restarting it" in caplog.text
    first, second = (tmp_path / "args").read_text().splitlines()
    stop = "--stop-on-stdin-eof"
    assert first.split() == [
        "-m",
        "worker_ingress",
        "--port",
        "0",
        "--system-port",
        "0",
        stop,
        "--x",
    ]
    assert second.split() == [
        "-m", "worker_ingress", "--port", "41", "--system-port", "42", stop, "--x"
    ]  # fmt: skip
    assert not alive(children[1])


async def test_a_child_that_exits_0_is_not_restarted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Exit 0 is a drain the worker was asked for (a Ctrl-C reaches the whole group).
    python = fake_python(
        tmp_path,
        'echo "worker-ingress ready ws=ws://127.0.0.1:41 system=http://127.0.0.1:42"\n'
        "sleep 0.1\nexit 0",
    )
    with trio.fail_after(10), caplog.at_level(logging.INFO):
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(run_local_workers, 1, [], python=python))
            for _ in range(500):
                if "not restarted" in caplog.text:
                    break
                await trio.sleep(0.01)
            await trio.sleep(1.0)  # longer than the first restart delay
            nursery.cancel_scope.cancel()
    assert "stopped (status 0); not restarted" in caplog.text
    assert len(pids(tmp_path)) == 1


async def test_a_restart_that_cannot_spawn_is_logged_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The interpreter disappears after the first start (an upgraded venv, say).
    python = fake_python(
        tmp_path,
        'echo "worker-ingress ready ws=ws://127.0.0.1:41 system=http://127.0.0.1:42"\n'
        'rm -f "$0"\nsleep 0.1\nexit 3',
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(run_local_workers, 1, [], python=python))
            for _ in range(500):
                if "cannot restart local worker 0" in caplog.text:
                    break
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert "cannot restart local worker 0" in caplog.text


@pytest.mark.e2e
@pytest.mark.skipif(
    importlib.util.find_spec("worker_ingress._cli") is None, reason="worker CLI not present"
)
async def test_a_real_child_worker_serves_and_stops() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                run_local_workers, 1, ["--engine-request-limit", "2", "--speedup-ratio", "1000"]
            )
            assert len(urls) == 1
            link = WorkerLink(urls[0], _NullListener(), LinkSettings(), rng=random.Random(0))
            async with trio.open_nursery() as inner:
                await inner.start(link.run)
                await link.wait_connected()
                assert link.config is not None
                assert link.config.engine_request_limit == 2
                async with link.request("completions", {"prompt": "a b", "max_tokens": 3}) as s:
                    assert isinstance(await s.first(), wire.Started)
                    assert isinstance([r async for r in s][-1], wire.End)
                inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
        # The child is gone: nothing listens on its port any more.
        host, port = urls[0].removeprefix("ws://").rsplit(":", 1)
        with pytest.raises(OSError, match="connect"):
            await trio.open_tcp_stream(host, int(port))


@pytest.mark.e2e
async def test_a_killed_real_child_comes_back_at_the_same_url() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            (url,) = await nursery.start(run_local_workers, 1, ["--speedup-ratio", "1000"])
            link = WorkerLink(url, _NullListener(), LinkSettings(), rng=random.Random(0))
            async with trio.open_nursery() as inner:
                await inner.start(link.run)
                await link.wait_connected()
                first_id = link.config.worker_id if link.config else None
                pid = _pid_listening(url)
                os.kill(pid, signal.SIGKILL)
                # The link notices, the child is started again on its port, the link is back.
                for _ in range(1000):
                    if link.connected and link.config and link.config.worker_id != first_id:
                        break
                    await trio.sleep(0.01)
                assert link.connected
                assert link.config is not None
                assert link.config.worker_id != first_id
                async with link.request("completions", {"prompt": "a", "max_tokens": 2}) as s:
                    assert isinstance(await s.first(), wire.Started)
                inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for its new parent counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


@pytest.mark.e2e
async def test_children_of_a_sigkilled_frontend_exit_and_tls_and_token_reach_them(
    tmp_path: Path,
) -> None:
    """The frontend is a real process: killed with SIGKILL, it cannot stop its children, and
    they must go all the same. On the way, the children serve wss:// with the frontend's
    certificate and take the token from the inherited environment."""
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    env["DYN_WORKER_TOKEN"] = "local-secret"
    command = [
        sys.executable, "-m", "frontend_shim", "--http-port", "0", "--local-workers", "2",
        "--speedup-ratio", "100", "--tls-cert-path", str(cert), "--tls-key-path", str(key),
    ]  # fmt: skip
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    log = bytearray()
    try:
        with trio.fail_after(40):
            assert process.stdout is not None
            assert process.stderr is not None
            err = process.stderr
            async with trio.open_nursery() as nursery:

                async def collect_log() -> None:
                    while chunk := await err.receive_some(65536):
                        log.extend(chunk)

                nursery.start_soon(collect_log)
                line = b""
                while not line.endswith(b"\n"):
                    chunk = await process.stdout.receive_some(4096)
                    assert chunk, log.decode(errors="replace")
                    line += chunk
                url = line.decode().split("http=")[1].strip()
                assert url.startswith("https://127.0.0.1:")
                context = ssl.create_default_context()
                ca.configure_trust(context)
                async with httpx.AsyncClient(verify=context) as client:
                    for _ in range(500):
                        health = (await client.get(url + "/health")).json()
                        if health["workers_connected"] == 2:
                            break
                        await trio.sleep(0.02)
                    assert health["workers_connected"] == 2, log.decode(errors="replace")
                    reply = await client.post(
                        url + "/v1/completions",
                        json={"model": "mock-model", "prompt": "a b", "max_tokens": 2},
                    )
                    assert reply.status_code == 200
                children = [
                    int(pid) for pid in re.findall(rb"local worker \d \(pid (\d+)\) at wss://", log)
                ]
                assert len(children) == 2, log.decode(errors="replace")
                assert b"refused the token" not in log
                process.kill()
                await process.wait()
                for _ in range(1500):
                    if all(_gone(pid) for pid in children):
                        break
                    await trio.sleep(0.01)
                assert all(_gone(pid) for pid in children), "children outlived a SIGKILLed parent"
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
            for pid in re.findall(rb"\(pid (\d+)\)", log):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def _pid_listening(url: str) -> int:
    """The pid of the local child listening on ``url``'s port (from /proc)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
            inodes.add(fields[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no process listens on {url}")


class _NullListener:
    def worker_up(self, key: str, config: wire.RuntimeConfig, now: float) -> None:
        pass

    def worker_events(self, key: str, events: object, now: float) -> None:
        pass

    def worker_lagging(self, key: str, lagging: bool, now: float) -> None:
        pass

    def worker_down(self, key: str, now: float) -> None:
        pass

    def thresholds(self, model: str) -> wire.BusyThresholds | None:
        return None
