"""Client text in messages: the one rule for quoting what a peer sent, and the one wording of a
404 and a 405, on both sides.

Rules:

1. A message quotes client input by a short prefix only: at most :data:`QUOTE_CHARS`
   characters, then ``... (N characters)``, however long the input (:func:`shorten` for text,
   :func:`quote` for any value, by its ``repr``). Converting the value can never fail: an
   integer too large for ``repr`` (Python refuses more than 4,300 digits) is described by its
   size.
2. Where the limit is in bytes (the reason of a websocket close frame: 123 bytes of UTF-8 after
   the code), the text is cut by bytes, at a character boundary (:func:`cut_utf8`).
3. A path nobody serves is answered 404 ``no such endpoint: <path>``; a method a path does not
   take, 405 ``<method> is not allowed on <path>`` (:func:`no_such_endpoint`,
   :func:`not_allowed`), both quoted by rule 1.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CLOSE_REASON_BYTES",
    "QUOTE_CHARS",
    "cut_utf8",
    "no_such_endpoint",
    "not_allowed",
    "quote",
    "shorten",
]

#: Characters of client input a message quotes (rule 1).
QUOTE_CHARS: Final = 64
#: Bytes a websocket close frame's reason may take: 125 of control-frame payload less the code.
CLOSE_REASON_BYTES: Final = 123
# Bits past which repr() of an int may refuse (4,300 digits are about 14,284 bits).
_MAX_SHOWN_BITS: Final = 14_000


def shorten(text: str) -> str:
    """Client text for a message: as it is, or cut to a short prefix (rule 1)."""
    if len(text) <= QUOTE_CHARS:
        return text
    return f"{text[:QUOTE_CHARS]}... ({len(text)} characters)"


def quote(value: object) -> str:
    """A client value for a message: its ``repr``, cut to a short prefix (rule 1)."""
    if isinstance(value, int) and value.bit_length() > _MAX_SHOWN_BITS:
        return f"an integer of {value.bit_length()} bits"
    return shorten(repr(value))


def cut_utf8(text: str, limit: int) -> str:
    """``text`` cut so that its UTF-8 takes at most ``limit`` bytes, at a character boundary
    (rule 2)."""
    encoded = text.encode("utf-8", "replace")
    if len(encoded) <= limit:
        return text
    # "ignore" drops the bytes of a character the cut split.
    return encoded[:limit].decode("utf-8", "ignore")


def no_such_endpoint(path: str) -> str:
    """The message of a 404 for ``path`` (rule 3)."""
    return f"no such endpoint: {shorten(path)}"


def not_allowed(method: str, path: str) -> str:
    """The message of a 405 for ``method`` on ``path`` (rule 3)."""
    return f"{shorten(method)} is not allowed on {shorten(path)}"
