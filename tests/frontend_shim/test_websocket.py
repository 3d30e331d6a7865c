"""The frontend's websocket client codec (sans-IO): framing, control frames, caps, handshake.

A wsproto server is the reference peer: what it writes, the codec must read, and the other way
round, so the codec cannot drift from RFC 6455 while it tests only against itself.
"""

from __future__ import annotations

import os
import time
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
)

from frontend_shim._websocket import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    FrameReader,
    HandshakeError,
    HandshakeReader,
    HandshakeRejected,
    MessageTooBig,
    WebSocketProtocolError,
    close_payload,
    encode_frame,
    handshake_request,
    parse_close,
)
from shim_common.wire import MESSAGE_FRAMES

CAP = 1 << 20


def server_after_handshake(subprotocols: tuple[str, ...] = ()) -> tuple[WSConnection, bytes]:
    """A wsproto server that accepted our upgrade; returns it and the bytes of its answer."""
    server = WSConnection(ConnectionType.SERVER)
    request, _key = handshake_request("127.0.0.1:9", "/v1/requests", (), subprotocols)
    server.receive_data(request)
    (event,) = list(server.events())
    assert isinstance(event, Request)
    chosen = subprotocols[0] if subprotocols else None
    return server, server.send(AcceptConnection(subprotocol=chosen))


def unmasked(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    """A server frame built by hand (for the cases wsproto will not write)."""
    head = bytes([(0x80 if fin else 0) | opcode])
    length = len(payload)
    if length < 126:
        return head + bytes([length]) + payload
    if length < 1 << 16:
        return head + bytes([126]) + length.to_bytes(2, "big") + payload
    return head + bytes([127]) + length.to_bytes(8, "big") + payload


# ----------------------------------------------------------------------------- handshake


def test_the_upgrade_request_carries_the_key_headers_and_subprotocols() -> None:
    request, key = handshake_request(
        "[::1]:9100", "/v1/events", [("Authorization", "Bearer s3cret")], ("a.b",)
    )
    text = request.decode()
    assert text.startswith("GET /v1/events HTTP/1.1\r\nHost: [::1]:9100\r\n")
    assert f"Sec-WebSocket-Key: {key.decode()}\r\n" in text
    assert "Authorization: Bearer s3cret\r\n" in text
    assert "Sec-WebSocket-Protocol: a.b\r\n" in text
    assert text.endswith("\r\n\r\n")


def test_a_wsproto_server_accepts_our_upgrade_and_we_read_its_answer() -> None:
    server = WSConnection(ConnectionType.SERVER)
    request, key = handshake_request("127.0.0.1:9", "/v1/requests", (), ("dynamo-shim.batch",))
    server.receive_data(request)
    (event,) = list(server.events())
    assert isinstance(event, Request)
    assert event.subprotocols == ["dynamo-shim.batch"]
    answer = server.send(AcceptConnection(subprotocol="dynamo-shim.batch"))
    frame = server.send(BytesMessage(data=b"hello"))
    reader = HandshakeReader(key, ("dynamo-shim.batch",))
    # The answer arrives in two pieces, the first frame right behind the head.
    assert reader.receive(answer[:10]) is None
    rest = reader.receive(answer[10:] + frame)
    assert rest == frame
    assert reader.subprotocol == "dynamo-shim.batch"


def test_a_refused_upgrade_reads_as_its_status_and_body() -> None:
    server = WSConnection(ConnectionType.SERVER)
    request, key = handshake_request("127.0.0.1:9", "/v1/events")
    server.receive_data(request)
    list(server.events())
    answer = server.send(
        RejectConnection(status_code=401, headers=[(b"content-length", b"12")], has_body=True)
    )
    answer += server.send(RejectData(data=b"unauthorized"))
    with pytest.raises(HandshakeRejected) as refused:
        HandshakeReader(key).receive(answer)
    assert refused.value.status == 401
    assert "unauthorized" in str(refused.value)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: wrong\r\n\r\n",
        b"not http at all\r\n\r\n",
        b"",
    ],
)
def test_a_bad_answer_is_a_handshake_error(answer: bytes) -> None:
    _request, key = handshake_request("127.0.0.1:9", "/")
    with pytest.raises(HandshakeError):
        HandshakeReader(key).receive(answer)


def test_a_subprotocol_we_did_not_offer_is_refused() -> None:
    # Offered "a" to a server (wsproto) that chose it; the reader was told only "b" was offered.
    server = WSConnection(ConnectionType.SERVER)
    request, key = handshake_request("127.0.0.1:9", "/", (), ("a",))
    server.receive_data(request)
    list(server.events())
    answer = server.send(AcceptConnection(subprotocol="a"))
    with pytest.raises(HandshakeError, match="not offered"):
        HandshakeReader(key, ("b",)).receive(answer)


# ----------------------------------------------------------------------------- frames


