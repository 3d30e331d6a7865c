"""The one quoting rule for client text, and the one wording of 404 and 405
(:mod:`shim_common._client_text`)."""

from __future__ import annotations

from shim_common._client_text import (
    CLOSE_REASON_BYTES,
    QUOTE_CHARS,
    cut_utf8,
    no_such_endpoint,
    not_allowed,
    quote,
    shorten,
)
from shim_common._http_exchange import openai_error_type


def test_text_is_quoted_whole_up_to_the_limit_then_by_a_prefix_and_its_length() -> None:
    assert shorten("x" * QUOTE_CHARS) == "x" * QUOTE_CHARS
    assert shorten("x" * 16_000) == "x" * QUOTE_CHARS + "... (16000 characters)"
    assert quote("a'b") == repr("a'b")
    assert quote(10**10_000) == "an integer of 33220 bits"  # repr() would refuse it


def test_a_byte_limit_cuts_by_bytes_at_a_character_boundary() -> None:
    reason = "undecodable message: " + "é" * 200  # two bytes each
    cut = cut_utf8(reason, CLOSE_REASON_BYTES)
    assert len(cut.encode()) <= CLOSE_REASON_BYTES
    assert len(cut.encode()) >= CLOSE_REASON_BYTES - 1  # no more than the split character lost
    assert reason.startswith(cut)
    assert cut_utf8("short", CLOSE_REASON_BYTES) == "short"


def test_404_and_405_have_one_wording_and_quote_the_path() -> None:
    assert no_such_endpoint("/x") == "no such endpoint: /x"
    assert not_allowed("PUT", "/live") == "PUT is not allowed on /live"
    assert len(no_such_endpoint("/" + "p" * 16_000)) < 120


def test_one_map_from_status_to_the_openai_error_type() -> None:
    assert [openai_error_type(s) for s in (400, 404, 405, 413, 500, 503)] == [
        "invalid_request_error",
        "not_found_error",
        "invalid_request_error",
        "invalid_request_error",
        "server_error",
        "server_error",
    ]
