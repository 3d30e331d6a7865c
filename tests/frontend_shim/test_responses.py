"""Formatting worker replies: the OpenAI objects, and no routing state behind them."""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing
import trio_websocket
from worker_configs import runtime_config

import frontend_shim._responses as responses
from frontend_shim._app import run_frontend
from frontend_shim._config import FrontendSettings
from frontend_shim._request_body import MAX_EMBEDDING_INPUTS
from frontend_shim._request_plane import RequestStream, ResponseBuffer
from frontend_shim._responses import MAX_ANSWER_CHARS, ResponseShape
from shim_common import wire
from shim_common._http_exchange import HTTPResponder

#: What formatting must not reach: routing, load state, the links, the books.
_ROUTING = {
    "frontend_shim._accounting",
    "frontend_shim._fleet_bridge",
    "frontend_shim._free_sets",
    "frontend_shim._links",
    "frontend_shim._load",
    "frontend_shim._metrics",
    "frontend_shim._pool",
    "frontend_shim._router",
    "frontend_shim._waiting",
}


def test_the_formatter_imports_no_routing_state() -> None:
    tree = ast.parse(Path(responses.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert not imported & _ROUTING


def test_a_streamed_chat_chunk_is_the_envelope_around_its_choice() -> None:
    shape = ResponseShape("chat_completions", {"model": "m", "stream": True})
    first = msgspec.json.decode(shape.chunk(wire.Chunk(request_id=1, text="hi"), first=True))
    assert first["id"] == shape.id
    assert first["id"].startswith("chatcmpl-")
    assert first["object"] == "chat.completion.chunk"
    assert first["model"] == "m"
    assert first["choices"] == [
        {"index": 0, "delta": {"content": "hi", "role": "assistant"}, "finish_reason": None}
    ]
    later = msgspec.json.decode(
        shape.chunk(wire.Chunk(request_id=1, text="!", finish_reason="stop", index=1), first=False)
    )
    assert later["choices"] == [{"index": 1, "delta": {"content": "!"}, "finish_reason": "stop"}]


@pytest.mark.parametrize("endpoint", ["chat_completions", "completions"])
def test_an_event_is_the_sse_frame_of_its_chunk_byte_for_byte(endpoint: wire.Endpoint) -> None:
    shape = ResponseShape(endpoint, {"model": "m", "stream": True})
    texts = ["", " tok", 'quote " and \\ back', "line\nbreak", "\u00e9\u4e2d\U0001f600", "\x00\x1f"]
    for text in texts:
        for index in (0, 3):
            for finish_reason in (None, "length"):
                for first in (True, False):
                    reply = wire.Chunk(
                        request_id=1, text=text, index=index, finish_reason=finish_reason
                    )
                    event = shape.event(reply, first)
                    assert event == b"data: " + shape.chunk(reply, first) + b"\n\n"
                    assert msgspec.json.decode(event[6:-2])["choices"][0]["index"] == index


def test_a_whole_text_completion_lists_its_choices_with_usage() -> None:
    shape = ResponseShape("completions", {"model": "m", "stream_options": {"include_usage": True}})
    assert shape.include_usage
    end = wire.End(request_id=1, prompt_tokens=3, completion_tokens=2)
    whole = msgspec.json.decode(shape.whole({0: ("ab", None), 1: ("c", "length")}, end))
    assert whole["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "ab", "stop"),
        (1, "c", "length"),
    ]
    assert whole["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert msgspec.json.decode(shape.usage_chunk(end))["choices"] == []


def test_response_ids_are_unique_per_request() -> None:
    ids = {ResponseShape("completions", {"model": "m"}).id for _ in range(100)}
    assert len(ids) == 100


# ----------------------------------------------------------------------------- a hostile worker


async def _serve_overrunning_worker(
    nursery: trio.Nursery, answer: Callable[[wire.Generate], list[msgspec.Struct]]
) -> int:
    """A worker speaking the real protocol whose every answer is ``answer(generate)``."""
    hello = wire.encode(
        wire.Hello(protocol_version=wire.PROTOCOL_VERSION, config=runtime_config(model="m"))
    )

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.send_message(hello)
        with contextlib.suppress(trio_websocket.ConnectionClosed):
            while True:
                data = await ws.get_message()
                assert isinstance(data, bytes)
                message = wire.decode_client_message(data)
                if isinstance(message, wire.Generate):
                    for reply in answer(message):
                        await ws.send_message(wire.encode(reply))

    server = await nursery.start(trio_websocket.serve_websocket, handler, "127.0.0.1", 0, None)
    return int(server.port)


def _started(generate: wire.Generate) -> wire.Started:
    return wire.Started(request_id=generate.request_id, prompt_tokens=1)


def _end(generate: wire.Generate) -> wire.End:
    return wire.End(request_id=generate.request_id, prompt_tokens=1, completion_tokens=1)


def _too_much_text(generate: wire.Generate) -> list[msgspec.Struct]:
    half = "x" * (MAX_ANSWER_CHARS // 2 + 1)
    chunks = [wire.Chunk(request_id=generate.request_id, text=half) for _ in range(2)]
    return [_started(generate), *chunks, _end(generate)]


def _far_index(generate: wire.Generate) -> list[msgspec.Struct]:
    chunk = wire.Chunk(request_id=generate.request_id, text="x", index=10**12)
    return [_started(generate), chunk, _end(generate)]


def _too_many_vectors(generate: wire.Generate) -> list[msgspec.Struct]:
    vectors = [
        wire.Chunk(request_id=generate.request_id, embedding=[0.5], index=index)
        for index in range(MAX_EMBEDDING_INPUTS + 1)
    ]
    return [_started(generate), *vectors, _end(generate)]


@pytest.mark.parametrize(
    ("answer", "path", "body", "says"),
    [
        (_too_much_text, "/v1/completions", {"prompt": "x"}, "characters"),
        (_far_index, "/v1/completions", {"prompt": "x"}, "choice index"),
        (_far_index, "/v1/completions", {"prompt": "x", "stream": True}, "choice index"),
        (_too_many_vectors, "/v1/embeddings", {"input": "x"}, "vectors"),
    ],
)
async def test_a_worker_past_the_bounds_of_an_answer_fails_that_request_alone(
    answer: Callable[[wire.Generate], list[msgspec.Struct]],
    path: str,
    body: dict[str, Any],
    says: str,
) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve_overrunning_worker(nursery, answer)
            settings = FrontendSettings(http_port=0, workers=(f"ws://127.0.0.1:{port}",))
            url: str = await nursery.start(run_frontend, settings)
            async with httpx.AsyncClient(base_url=url, timeout=15) as client:
                for _ in range(500):
                    if (await client.get("/health")).json()["workers_connected"] == 1:
                        break
                    await trio.sleep(0.01)
                reply = await client.post(path, json={"model": "m", **body})
                if body.get("stream"):
                    assert reply.status_code == 200
                    assert b"event: error" in reply.content
                    assert says.encode() in reply.content
                    assert b"[DONE]" not in reply.content
                else:
                    assert reply.status_code == 500
                    assert says in reply.json()["error"]["message"]
                metrics = (await client.get("/metrics")).text
                assert 'status="500"' in metrics
                assert (await client.get("/live")).status_code == 200
            nursery.cancel_scope.cancel()


class _RecordingChannel:
    """The HTTP connection's side of a responder, recording each write of a streamed body."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.response_started = False
        self.response_finished = False

    async def receive_body(self) -> bytes:
        return b""

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        raise AssertionError("a streamed answer sends no whole response")

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.response_started = True

    async def send_data(self, data: bytes) -> None:
        self.writes.append(data)

    async def end_stream(self) -> None:
        self.response_finished = True


class _WholeChannel(_RecordingChannel):
    """A channel that records a whole response as one write."""

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.writes.append(body)


class _Tally:
    def __init__(self, channel: _RecordingChannel | None = None) -> None:
        self.status = 0
        self.outputs = 0
        self.done = False
        self.unwritten = False
        self.channel = channel
        #: For each call of written() after new output: the writes the channel had by then.
        self.written_at: list[int] = []
        self.ends: list[tuple[wire.End | wire.Failed, int, list[bytes] | None]] = []

    def output(self, reply: wire.Chunk) -> None:
        self.outputs += 1
        self.unwritten = True

    def written(self, now: float) -> None:
        if self.unwritten and self.channel is not None:
            self.written_at.append(len(self.channel.writes))
        self.unwritten = False

    def completed(self, now: float) -> None:
        self.done = True

    def ended(self, final: wire.End | wire.Failed) -> None:
        #: What was counted when the final frame was noted, and the writes by then.
        self.ends.append(
            (final, self.outputs, None if self.channel is None else self.channel.writes[:])
        )


async def test_replies_that_arrived_together_leave_in_one_write_later_ones_in_their_own() -> None:
    buffer = ResponseBuffer(16)
    buffer.push(wire.Started(request_id=1, prompt_tokens=2))
    stream = RequestStream(1, buffer)
    await stream.first()
    for text in ("a", "b", "c"):
        buffer.push(wire.Chunk(request_id=1, text=text, tokens=1))
    channel = _RecordingChannel()
    tally = _Tally(channel)
    body = {"model": "m", "stream": True}
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                responses.serve_started,
                HTTPResponder(channel),
                "chat_completions",
                stream,
                body,
                tally,
            )
            await trio.testing.wait_all_tasks_blocked()
            assert len(channel.writes) == 1  # three tokens, one write
            buffer.push(wire.Chunk(request_id=1, text="d", tokens=1, finish_reason="length"))
            await trio.testing.wait_all_tasks_blocked()
            assert len(channel.writes) == 2  # a token that came alone leaves at once, alone
            buffer.push(wire.End(request_id=1, prompt_tokens=2, completion_tokens=4))
    assert len(channel.writes) == 3
    events = b"".join(channel.writes).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    deltas = [msgspec.json.decode(event[6:])["choices"][0]["delta"] for event in events[:-2]]
    assert [delta["content"] for delta in deltas] == ["a", "b", "c", "d"]
    assert deltas[0]["role"] == "assistant"
    assert "role" not in deltas[1]
    assert channel.writes[0].count(b"data: ") == 3
    assert tally.outputs == 4
    # Told after each write that carried output, so the time to first token is taken once
    # the first token is written.
    assert tally.written_at == [1, 2]
    assert tally.done
    assert tally.status == 200
    assert channel.response_finished


def _started_stream(buffer: ResponseBuffer) -> RequestStream:
    buffer.push(wire.Started(request_id=1, prompt_tokens=2))
    return RequestStream(1, buffer)


@pytest.mark.parametrize("streamed", [True, False])
async def test_the_end_is_noted_after_every_chunk_read_with_it_and_before_the_last_write(
    streamed: bool,
) -> None:
    # The worker's last chunks and its End in one read: the release of the request must see
    # the chunks (they size what is taken off the worker's load), and come before the client
    # can have the answer's last byte.
    buffer = ResponseBuffer(16)
    stream = _started_stream(buffer)
    await stream.first()
    for text in ("a", "b", "c"):
        buffer.push(wire.Chunk(request_id=1, text=text, tokens=1))
    end = wire.End(request_id=1, prompt_tokens=2, completion_tokens=3)
    buffer.push(end)
    channel = _RecordingChannel()
    tally = _Tally(channel)
    body = {"model": "m", "stream": streamed}
    channel = _WholeChannel() if not streamed else channel
    tally.channel = channel
    responder = HTTPResponder(channel)
    with trio.fail_after(5):
        await responses.serve_started(responder, "chat_completions", stream, body, tally)
    assert tally.ends == [(end, 3, [])]
    assert tally.done
    assert len(channel.writes) == 1


async def test_a_stream_that_fails_after_its_first_chunk_still_takes_its_first_token() -> None:
    buffer = ResponseBuffer(16)
    stream = _started_stream(buffer)
    await stream.first()
    buffer.push(wire.Chunk(request_id=1, text="a", tokens=1))
    failed = wire.Failed(request_id=1, kind="engine", message="boom")
    buffer.push(failed)
    channel = _RecordingChannel()
    tally = _Tally(channel)
    with trio.fail_after(5):
        await responses.serve_started(
            HTTPResponder(channel), "completions", stream, {"model": "m", "stream": True}, tally
        )
    assert tally.written_at == [1]  # the chunk's write, before the error event
    assert tally.ends == [(failed, 1, [])]
    assert tally.status == 500
