"""The gate in front of a real engine: llama.cpp's ``llama-server`` behind ``worker-ingress``.

Every test runs three real processes on loopback: ``llama-server`` with a tiny random model made
on the spot (``tiny_gguf.py``), ``worker-ingress --engine openai`` in front of it, and
``frontend-shim`` in front of the worker. The binary comes from ``scripts/build-llama-server``
(cached after the first build); the tests are skipped only when it is absent and cannot be built
here, and CI builds it first.

Rules: ports come from the OS (``--port 0`` everywhere, found in each process's output); every
test runs under ``trio.fail_after``; every loop is bounded; nothing asserts on durations. The
server's own endpoints (``/slots``, ``/metrics``, its log) confirm what it saw.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio
from tiny_gguf import write_model
from trio_websocket import open_websocket_url

from shim_common.wire import Hello, decode_event_message

pytestmark = [pytest.mark.e2e, pytest.mark.real_engine]

TIMEOUT: Final = 60.0
MODEL: Final = "tiny"
BUILD_SCRIPT: Final = Path(__file__).resolve().parent.parent / "scripts" / "build-llama-server"
SERVER_READY: Final = re.compile(rb"listening on (http://127\.0\.0\.1:\d+)")
SHIM_READY: Final = re.compile(rb" ready (\w+=\S+)(?: (\w+=\S+))?")


# ------------------------------------------------------------------------------------------
# The binary and the model (once per session)


@pytest.fixture(scope="session")
def llama_server() -> str:
    """Path of the ``llama-server`` binary, built (once, then cached) when missing."""
    given = os.environ.get("DYN_SHIM_LLAMA_SERVER")
    if given:
        return given
    try:
        built = subprocess.run(
            [str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=3600, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"llama-server is not built and cannot be built here: {exc}")
    if built.returncode != 0:
        reason = (built.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"llama-server is not built and cannot be built here: {reason}")
    return built.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "tiny.gguf")


# ------------------------------------------------------------------------------------------
# Processes


@dataclasses.dataclass
class Process:
    process: trio.Process
    log: Path
    ready: re.Match[bytes]

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@asynccontextmanager
async def started(
    args: Sequence[str], log: Path, ready: re.Pattern[bytes], env: dict[str, str] | None = None
) -> AsyncIterator[Process]:
    """Run a process (output to ``log``) until the block ends; enter once ``ready`` shows."""
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            list(args), stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env
        )
    try:
        match = None
        for _ in range(1200):  # polled every 25 ms, under the test's fail_after
            match = ready.search(await trio.Path(log).read_bytes())
            if match is not None or process.poll() is not None:
                break
            await trio.sleep(0.025)
        output = await trio.Path(log).read_text(errors="replace")
        assert match is not None, f"{args[0]} did not start:\n{output[-3000:]}"
        yield Process(process, log, match)
    finally:
        # Shielded: a failing or timed-out test must still reap what it started.
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
                with trio.move_on_after(5):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


def _env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}


@dataclasses.dataclass
class Stack:
    server: Process
    server_url: str
    worker: Process
    worker_ws: str
    worker_system: str
    frontend_url: str
    client: httpx.AsyncClient


@asynccontextmanager
async def stack(
    tmp_path: Path,
    binary: str,
    model: Path,
    *,
    slots: int,
    context: int,
    request_limit: int | None,
) -> AsyncIterator[Stack]:
    """llama-server, a worker in front of it and a frontend in front of the worker."""
    server_args = [binary, "-m", str(model), "--alias", MODEL, "--host", "127.0.0.1"]
    server_args += ["--port", "0", "-np", str(slots), "-c", str(context), "--metrics", "-t", "1"]
    async with started(server_args, tmp_path / "server.log", SERVER_READY) as server:
        server_url = server.ready[1].decode()
        worker_args = [sys.executable, "-m", "worker_ingress", "--port", "0", "--system-port"]
        worker_args += ["0", "--model", MODEL, "--engine", "openai", "--upstream-url", server_url]
        if request_limit is not None:
            worker_args += ["--engine-request-limit", str(request_limit)]
        async with started(worker_args, tmp_path / "worker.log", SHIM_READY, _env()) as worker:
            ws_url = worker.ready[1].decode().partition("=")[2]
            system_url = worker.ready[2].decode().partition("=")[2]
            frontend_args = [sys.executable, "-m", "frontend_shim", "--http-port", "0"]
            frontend_args += ["--worker", ws_url]
            log = tmp_path / "frontend.log"
            async with (
                started(frontend_args, log, SHIM_READY, _env()) as frontend,
                httpx.AsyncClient(trust_env=False, timeout=TIMEOUT) as client,
            ):
                frontend_url = frontend.ready[1].decode().partition("=")[2]
                for _ in range(400):
                    health = (await client.get(f"{frontend_url}/health")).json()
                    if health.get("workers_connected") == 1:
                        break
                    await trio.sleep(0.025)
                yield Stack(server, server_url, worker, ws_url, system_url, frontend_url, client)


# ------------------------------------------------------------------------------------------
# Reading what each side says


def metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)", line)
        if match:
            total += float(match[1])
    return total


async def busy_slots(s: Stack) -> int:
    slots = (await s.client.get(f"{s.server_url}/slots")).json()
    return sum(1 for slot in slots if slot["is_processing"])


async def server_metric(s: Stack, name: str) -> float:
    return metric((await s.client.get(f"{s.server_url}/metrics")).text, name)


async def worker_metric(s: Stack, name: str) -> float:
    return metric((await s.client.get(f"{s.worker_system}/metrics")).text, name)


def body(path: str, *, stream: bool, max_tokens: int, **extra: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream}
    if path.endswith("/chat/completions"):
        payload["messages"] = [{"role": "user", "content": "tell me about the water"}]
    else:
        payload["prompt"] = "the water is"
    return {**payload, **extra}


@dataclasses.dataclass
class Streamed:
    text: str = ""
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    usage: dict[str, int] | None = None
    done: bool = False
    errors: list[str] = dataclasses.field(default_factory=list)


async def read_stream(lines: AsyncIterator[str], into: Streamed) -> None:
    """Read the lines of a server-sent event stream of completion chunks into ``into``."""
    error_next = False
    async for line in lines:
        if line.startswith("event: error"):
            error_next = True
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if error_next:
            into.errors.append(data)
            error_next = False
        elif data == "[DONE]":
            into.done = True
        else:
            chunk = json.loads(data)
            into.usage = chunk.get("usage") or into.usage
            for choice in chunk["choices"]:
                into.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if choice.get("finish_reason"):
                    into.finish_reasons.append(choice["finish_reason"])


# ------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_completions_streamed_and_whole(
    tmp_path: Path, llama_server: str, tiny_model: Path, path: str
) -> None:
    with trio.fail_after(TIMEOUT):
        async with stack(
            tmp_path, llama_server, tiny_model, slots=2, context=4096, request_limit=2
        ) as s:
            url = s.frontend_url + path
            whole = await s.client.post(url, json=body(path, stream=False, max_tokens=12))
            assert whole.status_code == 200, whole.text
            answer = whole.json()
            (choice,) = answer["choices"]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert isinstance(text, str)
            assert text
            assert choice["finish_reason"] == "length"
            assert answer["usage"]["completion_tokens"] == 12

            streamed = Streamed()
            options = {"stream_options": {"include_usage": True}}
            request = body(path, stream=True, max_tokens=12, **options)
            async with s.client.stream("POST", url, json=request) as response:
                assert response.status_code == 200
                await read_stream(response.aiter_lines(), streamed)
            assert streamed.text
            assert streamed.finish_reasons == ["length"]
            assert streamed.usage is not None
            assert streamed.usage["completion_tokens"] == 12
            assert (streamed.done, streamed.errors) == (True, [])
            # The server ran exactly these two requests.
            assert await server_metric(s, "llamacpp:tokens_predicted_total") == 24


async def test_start_up_announces_the_server_limits_reads_its_load_and_warns(
    tmp_path: Path, llama_server: str, tiny_model: Path
) -> None:
    with trio.fail_after(TIMEOUT):
        # N = 3 while the server has 2 slots: the worker must say so at start-up.
        async with stack(
            tmp_path, llama_server, tiny_model, slots=2, context=8192, request_limit=3
        ) as s:
            output = s.worker.output()
            assert "--engine-request-limit 3 exceeds the 2 requests upstream" in output
            assert "set --engine-request-limit 2" in output
            # 2 slots of 4096 tokens, in blocks of the default 16 tokens.
            async with open_websocket_url(s.worker_ws + "/v1/events") as ws:
                first = await ws.get_message()
            assert isinstance(first, bytes)
            hello = decode_event_message(first)
            assert isinstance(hello, Hello)
            assert (hello.config.kv_total_blocks, hello.config.block_size) == (512, 16)
            assert hello.config.max_num_seqs == 2
            assert await worker_metric(s, "dynamo_component_total_blocks") == 512

            # A request sent to the server directly, past the gate: only the server's /slots
            # can tell the worker about it.
            direct = body("/v1/completions", stream=True, max_tokens=4000)
            async with s.client.stream("POST", f"{s.server_url}/v1/completions", json=direct):
                for _ in range(2000):
                    if await worker_metric(s, "dynamo_component_kv_used_blocks") > 0:
                        break
                    await trio.sleep(0.02)
                else:
                    raise AssertionError("the worker never reported the server's load")
            for _ in range(2000):  # the stream closed: the server stops, the load goes
                if await worker_metric(s, "dynamo_component_kv_used_blocks") == 0:
                    break
                await trio.sleep(0.02)
            else:
                raise AssertionError("the load read from the server never went back to 0")


async def test_the_gate_caps_what_the_server_runs(
    tmp_path: Path, llama_server: str, tiny_model: Path
) -> None:
    requests = 3
    with trio.fail_after(TIMEOUT):
        # 4 slots upstream, but N = 1: the server must never run two requests at once.
        async with stack(
            tmp_path, llama_server, tiny_model, slots=4, context=8192, request_limit=1
        ) as s:
            finished: list[Streamed] = []
            most_busy = 0

            async def one() -> None:
                streamed = Streamed()
                request = body("/v1/completions", stream=True, max_tokens=300)
                url = f"{s.frontend_url}/v1/completions"
                async with s.client.stream("POST", url, json=request) as response:
                    assert response.status_code == 200
                    await read_stream(response.aiter_lines(), streamed)
                finished.append(streamed)

            async with trio.open_nursery() as nursery:
                for _ in range(requests):
                    nursery.start_soon(one)
                for _ in range(5000):
                    if len(finished) == requests:
                        break
                    most_busy = max(most_busy, await busy_slots(s))
                    await trio.sleep(0.005)
            assert most_busy == 1
            assert [streamed.finish_reasons for streamed in finished] == [["length"]] * requests
            assert await server_metric(s, "llamacpp:tokens_predicted_total") == 300 * requests


async def test_a_client_that_leaves_stops_the_generation(
    tmp_path: Path, llama_server: str, tiny_model: Path
) -> None:
    max_tokens = 30_000
    with trio.fail_after(TIMEOUT):
        async with stack(
            tmp_path, llama_server, tiny_model, slots=1, context=32768, request_limit=1
        ) as s:
            request = body("/v1/completions", stream=True, max_tokens=max_tokens)
            url = f"{s.frontend_url}/v1/completions"
            async with s.client.stream("POST", url, json=request) as response:
                lines = response.aiter_lines()
                for _ in range(5):
                    await anext(lines)
                assert await busy_slots(s) == 1
            # The client hung up: frontend, worker and server let go, the slot frees at once.
            for _ in range(2000):
                if await busy_slots(s) == 0:
                    break
                await trio.sleep(0.01)
            else:
                raise AssertionError("the server went on generating for a client that left")
            assert await server_metric(s, "llamacpp:tokens_predicted_total") < max_tokens
            assert "cancel task" in s.server.output()
            assert await worker_metric(s, "dynamo_engine_request") == 0


async def test_a_server_killed_mid_stream_ends_the_stream_with_an_error(
    tmp_path: Path, llama_server: str, tiny_model: Path
) -> None:
    with trio.fail_after(TIMEOUT):
        async with stack(
            tmp_path, llama_server, tiny_model, slots=1, context=32768, request_limit=1
        ) as s:
            streamed = Streamed()
            request = body("/v1/chat/completions", stream=True, max_tokens=30_000)
            url = f"{s.frontend_url}/v1/chat/completions"
            async with s.client.stream("POST", url, json=request) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                for _ in range(5):
                    await anext(lines)
                s.server.process.kill()
                await read_stream(lines, streamed)
            assert streamed.done is False
            assert len(streamed.errors) == 1
            assert "upstream" in json.loads(streamed.errors[0])["error"]["message"]
            # The worker is still up, its slot free, and it answers the next request itself.
            assert await worker_metric(s, "dynamo_engine_request") == 0
            after = await s.client.post(url, json=body(url, stream=False, max_tokens=4))
            assert after.status_code >= 500


async def test_the_servers_cached_prompt_tokens_reach_the_client(
    tmp_path: Path, llama_server: str, tiny_model: Path
) -> None:
    # One slot: the same prompt again reuses what the slot cached, and llama-server says so in
    # its usage; the answer the client gets carries the count, streamed or not.
    path = "/v1/chat/completions"
    with trio.fail_after(TIMEOUT):
        async with stack(
            tmp_path, llama_server, tiny_model, slots=1, context=4096, request_limit=1
        ) as s:
            url = s.frontend_url + path
            cached: list[int] = []
            for _ in range(2):
                whole = await s.client.post(url, json=body(path, stream=False, max_tokens=2))
                assert whole.status_code == 200, whole.text
                cached.append(whole.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            streamed = Streamed()
            options = {"stream_options": {"include_usage": True}}
            request = body(path, stream=True, max_tokens=2, **options)
            async with s.client.stream("POST", url, json=request) as response:
                assert response.status_code == 200
                await read_stream(response.aiter_lines(), streamed)
            assert streamed.usage is not None
            details: Any = streamed.usage["prompt_tokens_details"]
            cached.append(details["cached_tokens"])
            hits = await worker_metric(s, "dynamo_worker_prefix_cache_hit_tokens_total")
            queried = await worker_metric(s, "dynamo_worker_prefix_cache_queried_tokens_total")
    assert cached[0] == 0
    assert cached[1] > 0
    assert cached[2] > 0
    assert hits == sum(cached)
    assert queried > hits
