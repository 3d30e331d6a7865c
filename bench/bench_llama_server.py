"""Tokens per second of llama.cpp's ``llama-server`` alone and behind the gate.

Starts ``llama-server`` (one slot), a ``worker-ingress --engine openai`` in front of it (N = 1)
and a ``frontend-shim`` in front of the worker, all on loopback with ports from the OS. Then sends
the same streamed completion (same prompt, same ``max_tokens``, greedy sampling, so every run does
the same work) to the server directly and through the frontend, alternating, and prints the median
tokens per second of each: completion tokens divided by the time from sending the request to
``[DONE]``. It also prints the CPU time the worker and the frontend spent per token relayed, read
from ``/proc`` (Linux), which unlike the rates does not depend on what else the machine runs.

Usage::

    python tests/tiny_gguf.py tiny.gguf
    python bench/bench_llama_server.py --model tiny.gguf \\
        --llama-server "$(scripts/build-llama-server)" --runs 5 --max-tokens 1000
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

SERVER_READY = re.compile(rb"listening on (http://127\.0\.0\.1:\d+)")
SHIM_READY = re.compile(rb" ready \w+=(\S+)")


@asynccontextmanager
async def started(
    args: Sequence[str], log: Path, ready: re.Pattern[bytes], pids: list[int] | None = None
) -> AsyncIterator[str]:
    """Run a process until the block ends; yield the URL its ready line names."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            list(args), stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env
        )
    if pids is not None:
        pids.append(process.pid)
    try:
        with trio.fail_after(60):
            while not (match := ready.search(await trio.Path(log).read_bytes())):
                if process.poll() is not None:
                    raise RuntimeError(f"{args[0]} exited, see {log}")
                await trio.sleep(0.05)
        yield match[1].decode()
    finally:
        with trio.CancelScope(shield=True):
            process.terminate()
            await process.wait()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (0 where ``/proc`` is missing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def tokens_per_second(client: httpx.AsyncClient, url: str, max_tokens: int) -> float:
    body = {
        "model": "tiny",
        "prompt": "the water is",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith('data: {"') and '"usage"' in line:
                match = re.search(r'"completion_tokens":\s*(\d+)', line)
                tokens = int(match[1]) if match else tokens
    elapsed = time.perf_counter() - start
    if tokens != max_tokens:
        raise RuntimeError(f"{url} generated {tokens} tokens, not {max_tokens}")
    return tokens / elapsed


async def main(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="bench-llama-"))
    server_args = [args.llama_server, "-m", args.model, "--alias", "tiny", "--host", "127.0.0.1"]
    server_args += ["--port", "0", "-np", "1", "-c", "8192", "-t", str(args.threads)]
    async with started(server_args, logs / "server.log", SERVER_READY) as server:
        worker_args = [sys.executable, "-m", "worker_ingress", "--port", "0", "--system-port"]
        worker_args += ["0", "--model", "tiny", "--engine", "openai", "--upstream-url", server]
        worker_args += ["--engine-request-limit", "1"]
        shims: list[int] = []
        async with started(worker_args, logs / "worker.log", SHIM_READY, shims) as worker:
            frontend_args = [sys.executable, "-m", "frontend_shim", "--http-port", "0"]
            frontend_args += ["--worker", worker]
            async with (
                started(frontend_args, logs / "frontend.log", SHIM_READY, shims) as frontend,
                httpx.AsyncClient(trust_env=False, timeout=300) as client,
            ):
                for _ in range(200):
                    if (await client.get(f"{frontend}/health")).json()["workers_connected"]:
                        break
                    await trio.sleep(0.05)
                targets = {"alone": server, "through the gate": frontend}
                results: dict[str, list[float]] = {name: [] for name in targets}
                for url in targets.values():  # warm-up: prompt cache, connections
                    await tokens_per_second(client, url, args.max_tokens)
                cpu = 0.0
                for _ in range(args.runs):
                    for name, url in targets.items():
                        before = sum(cpu_seconds(pid) for pid in shims)
                        results[name].append(await tokens_per_second(client, url, args.max_tokens))
                        if url == frontend:
                            cpu += sum(cpu_seconds(pid) for pid in shims) - before
    print(f"{args.runs} runs of {args.max_tokens} tokens, streamed, llama-server -t {args.threads}")
    for name, values in results.items():
        spread = ", ".join(f"{value:.0f}" for value in values)
        print(f"{name:>17}: median {statistics.median(values):7.0f} tokens/s  ({spread})")
    per_token = cpu / (args.runs * args.max_tokens)
    print(f"worker + frontend CPU per token relayed: {per_token * 1e6:.0f} us")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    trio.run(main, parser.parse_args())
