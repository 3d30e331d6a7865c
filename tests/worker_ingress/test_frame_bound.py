"""The worker's bound on the frames of one message, in front of its websocket library (sans-IO).

wsproto, which the library reads with, is the reference: the counter finds the frames where
wsproto finds them, however the bytes are split, and refuses exactly the frame past the bound.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Request

from shim_common.wire import MESSAGE_FRAME_BYTES, MESSAGE_FRAMES
from worker_ingress._frame_bound import PING_BURST, FrameCounter, _close_from_client

REQUEST = (
    b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\n\r\n"
)


def client_frame(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    """A masked frame, as a client sends it (a random key: the counter must not care)."""
    head = bytes([(0x80 if fin else 0) | opcode])
    length = len(payload)
    if length < 126:
        head += bytes([0x80 | length])
    elif length < 1 << 16:
        head += bytes([0x80 | 126]) + length.to_bytes(2, "big")
    else:
        head += bytes([0x80 | 127]) + length.to_bytes(8, "big")
    key = os.urandom(4)
    return head + key + bytes(byte ^ key[i % 4] for i, byte in enumerate(payload))


def feed(counter: FrameCounter, data: bytes, cuts: list[int] = []) -> int | None:  # noqa: B006
    """Feed ``data`` in pieces, the request and then the frames, as the stream does; where in it
    the frame past the bound begins, if anywhere."""
    start = 0
    requested = False
    for cut in [*cuts, len(data)]:
        if cut <= start:
            continue
        piece = data[start:cut]
        if not requested:
            end = counter.request(piece)
            if end is None:
                start = cut
                continue
            requested = True
            start += end
            piece = piece[end:]
        at = counter.frames(piece, now=0.0)
        if at is not None:
            return start + at
        start = cut
    return None


def fragments(pieces: list[bytes]) -> bytes:
    """One binary message in the given fragments."""
    return b"".join(
        client_frame(0x2 if n == 0 else 0x0, piece, fin=n == len(pieces) - 1)
        for n, piece in enumerate(pieces)
    )


@given(
    st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=5), max_size=5),
    st.lists(st.integers(0, 4000), max_size=8),
)
def test_messages_within_the_bound_pass_whatever_the_split(
    messages: list[list[bytes]], cuts: list[int]
) -> None:
    data = REQUEST + client_frame(0x9, b"ping") + b"".join(fragments(m) for m in messages)
    assert feed(FrameCounter(now=0.0), data, sorted(cuts)) is None


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_the_frame_past_the_bound_is_found_at_its_first_byte(piece: int) -> None:
    # Empty fragments: 1,024 frames in all pass, and the next is refused where it begins.
    opening = client_frame(0x2, b"", fin=False)
    empty = client_frame(0x0, b"", fin=False)
    data = REQUEST + opening + empty * (MESSAGE_FRAMES - 1) + client_frame(0x9, b"p") + empty
    counter = FrameCounter(now=0.0)
    at = feed(counter, data, list(range(piece, len(data), piece)))
    assert at == len(data) - len(empty)
    assert counter.breach is not None
    assert f"more than {MESSAGE_FRAMES} frames in one message of 0 bytes" in counter.breach


def test_large_fragments_earn_their_frames() -> None:
    # One frame more per 256 bytes received: 4,096 fragments of 256 bytes, and then a message
    # of 1,024 empty fragments, are whole messages within the bound.
    piece = b"x" * MESSAGE_FRAME_BYTES
    data = REQUEST + fragments([piece] * 4096) + fragments([b""] * MESSAGE_FRAMES)
    assert feed(FrameCounter(now=0.0), data) is None
    assert feed(FrameCounter(now=0.0), data + fragments([b""] * (MESSAGE_FRAMES + 1))) is not None


@pytest.mark.parametrize(
    "request_head",
    [
        REQUEST,
        # A body wsproto reads as part of the request: the frames begin after it, for both.
        REQUEST.replace(b"\r\n\r\n", b"\r\nContent-Length: 10\r\n\r\n") + b"\x82\x7f" * 5,
        REQUEST.replace(b"\r\n", b"\n"),  # bare line feeds, which h11 takes too
    ],
)
def test_the_counter_finds_the_first_frame_where_wsproto_does(request_head: bytes) -> None:
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(request_head)
    assert isinstance(next(server.events()), Request)
    server.send(AcceptConnection())
    opening = client_frame(0x2, b"", fin=False)
    empty = client_frame(0x0, b"", fin=False)
    frames = opening + empty * (MESSAGE_FRAMES + 5)
    counter = FrameCounter(now=0.0)
    at = feed(counter, request_head + frames)
    assert at is not None
    # What passes reaches wsproto, and the close that stands for the rest is read as the
    # client's close with 1002.
    server.receive_data(frames[: at - len(request_head)])
    server.receive_data(_close_from_client(counter.breach or ""))
    events = list(server.events())
    assert all(isinstance(event, BytesMessage) and not event.data for event in events[:-1])
    assert len(events) - 1 == MESSAGE_FRAMES
    assert isinstance(events[-1], CloseConnection)
    assert events[-1].code == 1002
    assert "frames in one message" in (events[-1].reason or "")


def test_a_request_the_library_refuses_is_not_looked_at() -> None:
    counter = FrameCounter(now=0.0)
    assert counter.request(b"\x16\x03\x01 not http at all\r\n\r\n") is None
    assert counter.ignored


def test_pings_past_the_burst_are_a_breach_and_a_steady_keepalive_never_is() -> None:
    counter = FrameCounter(now=0.0)
    assert counter.request(REQUEST) == len(REQUEST)
    ping = client_frame(0x9, b"k")
    # A ping four times a second (60 times a frontend's keepalive) for an hour: never a breach.
    steady = [counter.frames(ping, now=n / 4) for n in range(14_400)]
    assert steady == [None] * len(steady)
    # Then the burst at once, and one more, found where that ping begins.
    flood = ping * (PING_BURST + 1)
    at = FrameCounter(now=0.0).frames(flood, now=0.0)
    assert at == PING_BURST * len(ping)
    counter = FrameCounter(now=0.0)
    assert counter.frames(flood, now=0.0) is not None
    assert counter.breach == "pings past 32 at once and 10 a second"
    # Pongs and data cost the worker no reply: not counted.
    assert FrameCounter(now=0.0).frames(client_frame(0xA, b"") * 1000, now=0.0) is None
