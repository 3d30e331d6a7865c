"""An OpenAI-style client that retries overload answers the way the frontend asks it to.

Standard library only, so it can be copied into any project. Run it against a frontend::

    python examples/retrying_client.py --url http://127.0.0.1:8000 --prompt "hello there"
    python examples/retrying_client.py --url http://127.0.0.1:8000 --stream --max-tokens 32

Retry rules (what :func:`backoff_delay` and :func:`send_with_retries` implement):

1. Only answers that mean "not now" are retried: the overload status (529 by default, or 429/503
   when the frontend runs with ``DYN_HTTP_OVERLOAD_STATUS_CODE``), and 503 (no worker up, or a
   worker draining). A refused or reset connection before any answer is retried too, because the
   request never reached a worker. Anything else (200, 400, 404, 500...) is final.
2. The n-th retry (n = 0, 1, ...) waits a delay drawn uniformly from ``[c / 2, c]`` with
   ``c = min(max_delay, base_delay * 2**n)``: capped exponential backoff with "equal jitter", so a
   crowd of clients rejected together does not come back together, and no delay is ever zero.
3. ``Retry-After`` (whole seconds, or an HTTP date) is a floor: the client never comes back sooner
   than the server asked. It is not cut by ``max_delay`` (the server knows its backlog better),
   but it is bounded by ``max_retry_after`` so a wrong header cannot park the client for hours.
4. Everything is bounded: at most ``max_attempts`` attempts, and no retry is started that would
   begin after ``deadline`` seconds from the first attempt; the last answer is then returned.

A 529 arrives before any byte of the completion, also with ``"stream": true`` (the frontend sends
the status line only once a worker started the request), so retrying never duplicates output.
"""

from __future__ import annotations

import argparse
import dataclasses
import email.utils
import json
import math
import random
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

__all__ = [
    "DEFAULT_RETRY_STATUSES",
    "Answer",
    "RetryPolicy",
    "backoff_delay",
    "build_body",
    "main",
    "parse_retry_after",
    "send_with_retries",
]

#: Statuses that mean "try again later": overload (529, or 429 when so configured) and 503.
DEFAULT_RETRY_STATUSES: Final = frozenset({429, 503, 529})


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry.

    Attributes:
        max_attempts: Attempts in total, the first included (>= 1).
        base_delay: Ceiling of the first backoff delay, in seconds (> 0).
        max_delay: Largest ceiling of the exponential part, in seconds (>= base_delay).
        max_retry_after: Largest ``Retry-After`` honoured, in seconds; larger values are cut.
        deadline: Seconds after the first attempt after which no retry starts.
        retry_statuses: HTTP statuses that are retried.
    """

    max_attempts: int = 6
    base_delay: float = 0.5
    max_delay: float = 30.0
    max_retry_after: float = 120.0
    deadline: float = 300.0
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.base_delay <= self.max_delay:
            raise ValueError("need 0 < base_delay <= max_delay")
        if not self.max_retry_after >= 0 or not self.deadline >= 0:
            raise ValueError("max_retry_after and deadline must be >= 0")


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Read a ``Retry-After`` header: delay-seconds or an HTTP date.

    Args:
        value: The header's value, or ``None`` when absent.
        now: Current wall-clock time (seconds since the epoch) for the date form; default
            ``time.time()``.

    Returns:
        Seconds to wait (>= 0), or ``None`` when absent or unreadable.
    """
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(int(text))
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; a naive result means it said so implicitly
        return None
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


