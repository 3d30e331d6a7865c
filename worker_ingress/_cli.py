"""The ``worker-ingress`` command: flags and ``DYN_*`` variables in, a running worker out.

Every flag also reads the environment variable named in its help; the command line wins over the
environment, which wins over the default. Any invalid value stops the process before it binds a
port, with exit code 2 and one line on stderr that names the flag or variable and the value given.
"""

from __future__ import annotations

import inspect
import logging
import os
import secrets
import sys
import typing
from collections.abc import Sequence
from typing import Annotated, Final, cast

from cyclopts import App, Parameter, validators

from shim_common._access import WORKER_TOKEN_ENV, TLSFiles, token_from_env
from shim_common._cli import (
    DEFAULT_LOG_FILTER,
    LOG_LEVEL_PARAMETER,
    CliError,
    LogFilter,
    apply_log_filter,
    exit_invalid,
    invoke,
    of_kind,
    positive,
    strict_int,
    valid_port,
)
from shim_common._client_text import shorten
from shim_common._numbers import COUNT, RANKS, RATIO, SECONDS
from shim_common.wire import MAX_KV_BLOCKS, WorkerType
from worker_ingress._config import (
    DEFAULT_MAX_TRACKED_TENANTS,
    DEFAULT_QUEUE_LIMIT,
    MockerSettings,
    WorkerSettings,
)
from worker_ingress._fair_queue import MAX_TENANT_WEIGHT, MIN_TENANT_WEIGHT
from worker_ingress._version import __version__

__all__ = [
    "LOCAL_WORKER_FLAGS",
    "QUEUE_LIMIT_ENV",
    "QUEUE_LIMIT_ENV_1_7",
    "CliError",
    "local_worker_parameters",
    "main",
    "parse_args",
]

#: Q has no flag, on purpose (as in Dynamo): it is an advanced override, read from here only.
QUEUE_LIMIT_ENV = "DYN_DYNAMO_REQUEST_QUEUE_LIMIT"
#: Dynamo 1.7's name for Q; it wins over :data:`QUEUE_LIMIT_ENV` when both are set.
QUEUE_LIMIT_ENV_1_7 = "DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT"

#: The flags (parameter names of the command) a frontend may be given and passes on to its
#: ``--local-workers`` children: the engine, its shape and the gate's limits. Not the listen
#: addresses, the id, TLS or the supervision flags: the frontend sets those for each child itself.
LOCAL_WORKER_FLAGS: Final = (
    "model",
    "engine",
    "upstream_url",
    "engine_request_limit",
    "engine_request_waiting_limit",
    "tenant_weights",
    "tenant_metrics_limit",
    "max_tracked_tenants",
    "queue_timeout",
    "ttft_slo",
    "adaptive_min_limit",
    "graceful_shutdown_timeout",
    "heartbeat_interval",
    "num_gpu_blocks",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "data_parallel_size",
    "speedup_ratio",
    "kv_transfer_bandwidth",
    "kv_bytes_per_token",
)
#: The most KV bytes a token of the simulated model may take (``--kv-bytes-per-token``): 1 GiB,
#: thousands of times a large dense model's, so that a prompt's bytes stay a count.
MAX_KV_BYTES_PER_TOKEN: Final = 2**30


app = App(
    name="worker-ingress",
    help_formatter="plain",
    version=__version__,
    help_on_error=False,
)


