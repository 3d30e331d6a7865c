"""How the HTTP server writes a response head: status lines and header lines, validated once.

Responses are written by hand: a status line, the handler's headers (each validated the first
time it is seen, then its wire line cached), and the framing lines the connection adds itself.
A handler's own ``Content-Length`` or ``Transfer-Encoding`` is dropped, since the connection
frames every body; an invalid name or value raises
:class:`~shim_common._http_exchange.InvalidResponse` before anything is written.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Final

from shim_common._http_exchange import InvalidResponse
from shim_common._http_parser import comma_tokens

__all__ = [
    "CHUNKED_LINE",
    "CLOSE_LINE",
    "CONTINUE",
    "LAST_CHUNK",
    "complete_response",
    "header_lines",
    "status_line",
]

_REASONS: Final[dict[int, bytes]] = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}
_TOKEN: Final = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
# A field value: visible characters and obs-text, single spaces or tabs inside, none around.
_FIELD_VALUE: Final = re.compile(rb"(?:[\x21-\x7e\x80-\xff](?:[ \t]*[\x21-\x7e\x80-\xff])*)?")
# The framing headers the connection writes itself; a handler's own are dropped.
_FRAMING: Final = frozenset({b"content-length", b"transfer-encoding"})
# Header lines already validated, by header, with whether each says ``Connection: close``;
# bounded (short lines only, cleared when full), as some values vary per response.
_LINES: dict[tuple[bytes, bytes], tuple[bytes, bool]] = {}
_MAX_CACHED_LINES: Final = 1024
_MAX_CACHED_LINE_BYTES: Final = 256


def status_line(status: int) -> bytes:
    """The status line of a final response, e.g. ``HTTP/1.1 200 OK``, with its CRLF.

    Raises:
        InvalidResponse: ``status`` is not a final three-digit status (200-999).
    """
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 200 <= status <= 999:
            raise InvalidResponse(f"status {status} is not a final three-digit status")
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))
        _STATUS_LINES[status] = line
    return line


def header_lines(headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """The handler's headers as wire lines (framing headers left out), and whether they say
    ``Connection: close``.

    Raises:
        InvalidResponse: a name that is not a token, or a value with control characters.
    """
    lines = b""
    says_close = False
    for header in headers:
        cached = _LINES.get(header)
        if cached is None:
            cached = _header_line(header)
            if len(cached[0]) <= _MAX_CACHED_LINE_BYTES:
                if len(_LINES) >= _MAX_CACHED_LINES:
                    _LINES.clear()
                _LINES[header] = cached
        lines += cached[0]
        says_close = says_close or cached[1]
    return lines, says_close


def complete_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A whole response kept open, head and ``Content-Length`` body, written ahead of time: what
    an answer given at once (:data:`~shim_common._http_exchange.AnswerAtOnce`) returns.

    Raises:
        InvalidResponse: an invalid status or header, or headers that say ``Connection: close``
            (an answer given at once keeps the connection; one that closes it is the handler's).
    """
    lines, says_close = header_lines(headers)
    if says_close:
        raise InvalidResponse("an answer given at once keeps the connection open")
    return status_line(status) + lines + b"content-length: %d\r\n\r\n" % len(body) + body


def _header_line(header: tuple[bytes, bytes]) -> tuple[bytes, bool]:
    name, value = header
    if _TOKEN.fullmatch(name) is None or _FIELD_VALUE.fullmatch(value) is None:
        raise InvalidResponse(f"invalid response header {header!r}")
    lower = name.lower()
    if lower in _FRAMING:
        return b"", False
    closes = lower == b"connection" and b"close" in comma_tokens(value)
    return lower + b": " + value + b"\r\n", closes


CHUNKED_LINE: Final = b"transfer-encoding: chunked\r\n"
CLOSE_LINE: Final = b"connection: close\r\n"
LAST_CHUNK: Final = b"0\r\n\r\n"
CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
