"""The ``worker-ingress`` command line: precedence, validation, help."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from shim_common._cli import LOG_OFF, LogFilter, apply_log_filter, parse_log_filter
from worker_ingress._admission import AdmissionGate
from worker_ingress._cli import LOCAL_WORKER_FLAGS, CliError, parse_args
from worker_ingress._config import UNLIMITED_ENGINE_SLOTS, UNLIMITED_QUEUE_LIMIT

ALL_VARIABLES = [
    "DYN_WORKER_HOST",
    "DYN_WORKER_PORT",
    "DYN_SYSTEM_PORT",
    "DYN_MODEL_NAME",
    "DYN_WORKER_ID",
    "DYN_ENGINE",
    "DYN_UPSTREAM_URL",
    "DYN_ENGINE_REQUEST_LIMIT",
    "DYN_DYNAMO_REQUEST_QUEUE_LIMIT",
    "DYN_REQUEST_QUEUE_TIMEOUT",
    "DYN_GRACEFUL_SHUTDOWN_TIMEOUT",
    "DYN_HEARTBEAT_INTERVAL",
    "DYN_MOCKER_NUM_GPU_BLOCKS",
    "DYN_MOCKER_BLOCK_SIZE",
    "DYN_MOCKER_MAX_NUM_SEQS",
    "DYN_MOCKER_MAX_NUM_BATCHED_TOKENS",
    "DYN_MOCKER_DATA_PARALLEL_SIZE",
    "DYN_MOCKER_SPEEDUP_RATIO",
    "DYN_ENABLE_PREFIX_CACHING",
    "DYN_TOKENIZER",
    "DYN_LOG",
    "DYN_WORKER_TOKEN",
    "DYN_TLS_CERT_PATH",
    "DYN_TLS_KEY_PATH",
    "DYN_STOP_ON_STDIN_EOF",
    "DYN_BACKEND_ADMISSION_ENGINE_REQUEST_LIMIT",
    "DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT",
    "DYN_BACKEND_ADMISSION_ENGINE_REQUEST_WAITING_LIMIT",
    "DYN_TENANT_WEIGHTS",
    "DYN_TENANT_METRICS_LIMIT",
    "DYN_MAX_TRACKED_TENANTS",
]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ALL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_defaults() -> None:
    settings, log_level = parse_args([])
    assert settings.host == "127.0.0.1"
    assert (settings.port, settings.system_port) == (9100, 9101)
    assert settings.model == "mock-model"
    assert settings.engine == "mocker"
    assert settings.engine_request_limit is None
    assert (settings.engine_slots, settings.queue_limit) == (
        UNLIMITED_ENGINE_SLOTS,
        UNLIMITED_QUEUE_LIMIT,
    )
    assert settings.queue_timeout is None
    assert settings.drain_grace == 30.0
    assert settings.mocker.num_gpu_blocks == 16384
    assert settings.mocker.block_size == 16
    assert settings.mocker.max_num_seqs == 256
    assert settings.mocker.max_num_batched_tokens == 8192
    assert settings.mocker.data_parallel_size == 1
    assert settings.mocker.speedup_ratio == 1.0
    assert log_level == LogFilter(logging.INFO)


def test_worker_id_is_random_but_given_one_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    first, _ = parse_args([])
    second, _ = parse_args([])
    assert first.worker_id != second.worker_id
    monkeypatch.setenv("DYN_WORKER_ID", "w-7")
    assert parse_args([])[0].worker_id == "w-7"


def test_command_line_beats_environment_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_ENGINE_REQUEST_LIMIT", "16")
    assert parse_args([])[0].engine_request_limit == 16
    settings, _ = parse_args(["--engine-request-limit", "4"])
    # The value given on the command line is the one the gate uses.
    assert settings.engine_request_limit == 4
    assert settings.engine_slots == 4
    assert settings.queue_limit == 16


def test_ttft_objective_and_its_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    settings, _ = parse_args([])
    assert (settings.ttft_slo, settings.adaptive_min_limit) == (None, 1)
    settings, _ = parse_args(["--engine-request-limit", "8", "--ttft-slo", "0.25"])
    assert settings.ttft_slo == 0.25
    monkeypatch.setenv("DYN_TTFT_SLO", "0.5")
    monkeypatch.setenv("DYN_ADAPTIVE_MIN_LIMIT", "3")
    settings, _ = parse_args(["--engine-request-limit", "8"])
    assert (settings.ttft_slo, settings.adaptive_min_limit) == (0.5, 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ttft-slo", "0.3"], "--ttft-slo .*needs --engine-request-limit"),
        (["--engine-request-limit", "4", "--ttft-slo", "0"], "--ttft-slo"),
        (["--engine-request-limit", "4", "--ttft-slo", "nan"], "--ttft-slo"),
        (["--engine-request-limit", "4", "--ttft-slo", "soon"], "--ttft-slo"),
        (["--engine-request-limit", "4", "--adaptive-min-limit", "0"], "--adaptive-min-limit"),
        (["--engine-request-limit", "4", "--adaptive-min-limit", "5"], "Must be <= .*4"),
    ],
)
def test_ttft_objective_bad_values(argv: list[str], message: str) -> None:
    with pytest.raises(CliError, match=message):
        parse_args(argv)


def test_queue_limit_is_read_from_the_environment_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_DYNAMO_REQUEST_QUEUE_LIMIT", "5")
    settings, _ = parse_args(["--engine-request-limit", "2"])
    assert (settings.engine_slots, settings.queue_limit) == (2, 5)
    # Without N the queue limit is not used: the gate is effectively unlimited.
    settings, _ = parse_args([])
    assert settings.queue_limit == UNLIMITED_QUEUE_LIMIT
    with pytest.raises(CliError, match="Unknown option"):
        parse_args(["--dynamo-request-queue-limit", "5"])


def test_dynamo_1_7_spellings_and_their_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_ENGINE_REQUEST_LIMIT", "16")
    monkeypatch.setenv("DYN_DYNAMO_REQUEST_QUEUE_LIMIT", "9")
    assert parse_args([])[0].engine_request_limit == 16
    monkeypatch.setenv("DYN_BACKEND_ADMISSION_ENGINE_REQUEST_LIMIT", "3")
    monkeypatch.setenv("DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT", "4")
    settings, _ = parse_args([])
    # Dynamo 1.7's names win over the older ones; the flag wins over both.
    assert (settings.engine_slots, settings.queue_limit) == (3, 4)
    assert parse_args(["--engine-request-limit", "5"])[0].engine_slots == 5


def test_waiting_limit_and_tenant_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_BACKEND_ADMISSION_ENGINE_REQUEST_WAITING_LIMIT", "2")
    monkeypatch.setenv("DYN_TENANT_WEIGHTS", "gold=4, free=0.5")
    settings, _ = parse_args(["--tenant-metrics-limit", "7", "--max-tracked-tenants", "9"])
    assert settings.max_tracked_tenants == 9
    assert AdmissionGate.from_settings(settings).state.policy.max_tenants == 9
    assert settings.engine_request_waiting_limit == 2
    # W alone enables rejection, as N does: Q is the configured one, not 40000.
    assert settings.queue_limit == 16
    assert settings.tenant_weights == {"gold": 4.0, "free": 0.5}
    assert settings.tenant_metrics_limit == 7
    settings, _ = parse_args(["--engine-request-waiting-limit", "1", "--tenant-weights", "x=2"])
    assert (settings.engine_request_waiting_limit, settings.tenant_weights) == (1, {"x": 2.0})


def test_mocker_flags_read_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_MOCKER_NUM_GPU_BLOCKS", "64")
    monkeypatch.setenv("DYN_MOCKER_SPEEDUP_RATIO", "10")
    settings, _ = parse_args(["--block-size", "4", "--data-parallel-size", "2"])
    assert settings.mocker.num_gpu_blocks == 64
    assert settings.mocker.speedup_ratio == 10.0
    assert settings.mocker.block_size == 4
    assert settings.mocker.data_parallel_size == 2


def test_the_role_and_the_transfer_flags_read_their_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings, _ = parse_args([])
    assert settings.disaggregation_mode == "agg"
    # As Dynamo's mocker: no transfer delay unless a bandwidth is given; Llama-3-8B's KV in fp16.
    assert settings.mocker.kv_transfer_bandwidth == 0.0
    assert settings.mocker.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    monkeypatch.setenv("DYN_DISAGGREGATION_MODE", "decode")
    monkeypatch.setenv("DYN_KV_TRANSFER_BANDWIDTH", "64")
    monkeypatch.setenv("DYN_MOCKER_KV_BYTES_PER_TOKEN", "4096")
    settings, _ = parse_args([])
    assert settings.disaggregation_mode == "decode"
    assert (settings.mocker.kv_transfer_bandwidth, settings.mocker.kv_bytes_per_token) == (64, 4096)
    settings, _ = parse_args(["--disaggregation-mode", "prefill", "--kv-transfer-bandwidth", "0"])
    assert (settings.disaggregation_mode, settings.mocker.kv_transfer_bandwidth) == ("prefill", 0)


def test_the_role_and_the_transfer_flags_pass_to_local_workers_but_the_role() -> None:
    # A frontend's local workers stay aggregated; the transfer shapes the simulated engine.
    assert "disaggregation_mode" not in LOCAL_WORKER_FLAGS
    assert {"kv_transfer_bandwidth", "kv_bytes_per_token"} <= set(LOCAL_WORKER_FLAGS)


def test_prefix_caching_is_on_by_default_and_both_spellings_turn_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse_args([])[0].mocker.enable_prefix_caching is True
    assert parse_args(["--no-enable-prefix-caching"])[0].mocker.enable_prefix_caching is False
    monkeypatch.setenv("DYN_ENABLE_PREFIX_CACHING", "false")
    assert parse_args([])[0].mocker.enable_prefix_caching is False
    assert parse_args(["--enable-prefix-caching"])[0].mocker.enable_prefix_caching is True
    monkeypatch.setenv("DYN_ENABLE_PREFIX_CACHING", "perhaps")
    with pytest.raises(CliError, match="DYN_ENABLE_PREFIX_CACHING"):
        parse_args([])


def test_a_tokenizer_path_is_kept_and_an_empty_one_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([])[0].mocker.tokenizer is None
    monkeypatch.setenv("DYN_TOKENIZER", "/models/m/tokenizer.json")
    assert parse_args([])[0].mocker.tokenizer == "/models/m/tokenizer.json"
    with pytest.raises(CliError, match="--tokenizer"):
        parse_args(["--tokenizer", ""])


@pytest.mark.parametrize(
    ("argv", "environment", "named"),
    [
        (["--engine-request-limit", "0"], {}, "--engine-request-limit"),
        (["--engine-request-limit", "-3"], {}, "--engine-request-limit"),
        (["--engine-request-limit", "two"], {}, "--engine-request-limit"),
        ([], {"DYN_ENGINE_REQUEST_LIMIT": "abc"}, "DYN_ENGINE_REQUEST_LIMIT"),
        ([], {"DYN_ENGINE_REQUEST_LIMIT": ""}, "DYN_ENGINE_REQUEST_LIMIT"),
        ([], {"DYN_ENGINE_REQUEST_LIMIT": "0"}, "DYN_ENGINE_REQUEST_LIMIT"),
        ([], {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "1"}, "DYN_DYNAMO_REQUEST_QUEUE_LIMIT"),
        ([], {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "0"}, "DYN_DYNAMO_REQUEST_QUEUE_LIMIT"),
        ([], {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "many"}, "DYN_DYNAMO_REQUEST_QUEUE_LIMIT"),
        ([], {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": ""}, "DYN_DYNAMO_REQUEST_QUEUE_LIMIT"),
        (
            [],
            {"DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT": "1"},
            "DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT",
        ),
        (
            [],
            {"DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT": "0"},
            "DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT",
        ),
        (
            [],
            {"DYN_BACKEND_ADMISSION_ENGINE_REQUEST_LIMIT": "0"},
            "DYN_BACKEND_ADMISSION_ENGINE_REQUEST_LIMIT",
        ),
        (["--engine-request-waiting-limit", "0"], {}, "--engine-request-waiting-limit"),
        (
            [],
            {"DYN_BACKEND_ADMISSION_ENGINE_REQUEST_WAITING_LIMIT": "x"},
            "DYN_BACKEND_ADMISSION_ENGINE_REQUEST_WAITING_LIMIT",
        ),
        (["--tenant-weights", "a=0"], {}, "--tenant-weights"),
        (["--tenant-weights", "a"], {}, "--tenant-weights"),
        ([], {"DYN_TENANT_WEIGHTS": "a=1,a=2"}, "DYN_TENANT_WEIGHTS"),
        (["--tenant-metrics-limit", "-1"], {}, "--tenant-metrics-limit"),
        (["--max-tracked-tenants", "0"], {}, "--max-tracked-tenants"),
        (["--port", "70000"], {}, "--port"),
        ([], {"DYN_SYSTEM_PORT": "-1"}, "DYN_SYSTEM_PORT"),
        (["--queue-timeout", "0"], {}, "--queue-timeout"),
        (["--queue-timeout", "nan"], {}, "--queue-timeout"),
        (["--graceful-shutdown-timeout", "-1"], {}, "--graceful-shutdown-timeout"),
        (["--heartbeat-interval", "0"], {}, "--heartbeat-interval"),
        (["--num-gpu-blocks", "0"], {}, "--num-gpu-blocks"),
        # More than a frontend accepts: refused at start, not by every frontend's link.
        (["--num-gpu-blocks", str(2**26 + 1)], {}, "--num-gpu-blocks"),
        ([], {"DYN_MOCKER_BLOCK_SIZE": "0"}, "DYN_MOCKER_BLOCK_SIZE"),
        (["--max-num-seqs", "0"], {}, "--max-num-seqs"),
        (["--max-num-batched-tokens", "0"], {}, "--max-num-batched-tokens"),
        (["--data-parallel-size", "0"], {}, "--data-parallel-size"),
        (["--speedup-ratio", "0"], {}, "--speedup-ratio"),
        (["--speedup-ratio", "inf"], {}, "--speedup-ratio"),
        (["--engine", "nonsense"], {}, "--engine"),
        (["--worker-id", ""], {}, "--worker-id"),
        ([], {"DYN_WORKER_ID": " "}, "--worker-id"),
        (["--engine", "openai"], {}, "--upstream-url"),
        (["--disaggregation-mode", "both"], {}, "--disaggregation-mode"),
        ([], {"DYN_DISAGGREGATION_MODE": "Prefill"}, "DYN_DISAGGREGATION_MODE"),
        (["--disaggregation-mode", "decode", "--engine", "instant"], {}, "--disaggregation-mode"),
        (
            [
                "--disaggregation-mode",
                "prefill",
                "--engine",
                "openai",
                "--upstream-url",
                "http://u",
            ],
            {},
            "--disaggregation-mode",
        ),
        (["--kv-transfer-bandwidth", "-1"], {}, "--kv-transfer-bandwidth"),
        (["--kv-transfer-bandwidth", "inf"], {}, "--kv-transfer-bandwidth"),
        ([], {"DYN_KV_TRANSFER_BANDWIDTH": "fast"}, "DYN_KV_TRANSFER_BANDWIDTH"),
        (["--kv-bytes-per-token", "0"], {}, "--kv-bytes-per-token"),
        (["--kv-bytes-per-token", "1.5"], {}, "--kv-bytes-per-token"),
        (["--kv-bytes-per-token", str(2**30 + 1)], {}, "--kv-bytes-per-token"),
        ([], {"DYN_MOCKER_KV_BYTES_PER_TOKEN": "-4"}, "DYN_MOCKER_KV_BYTES_PER_TOKEN"),
        (["--log-level", "loud"], {}, "--log-level"),
        ([], {"DYN_LOG": "loud"}, "DYN_LOG"),
        ([], {"DYN_LOG": "info,worker_ingress=loud"}, "DYN_LOG"),
    ],
)
def test_invalid_values_name_the_flag_or_variable(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], environment: dict[str, str], named: str
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(CliError) as caught:
        parse_args(argv)
    message = str(caught.value)
    assert named in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- DYN_LOG


@pytest.mark.parametrize(
    ("raw", "level", "ignored"),
    [
        ("info", logging.INFO, ()),
        ("warn", logging.WARNING, ()),
        ("WARN", logging.WARNING, ()),
        ("Warning", logging.WARNING, ()),
        ("error", logging.ERROR, ()),
        ("critical", logging.CRITICAL, ()),
        ("debug", logging.DEBUG, ()),
        ("trace", logging.DEBUG, ()),
        ("off", LOG_OFF, ()),
        (" debug ", logging.DEBUG, ()),
        ("", logging.INFO, ()),
        ("info,worker_ingress=debug", logging.INFO, ("worker_ingress=debug",)),
        ("worker_ingress=debug", logging.INFO, ("worker_ingress=debug",)),
        ("a=trace,warn,b::c=ERROR", logging.WARNING, ("a=trace", "b::c=ERROR")),
        ("error,debug", logging.ERROR, ("debug",)),
        ("info,", logging.INFO, ()),
        ("h2[conn{id=1,peer=x}]=debug,info", logging.INFO, ("h2[conn{id=1,peer=x}]=debug",)),
    ],
)
def test_log_filter_reads_rust_levels_and_filters(
    raw: str, level: int, ignored: tuple[str, ...]
) -> None:
    assert parse_log_filter(raw) == LogFilter(level, ignored)


@pytest.mark.parametrize("raw", ["loud", "infos", "=debug", "a=loud", "info,a=", "info,a"])
def test_log_filter_refuses_what_it_cannot_read(raw: str) -> None:
    with pytest.raises(ValueError, match="is not a log level") as caught:
        parse_log_filter(raw)
    assert f'"{raw}"' in str(caught.value)


def test_log_level_from_environment_and_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_LOG", "warn")
    assert parse_args([])[1] == LogFilter(logging.WARNING)
    monkeypatch.setenv("DYN_LOG", "info,worker_ingress=debug")
    assert parse_args([])[1] == LogFilter(logging.INFO, ("worker_ingress=debug",))
    assert parse_args(["--log-level", "TRACE"])[1] == LogFilter(logging.DEBUG)


@pytest.fixture
def _root_level() -> Iterator[None]:
    root = logging.getLogger()
    saved = root.level
    yield
    root.setLevel(saved)


@pytest.mark.usefixtures("_root_level")
def test_ignored_directives_are_named_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("worker_ingress")
    with caplog.at_level(logging.DEBUG, logger="worker_ingress"):
        apply_log_filter(parse_log_filter("a=debug,warn,b=trace"), log)
    assert logging.getLogger().level == logging.WARNING
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "a=debug, b=trace" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="worker_ingress"):
        apply_log_filter(parse_log_filter("error"), log)
    assert logging.getLogger().level == logging.ERROR
    assert not caplog.records


def _run_command(argv: list[str], environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    return subprocess.run(
        [sys.executable, "-m", "worker_ingress", *argv],
        env={**clean, "COLUMNS": "200", **environment},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_invalid_value_exits_2_with_one_line() -> None:
    result = _run_command([], {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "1"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "DYN_DYNAMO_REQUEST_QUEUE_LIMIT" in lines[0]
    assert '"1"' in lines[0]
    assert result.stdout == ""


def test_invalid_log_level_exits_2_naming_the_variable() -> None:
    result = _run_command([], {"DYN_LOG": "loud"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "DYN_LOG" in lines[0]
    assert '"loud"' in lines[0]


def test_unknown_engine_module_exits_2() -> None:
    result = _run_command(["--engine", "no_such_module_here:create"], {})
    assert result.returncode == 2
    assert "no_such_module_here" in result.stderr


def test_help_names_every_variable() -> None:
    result = _run_command(["--help"], {})
    assert result.returncode == 0
    for name in ALL_VARIABLES:
        assert name in result.stdout, name
