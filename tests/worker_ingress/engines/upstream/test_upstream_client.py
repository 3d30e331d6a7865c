"""The upstream client's sans-IO parts: the base URL and the server-sent events decoder.

The client's I/O (timeouts, cancellation reaching the upstream, the keep-alive retry rule) is
exercised through the engine against a fake upstream, in ``test_upstream_engine.py``.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given

from worker_ingress.engines.upstream._client import Origin, SSEDecoder, parse_base_url


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        ("http://127.0.0.1:8001", Origin("127.0.0.1", 8001, "")),
        ("http://127.0.0.1:8001/v1", Origin("127.0.0.1", 8001, "")),
        ("http://127.0.0.1:8001/v1/", Origin("127.0.0.1", 8001, "")),
        ("http://host/engine/v1", Origin("host", 80, "/engine")),
    ],
)
def test_parse_base_url(url: str, origin: Origin) -> None:
    assert parse_base_url(url) == origin


@pytest.mark.parametrize("url", ["https://h:1", "127.0.0.1:8001", "http://:80", "http://h:x"])
def test_parse_base_url_refuses(url: str) -> None:
    with pytest.raises(ValueError, match="upstream URL"):
        parse_base_url(url)


SSE_STREAM = (
    b": keep-alive comment\r\n\r\n"
    b'data: {"a": 1}\n\n'
    b"event: message\r\ndata: first\r\ndata: second\r\n\r\n"
    b"data:nospace\r\r"
    b"data: [DONE]\n\n"
)
SSE_EVENTS = ['{"a": 1}', "first\nsecond", "nospace", "[DONE]"]


def test_sse_decoder_whole() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(SSE_STREAM) + decoder.close() == SSE_EVENTS


@given(st.lists(st.integers(min_value=0, max_value=len(SSE_STREAM)), max_size=12))
def test_sse_decoder_any_split(cuts: list[int]) -> None:
    decoder = SSEDecoder()
    events: list[str] = []
    bounds = [0, *sorted(cuts), len(SSE_STREAM)]
    for start, end in itertools.pairwise(bounds):
        events += decoder.feed(SSE_STREAM[start:end])
    assert events + decoder.close() == SSE_EVENTS


def test_sse_decoder_bounds_a_line() -> None:
    decoder = SSEDecoder(max_line_bytes=16)
    with pytest.raises(ValueError, match="over 16 bytes"):
        decoder.feed(b"data: " + b"x" * 32)


def test_sse_decoder_event_without_final_blank_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: last") == []
    assert decoder.close() == ["last"]
