"""End-to-end: disaggregated serving's worker side through real processes, on loopback, under
``trio.fail_after``: a prefill worker and a decode worker (two mockers started with
``--disaggregation-mode``), driven by a raw request-plane client as a disaggregating frontend
drives them, and served by a frontend that knows no roles, to which both are aggregated workers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
from test_e2e import (
    MODEL,
    call,
    clean_env,
    completion,
    frontend_cmd,
    metric,
    started,
    wait_connected,
    worker_cmd,
)
from trio_websocket import WebSocketConnection, open_websocket_url

from shim_common import wire
from shim_common.wire import FEATURE_DISAGG, Chunk, End, Generate, Hello, Started

pytestmark = pytest.mark.e2e

TIMEOUT = 60.0
BLOCK = 4
FLAGS = ("--speedup-ratio", "50", "--block-size", str(BLOCK), "--num-gpu-blocks", "256")
PROMPT = " ".join(f"d{i}" for i in range(30))  # 30 tokens: 7 full blocks and a partial one


async def binary(ws: WebSocketConnection) -> bytes:
    message = await ws.get_message()
    assert isinstance(message, bytes)
    return message


@asynccontextmanager
async def request_plane(url: str) -> AsyncIterator[tuple[WebSocketConnection, Hello]]:
    async with open_websocket_url(
        url + wire.REQUESTS_PATH, max_message_size=wire.MAX_MESSAGE_BYTES
    ) as ws:
        hello = wire.decode_worker_message(await binary(ws))
        assert isinstance(hello, Hello)
        yield ws, hello


async def frames_of(ws: WebSocketConnection, request: Generate) -> list[wire.WorkerMessage]:
    await ws.send_message(wire.encode(request))
    frames: list[wire.WorkerMessage] = []
    while not frames or not isinstance(frames[-1], End | wire.Failed | wire.Rejected):
        frame = wire.decode_worker_message(await binary(ws))
        assert not isinstance(frame, Hello | wire.Batch)
        assert frame.request_id == request.request_id
        frames.append(frame)
    return frames


def body(max_tokens: int) -> dict[str, object]:
    return {"prompt": PROMPT, "max_tokens": max_tokens}


async def test_a_request_prefilled_by_one_worker_process_is_decoded_by_another() -> None:
    env = clean_env()
    prefill_flags = ("--disaggregation-mode", "prefill", "--worker-id", "p-1")
    decode_flags = ("--disaggregation-mode", "decode", "--kv-transfer-bandwidth", "8")
    with trio.fail_after(TIMEOUT):
        async with (
            started(worker_cmd(*FLAGS, *prefill_flags, "--kv-bytes-per-token", "4096"), env) as (
                prefill,
                _,
            ),
            started(worker_cmd(*FLAGS, *decode_flags), env) as (decode, decode_system),
            request_plane(prefill) as (p, p_hello),
            request_plane(decode) as (d, d_hello),
        ):
            assert (p_hello.config.worker_type, d_hello.config.worker_type) == ("prefill", "decode")
            assert FEATURE_DISAGG in p_hello.features
            assert FEATURE_DISAGG in d_hello.features
            assert wire.FEATURE_KV_EVENTS not in d_hello.features

            prefill_frames = await frames_of(
                p, Generate(request_id=1, endpoint="completions", body=body(5), prefill_only=True)
            )
            assert [type(frame) for frame in prefill_frames] == [Started, End]
            end = prefill_frames[-1]
            assert isinstance(end, End)
            assert end.completion_tokens == 0
            handoff = end.handoff
            assert handoff is not None
            assert (handoff.worker_id, handoff.prompt_tokens, handoff.block_size) == (
                "p-1",
                30,
                BLOCK,
            )
            assert len(handoff.block_names) == 30 // BLOCK
            assert handoff.kv_bytes == 30 * 4096

            decode_frames = await frames_of(
                d, Generate(request_id=1, endpoint="completions", body=body(5), handoff=handoff)
            )
            assert isinstance(decode_frames[0], Started)
            assert all(isinstance(frame, Chunk) for frame in decode_frames[1:-1])
            text = "".join(frame.text for frame in decode_frames if isinstance(frame, Chunk))
            assert text == "alpha bravo charlie delta echo"
            done = decode_frames[-1]
            assert isinstance(done, End)
            assert (done.prompt_tokens, done.completion_tokens) == (30, 5)

            # A hand-off of another block size is refused, clearly, and takes no slot.
            wrong = msgspec.structs.replace(handoff, block_size=16, block_names=[])
            (refused,) = await frames_of(
                d, Generate(request_id=2, endpoint="completions", body=body(1), handoff=wrong)
            )
            assert isinstance(refused, wire.Failed)
            assert refused.kind == "bad_request"
            assert "block size" in refused.message
            # Everything given back: no request in the engine, no block held.
            status, text_metrics = await call(decode_system, "GET", "/metrics")
            assert status == 200
            assert metric(text_metrics, "dynamo_engine_request") == 0
            assert metric(text_metrics, "dynamo_component_kv_used_blocks") == 0


async def test_a_frontend_that_knows_no_roles_serves_through_prefill_and_decode_workers() -> None:
    # An older frontend ignores worker_type and never sends a hop: to it both workers are
    # aggregated ones, and each serves a plain request whole.
    env = clean_env()
    with trio.fail_after(TIMEOUT):
        async with (
            started(worker_cmd(*FLAGS, "--disaggregation-mode", "prefill"), env) as (prefill, _),
            started(worker_cmd(*FLAGS, "--disaggregation-mode", "decode"), env) as (decode, _),
            started(
                frontend_cmd(
                    "--router-mode", "round-robin", "--worker", prefill, "--worker", decode
                ),
                env,
            ) as (frontend,),
        ):
            await wait_connected(frontend, 2)
            for _ in range(4):  # round-robin: both workers serve
                status, answer = await call(frontend, "POST", "/v1/completions", completion(3))
                assert status == 200, answer
                usage = json.loads(answer)["usage"]
                assert usage["completion_tokens"] == 3
                assert json.loads(answer)["model"] == MODEL
