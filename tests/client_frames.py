"""What a websocket client wrote, unmasked: for tests that play the worker's side by hand."""

from __future__ import annotations


def client_frames(data: bytes | bytearray) -> list[tuple[int, bytes]]:
    """The ``(opcode, payload)`` of each whole frame a client wrote (masked, payloads under 126
    bytes, as the frontend's control frames are), in order; a trailing partial frame is left out."""
    frames = []
    position = 0
    while position + 6 <= len(data):
        length = data[position + 1] & 0x7F
        if position + 6 + length > len(data):
            break
        mask = data[position + 2 : position + 6]
        payload = data[position + 6 : position + 6 + length]
        frames.append(
            (data[position] & 0x0F, bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        )
        position += 6 + length
    return frames
