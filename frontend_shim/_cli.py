"""The ``frontend-shim`` command: flags and ``DYN_*`` variables in, a running frontend out.

Precedence is command line, then environment, then default; an invalid value stops the process
with exit code 2 and one line naming the flag or variable. Worker flags given to the frontend
(``--engine-request-limit``, the mocker's shape, ...) are not used by the frontend itself: they are
the worker's own declarations (:func:`worker_ingress.local_worker_parameters`, added to this
command's signature), checked with the worker's own parser and passed on to ``--local-workers``
children, which also inherit the ``DYN_*`` environment.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Sequence
from typing import Annotated, cast

from cyclopts import App, Parameter, Token, validators

from frontend_shim import __version__
from frontend_shim._config import (
    DEFAULT_MAX_BODY_BYTES,
    FrontendSettings,
    RouterMode,
    admin_api_disabled,
    overload_status_from_env,
)
from frontend_shim._request_class import GATEWAY_TOKEN_ENV
from shim_common._access import (
    ADMIN_TOKEN_ENV,
    WORKER_TOKEN_ENV,
    TLSFiles,
    check_ca_file,
    token_from_env,
)
from shim_common._cli import (
    DEFAULT_LOG_FILTER,
    LOG_LEVEL_PARAMETER,
    CliError,
    LogFilter,
    apply_log_filter,
    exit_invalid,
    finite,
    invoke,
    of_kind,
    strict_int,
    valid_port,
)
from shim_common._numbers import COUNT, FRACTION, PRIORITY, RATIO, SECONDS
from shim_common.wire import BusyThresholds
from worker_ingress import local_worker_parameters

__all__ = ["CliError", "main", "parse_args"]


ADMISSION_CONTROL_FLAG_WARNING = (
    "--admission-control is no longer supported and is ignored; configure "
    "--active-decode-blocks-threshold, --active-prefill-tokens-threshold, and "
    "--active-prefill-tokens-threshold-frac directly"
)
ADMISSION_CONTROL_ENV_WARNING = (
    "DYN_ADMISSION_CONTROL is no longer supported and is ignored; configure "
    "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD, DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD, and "
    "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC directly"
)

_log = logging.getLogger("frontend_shim")


app = App(
    name="frontend-shim",
    help_formatter="plain",
    version=__version__,
    help_on_error=False,
)

WORKERS = Parameter(group="Workers")
#: Where ``--help`` lists the worker's flags that this command takes for ``--local-workers``.
PASSED_GROUP = "Worker flags passed to --local-workers"


#: The most HTTP processes one frontend runs.
MAX_PROCESSES = 256


def _processes_converter(type_: object, tokens: Sequence[Token]) -> int:
    """``--processes``: a whole number, or ``auto`` (one per usable core)."""
    if tokens[0].value.strip().lower() == "auto":
        from frontend_shim._processes import usable_cores

        return usable_cores()
    return strict_int(type_, tokens)


def _frontend(
    *,
    http_host: Annotated[str, Parameter(env_var="DYN_HTTP_HOST")] = "127.0.0.1",
    http_port: Annotated[
        int,
        Parameter(
            converter=strict_int,
            env_var="DYN_HTTP_PORT",
            validator=valid_port(),
        ),
    ] = 8000,
    worker: Annotated[
        tuple[str, ...], Parameter(env_var="DYN_WORKERS", negative=(), consume_multiple=False)
    ] = (),
    local_workers: Annotated[
        int,
        Parameter(
            converter=strict_int,
            env_var="DYN_LOCAL_WORKERS",
            validator=validators.Number(gte=0, lte=256),
        ),
    ] = 0,
    processes: Annotated[
        int,
        Parameter(
            converter=_processes_converter,
            env_var="DYN_FRONTEND_PROCESSES",
            validator=validators.Number(gte=1, lte=MAX_PROCESSES),
        ),
    ] = 1,
    max_loop_lag: Annotated[
        float,
        Parameter(env_var="DYN_FRONTEND_MAX_LOOP_LAG", validator=of_kind(SECONDS, gte=0)),
    ] = 0.01,
    router_mode: Annotated[RouterMode, Parameter(env_var="DYN_ROUTER_MODE")] = "round-robin",
    active_decode_blocks_threshold: Annotated[
        float | None,
        Parameter(
            env_var="DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD",
            validator=of_kind(FRACTION),
        ),
    ] = None,
    active_prefill_tokens_threshold: Annotated[
        int | None,
        Parameter(
            converter=strict_int,
            env_var="DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD",
            validator=of_kind(COUNT),
        ),
    ] = None,
    active_prefill_tokens_threshold_frac: Annotated[
        float | None,
        Parameter(
            env_var="DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC",
            validator=of_kind(RATIO),
        ),
    ] = None,
    router_track_output_blocks: Annotated[
        bool, Parameter(env_var="DYN_ROUTER_TRACK_OUTPUT_BLOCKS", negative=())
    ] = False,
    router_queue_threshold: Annotated[
        float | None,
        Parameter(
            env_var="DYN_ROUTER_QUEUE_THRESHOLD", validator=of_kind(RATIO, gt=0)
        ),
    ] = None,
    router_queue_capacity: Annotated[
        int,
        Parameter(
            converter=strict_int,
            env_var="DYN_ROUTER_QUEUE_CAPACITY",
            validator=of_kind(COUNT, gte=1),
        ),
    ] = 1024,
    migration_limit: Annotated[
        int,
        Parameter(
            converter=strict_int, env_var="DYN_MIGRATION_LIMIT", validator=of_kind(COUNT)
        ),
    ] = 0,
    busy_exempt_priority: Annotated[
        int | None,
        Parameter(
            converter=strict_int,
            env_var="DYN_BUSY_EXEMPT_PRIORITY",
            validator=of_kind(PRIORITY),
        ),
    ] = None,
    max_client_priority: Annotated[
        int | None,
        Parameter(
            converter=strict_int,
            env_var="DYN_MAX_CLIENT_PRIORITY",
            validator=of_kind(PRIORITY),
        ),
    ] = None,
    max_body_bytes: Annotated[
        int,
        Parameter(
            converter=strict_int,
            env_var="DYN_HTTP_MAX_BODY_BYTES",
            validator=of_kind(COUNT, gte=1),
        ),
    ] = DEFAULT_MAX_BODY_BYTES,
    admission_control: Annotated[
        str | None, Parameter(env_var="DYN_ADMISSION_CONTROL", show=False)
    ] = None,
    graceful_shutdown_timeout: Annotated[
        float | None,
        Parameter(
            env_var="DYN_GRACEFUL_SHUTDOWN_TIMEOUT",
            validator=of_kind(SECONDS),
        ),
    ] = None,
    max_event_lag: Annotated[
        float,
        Parameter(
            env_var="DYN_MAX_EVENT_LAG",
            validator=of_kind(SECONDS, gt=0, lte=3600),
        ),
    ] = 1.0,
    worker_connect_concurrency: Annotated[
        int,
        Parameter(
            converter=strict_int,
            env_var="DYN_WORKER_CONNECT_CONCURRENCY",
            validator=validators.Number(gte=1, lte=100_000),
        ),
    ] = 64,
    event_budget: Annotated[
        float | None,
        Parameter(
            env_var="DYN_EVENT_BUDGET",
            validator=(validators.Number(gte=0, lte=10_000_000), finite),
        ),
    ] = None,
    router_kv_overlap_score_credit: Annotated[
        float,
        Parameter(env_var="DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", validator=of_kind(RATIO)),
    ] = 1.0,
    router_prefill_load_scale: Annotated[
        float,
        Parameter(env_var="DYN_ROUTER_PREFILL_LOAD_SCALE", validator=of_kind(RATIO)),
    ] = 1.0,
    router_temperature: Annotated[
        float, Parameter(env_var="DYN_ROUTER_TEMPERATURE", validator=of_kind(RATIO))
    ] = 0.0,
    router_kv_events: Annotated[
        bool,
        Parameter(
            name=("--router-kv-events", "--kv-events"),
            negative=("--no-router-kv-events", "--no-kv-events"),
            env_var="DYN_ROUTER_USE_KV_EVENTS",
        ),
    ] = True,
    router_ttl_secs: Annotated[
        float,
        Parameter(env_var="DYN_ROUTER_TTL_SECS", validator=of_kind(SECONDS, gt=0)),
    ] = 120.0,
    tokenizer: Annotated[str | None, Parameter(env_var="DYN_TOKENIZER")] = None,
    tls_cert_path: Annotated[str | None, Parameter(env_var="DYN_TLS_CERT_PATH")] = None,
    tls_key_path: Annotated[str | None, Parameter(env_var="DYN_TLS_KEY_PATH")] = None,
    tls_ca_path: Annotated[str | None, Parameter(env_var="DYN_TLS_CA_PATH")] = None,
    log_level: Annotated[LogFilter, LOG_LEVEL_PARAMETER] = DEFAULT_LOG_FILTER,
    **worker_flags: object,
) -> tuple[FrontendSettings, LogFilter]:
    """Serve the OpenAI API in front of workers, and shed load with HTTP 529 when all are busy.

    Other environment: DYN_HTTP_OVERLOAD_STATUS_CODE (status of an overload answer, default 529;
    any integer 200-599), DYN_DISABLE_FRONTEND_ADMIN_API (truthy: /busy_threshold answers 404),
    DYN_WORKER_TOKEN (bearer token sent to every worker), DYN_ADMIN_TOKEN (bearer token
    /busy_threshold requires), DYN_GATEWAY_TOKEN (the token a trusted gateway sends in
    x-dynamo-gateway-token: only its requests claim a priority and a tenant freely).
    --admission-control and DYN_ADMISSION_CONTROL are accepted and ignored.

    Parameters
    ----------
    http_host
        HTTP listen address.
    http_port
        HTTP port; 0 picks a free one.
    worker
        A worker's websocket URL, ws://host:port (repeatable; the variable is comma-separated). A
        host name that resolves to several addresses is several workers, re-resolved periodically.
    local_workers
        Start this many mocker workers as child processes and use them.
    processes
        HTTP processes serving the one port, routing on one picture of the fleet that a host
        process keeps (it follows the workers' events once); "auto": one per usable core.
    max_loop_lag
        Seconds this frontend's own event loop may fall behind (the requests it has read wait
        that long for their turn) before it turns a share of new requests away with 529 and
        the reason frontend_overloaded, so that those it serves keep their latency. 0: never.
    router_mode
        round-robin, random, or kv (load-aware: fewest active blocks and prefill tokens).
    active_decode_blocks_threshold
        A rank is busy when its KV blocks in use over its total exceed this (0 to 1).
    active_prefill_tokens_threshold
        A rank is busy when its active prefill tokens exceed this.
    active_prefill_tokens_threshold_frac
        A rank is busy when its active prefill tokens exceed this times its max-num-batched-tokens.
    router_track_output_blocks
        Count generated tokens in this router's own block count of each worker.
    router_queue_threshold
        When every worker's prefill tokens exceed this fraction of its max-num-batched-tokens,
        requests wait in a bounded frontend queue instead of being routed.
    router_queue_capacity
        Requests the frontend queue holds at most; beyond it a request is rejected.
    migration_limit
        Times a request that a worker rejected before it started is retried on another worker.
    busy_exempt_priority
        Requests with a priority <= this (x-dynamo-priority, else the body's priority) are not
        shed by the busy thresholds: with every worker busy they go to the least loaded one not
        marked overloaded, whose own cap decides. Unset: every request may be shed.
    max_client_priority
        The most urgent priority a client may claim (lower is more urgent): a request's
        x-dynamo-priority or body priority below it is raised to it. Unset: any priority from
        -1000 to 1000. With DYN_GATEWAY_TOKEN set it bounds every request but the gateway's.
    max_body_bytes
        Largest request body accepted (413 beyond).
    admission_control
        Ignored (kept so old launch commands still start).
    graceful_shutdown_timeout
        Seconds requests in flight get to finish after SIGTERM or SIGINT (default 30); also
        passed to local workers when given on the command line.
    max_event_lag
        Seconds a worker's load events may be read behind (measured against the time the
        worker sent them, robust to clock skew) before the worker is not routed to; it is
        routed to again once the lag is under half of this.
    worker_connect_concurrency
        Worker connection attempts in flight at once, so a large fleet starts without a
        stampede of handshakes.
    event_budget
        Event messages a second this frontend takes from all its workers together; each worker
        is asked for (or read at) the interval that keeps to it. 0: no budget. Unset: the
        budget is what fits in 48 % of a core at the cost per message this frontend measures.
    router_kv_overlap_score_credit
        kv: how much a cached prompt block is worth against one to prefill (0: ignore the
        cache).
    router_prefill_load_scale
        kv: weight of the prompt's uncached blocks against a worker's active decode blocks.
    router_temperature
        kv: 0, the cheapest rank wins; above 0, a softmax draw over normalised costs.
    router_kv_events
        kv: follow the workers' KV events (for workers that publish them); off, predict their
        caches from this router's own decisions.
    router_ttl_secs
        kv: seconds a block predicted from this router's own decision is believed, without KV
        events.
    tokenizer
        A model's tokenizer.json: kv cuts prompts into blocks with it (needs the tokenizers
        extra), and local workers are given it too. Unset: one token per word, as the mocker.
    tls_cert_path
        PEM certificate chain: the HTTP listener serves https:// (needs --tls-key-path).
        Local workers are given it too and serve wss://.
    tls_key_path
        PEM private key of --tls-cert-path.
    tls_ca_path
        PEM bundle trusted for wss:// workers (default: the system's trust store).
    log_level
        Level of the stderr log: error, warn, info, debug, trace (as debug), off; also
        warning and critical; any case. A Rust filter such as "info,my_module=debug" is
        accepted: its first bare level applies, the rest is ignored with a warning.
    """
    del admission_control  # accepted so that old launch commands start; warned about by parse_args
    # The worker's flags this command was given, in the worker's order; the drain grace is also
    # this command's own flag, passed on when given.
    given = {**worker_flags, "graceful_shutdown_timeout": graceful_shutdown_timeout}
    passed = {f"--{name.replace('_', '-')}": given.get(name) for name in _PASSED_NAMES}
    tls = TLSFiles(tls_cert_path, tls_key_path)
    if tls_ca_path is not None:
        check_ca_file("--tls-ca-path (DYN_TLS_CA_PATH)", tls_ca_path)
    # Local workers serve wss:// with the frontend's own certificate (see _app).
    passed["--tls-cert-path"] = tls.cert_path
    passed["--tls-key-path"] = tls.key_path
    # The workers cut prompts with the frontend's tokeniser: one tokenisation for both sides.
    passed["--tokenizer"] = tokenizer
    worker_args = tuple(
        part for flag, value in passed.items() if value is not None for part in (flag, str(value))
    )
    settings = FrontendSettings(
        http_host=http_host,
        http_port=http_port,
        workers=_split_workers(worker),
        local_workers=local_workers,
        local_worker_args=worker_args,
        processes=processes,
        max_loop_lag=max_loop_lag,
        router_mode=router_mode,
        thresholds=BusyThresholds(
            active_decode_blocks=active_decode_blocks_threshold,
            active_prefill_tokens=active_prefill_tokens_threshold,
            active_prefill_tokens_frac=active_prefill_tokens_threshold_frac,
        ),
        router_track_output_blocks=router_track_output_blocks,
        router_queue_threshold=router_queue_threshold,
        router_queue_capacity=router_queue_capacity,
        migration_limit=migration_limit,
        busy_exempt_priority=busy_exempt_priority,
        max_client_priority=max_client_priority,
        max_body_bytes=max_body_bytes,
        overload_status=overload_status_from_env(),
        admin_api_disabled=admin_api_disabled(),
        drain_grace=30.0 if graceful_shutdown_timeout is None else graceful_shutdown_timeout,
        max_event_lag=max_event_lag,
        connect_concurrency=worker_connect_concurrency,
        event_budget=event_budget,
        worker_token=token_from_env(WORKER_TOKEN_ENV),
        admin_token=token_from_env(ADMIN_TOKEN_ENV),
        gateway_token=token_from_env(GATEWAY_TOKEN_ENV),
        tls_cert_path=tls.cert_path,
        tls_key_path=tls.key_path,
        tls_ca_path=tls_ca_path,
        router_kv_overlap_score_credit=router_kv_overlap_score_credit,
        router_prefill_load_scale=router_prefill_load_scale,
        router_temperature=router_temperature,
        router_kv_events=router_kv_events,
        router_ttl_secs=router_ttl_secs,
        tokenizer=tokenizer,
    )
    if tokenizer is not None:
        _check_tokenizer(tokenizer)
    if local_workers:
        _check_worker_args(worker_args)
    return settings, log_level


# The command's signature: its own parameters, then the worker's flags it passes on, taken from the
# worker's declarations (their types and checks are the worker's).
_own = inspect.signature(_frontend, eval_str=True)
_worker_parameters = local_worker_parameters(PASSED_GROUP)
_PASSED_NAMES = tuple(p.name for p in _worker_parameters)
_frontend.__signature__ = _own.replace(  # type: ignore[attr-defined]
    parameters=[
        *(p for p in _own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD),
        *(p for p in _worker_parameters if p.name not in _own.parameters),
    ]
)
app.default(_frontend)


def _split_workers(given: Sequence[str]) -> tuple[str, ...]:
    from frontend_shim._discovery import parse_worker_url

    urls: list[str] = []
    for item in given:
        for url in item.split(","):
            url = url.strip()
            if not url:
                continue
            try:
                parse_worker_url(url)
            except ValueError as exc:
                raise CliError(f"Invalid value for --worker: {exc}") from None
            urls.append(url)
    return tuple(urls)


def _check_tokenizer(path: str) -> None:
    from shim_common.prefix import FileTokenizer

    try:
        FileTokenizer(path)
    except (ImportError, ValueError) as exc:
        raise CliError(f"Invalid value for --tokenizer (DYN_TOKENIZER): {exc}") from None


def _check_worker_args(worker_args: Sequence[str]) -> None:
    from worker_ingress import validate_worker_args

    try:
        validate_worker_args(worker_args)
    except CliError as exc:
        raise CliError(f"worker flag for --local-workers: {exc}") from None


def parse_args(argv: Sequence[str]) -> tuple[FrontendSettings, LogFilter]:
    """Parse flags and environment into settings.

    Raises:
        CliError: an invalid flag, variable or combination (message fit for one line).
    """
    result = cast(tuple[FrontendSettings, LogFilter], invoke(app, _gather_workers(argv)))
    # Which spelling was used decides which names the warning gives (Dynamo's two texts).
    if any(arg.split("=")[0] == "--admission-control" for arg in argv):
        _log.warning(ADMISSION_CONTROL_FLAG_WARNING)
    elif "DYN_ADMISSION_CONTROL" in os.environ:
        _log.warning(ADMISSION_CONTROL_ENV_WARNING)
    return result


def _gather_workers(argv: Sequence[str]) -> list[str]:
    """``argv`` with every ``--worker URL`` joined into one ``--worker=URL,URL,...`` where the
    first stood: the parser's cost grows with the square of repeated flags, and a fleet of 2,048
    workers given one flag each took it most of a minute (the values are split again after)."""
    gathered: list[str] = []
    others: list[str] = []
    first = -1
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            others.extend(argv[index:])
            break
        value: str | None = None
        if arg.startswith("--worker="):
            value = arg.removeprefix("--worker=")
        elif arg == "--worker" and index + 1 < len(argv) and not argv[index + 1].startswith("-"):
            index += 1
            value = argv[index]
        if value is None:
            others.append(arg)
        else:
            if first < 0:
                first = len(others)
            gathered.append(value)
        index += 1
    if first < 0:
        return list(argv)
    return [*others[:first], "--worker=" + ",".join(gathered), *others[first:]]


def _raise_open_file_limit(wanted: int) -> None:
    """Raise the soft limit of open files toward the hard one: every worker costs two sockets,
    and a common soft limit of 1,024 would stop a frontend at about 500 workers."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = hard if hard != resource.RLIM_INFINITY else 1 << 20
    target = min(ceiling, max(soft, wanted, 65536))
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            _log.warning("cannot raise the open-file limit from %d: %s", soft, exc)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``frontend-shim`` console script."""
    # Configured before parsing so that the --admission-control warning reaches stderr.
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings, log_level = parse_args(sys.argv[1:] if argv is None else argv)
    except CliError as exc:
        exit_invalid("frontend-shim", str(exc))
    apply_log_filter(log_level, _log)
    _raise_open_file_limit(2 * len(settings.workers) + 1024)

    import trio

    if settings.processes > 1:
        from frontend_shim._processes import run_frontend_processes

        trio.run(run_frontend_processes, settings, settings.processes)
        return
    from frontend_shim._app import run_frontend

    trio.run(run_frontend, settings)