@app.default
def _worker(
    *,
    host: Annotated[str, Parameter(env_var="DYN_WORKER_HOST")] = "127.0.0.1",
    port: Annotated[
        int, Parameter(converter=strict_int, env_var="DYN_WORKER_PORT", validator=valid_port())
    ] = 9100,
    system_port: Annotated[
        int, Parameter(converter=strict_int, env_var="DYN_SYSTEM_PORT", validator=valid_port())
    ] = 9101,
    model: Annotated[str, Parameter(env_var="DYN_MODEL_NAME")] = "mock-model",
    worker_id: Annotated[str | None, Parameter(env_var="DYN_WORKER_ID")] = None,
    engine: Annotated[str, Parameter(env_var="DYN_ENGINE")] = "mocker",
    upstream_url: Annotated[str | None, Parameter(env_var="DYN_UPSTREAM_URL")] = None,
    disaggregation_mode: Annotated[
        WorkerType, Parameter(env_var="DYN_DISAGGREGATION_MODE")
    ] = "agg",
    engine_request_limit: Annotated[
        int | None,
        Parameter(
            converter=strict_int,
            # Dynamo 1.7's name first: the first variable set wins, after the flag.
            env_var=["DYN_BACKEND_ADMISSION_ENGINE_REQUEST_LIMIT", "DYN_ENGINE_REQUEST_LIMIT"],
            validator=positive(),
        ),
    ] = None,
    engine_request_waiting_limit: Annotated[
        int | None,
        Parameter(
            converter=strict_int,
            env_var="DYN_BACKEND_ADMISSION_ENGINE_REQUEST_WAITING_LIMIT",
            validator=positive(),
        ),
    ] = None,
    tenant_weights: Annotated[str | None, Parameter(env_var="DYN_TENANT_WEIGHTS")] = None,
    tenant_metrics_limit: Annotated[
        int,
        Parameter(
            converter=strict_int,
            env_var="DYN_TENANT_METRICS_LIMIT",
            validator=validators.Number(gte=0, lte=10_000),
        ),
    ] = 50,
    max_tracked_tenants: Annotated[
        int,
        Parameter(
            converter=strict_int,
            env_var="DYN_MAX_TRACKED_TENANTS",
            validator=validators.Number(gte=1, lte=1_000_000),
        ),
    ] = DEFAULT_MAX_TRACKED_TENANTS,
    queue_timeout: Annotated[
        float | None,
        Parameter(
            env_var="DYN_REQUEST_QUEUE_TIMEOUT",
            validator=of_kind(SECONDS, gt=0),
        ),
    ] = None,
    ttft_slo: Annotated[
        float | None,
        Parameter(env_var="DYN_TTFT_SLO", validator=of_kind(SECONDS, gt=0)),
    ] = None,
    adaptive_min_limit: Annotated[
        int,
        Parameter(converter=strict_int, env_var="DYN_ADAPTIVE_MIN_LIMIT", validator=positive()),
    ] = 1,
    graceful_shutdown_timeout: Annotated[
        float,
        Parameter(
            env_var="DYN_GRACEFUL_SHUTDOWN_TIMEOUT",
            validator=of_kind(SECONDS),
        ),
    ] = 30.0,
    heartbeat_interval: Annotated[
        float,
        Parameter(
            env_var="DYN_HEARTBEAT_INTERVAL",
            validator=of_kind(SECONDS, gt=0, lte=60),
        ),
    ] = 1.0,
    load_publish_interval: Annotated[
        float,
        Parameter(
            env_var="DYN_LOAD_PUBLISH_INTERVAL",
            validator=of_kind(SECONDS, lte=10),
        ),
    ] = 0.1,
    num_gpu_blocks: Annotated[
        int,
        Parameter(
            converter=strict_int,
            env_var="DYN_MOCKER_NUM_GPU_BLOCKS",
            # A frontend refuses a hello announcing more (wire.MAX_KV_BLOCKS).
            validator=of_kind(COUNT, gte=1, lte=MAX_KV_BLOCKS),
        ),
    ] = 16384,
    block_size: Annotated[
        int, Parameter(converter=strict_int, env_var="DYN_MOCKER_BLOCK_SIZE", validator=positive())
    ] = 16,
    max_num_seqs: Annotated[
        int,
        Parameter(converter=strict_int, env_var="DYN_MOCKER_MAX_NUM_SEQS", validator=positive()),
    ] = 256,
    max_num_batched_tokens: Annotated[
        int,
        Parameter(
            converter=strict_int, env_var="DYN_MOCKER_MAX_NUM_BATCHED_TOKENS", validator=positive()
        ),
    ] = 8192,
    data_parallel_size: Annotated[
        int,
        Parameter(
            converter=strict_int, env_var="DYN_MOCKER_DATA_PARALLEL_SIZE", validator=of_kind(RANKS)
        ),
    ] = 1,
    speedup_ratio: Annotated[
        float,
        Parameter(env_var="DYN_MOCKER_SPEEDUP_RATIO", validator=of_kind(RATIO, gt=0)),
    ] = 1.0,
    kv_transfer_bandwidth: Annotated[
        float,
        Parameter(env_var="DYN_KV_TRANSFER_BANDWIDTH", validator=of_kind(RATIO)),
    ] = 0.0,
    kv_bytes_per_token: Annotated[
        int,
        Parameter(
            converter=strict_int,
            env_var="DYN_MOCKER_KV_BYTES_PER_TOKEN",
            validator=of_kind(COUNT, gte=1, lte=MAX_KV_BYTES_PER_TOKEN),
        ),
    ] = 131_072,
    enable_prefix_caching: Annotated[bool, Parameter(env_var="DYN_ENABLE_PREFIX_CACHING")] = True,
    tokenizer: Annotated[str | None, Parameter(env_var="DYN_TOKENIZER")] = None,
    tls_cert_path: Annotated[str | None, Parameter(env_var="DYN_TLS_CERT_PATH")] = None,
    tls_key_path: Annotated[str | None, Parameter(env_var="DYN_TLS_KEY_PATH")] = None,
    stop_on_stdin_eof: Annotated[
        bool, Parameter(env_var="DYN_STOP_ON_STDIN_EOF", negative=())
    ] = False,
    log_level: Annotated[LogFilter, LOG_LEVEL_PARAMETER] = DEFAULT_LOG_FILTER,
) -> tuple[WorkerSettings, LogFilter]:
    """Serve one engine behind an admission gate: N engine slots plus Q queue places.

    Requests beyond N running and Q waiting are rejected at once with
    "Server overloaded: worker at capacity". The environment variable
    DYN_BACKEND_ADMISSION_REQUEST_QUEUE_LIMIT (Dynamo 1.7), else DYN_DYNAMO_REQUEST_QUEUE_LIMIT,
    sets Q (an integer >= 2, default 16, used only when --engine-request-limit or
    --engine-request-waiting-limit is set); it has no flag. Queued requests start by priority
    (lower first), then by the tenants' fair share. DYN_WORKER_TOKEN (environment only), when
    set, is the bearer token a frontend must present on both planes (HTTP 401 without it).

    Parameters
    ----------
    host
        Address of the websocket listener (request plane /v1/requests, event plane /v1/events).
    port
        Port of the websocket listener; 0 picks a free one.
    system_port
        HTTP port for /metrics, /health and /live; 0 picks a free one.
    model
        Model name the worker serves and announces.
    worker_id
        Id announced to frontends (default: random, stable for the process).
    engine
        "mocker" (built-in simulator), "openai" (an OpenAI-compatible upstream server, see
        --upstream-url), "instant" (answers at once, for measuring the ingress) or
        "package.module:factory" for an in-process engine.
    upstream_url
        Base URL of the upstream server for --engine openai, e.g. http://127.0.0.1:8001.
    disaggregation_mode
        The worker's role, announced to frontends: "agg" (prefill and decode, as before),
        "prefill" (the prefill pool: prefills prompts and hands their KV off) or "decode" (the
        decode pool: decodes from a hand-off). Every role still serves a plain request whole.
        "prefill" and "decode" need an engine that can hand KV off (the mocker).
    engine_request_limit
        N: at most N requests run in the engine at once; setting it enables rejection. Unset: 10000
        slots, and 40000 queue places unless W is set. Also read from
        DYN_BACKEND_ADMISSION_ENGINE_REQUEST_LIMIT (Dynamo 1.7), which wins over
        DYN_ENGINE_REQUEST_LIMIT.
    engine_request_waiting_limit
        W: at most W requests in the engine that have not produced their first output yet; a
        queued request starts only when a slot and a waiting place are free. Setting it enables
        rejection. Unset: no separate bound.
    tenant_weights
        Fair-share weights, "name=weight,...", numbers from 1e-6 to 1e6; unnamed tenants weigh 1.
    tenant_metrics_limit
        Tenants exported by name in the per-tenant metrics, in order of first appearance; the
        rest are summed under tenant="other".
    max_tracked_tenants
        Tenants the gate keeps fair-share state for at once (a tenant is tracked while it has a
        request in the gate); beyond it, new tenants share one record until some leave.
    queue_timeout
        Seconds a request may wait in the queue before it is rejected with
        "Server overloaded: queue timeout" (default: no limit).
    ttft_slo
        Seconds: the time-to-first-token objective, from arrival (at the frontend, whose
        share travels with the request) to the first output (needs --engine-request-limit).
        The worker then runs at an effective limit between --adaptive-min-limit and N that it
        adapts so that the 90th percentile stays within it, and refuses early, with "Server
        overloaded: would miss the TTFT objective", a request that would wait past it (default:
        off).
    adaptive_min_limit
        With --ttft-slo: the effective limit never goes below this (at most N).
    graceful_shutdown_timeout
        Seconds running and queued requests get to finish after SIGTERM or SIGINT.
    heartbeat_interval
        Seconds between event-plane heartbeats (frontends treat a silent worker as stale).
    load_publish_interval
        Seconds between two load-event batches to one frontend at most: a changing load costs
        a bounded number of messages however fast the engine steps. A rank turning busy or free
        under a frontend's thresholds is sent at once. 0 sends every change.
    num_gpu_blocks
        Mocker: KV cache blocks per data-parallel rank (at most 67,108,864, the most a frontend
        accepts).
    block_size
        Mocker: tokens per KV cache block.
    max_num_seqs
        Mocker: sequences in the running batch at most, per rank.
    max_num_batched_tokens
        Mocker: token budget of one engine step (decode and chunked prefill), per rank.
    data_parallel_size
        Mocker: data-parallel ranks.
    speedup_ratio
        Mocker: simulated step times are divided by this (not the KV transfer's, as in
        Dynamo's mocker).
    kv_transfer_bandwidth
        Mocker: GB/s at which a decode worker receives a hand-off's KV (its bytes divided by
        this, in wall seconds); 0 (the default, as in Dynamo's mocker) moves it at once. About
        64 is an InfiniBand link between nodes, about 450 NVLink within one.
    kv_bytes_per_token
        Mocker: KV bytes of one token of the simulated model, what a hand-off moves per
        prompt token: layers x KV heads x head dimension x 2 (K and V) x bytes per element.
        Default 131072, Llama-3-8B in fp16 (32 x 8 x 128 x 2 x 2).
    enable_prefix_caching
        Mocker: keep the KV blocks of the prompts seen and reuse a prompt's longest cached
        prefix (--no-enable-prefix-caching: every prompt is prefilled whole).
    tokenizer
        Mocker: a model's tokenizer.json (needs the tokenizers extra); prompts are cut into
        blocks by its token ids. Default: one token per whitespace-separated word.
    tls_cert_path
        PEM certificate chain: the websocket port serves wss:// and the system port https://
        (needs --tls-key-path).
    tls_key_path
        PEM private key of --tls-cert-path.
    stop_on_stdin_eof
        Drain and exit once standard input reaches end of file: a supervisor that keeps the
        write end of a pipe open takes the worker down with it however it dies.
    log_level
        Level of the stderr log: error, warn, info, debug, trace (as debug), off; also
        warning and critical; any case. A Rust filter such as "info,my_module=debug" is
        accepted: its first bare level applies, the rest is ignored with a warning.
    """
    tls = TLSFiles(tls_cert_path, tls_key_path)
    settings = WorkerSettings(
        host=host,
        port=port,
        system_port=system_port,
        model=model,
        worker_id=secrets.token_hex(8)
        if worker_id is None
        else _non_empty("--worker-id", worker_id),
        engine=engine,
        upstream_url=upstream_url,
        disaggregation_mode=disaggregation_mode,
        engine_request_limit=engine_request_limit,
        engine_request_waiting_limit=engine_request_waiting_limit,
        tenant_weights=_tenant_weights(tenant_weights),
        tenant_metrics_limit=tenant_metrics_limit,
        max_tracked_tenants=max_tracked_tenants,
        request_queue_limit=_queue_limit_from_env(),
        queue_timeout=queue_timeout,
        ttft_slo=ttft_slo,
        adaptive_min_limit=adaptive_min_limit,
        drain_grace=graceful_shutdown_timeout,
        heartbeat_interval=heartbeat_interval,
        load_publish_interval=load_publish_interval,
        mocker=MockerSettings(
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            data_parallel_size=data_parallel_size,
            speedup_ratio=speedup_ratio,
            enable_prefix_caching=enable_prefix_caching,
            tokenizer=None if tokenizer is None else _non_empty("--tokenizer", tokenizer),
            kv_transfer_bandwidth=kv_transfer_bandwidth,
            kv_bytes_per_token=kv_bytes_per_token,
        ),
        token=token_from_env(WORKER_TOKEN_ENV),
        tls_cert_path=tls.cert_path,
        tls_key_path=tls.key_path,
        stop_on_stdin_eof=stop_on_stdin_eof,
    )
    _check_engine(settings)
    _check_objective(settings)
    return settings, log_level


