"""Validated frontend settings: what the CLI produces and the frontend runs on."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Final, Literal

from frontend_shim._event_budget import DEFAULT_EVENT_BUDGET
from frontend_shim._event_cost import DEFAULT_COST_WINDOW, DEFAULT_MIN_WINDOW_MESSAGES
from shim_common.wire import BusyThresholds

__all__ = [
    "DEFAULT_EVENT_BUDGET",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_OVERLOAD_STATUS",
    "FrontendSettings",
    "RouterMode",
    "admin_api_disabled",
    "overload_status_from_env",
]

RouterMode = Literal["round-robin", "random", "kv"]

DEFAULT_MAX_BODY_BYTES: Final = 16 * 1024 * 1024
DEFAULT_OVERLOAD_STATUS: Final = 529
OVERLOAD_STATUS_ENV: Final = "DYN_HTTP_OVERLOAD_STATUS_CODE"
ADMIN_API_ENV: Final = "DYN_DISABLE_FRONTEND_ADMIN_API"

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrontendSettings:
    """Everything the frontend process needs to start."""

    http_host: str = "127.0.0.1"
    http_port: int = 8000
    #: Worker websocket URLs as given (``ws://host:port``); a host name may stand for several.
    workers: tuple[str, ...] = ()
    #: Mocker workers to start as child processes.
    local_workers: int = 0
    #: Worker flags given to the frontend, passed on to local workers verbatim.
    local_worker_args: tuple[str, ...] = ()
    #: HTTP processes serving the port (``--processes``); above 1, a host process keeps the
    #: picture of the fleet for all of them (frontend_shim._processes).
    processes: int = 1
    #: Seconds of this process's own loop lag above which it sheds new requests
    #: (``--max-loop-lag``, frontend_shim._loop_guard); 0: never.
    max_loop_lag: float = 0.01
    router_mode: RouterMode = "round-robin"
    #: The busy thresholds every model starts with (``--active-*-threshold*``).
    thresholds: BusyThresholds = dataclasses.field(default_factory=BusyThresholds)
    router_track_output_blocks: bool = False
    router_queue_threshold: float | None = None
    #: Requests the frontend queue holds at most (with --router-queue-threshold).
    router_queue_capacity: int = 1024
    migration_limit: int = 0
    #: ``--busy-exempt-priority``: requests of this priority or better skip the busy thresholds.
    busy_exempt_priority: int | None = None
    #: ``--max-client-priority``: the most urgent priority a client may claim (``None``: any).
    max_client_priority: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: Status code of an overload answer (``DYN_HTTP_OVERLOAD_STATUS_CODE``).
    overload_status: int = DEFAULT_OVERLOAD_STATUS
    #: ``/busy_threshold`` answers 404 when true (``DYN_DISABLE_FRONTEND_ADMIN_API``).
    admin_api_disabled: bool = False
    #: Seconds requests in flight get to finish after SIGTERM/SIGINT.
    drain_grace: float = 30.0
    #: Seconds between DNS look-ups of worker host names.
    resolve_interval: float = 10.0
    #: Load older than this many heartbeat intervals is stale.
    stale_after_heartbeats: float = 3.0
    #: Seconds a worker's event stream may be read behind before the worker is not routed to.
    max_event_lag: float = 1.0
    #: Worker connection attempts in flight at once (a large fleet starts without a stampede).
    connect_concurrency: int = 64
    #: Event messages a second taken from all workers together (0: no budget; ``None``: the
    #: budget follows the measured cost per message, starting at ``DEFAULT_EVENT_BUDGET``).
    event_budget: float | None = None
    #: Seconds between two samples of the cost per event message. Not a flag: tests shorten it.
    event_cost_window: float = DEFAULT_COST_WINDOW
    #: Messages a window of the cost meter needs to count. Not a flag: tests lower it.
    event_cost_min_messages: int = DEFAULT_MIN_WINDOW_MESSAGES
    #: Seconds an overload mark lasts at most without a load event from the worker. Not a flag:
    #: the documented behaviour is 1 s; tests shorten it rather than wait.
    overload_mark_lease: float = 1.0
    #: ``DYN_WORKER_TOKEN``: sent as ``Authorization: Bearer`` on every worker link. Kept out of
    #: ``repr`` (and so out of logs), like the admin token.
    worker_token: str | None = dataclasses.field(default=None, repr=False)
    #: ``DYN_ADMIN_TOKEN``: required by ``GET``/``POST /busy_threshold`` when set.
    admin_token: str | None = dataclasses.field(default=None, repr=False)
    #: ``DYN_GATEWAY_TOKEN``: with it, only a request that carries it in
    #: ``x-dynamo-gateway-token`` claims its class freely (frontend_shim/_request_class.py).
    gateway_token: str | None = dataclasses.field(default=None, repr=False)
    #: ``--tls-cert-path``/``--tls-key-path``: the HTTP listener serves ``https://``.
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    #: ``--tls-ca-path``: the bundle ``wss://`` workers are verified with; ``None``: the system's.
    tls_ca_path: str | None = None
    #: Seconds a write to an HTTP client may make no progress before it is dropped. Not a flag.
    http_send_timeout: float = 60.0
    #: ``--router-kv-overlap-score-credit``: what a cached prompt block is worth to ``kv``.
    router_kv_overlap_score_credit: float = 1.0
    #: ``--router-prefill-load-scale``: uncached prompt blocks against decode blocks.
    router_prefill_load_scale: float = 1.0
    #: ``--router-temperature``: 0, the cheapest rank wins; > 0, a softmax draw.
    router_temperature: float = 0.0
    #: ``--router-kv-events``: the ``kv`` index follows the workers' KV events; off, it predicts
    #: their caches from its own decisions.
    router_kv_events: bool = True
    #: ``--router-ttl-secs``: seconds a predicted block is believed without KV events.
    router_ttl_secs: float = 120.0
    #: ``--tokenizer``: a model's ``tokenizer.json`` the ``kv`` router cuts prompts with (and
    #: local workers too); ``None``: the mocker's word tokeniser.
    tokenizer: str | None = None


def overload_status_from_env(environ: Mapping[str, str] | None = None) -> int:
    """Read ``DYN_HTTP_OVERLOAD_STATUS_CODE``: any integer 200-599 is used, anything else is 529.

    An unparseable or out-of-range value is not fatal (as in Dynamo) but is logged.
    """
    raw = (os.environ if environ is None else environ).get(OVERLOAD_STATUS_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_OVERLOAD_STATUS
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if 200 <= value <= 599:
        return value
    _log.warning(
        '%s="%s" is not an HTTP status code from 200 to 599; using %d',
        OVERLOAD_STATUS_ENV,
        raw,
        DEFAULT_OVERLOAD_STATUS,
    )
    return DEFAULT_OVERLOAD_STATUS


def admin_api_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``DYN_DISABLE_FRONTEND_ADMIN_API`` is truthy (1, true, yes, on)."""
    raw = (os.environ if environ is None else environ).get(ADMIN_API_ENV, "")
    return raw.strip().lower() in {"1", "true", "yes", "on"}
