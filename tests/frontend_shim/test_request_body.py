"""What the frontend reads of a completion body, and how it refuses one."""

from __future__ import annotations

import pytest

from frontend_shim._request_body import BadRequest, parse_completion_body


def test_a_well_formed_body_comes_back_whole() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 3}'
    body = parse_completion_body(raw, "chat_completions")
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 3}


@pytest.mark.parametrize(
    ("raw", "endpoint", "says"),
    [
        (b"{", "completions", "not valid JSON"),
        (b"[1]", "completions", "JSON object"),
        (b'{"prompt": "x"}', "completions", "`model`"),
        (b'{"model": ""}', "completions", "`model`"),
        (b'{"model": "m", "stream": "yes"}', "completions", "`stream`"),
        (b'{"model": "m", "messages": []}', "chat_completions", "`messages`"),
    ],
)
def test_a_malformed_body_is_a_400_naming_what_is_wrong(
    raw: bytes, endpoint: str, says: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_completion_body(raw, endpoint)  # type: ignore[arg-type]
    assert refused.value.status == 400
    assert not refused.value.admin
    assert says in str(refused.value)
