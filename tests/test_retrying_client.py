"""Tests of ``examples/retrying_client.py``: its backoff schedule, its retry loop against a
scripted transport, and the client once against a shedding server on loopback.
"""

from __future__ import annotations

import datetime
import json
import random
from collections.abc import Iterator, Mapping
from email.utils import format_datetime
from typing import Any

import pytest
import trio
from example_scripts import ScriptedServer, load_example
from hypothesis import given
from hypothesis import strategies as st

from shim_common._httpserver import serve_http

retrying = load_example("retrying_client")


# ----------------------------------------------------------------------------- backoff schedule


def test_backoff_doubles_with_jitter_and_stops_at_the_cap() -> None:
    policy = retrying.RetryPolicy(base_delay=0.5, max_delay=4.0)
    rng = random.Random(7)
    for retry in range(40):
        ceiling = min(4.0, 0.5 * 2**retry)
        delay = retrying.backoff_delay(retry, None, policy, rng)
        assert ceiling / 2 <= delay <= ceiling


def test_backoff_jitter_spreads_clients_rejected_together() -> None:
    policy = retrying.RetryPolicy(base_delay=1.0, max_delay=8.0)
    rng = random.Random(1)
    delays = {round(retrying.backoff_delay(3, None, policy, rng), 6) for _ in range(50)}
    assert len(delays) > 40


@given(
    retry=st.integers(min_value=0, max_value=10_000),
    retry_after=st.one_of(st.none(), st.floats(min_value=0, max_value=1e6)),
    base=st.floats(min_value=0.001, max_value=10),
    extra=st.floats(min_value=0, max_value=100),
    max_retry_after=st.floats(min_value=0, max_value=1000),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_backoff_honours_retry_after_up_to_its_bound(
    retry: int,
    retry_after: float | None,
    base: float,
    extra: float,
    max_retry_after: float,
    seed: int,
) -> None:
    policy = retrying.RetryPolicy(
        base_delay=base, max_delay=base + extra, max_retry_after=max_retry_after
    )
    delay = retrying.backoff_delay(retry, retry_after, policy, random.Random(seed))
    ceiling = min(policy.max_delay, base * 2.0 ** min(retry, 64))
    floor = 0.0 if retry_after is None else min(retry_after, max_retry_after)
    assert delay >= floor  # never sooner than the server asked (within the bound)
    assert delay >= ceiling / 2  # never zero
    assert delay <= max(ceiling, floor)  # the cap holds unless Retry-After asks for more


def test_retry_after_seconds_and_http_date() -> None:
    now = 1_700_000_000.0
    assert retrying.parse_retry_after("3") == 3.0
    assert retrying.parse_retry_after(" 12 ") == 12.0
    assert retrying.parse_retry_after(None) is None
    assert retrying.parse_retry_after("soon") is None
    assert retrying.parse_retry_after("-1") is None
    date = format_datetime(datetime.datetime.fromtimestamp(now + 30, tz=datetime.UTC), usegmt=True)
    assert retrying.parse_retry_after(date, now=now) == pytest.approx(30.0)
    assert retrying.parse_retry_after(date, now=now + 100) == 0.0


def test_policy_refuses_values_that_cannot_bound_anything() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        retrying.RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="base_delay"):
        retrying.RetryPolicy(base_delay=5.0, max_delay=1.0)


# ----------------------------------------------------------------------------- retry loop, faked


class _Scripted:
    """A transport that answers from a list: ``(status, headers)`` or an exception."""

    def __init__(self, answers: list[tuple[int, dict[str, str]] | OSError]) -> None:
        self.answers = answers
        self.calls = 0

    def __call__(self, url: str, body: bytes, timeout: float) -> tuple[int, Mapping[str, str], Any]:
        answer = self.answers[self.calls]
        self.calls += 1
        if isinstance(answer, OSError):
            raise answer
        status, headers = answer
        return status, headers, _Body(b'{"choices":[{"message":{"content":"hi"}}]}')


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.closed = False

    def read(self) -> bytes:
        return self.data

    def close(self) -> None:
        self.closed = True

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.data.splitlines(keepends=True))