def backoff_delay(
    retry: int,
    retry_after: float | None,
    policy: RetryPolicy,
    rng: random.Random,
) -> float:
    """The delay before retry number ``retry`` (0 for the first retry).

    Args:
        retry: How many retries were made before this one.
        retry_after: The server's ``Retry-After`` in seconds, or ``None``.
        policy: The retry policy.
        rng: Source of the jitter.

    Returns:
        Seconds to wait: uniform in ``[c / 2, c]`` with
        ``c = min(max_delay, base_delay * 2**retry)``, raised to ``Retry-After`` (itself cut
        at ``max_retry_after``) when the server sent one.
    """
    # min() on the exponent keeps 2**retry finite however long the client keeps trying.
    ceiling = min(policy.max_delay, policy.base_delay * 2.0 ** min(retry, 64))
    delay = rng.uniform(ceiling / 2, ceiling)
    if retry_after is not None:
        delay = max(delay, min(retry_after, policy.max_retry_after))
    return delay


@dataclasses.dataclass
class Answer:
    """The final answer of :func:`send_with_retries`.

    Attributes:
        status: HTTP status, or 0 when no answer came (connection refused on the last attempt).
        headers: Response headers (lower-case names).
        body: The whole body for a non-streamed answer; empty when ``stream_lines`` is set.
        attempts: Attempts made.
        delays: Seconds waited before each retry, in order.
        stream_lines: For a streamed 200, an iterator over the SSE lines as they arrive.
        error: The connection error of the last attempt, when ``status`` is 0.
    """

    status: int
    headers: dict[str, str]
    body: bytes
    attempts: int
    delays: list[float]
    stream_lines: Iterator[str] | None = None
    error: str | None = None


#: ``(url, body, timeout) -> (status, headers, response)``; the default uses urllib.
Transport = Callable[[str, bytes, float], tuple[int, Mapping[str, str], Any]]


def urllib_transport(url: str, body: bytes, timeout: float) -> tuple[int, Mapping[str, str], Any]:
    """POST ``body`` as JSON with urllib; any HTTP status is returned, not raised.

    Raises:
        OSError: the connection failed before an answer (refused, reset, timed out).
    """
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as error:  # a status >= 400 is an answer, not a failure
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error
    return response.status, {k.lower(): v for k, v in response.headers.items()}, response


def send_with_retries(
    url: str,
    body: Mapping[str, Any],
    policy: RetryPolicy,
    *,
    timeout: float = 600.0,
    transport: Transport = urllib_transport,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    log: Callable[[str], None] = lambda _line: None,
) -> Answer:
    """POST ``body`` to ``url``, retrying "not now" answers under ``policy``.

    Args:
        url: Full endpoint URL, e.g. ``http://127.0.0.1:8000/v1/chat/completions``.
        body: The OpenAI request body.
        policy: Attempts, delays and deadline.
        timeout: Socket timeout of one attempt, in seconds.
        transport: Sends one attempt (injected by tests).
        sleep: Waits between attempts (injected by tests).
        clock: Monotonic seconds, for the deadline.
        rng: Jitter source; a fresh ``random.Random()`` when omitted.
        log: Receives one line per retry.

    Returns:
        The last answer. A streamed 200 is returned unread, its lines in ``stream_lines``.
    """
    rng = rng if rng is not None else random.Random()
    payload = json.dumps(body).encode()
    streamed = body.get("stream") is True
    started = clock()
    delays: list[float] = []
    attempt = 0
    while True:
        attempt += 1
        error: str | None = None
        try:
            status, headers, response = transport(url, payload, timeout)
        except OSError as exc:
            status, headers, response, error = 0, {}, None, f"{type(exc).__name__}: {exc}"
        retryable = status == 0 or status in policy.retry_statuses
        if not retryable:
            if streamed and status == 200:
                return Answer(status, dict(headers), b"", attempt, delays, _sse_lines(response))
            return Answer(status, dict(headers), _read_all(response), attempt, delays)
        # Read the short error body so that keep-alive connections are left clean.
        answer_body = _read_all(response)
        retry_after = parse_retry_after(headers.get("retry-after"))
        delay = backoff_delay(len(delays), retry_after, policy, rng)
        out_of_time = clock() + delay - started > policy.deadline
        if attempt >= policy.max_attempts or out_of_time:
            return Answer(status, dict(headers), answer_body, attempt, delays, error=error)
        log(
            f"attempt {attempt}: {error or status}"
            f" (Retry-After {headers.get('retry-after', '-')}); retrying in {delay:.2f} s"
        )
        delays.append(delay)
        sleep(delay)