def test_whole_messages_and_control_frames_come_out_in_order() -> None:
    server, _ = server_after_handshake()
    data = server.send(BytesMessage(data=b"one")) + server.send(Ping(payload=b"p"))
    data += server.send(BytesMessage(data=b"x" * 70_000))
    frames = FrameReader(CAP).receive(data)
    assert frames == [(OP_BINARY, b"one"), (OP_PING, b"p"), (OP_BINARY, b"x" * 70_000)]


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=8), st.data())
def test_any_split_of_the_bytes_gives_the_same_messages(
    payloads: list[bytes], data: st.DataObject
) -> None:
    server, _ = server_after_handshake()
    stream = b"".join(server.send(BytesMessage(data=p)) for p in payloads)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    reader = FrameReader(CAP)
    got: list[bytes] = []
    start = 0
    for cut in [*cuts, len(stream)]:
        got.extend(payload for _, payload in reader.receive(stream[start:cut]))
        start = cut
    assert got == payloads
    assert reader.buffered == 0


def _cpu_to_read(reader: FrameReader, pieces: list[bytes]) -> tuple[float, list[bytes]]:
    started = time.process_time()
    got = [payload for piece in pieces for _, payload in reader.receive(piece)]
    return time.process_time() - started, got


def test_a_large_message_read_in_small_pieces_costs_about_what_it_costs_whole() -> None:
    # 16 MiB in 64 KiB reads: joining what is held at every read copies the message 128 times
    # over (about 2 GiB moved); held as pieces and joined once, it costs a small multiple of
    # one read of the whole. An order of magnitude apart, so the best of three suffices.
    message = os.urandom(16 << 20)
    frame = unmasked(OP_BINARY, message)
    pieces = [frame[start : start + (64 << 10)] for start in range(0, len(frame), 64 << 10)]
    ratios = []
    for _ in range(3):
        whole, got_whole = _cpu_to_read(FrameReader(32 << 20), [frame])
        pieced, got_pieced = _cpu_to_read(FrameReader(32 << 20), pieces)
        assert got_whole == got_pieced == [message]
        ratios.append(pieced / max(whole, 1e-4))
    assert min(ratios) < 10, ratios


def test_a_fragmented_message_is_returned_once_whole_with_a_ping_between() -> None:
    data = (
        unmasked(OP_BINARY, b"ab", fin=False)
        + unmasked(OP_PING, b"!")
        + unmasked(OP_CONTINUATION, b"cd", fin=False)
        + unmasked(OP_CONTINUATION, b"ef")
    )
    assert FrameReader(CAP).receive(data) == [(OP_PING, b"!"), (OP_BINARY, b"abcdef")]


def test_text_and_close_frames_are_reported_for_the_caller_to_act_on() -> None:
    frames = FrameReader(CAP).receive(
        unmasked(OP_TEXT, b"hi") + unmasked(OP_CLOSE, close_payload(1008, "dup"))
    )
    assert frames[0] == (OP_TEXT, b"hi")
    assert frames[1][0] == OP_CLOSE
    assert parse_close(frames[1][1]) == (1008, "dup")
    assert parse_close(b"") == (1005, "")


def test_a_long_close_reason_is_cut_by_bytes_at_a_character_boundary() -> None:
    reason = "é" * 200  # two bytes each: a cut at byte 123 would split one
    payload = close_payload(1011, reason)
    assert len(payload) <= 125  # a control frame's payload
    code, text = int.from_bytes(payload[:2], "big"), payload[2:].decode("utf-8")  # strict
    assert code == 1011
    assert reason.startswith(text)
    assert len(text) == 61


def test_the_size_cap_is_enforced_from_the_header_before_the_payload_arrives() -> None:
    reader = FrameReader(100)
    with pytest.raises(MessageTooBig):
        reader.receive(unmasked(OP_BINARY, b"x" * 101)[:4])  # the header alone


def test_fragments_count_together_against_the_cap() -> None:
    reader = FrameReader(100)
    reader.receive(unmasked(OP_BINARY, b"x" * 60, fin=False))
    with pytest.raises(MessageTooBig):
        reader.receive(unmasked(OP_CONTINUATION, b"x" * 60))


def test_continuation_headers_count_toward_the_cap() -> None:
    reader = FrameReader(100)
    reader.receive(unmasked(OP_BINARY, b"x" * 60, fin=False))
    # 60 + 38 bytes of payload and a 2-byte header: exactly the cap.
    assert reader.receive(unmasked(OP_CONTINUATION, b"x" * 38)) == [(OP_BINARY, b"x" * 98)]
    reader.receive(unmasked(OP_BINARY, b"x" * 60, fin=False))
    with pytest.raises(MessageTooBig):
        reader.receive(unmasked(OP_CONTINUATION, b"x" * 39))


def test_a_message_in_endless_empty_fragments_is_refused_within_its_frame_bound() -> None:
    # Each empty fragment is under every size cap and no control frame; before, each was held
    # (59 MB of them grew a frontend by 239 MB, the session never ended).
    # The bound is 1,024 frames and one per 256 bytes: their 2-byte headers count, so 1,031
    # frames in all pass and the next is refused from its header.
    reader = FrameReader(CAP)
    empty = unmasked(OP_CONTINUATION, b"", fin=False)
    assert reader.receive(unmasked(OP_BINARY, b"", fin=False) + empty * (MESSAGE_FRAMES + 6)) == []
    with pytest.raises(WebSocketProtocolError, match="more than 1032 frames in one message"):
        reader.receive(empty * 100_000)