def local_worker_parameters(group: str) -> list[inspect.Parameter]:
    """The :data:`LOCAL_WORKER_FLAGS` as keyword parameters of another cyclopts command.

    Each keeps this command's type, converter and validators, so a value the worker would refuse
    is refused by the command that takes it, naming the flag; it reads no environment variable
    (the children inherit the environment and read it themselves), defaults to ``None`` (not
    given) and is helped as "Passed to local workers:" and this command's own help text.

    Args:
        group: the help group to list them under.
    """
    hints = typing.get_type_hints(_worker, include_extras=True)
    helps = _parameter_help(_worker.__doc__ or "")
    made: list[inspect.Parameter] = []
    for name in LOCAL_WORKER_FLAGS:
        value_type, *extras = typing.get_args(hints[name]) or (hints[name],)
        own = next((e for e in extras if isinstance(e, Parameter)), Parameter())
        passed = Parameter(
            group=group,
            converter=own.converter,
            validator=own.validator,
            help=f"Passed to local workers: {helps.get(name, '')}".strip(),
        )
        made.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[value_type | None, passed],
            )
        )
    return made


def _parameter_help(docstring: str) -> dict[str, str]:
    """The text of each entry of a numpy-style ``Parameters`` section, on one line."""
    helps: dict[str, str] = {}
    lines = inspect.cleandoc(docstring).splitlines()
    start = next((i + 2 for i, line in enumerate(lines) if line.strip() == "Parameters"), None)
    name = None
    for line in lines[start or len(lines) :]:
        if line and not line.startswith(" "):
            name = line.strip()
            helps[name] = ""
        elif name is not None and line.strip():
            helps[name] = f"{helps[name]} {line.strip()}".strip()
    return helps


