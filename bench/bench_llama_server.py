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
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

if not __package__:  # run as a file: ``bench`` is in the folder above, as under ``python -m``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kit.children import Child, started_logging
from bench.kit.proc import cpu_seconds
from bench.kit.shim import frontend_command, worker_command

SERVER_READY = re.compile(rb"listening on (http://127\.0\.0\.1:\d+)")


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
    worker_args = worker_command(
        "--model", "tiny", "--engine", "openai", "--engine-request-limit", "1"
    )
    # Opened once, before the run: the children write to them.
    worker_log = (logs / "worker.log").open("wb")
    frontend_log = (logs / "frontend.log").open("wb")
    with worker_log, frontend_log:
        async with (
            started_logging(server_args, logs / "server.log", SERVER_READY) as (_, ready),
            Child([*worker_args, "--upstream-url", ready[1].decode()], log=worker_log) as worker,
            Child(frontend_command("--worker", worker.addresses["ws"]), log=frontend_log) as front,
            httpx.AsyncClient(trust_env=False, timeout=300) as client,
        ):
            server, frontend = ready[1].decode(), front.addresses["http"]
            shims = [worker.pid, front.pid]
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