def test_a_message_in_many_fragments_of_a_few_hundred_bytes_is_read_whole() -> None:
    # 1,024 frames and one more per 256 bytes: 4,096 fragments of 256 bytes fit, as does a
    # message of 1,024 empty fragments and a last one.
    piece = b"y" * 256
    data = unmasked(OP_BINARY, piece, fin=False)
    data += unmasked(OP_CONTINUATION, piece, fin=False) * 4094 + unmasked(OP_CONTINUATION, piece)
    assert FrameReader(CAP * 2).receive(data) == [(OP_BINARY, piece * 4096)]
    empty = unmasked(OP_BINARY, b"", fin=False) + unmasked(OP_CONTINUATION, b"", fin=False) * 1022
    assert FrameReader(CAP).receive(empty + unmasked(OP_CONTINUATION, b"z")) == [(OP_BINARY, b"z")]


def test_a_frame_dribbled_a_byte_per_read_is_held_at_about_its_size() -> None:
    # One object per read cost about 40 times the frame (a worker sending one byte per TCP
    # segment); one buffer grown in place costs a small multiple of it.
    size = 64 * 1024
    message = os.urandom(size)
    frame = unmasked(OP_BINARY, message)
    reader = FrameReader(CAP)
    pieces = [frame[at : at + 1] for at in range(len(frame))]
    got: list[tuple[int, bytes]] = []
    tracemalloc.start()
    try:
        for piece in pieces:
            got = reader.receive(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [(OP_BINARY, message)]
    assert peak < 8 * size, peak


def test_the_first_message_is_read_under_its_cap_and_nothing_after_it_until_the_limit() -> None:
    hello, batch = b"h" * 50, b"b" * 1000
    data = unmasked(OP_PING, b"p") + unmasked(OP_BINARY, hello) + unmasked(OP_BINARY, batch)
    reader = FrameReader(100, pause_after_first=True)
    # The ping before it is answered as ever; what follows the hello is held, unparsed (the
    # batch is over the first cap, and is no error before the caller sets the next one).
    assert reader.receive(data[:30]) == [(OP_PING, b"p")]
    assert reader.receive(data[30:]) == [(OP_BINARY, hello)]
    assert reader.receive(unmasked(OP_BINARY, b"later")) == []
    held = reader.limit(2000)
    assert reader.receive(held) == [(OP_BINARY, batch), (OP_BINARY, b"later")]
    # A first message over the first cap is refused from its header.
    with pytest.raises(MessageTooBig):
        FrameReader(100, pause_after_first=True).receive(unmasked(OP_BINARY, b"x" * 101)[:4])


@pytest.mark.parametrize(
    "frame",
    [
        bytes([0x82, 0x80 | 1]) + b"mask" + b"x",  # masked, from a server
        bytes([0xC2, 1]) + b"x",  # a reserved bit
        unmasked(OP_CONTINUATION, b"x"),  # nothing to continue
        unmasked(0x3, b"x"),  # an unknown opcode
        unmasked(OP_PING, b"x" * 126),  # a control frame too long
        unmasked(OP_PING, b"x", fin=False),  # a fragmented control frame
        unmasked(OP_BINARY, b"a", fin=False) + unmasked(OP_BINARY, b"b"),  # a message inside one
    ],
)
def test_frames_breaking_the_rules_are_protocol_errors(frame: bytes) -> None:
    with pytest.raises(WebSocketProtocolError):
        FrameReader(CAP).receive(frame)


@pytest.mark.parametrize("size", [0, 5, 125, 126, 65_535, 65_536, 200_000])
def test_our_masked_frames_read_back_through_wsproto(size: int) -> None:
    server, _ = server_after_handshake()
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    server.receive_data(encode_frame(OP_BINARY, payload) + encode_frame(OP_PONG, b"z"))
    events = list(server.events())
    message = events[0]
    assert isinstance(message, BytesMessage)
    assert message.data == payload
    server.receive_data(encode_frame(OP_CLOSE, close_payload(1000)))
    assert any(isinstance(event, CloseConnection) for event in server.events())


def test_masking_keys_are_fresh_for_every_frame_across_refills() -> None:
    # Keys come from one read of os.urandom per 1,024 frames: 3,000 frames cross two refills.
    keys = [encode_frame(OP_BINARY, b"abcd")[2:6] for _ in range(3000)]
    assert len(set(keys)) > 2990  # random 32-bit keys: a handful of repeats at most
    frame = encode_frame(OP_BINARY, b"payload!")
    key, masked = frame[2:6], frame[6:]
    assert bytes(byte ^ key[i % 4] for i, byte in enumerate(masked)) == b"payload!"
