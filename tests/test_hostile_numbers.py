"""Hostile numbers at every entry point: NaN, infinities, huge and negative floats, integers past
2**64 (or, where msgpack cannot carry those, past int64 up to its top).

- Both command lines, every numeric flag and its ``DYN_*`` variable (found from the commands'
  own declarations, so a flag added later is covered): refused with one line naming it; a real
  process exits 2 with that line.
- ``POST /busy_threshold`` on a real frontend: 400 naming the field, nothing changed, and the
  frontend still serves completions.
- Completion bodies on a real frontend: a number the worker's protocol cannot carry is a 400, any
  other gets a short 4xx or is served, never a 5xx; the frontend serves on.
- A ``subscribe`` on a real worker's event plane: closed with 1007, and the worker still serves.

The ranges each kind of number takes are those of ``shim_common/_numbers.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import select
import subprocess
import sys
import time
import typing
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import msgspec
import pytest
import trio
from cyclopts import App
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from frontend_shim import _cli as frontend_cli
from frontend_shim._connection import PlaneClosed, open_plane
from shim_common import wire
from shim_common._cli import CliError
from shim_common._numbers import PRIORITY
from worker_ingress import _cli as worker_cli

pytestmark = pytest.mark.e2e

TIMEOUT = 20.0
MODEL = "mock-model"
THRESHOLDS = (
    "active_decode_blocks_threshold",
    "active_prefill_tokens_threshold",
    "active_prefill_tokens_threshold_frac",
)
#: How a frontend's threshold field is named in the worker's subscribe.
WIRE_NAMES = dict(
    zip(
        THRESHOLDS,
        ("active_decode_blocks", "active_prefill_tokens", "active_prefill_tokens_frac"),
        strict=True,
    )
)

_SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 1e10, -1.0])
HOSTILE_FLOATS = st.one_of(
    _SPECIAL,
    st.floats(min_value=1e10, allow_nan=False),
    st.floats(max_value=-1e-3, allow_nan=False),
)
#: Integers that no kind takes, including ones that no fixed-width integer can hold.
HOSTILE_INTS = st.one_of(
    st.integers(min_value=2**64),
    st.integers(min_value=2**53 + 1, max_value=2**64),
    st.integers(max_value=-1),
)
#: What msgpack can carry of those: up to uint64's top, down to int64's bottom.
HOSTILE_WIRE_INTS = st.one_of(
    st.integers(min_value=2**53 + 1, max_value=2**64 - 1),
    st.integers(min_value=-(2**63), max_value=-1),
)
HOSTILE = st.one_of(HOSTILE_FLOATS, HOSTILE_INTS)
SLOW = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("DYN_")}
    env.update(extra)
    return env


# ----------------------------------------------------------------------------- command lines


def numeric_flags(app: App) -> list[tuple[str, tuple[str, ...]]]:
    """``(flag, variables)`` of every flag of ``app`` whose value is a number (bools aside)."""
    found: list[tuple[str, tuple[str, ...]]] = []
    for argument in app.assemble_argument_collection():
        hint = argument.hint
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if not args or not all(a in (int, float) for a in args):
            continue
        found.append((argument.names[0], tuple(argument.parameter.env_var or ())))
    return found


FRONTEND_FLAGS = numeric_flags(frontend_cli.app)
WORKER_FLAGS = numeric_flags(worker_cli.app)


def test_the_commands_have_numeric_flags_to_test() -> None:
    frac = ("--active-prefill-tokens-threshold-frac", ("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC",))
    assert frac in FRONTEND_FLAGS
    assert ("--router-queue-threshold", ("DYN_ROUTER_QUEUE_THRESHOLD",)) in FRONTEND_FLAGS
    assert ("--queue-timeout", ("DYN_REQUEST_QUEUE_TIMEOUT",)) in WORKER_FLAGS
    assert ("--num-gpu-blocks", ()) in FRONTEND_FLAGS  # passed on: the children read the variable


def _text(value: int | float) -> str:
    return repr(value) if isinstance(value, float) else str(value)


@contextlib.contextmanager
def environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _refused(parse: Any, argv: Sequence[str], named: str) -> None:
    with pytest.raises(CliError) as info:
        parse(argv)
    message = str(info.value)
    assert "\n" not in message
    assert named in message, message
    assert len(message) < 300, message  # a short prefix of the value, never all of it


ENTRIES = [("frontend", f) for f in FRONTEND_FLAGS] + [("worker", f) for f in WORKER_FLAGS]
#: Flags of a signed kind: a negative value inside the kind's range is a value, not an attack.
SIGNED_FLAGS = {"--busy-exempt-priority": PRIORITY, "--max-client-priority": PRIORITY}
PARSERS = {"frontend": frontend_cli.parse_args, "worker": worker_cli.parse_args}


@settings(max_examples=300, deadline=None)
@given(entry=st.sampled_from(ENTRIES), value=HOSTILE)
def test_every_numeric_flag_and_variable_refuses_hostile_numbers(
    entry: tuple[str, tuple[str, tuple[str, ...]]], value: int | float
) -> None:
    command, (name, variables) = entry
    signed = SIGNED_FLAGS.get(name)
    assume(signed is None or not signed.low <= value <= signed.high)
    parse = PARSERS[command]
    clean = {k: v for k, v in os.environ.items() if k.startswith("DYN_")}
    for key in clean:
        del os.environ[key]
    try:
        _refused(parse, [name, _text(value)], name)
        for variable in variables:
            with environment(variable, _text(value)):
                _refused(parse, [], variable)
    finally:
        os.environ.update(clean)


#: Numbers the commands read outside their numeric flags: variables without a flag, and the
#: numbers inside a flag's text.
OTHER_ENTRIES = [
    ("DYN_DYNAMO_REQUEST_QUEUE_LIMIT", None),
    ("DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT", None),
    (None, "--tenant-weights"),
]


@settings(max_examples=100, deadline=None)
@given(entry=st.sampled_from(OTHER_ENTRIES), value=HOSTILE)
def test_numbers_read_from_other_text_refuse_hostile_numbers(
    entry: tuple[str | None, str | None], value: int | float
) -> None:
    variable, flag = entry
    if flag is not None:
        _refused(worker_cli.parse_args, [flag, f"gold={_text(value)}"], flag)
    if variable is not None:
        with environment(variable, _text(value)):
            _refused(worker_cli.parse_args, [], variable)


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("frontend_shim", ["--active-prefill-tokens-threshold-frac", "1e308"]),
        ("frontend_shim", ["--active-prefill-tokens-threshold", "1" * 40]),
        ("frontend_shim", ["--router-queue-threshold", "1e308"]),
        ("worker_ingress", ["--queue-timeout", "nan"]),
        ("worker_ingress", ["--num-gpu-blocks", str(2**64 + 1)]),
    ],
)
def test_a_process_given_a_hostile_number_exits_2_with_one_line(
    command: str, argv: list[str]
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", command, *argv],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert argv[0] in lines[0]
    assert "ready" not in result.stdout


# ----------------------------------------------------------------------------- live processes


READY = re.compile(r"\w+=(\S+)")


@contextlib.contextmanager
def running(args: Sequence[str]) -> Iterator[tuple[subprocess.Popen[bytes], list[str]]]:
    """A process until the block ends, and the URLs of its ready line."""
    process = subprocess.Popen(
        list(args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=clean_env()
    )
    try:
        assert process.stdout is not None
        line = b""
        for _ in range(200):
            readable, _, _ = select.select([process.stdout], [], [], 0.1)
            if readable:
                chunk = os.read(process.stdout.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
                if line.endswith(b"\n"):
                    break
        assert b" ready " in line, line
        yield process, READY.findall(line.decode())
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)
        if process.poll() is None:  # did not drain in time
            process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


class Fleet(typing.NamedTuple):
    worker: subprocess.Popen[bytes]
    ws_url: str
    frontend: subprocess.Popen[bytes]
    http_url: str


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """A real worker (the mocker) and a real frontend routing to it."""
    worker_cmd = [sys.executable, "-m", "worker_ingress", "--port", "0", "--system-port", "0"]
    with running([*worker_cmd, "--speedup-ratio", "100"]) as (worker, worker_urls):
        ws_url = worker_urls[0]
        frontend_cmd = [sys.executable, "-m", "frontend_shim", "--http-port", "0"]
        with running([*frontend_cmd, "--worker", ws_url]) as (frontend, frontend_urls):
            http_url = frontend_urls[0]
            with httpx.Client(base_url=http_url, timeout=TIMEOUT) as client:
                for _ in range(200):  # until the frontend has the worker
                    if client.get("/v1/models").json()["data"]:
                        break
                    time.sleep(0.05)
            yield Fleet(worker, ws_url, frontend, http_url)


def assert_serves(fleet: Fleet) -> None:
    """Both processes alive, and a completion through both answered."""
    assert fleet.worker.poll() is None
    assert fleet.frontend.poll() is None
    body = {"model": MODEL, "prompt": "one two", "max_tokens": 2}
    with httpx.Client(base_url=fleet.http_url, timeout=TIMEOUT) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@SLOW
@given(field=st.sampled_from(THRESHOLDS), value=HOSTILE)
def test_busy_threshold_refuses_hostile_numbers_with_400(
    fleet: Fleet, field: str, value: int | float
) -> None:
    # json.dumps writes NaN and Infinity as bare words (not JSON): a 400 as well. A float for
    # the integer threshold is a wrong type, which the API answers 422.
    raw = json.dumps({"model": MODEL, field: value})
    wrong_type = field == THRESHOLDS[1] and isinstance(value, float) and math.isfinite(value)
    with httpx.Client(base_url=fleet.http_url, timeout=TIMEOUT) as client:
        response = client.post(
            "/busy_threshold", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == (422 if wrong_type else 400), response.text
        assert len(response.text) < 400
        if math.isfinite(value) and abs(value) < 2**63:
            # (Past int64, the body decoder refuses the whole body before any field is read.)
            assert field in response.json()["error"]
        after = client.get("/busy_threshold")
    assert after.status_code == 200
    assert after.json()["thresholds"][0][field] is None  # nothing was set


def test_the_frontend_still_serves_after_hostile_thresholds(fleet: Fleet) -> None:
    for value in (1e308, 10**40, -1):
        for field in THRESHOLDS:
            raw = json.dumps({"model": MODEL, field: value})
            response = httpx.post(f"{fleet.http_url}/busy_threshold", content=raw, timeout=TIMEOUT)
            assert response.status_code in (400, 422), response.text
    assert_serves(fleet)


#: Completion fields a client may fill with any number; none of them lengthens the generation.
COMPLETION_FIELDS = ("seed", "temperature", "top_p", "n", "frequency_penalty", "logprobs")


@SLOW
@given(
    field=st.sampled_from(COMPLETION_FIELDS),
    value=st.one_of(HOSTILE, st.integers(min_value=2**63)),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
)
def test_completion_bodies_with_hostile_numbers_get_a_short_4xx_or_are_served(
    fleet: Fleet, field: str, value: int | float, path: str
) -> None:
    body = {"model": MODEL, "prompt": "one", "messages": [{"role": "user", "content": "one"}]}
    raw = json.dumps({**body, "max_tokens": 1, field: value})
    with httpx.Client(base_url=fleet.http_url, timeout=TIMEOUT) as client:
        response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert len(response.text) < 400
        error = response.json()["error"]
        assert error["code"] == response.status_code
        assert error["type"] == "invalid_request_error"
    carried = (
        -(2**63) <= value < 2**63 if isinstance(value, int) else math.isfinite(value)
    )  # NaN and the infinities are not JSON either
    if not carried:
        assert response.status_code == 400, response.text


def test_the_frontend_still_serves_after_hostile_completion_bodies(fleet: Fleet) -> None:
    for value in (2**64 + 1, 10**40, -(2**70)):
        raw = json.dumps({"model": MODEL, "prompt": "one", "max_tokens": value})
        response = httpx.post(f"{fleet.http_url}/v1/completions", content=raw, timeout=TIMEOUT)
        assert response.status_code == 400, response.text
    deep = b'{"model": "mock-model", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    response = httpx.post(f"{fleet.http_url}/v1/completions", content=deep, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert_serves(fleet)


async def _subscribe(ws_url: str, thresholds: dict[str, Any]) -> int | None:
    """Send one subscribe; the close code the worker answers with (``None``: it kept serving).

    The frontend's own plane client is the peer (a real websocket client of the event plane).
    """
    address = urllib.parse.urlsplit(ws_url)
    assert address.hostname is not None
    assert address.port is not None
    with trio.fail_after(TIMEOUT):
        connection = await open_plane(
            host=address.hostname,
            port=address.port,
            path=wire.EVENTS_PATH,
            max_message_bytes=wire.MAX_MESSAGE_BYTES,
        )
        try:
            messages: list[bytes] = []
            for _ in range(100):
                messages = await connection.messages()
                if messages:
                    break
            assert isinstance(wire.decode_event_message(messages[0]), wire.Hello)
            message = {"type": "subscribe", "thresholds": thresholds}
            await connection.send_message(msgspec.msgpack.encode(message))
            for _ in range(1000):  # event batches may come before the close
                await connection.messages()
        except PlaneClosed as closed:
            return closed.code
        finally:
            await connection.aclose(close_timeout=1.0)
    return None


@SLOW
@given(
    field=st.sampled_from(list(WIRE_NAMES.values())),
    value=st.one_of(HOSTILE_FLOATS, HOSTILE_WIRE_INTS),
)
def test_a_subscribe_with_hostile_numbers_is_closed_with_1007(
    fleet: Fleet, field: str, value: int | float
) -> None:
    assert trio.run(_subscribe, fleet.ws_url, {field: value}) == wire.CLOSE_UNDECODABLE
    assert fleet.worker.poll() is None


def test_the_worker_still_serves_after_hostile_subscribes(fleet: Fleet) -> None:
    for value in (math.nan, math.inf, 1e308):
        code = trio.run(_subscribe, fleet.ws_url, {"active_prefill_tokens_frac": value})
        assert code == wire.CLOSE_UNDECODABLE
    assert_serves(fleet)