def _read_all(response: Any) -> bytes:
    if response is None:
        return b""
    try:
        data: bytes = response.read()
    finally:
        response.close()
    return data


def _sse_lines(response: Any) -> Iterator[str]:
    try:
        for raw in response:
            yield raw.decode("utf-8").rstrip("\r\n")
    finally:
        response.close()


def build_body(
    endpoint: str, model: str, prompt: str, max_tokens: int, stream: bool
) -> dict[str, Any]:
    """The OpenAI body for ``chat`` (``/v1/chat/completions``) or ``completions``."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _text_of(choice: Mapping[str, Any]) -> str:
    """The text of a choice, streamed (``delta``) or whole (``message``), chat or completion."""
    for key in ("delta", "message"):
        part = choice.get(key)
        if isinstance(part, Mapping):
            content = part.get("content")
            return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _print_stream(lines: Iterator[str]) -> bool:
    """Print the deltas of an SSE stream; ``True`` when it ended with ``[DONE]``."""
    for line in lines:
        if not line.startswith("data: "):
            if line.startswith("event: error"):
                print("\n[stream failed]", file=sys.stderr)
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            print()
            return True
        event = json.loads(data)
        for choice in event.get("choices") or ():
            print(_text_of(choice), end="", flush=True)
        if "error" in event:
            print(f"\n[error] {event['error']}", file=sys.stderr)
    print()
    return False


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="frontend base URL")
    parser.add_argument("--model", default="mock-model")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--prompt", default="Say something short about load shedding.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stream", action="store_true", help="ask for server-sent events")
    parser.add_argument("--max-attempts", type=int, default=RetryPolicy.max_attempts)
    parser.add_argument("--base-delay", type=float, default=RetryPolicy.base_delay)
    parser.add_argument("--max-delay", type=float, default=RetryPolicy.max_delay)
    parser.add_argument("--max-retry-after", type=float, default=RetryPolicy.max_retry_after)
    parser.add_argument("--deadline", type=float, default=RetryPolicy.deadline)
    parser.add_argument(
        "--retry-status",
        default=",".join(str(s) for s in sorted(DEFAULT_RETRY_STATUSES)),
        help="comma-separated statuses to retry",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per attempt")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Send one request with retries and print its text.

    Returns:
        The exit status: 0 for a 200, 1 otherwise.
    """
    args = _parse_args(argv)
    try:
        policy = RetryPolicy(
            max_attempts=args.max_attempts,
            base_delay=args.base_delay,
            max_delay=args.max_delay,
            max_retry_after=args.max_retry_after,
            deadline=args.deadline,
            retry_statuses=frozenset(int(s) for s in args.retry_status.split(",") if s.strip()),
        )
    except ValueError as error:
        print(f"retrying_client: {error}", file=sys.stderr)
        return 2
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    body = build_body(args.endpoint, args.model, args.prompt, args.max_tokens, args.stream)
    answer = send_with_retries(
        args.url.rstrip("/") + path,
        body,
        policy,
        timeout=args.timeout,
        log=lambda line: print(line, file=sys.stderr),
    )
    waited = math.fsum(answer.delays)
    print(
        f"status {answer.status or answer.error} after {answer.attempts} attempt(s),"
        f" {waited:.2f} s of backoff",
        file=sys.stderr,
    )
    if answer.status != 200:
        print(answer.body.decode("utf-8", "replace"), file=sys.stderr)
        return 1
    if answer.stream_lines is not None:
        return 0 if _print_stream(answer.stream_lines) else 1
    result = json.loads(answer.body)
    for choice in result.get("choices") or ():
        print(_text_of(choice))
    return 0


if __name__ == "__main__":
    sys.exit(main())
