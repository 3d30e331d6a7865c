"""The ``frontend-shim`` command line: precedence, validation, pass-through, special variables."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from frontend_shim._cli import (
    ADMISSION_CONTROL_ENV_WARNING,
    ADMISSION_CONTROL_FLAG_WARNING,
    CliError,
    parse_args,
)
from frontend_shim._config import admin_api_disabled, overload_status_from_env
from shim_common._cli import LogFilter
from worker_ingress._cli import LOCAL_WORKER_FLAGS

VARIABLES = [
    "DYN_HTTP_HOST",
    "DYN_HTTP_PORT",
    "DYN_WORKERS",
    "DYN_LOCAL_WORKERS",
    "DYN_ROUTER_MODE",
    "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD",
    "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD",
    "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC",
    "DYN_ROUTER_TRACK_OUTPUT_BLOCKS",
    "DYN_ROUTER_QUEUE_THRESHOLD",
    "DYN_MIGRATION_LIMIT",
    "DYN_BUSY_EXEMPT_PRIORITY",
    "DYN_HTTP_MAX_BODY_BYTES",
    "DYN_HTTP_OVERLOAD_STATUS_CODE",
    "DYN_DISABLE_FRONTEND_ADMIN_API",
    "DYN_LOG",
    "DYN_WORKER_TOKEN",
    "DYN_ADMIN_TOKEN",
    "DYN_TLS_CERT_PATH",
    "DYN_TLS_KEY_PATH",
    "DYN_TLS_CA_PATH",
    "DYN_EVENT_BUDGET",
]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*VARIABLES, "DYN_ADMISSION_CONTROL", "DYN_ENGINE_REQUEST_LIMIT"]:
        monkeypatch.delenv(name, raising=False)


def test_defaults() -> None:
    settings, _ = parse_args([])
    assert (settings.http_host, settings.http_port) == ("127.0.0.1", 8000)
    assert settings.workers == ()
    assert settings.local_workers == 0
    assert settings.router_mode == "round-robin"
    assert settings.thresholds.active_decode_blocks is None
    assert settings.thresholds.active_prefill_tokens is None
    assert settings.thresholds.active_prefill_tokens_frac is None
    assert settings.router_track_output_blocks is False
    assert settings.router_queue_threshold is None
    assert settings.migration_limit == 0
    assert settings.max_body_bytes == 16 * 1024 * 1024
    assert settings.overload_status == 529
    assert settings.admin_api_disabled is False


def test_workers_from_flags_and_comma_separated_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    settings, _ = parse_args(["--worker", "ws://a:1", "--worker", "ws://b:2"])
    assert settings.workers == ("ws://a:1", "ws://b:2")
    monkeypatch.setenv("DYN_WORKERS", "ws://c:3, ws://d:4")
    assert parse_args([])[0].workers == ("ws://c:3", "ws://d:4")
    assert parse_args(["--worker", "ws://e:5"])[0].workers == ("ws://e:5",)


def test_thousands_of_worker_flags_parse_in_order_and_quickly() -> None:
    urls = [f"ws://10.0.{i // 256}.{i % 256}:9100" for i in range(4096)]
    argv = ["--router-mode", "kv"]
    for index, url in enumerate(urls):
        argv += ["--worker", url] if index % 2 else [f"--worker={url}"]
    argv += ["--http-port", "0"]
    started = time.perf_counter()
    settings, _ = parse_args(argv)
    elapsed = time.perf_counter() - started
    assert settings.workers == tuple(urls)
    assert settings.router_mode == "kv"
    assert settings.http_port == 0
    # One flag each used to cost the parser minutes at this size; now it is one flag.
    assert elapsed < 10


def test_the_event_budget_from_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # Unset: measured (the budget follows the cost per message); given: fixed; 0: none.
    assert parse_args([])[0].event_budget is None
    assert parse_args(["--event-budget", "6000"])[0].event_budget == 6000
    assert parse_args(["--event-budget", "0"])[0].event_budget == 0
    monkeypatch.setenv("DYN_EVENT_BUDGET", "2500.5")
    assert parse_args([])[0].event_budget == 2500.5
    for bad in ("-1", "nan", "lots"):
        monkeypatch.setenv("DYN_EVENT_BUDGET", bad)
        with pytest.raises(CliError, match="DYN_EVENT_BUDGET"):
            parse_args([])


def test_command_line_beats_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD", "0.5")
    monkeypatch.setenv("DYN_ROUTER_MODE", "kv")
    settings, _ = parse_args([])
    assert settings.thresholds.active_decode_blocks == 0.5
    assert settings.router_mode == "kv"
    settings, _ = parse_args(["--active-decode-blocks-threshold", "0.9", "--router-mode", "random"])
    assert settings.thresholds.active_decode_blocks == 0.9
    assert settings.router_mode == "random"


def test_track_output_blocks_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_ROUTER_TRACK_OUTPUT_BLOCKS", "true")
    assert parse_args([])[0].router_track_output_blocks is True


def test_busy_exempt_priority_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([])[0].busy_exempt_priority is None
    monkeypatch.setenv("DYN_BUSY_EXEMPT_PRIORITY", "-5")
    assert parse_args([])[0].busy_exempt_priority == -5
    assert parse_args(["--busy-exempt-priority", "0"])[0].busy_exempt_priority == 0


def test_worker_flags_pass_through_to_local_workers() -> None:
    settings, _ = parse_args(
        ["--local-workers", "2", "--engine-request-limit", "4", "--speedup-ratio", "10"]
    )
    assert settings.local_workers == 2
    assert settings.local_worker_args == ("--engine-request-limit", "4", "--speedup-ratio", "10.0")


@pytest.mark.parametrize(
    ("argv", "environment", "named"),
    [
        (["--active-decode-blocks-threshold", "1.5"], {}, "--active-decode-blocks-threshold"),
        (["--active-decode-blocks-threshold", "-0.1"], {}, "--active-decode-blocks-threshold"),
        (["--active-decode-blocks-threshold", "nan"], {}, "--active-decode-blocks-threshold"),
        ([], {"DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD": "-1"}, "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD"),
        (["--active-prefill-tokens-threshold", "1.5"], {}, "--active-prefill-tokens-threshold"),
        (
            ["--active-prefill-tokens-threshold-frac", "inf"],
            {},
            "--active-prefill-tokens-threshold-frac",
        ),
        (["--router-mode", "fastest"], {}, "--router-mode"),
        (["--router-queue-threshold", "0"], {}, "--router-queue-threshold"),
        (["--migration-limit", "-1"], {}, "--migration-limit"),
        (["--busy-exempt-priority", "high"], {}, "--busy-exempt-priority"),
        ([], {"DYN_BUSY_EXEMPT_PRIORITY": "2000"}, "DYN_BUSY_EXEMPT_PRIORITY"),
        ([], {"DYN_HTTP_PORT": "http"}, "DYN_HTTP_PORT"),
        (["--local-workers", "-1"], {}, "--local-workers"),
        (["--worker", "http://a:1"], {}, "--worker"),
        (["--worker", "ws://127.0.0.1"], {}, "--worker"),
        (["--worker", "http://127.0.0.1:5"], {}, "--worker"),
        ([], {"DYN_WORKERS": "ws://a:1,ws://b"}, "--worker"),
        (["--max-body-bytes", "0"], {}, "--max-body-bytes"),
        (
            ["--local-workers", "1", "--engine-request-limit", "0"],
            {},
            "--engine-request-limit",
        ),
        (["--local-workers", "1"], {"DYN_ENGINE_REQUEST_LIMIT": "x"}, "DYN_ENGINE_REQUEST_LIMIT"),
        ([], {"DYN_LOG": "loud"}, "DYN_LOG"),
        (["--log-level", "frontend_shim=verbose"], {}, "--log-level"),
    ],
)
def test_invalid_values_name_the_flag_or_variable(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], environment: dict[str, str], named: str
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(CliError) as caught:
        parse_args(argv)
    assert named in str(caught.value)
    assert "\n" not in str(caught.value)


def test_log_level_reads_what_dynamo_users_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([])[1] == LogFilter(logging.INFO)
    monkeypatch.setenv("DYN_LOG", "warn")
    assert parse_args([])[1] == LogFilter(logging.WARNING)
    monkeypatch.setenv("DYN_LOG", "debug,frontend_shim::router=trace")
    assert parse_args([])[1] == LogFilter(logging.DEBUG, ("frontend_shim::router=trace",))
    assert parse_args(["--log-level", "Error"])[1] == LogFilter(logging.ERROR)


def test_admission_control_is_accepted_ignored_and_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        settings, _ = parse_args(["--admission-control", "token-capacity"])
    assert ADMISSION_CONTROL_FLAG_WARNING in caplog.text
    assert settings.thresholds.active_decode_blocks is None
    caplog.clear()
    monkeypatch.setenv("DYN_ADMISSION_CONTROL", "none")
    with caplog.at_level(logging.WARNING):
        parse_args([])
    assert ADMISSION_CONTROL_ENV_WARNING in caplog.text


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, 529),
        ("", 529),
        ("not-a-code", 529),
        ("99", 529),
        ("100", 529),
        ("199", 529),
        ("600", 529),
        ("1000", 529),
        ("200", 200),
        ("429", 429),
        ("503", 503),
        (" 529 ", 529),
        ("599", 599),
    ],
)
def test_overload_status_code_variable(raw: str | None, expected: int) -> None:
    environ = {} if raw is None else {"DYN_HTTP_OVERLOAD_STATUS_CODE": raw}
    assert overload_status_from_env(environ) == expected


@pytest.mark.parametrize(
    ("raw", "disabled"),
    [(None, False), ("", False), ("0", False), ("false", False), ("1", True), ("TRUE", True)],
)
def test_admin_api_variable(raw: str | None, disabled: bool) -> None:
    environ = {} if raw is None else {"DYN_DISABLE_FRONTEND_ADMIN_API": raw}
    assert admin_api_disabled(environ) is disabled


def test_invalid_value_exits_2_and_help_names_every_variable() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    result = subprocess.run(
        [sys.executable, "-m", "frontend_shim", "--router-mode", "fastest"],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "--router-mode" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = subprocess.run(
        [sys.executable, "-m", "frontend_shim"],
        env={**clean, "DYN_LOG": "loud"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert 'DYN_LOG: "loud"' in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = subprocess.run(
        [sys.executable, "-m", "frontend_shim", "--help"],
        env={**clean, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0
    for name in VARIABLES:
        assert name in result.stdout, name


def test_the_passed_flags_are_the_workers_own_declarations() -> None:
    # Declared once, by the worker: every flag it lists is taken, with the worker's own check.
    settings, _ = parse_args(["--local-workers", "1", "--max-num-seqs", "8", "--model", "m"])
    assert settings.local_worker_args == ("--model", "m", "--max-num-seqs", "8")
    for flag in LOCAL_WORKER_FLAGS:
        assert parse_args([f"--{flag.replace('_', '-')}", "1"])[0].local_worker_args
    with pytest.raises(CliError, match=r'Invalid value "0" for --num-gpu-blocks\. Must be >= 1'):
        parse_args(["--num-gpu-blocks", "0"])


def test_the_kv_router_flags_and_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    settings, _ = parse_args([])
    assert settings.router_kv_overlap_score_credit == 1.0
    assert settings.router_prefill_load_scale == 1.0
    assert settings.router_temperature == 0.0
    assert settings.router_kv_events
    assert settings.router_ttl_secs == 120.0
    assert settings.tokenizer is None
    argv = [
        "--router-kv-overlap-score-credit", "0.5",
        "--router-prefill-load-scale", "2",
        "--router-temperature", "0.25",
        "--router-ttl-secs", "30",
    ]  # fmt: skip
    settings, _ = parse_args(argv)
    assert settings.router_kv_overlap_score_credit == 0.5
    assert settings.router_prefill_load_scale == 2.0
    assert settings.router_temperature == 0.25
    assert settings.router_ttl_secs == 30.0
    for flag in ("--no-router-kv-events", "--no-kv-events"):
        assert not parse_args([flag])[0].router_kv_events
    assert parse_args(["--kv-events"])[0].router_kv_events
    monkeypatch.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    monkeypatch.setenv("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", "0")
    monkeypatch.setenv("DYN_ROUTER_TTL_SECS", "5")
    settings, _ = parse_args([])
    assert not settings.router_kv_events
    assert settings.router_kv_overlap_score_credit == 0.0
    assert settings.router_ttl_secs == 5.0
    # The command line wins over the environment.
    assert parse_args(["--router-kv-events"])[0].router_kv_events
    for bad in (
        ["--router-ttl-secs", "0"],
        ["--router-temperature", "-1"],
        ["--router-prefill-load-scale", "nan"],
    ):
        with pytest.raises(CliError, match=bad[0]):
            parse_args(bad)
    with pytest.raises(CliError, match="--tokenizer"):
        parse_args(["--tokenizer", "/nonexistent/tokenizer.json"])