def _non_empty(flag: str, value: str) -> str:
    if not value.strip():
        raise CliError(f'Invalid value "{value}" for {flag}. Must not be empty.')
    return value


def _queue_limit_from_env() -> int:
    name = QUEUE_LIMIT_ENV_1_7 if QUEUE_LIMIT_ENV_1_7 in os.environ else QUEUE_LIMIT_ENV
    raw = os.environ.get(name)
    if raw is None:
        return DEFAULT_QUEUE_LIMIT
    try:
        value = COUNT.check(int(raw.strip()))
    except ValueError:
        raise CliError(
            f'Invalid value for {name} from env: "{shorten(raw)}" is not a whole number '
            "from 2 to 2**53."
        ) from None
    if value < 2:
        raise CliError(
            f'Invalid value "{raw}" for {name} provided by env. Must be >= 2 '
            "(the dispatcher holds one request, so the overflow channel has Q-1 places)."
        )
    return value


def _tenant_weights(raw: str | None) -> dict[str, float]:
    # "name=weight,..." -> {name: weight}; one clear line for the first bad item.
    if raw is None or not raw.strip():
        return {}
    weights: dict[str, float] = {}
    for item in raw.split(","):
        name, sep, number = item.strip().rpartition("=")
        try:
            weight = float(number)
        except ValueError:
            weight = float("nan")
        if not sep or not name or not MIN_TENANT_WEIGHT <= weight <= MAX_TENANT_WEIGHT:
            raise CliError(
                f'Invalid value "{shorten(raw)}" for --tenant-weights (DYN_TENANT_WEIGHTS): '
                f'"{shorten(item)}" is not name=weight with a number from 1e-6 to 1e6.'
            )
        if name in weights:
            raise CliError(
                f'Invalid value "{shorten(raw)}" for --tenant-weights (DYN_TENANT_WEIGHTS): tenant '
                f'"{shorten(name)}" is given twice.'
            )
        weights[name] = weight
    return weights