def _send(transport: _Scripted, policy: Any, clock: Any = None, body: Any = None) -> Any:
    waited: list[float] = []
    answer = retrying.send_with_retries(
        "http://127.0.0.1:1/v1/chat/completions",
        body or {"model": "m", "messages": []},
        policy,
        transport=transport,
        sleep=waited.append,
        clock=clock or (lambda: 0.0),
        rng=random.Random(3),
    )
    assert waited == answer.delays
    return answer


def test_retries_529_and_waits_at_least_retry_after() -> None:
    transport = _Scripted(
        [(529, {"retry-after": "4"}), (503, {"retry-after": "1"}), (200, {}), (200, {})]
    )
    policy = retrying.RetryPolicy(base_delay=0.1, max_delay=0.2)
    answer = _send(transport, policy)
    assert answer.status == 200
    assert answer.attempts == 3
    assert answer.delays[0] >= 4.0
    assert answer.delays[1] >= 1.0
    assert json.loads(answer.body)["choices"][0]["message"]["content"] == "hi"


def test_final_statuses_are_not_retried() -> None:
    for status in (200, 400, 404, 500):
        transport = _Scripted([(status, {}), (200, {})])
        answer = _send(transport, retrying.RetryPolicy())
        assert (answer.status, answer.attempts, transport.calls) == (status, 1, 1)


def test_a_refused_connection_is_retried() -> None:
    transport = _Scripted([ConnectionRefusedError("refused"), (200, {})])
    answer = _send(transport, retrying.RetryPolicy(base_delay=0.1, max_delay=0.1))
    assert (answer.status, answer.attempts) == (200, 2)


def test_attempts_are_bounded() -> None:
    transport = _Scripted([(529, {"retry-after": "1"})] * 10)
    answer = _send(transport, retrying.RetryPolicy(max_attempts=3))
    assert (answer.status, answer.attempts, transport.calls, len(answer.delays)) == (529, 3, 3, 2)


def test_no_retry_starts_after_the_deadline() -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    class _Slow(_Scripted):
        def __call__(
            self, url: str, body: bytes, timeout: float
        ) -> tuple[int, Mapping[str, str], Any]:
            now[0] += 1.0  # each attempt takes a second
            return super().__call__(url, body, timeout)

    transport = _Slow([(529, {"retry-after": "2"})] * 50)
    answer = retrying.send_with_retries(
        "http://127.0.0.1:1/v1/completions",
        {"model": "m", "prompt": "hi"},
        retrying.RetryPolicy(max_attempts=50, base_delay=0.1, max_delay=0.1, deadline=10.0),
        transport=transport,
        sleep=sleep,
        clock=lambda: now[0],
        rng=random.Random(3),
    )
    assert answer.status == 529
    # Attempts start at t=0, 3, 6, 9 (each takes 1 s, then 2 s of Retry-After); a fifth would
    # start at 12, past the 10 s deadline, so the loop stops after the fourth.
    assert answer.attempts == 4
    assert answer.delays == [2.0, 2.0, 2.0]


def test_a_streamed_200_is_handed_back_unread() -> None:
    transport = _Scripted([(200, {})])
    answer = _send(transport, retrying.RetryPolicy(), body={"model": "m", "stream": True})
    assert answer.body == b""
    assert answer.stream_lines is not None
    assert list(answer.stream_lines) == ['{"choices":[{"message":{"content":"hi"}}]}']


def test_request_bodies() -> None:
    chat = retrying.build_body("chat", "m", "hello", 8, True)
    assert chat == {
        "model": "m",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "hello"}],
    }
    assert retrying.build_body("completions", "m", "hi", 4, False)["prompt"] == "hi"


# ----------------------------------------------------------------------------- against loopback


async def test_retrying_client_against_a_shedding_server() -> None:
    server = ScriptedServer(shed_first=2)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, server.handle, "127.0.0.1", 0)
            waited: list[float] = []
            answer = await trio.to_thread.run_sync(
                lambda: retrying.send_with_retries(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    retrying.build_body("chat", "m", "hello", 4, False),
                    retrying.RetryPolicy(base_delay=0.01, max_delay=0.02),
                    timeout=10.0,
                    sleep=waited.append,  # record instead of sleeping: the test stays fast
                )
            )
            nursery.cancel_scope.cancel()
    assert answer.status == 200
    assert answer.attempts == 3
    assert len(waited) == 2
    assert all(delay >= 1.0 for delay in waited)  # the server's Retry-After: 1
    assert json.loads(answer.body)["choices"][0]["message"]["content"] == "ok"