def _check_objective(settings: WorkerSettings) -> None:
    # An objective adapts L below N, so it needs an N; the floor of L cannot exceed N.
    limit = settings.engine_request_limit
    if settings.ttft_slo is not None and limit is None:
        raise CliError(
            f'Invalid value "{settings.ttft_slo:g}" for --ttft-slo (DYN_TTFT_SLO): it needs '
            "--engine-request-limit (N), the most the effective limit may reach."
        )
    if limit is not None and settings.adaptive_min_limit > limit:
        raise CliError(
            f'Invalid value "{settings.adaptive_min_limit}" for --adaptive-min-limit '
            f"(DYN_ADAPTIVE_MIN_LIMIT). Must be <= --engine-request-limit ({limit})."
        )


def _check_engine(settings: WorkerSettings) -> None:
    mode = settings.disaggregation_mode
    if mode != "agg" and settings.engine in ("openai", "instant"):
        # A role the engine cannot serve: a frontend would send this worker hops it must refuse.
        raise CliError(
            f'Invalid value "{mode}" for --disaggregation-mode (DYN_DISAGGREGATION_MODE): '
            f"--engine {settings.engine} cannot hand KV off; a prefill or decode worker needs "
            "the mocker."
        )
    if settings.engine == "openai":
        if not settings.upstream_url:
            raise CliError("--engine openai needs --upstream-url (DYN_UPSTREAM_URL).")
        return
    if settings.engine in ("mocker", "instant"):
        return
    module, sep, factory = settings.engine.partition(":")
    if not sep or not module or not factory.isidentifier():
        raise CliError(
            f'Invalid value "{settings.engine}" for --engine. '
            'Choose "mocker", "openai", "instant" or "package.module:factory".'
        )


def parse_args(argv: Sequence[str]) -> tuple[WorkerSettings, LogFilter]:
    """Parse flags and environment into settings.

    Raises:
        CliError: an invalid flag, variable or combination (message fit for one line).
    """
    return cast(tuple[WorkerSettings, LogFilter], invoke(app, argv))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``worker-ingress`` console script."""
    try:
        settings, log_level = parse_args(sys.argv[1:] if argv is None else argv)
    except CliError as exc:
        exit_invalid("worker-ingress", str(exc))
    logging.basicConfig(
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    apply_log_filter(log_level, logging.getLogger("worker_ingress"))
    # Imported late so that --help and argument errors never pay for (or trip over) the engine.
    import trio

    from worker_ingress.engines._loader import EngineLoadError, load_engine

    try:
        engine = load_engine(settings)
    except EngineLoadError as exc:
        exit_invalid("worker-ingress", str(exc))

    from worker_ingress._server import run_worker

    trio.run(run_worker, settings, engine)
