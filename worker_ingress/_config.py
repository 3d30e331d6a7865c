"""Validated worker settings: what the CLI produces and every other module consumes.

The CLI (:mod:`worker_ingress._cli`) parses flags and ``DYN_*`` variables into these structs; the
rules that depend on several values (N unset means 10000 slots; Q is 40000 unless N or W is set,
when it is ``DYN_DYNAMO_REQUEST_QUEUE_LIMIT``) live here, once.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from shim_common.wire import WorkerType

__all__ = [
    "DEFAULT_MAX_TRACKED_TENANTS",
    "DEFAULT_QUEUE_LIMIT",
    "UNLIMITED_ENGINE_SLOTS",
    "UNLIMITED_QUEUE_LIMIT",
    "MockerSettings",
    "WorkerSettings",
]

#: Tenants the gate keeps fair-share state for at once, unless ``--max-tracked-tenants`` says.
DEFAULT_MAX_TRACKED_TENANTS: Final = 4096
#: Q when ``DYN_DYNAMO_REQUEST_QUEUE_LIMIT`` is unset and N or W is set.
DEFAULT_QUEUE_LIMIT: Final = 16
#: The gate's size when N is unset: large enough never to reject in practice.
UNLIMITED_ENGINE_SLOTS: Final = 10_000
UNLIMITED_QUEUE_LIMIT: Final = 40_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class MockerSettings:
    """Shape of the simulated engine (flags ``--num-gpu-blocks`` ... ``--speedup-ratio``)."""

    num_gpu_blocks: int = 16384
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    data_parallel_size: int = 1
    speedup_ratio: float = 1.0
    #: Keep and reuse prompt blocks (``--enable-prefix-caching``).
    enable_prefix_caching: bool = True
    #: A model's ``tokenizer.json`` (``--tokenizer``); ``None``: one token per word.
    tokenizer: str | None = None
    #: GB/s a decode worker receives a hand-off's KV at (``--kv-transfer-bandwidth``); 0: at once.
    kv_transfer_bandwidth: float = 0.0
    #: KV bytes of one token of the simulated model (``--kv-bytes-per-token``): Llama-3-8B in
    #: fp16, 32 layers x 8 KV heads x 128 dimensions x 2 (K and V) x 2 bytes.
    kv_bytes_per_token: int = 131_072


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """Everything a worker process needs to start."""

    host: str = "127.0.0.1"
    port: int = 9100
    system_port: int = 9101
    model: str = "mock-model"
    worker_id: str
    #: ``mocker``, ``openai`` or ``package.module:factory``.
    engine: str = "mocker"
    #: Base URL of the OpenAI-compatible server the ``openai`` engine forwards to.
    upstream_url: str | None = None
    #: The worker's role in disaggregated serving (``--disaggregation-mode``).
    disaggregation_mode: WorkerType = "agg"
    #: N as given; ``None`` when unset.
    engine_request_limit: int | None = None
    #: Q as given (``DYN_DYNAMO_REQUEST_QUEUE_LIMIT``); used only when N or W is set.
    request_queue_limit: int = DEFAULT_QUEUE_LIMIT
    #: Seconds a request may wait in the queue; ``None``: no limit.
    queue_timeout: float | None = None
    #: W: requests in the engine before their first output at most; ``None``: unset.
    engine_request_waiting_limit: int | None = None
    #: Tenant name to weight (``--tenant-weights``); others weigh 1.
    tenant_weights: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Tenants exported by name in the per-tenant metrics; the rest are summed as ``other``.
    tenant_metrics_limit: int = 50
    #: Tenants the gate keeps fair-share state for at once (``--max-tracked-tenants``).
    max_tracked_tenants: int = DEFAULT_MAX_TRACKED_TENANTS
    #: S, seconds (``--ttft-slo``): the time-to-first-token objective; ``None``: off, L = N.
    ttft_slo: float | None = None
    #: The floor of the effective limit L (``--adaptive-min-limit``), used with an objective.
    adaptive_min_limit: int = 1
    #: Seconds running and queued requests get to finish after SIGTERM/SIGINT.
    drain_grace: float = 30.0
    #: Seconds between event-plane heartbeats.
    heartbeat_interval: float = 1.0
    #: Seconds between two event batches to one subscriber at most.
    load_publish_interval: float = 0.1
    mocker: MockerSettings = dataclasses.field(default_factory=MockerSettings)
    #: ``DYN_WORKER_TOKEN``: the bearer token both planes require; ``None``: no check.
    #: Kept out of ``repr`` so that it never reaches a log.
    token: str | None = dataclasses.field(default=None, repr=False)
    #: ``--tls-cert-path`` and ``--tls-key-path``: serve ``wss://`` and ``https://``.
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    #: ``--stop-on-stdin-eof``: drain and exit once standard input reaches end of file.
    stop_on_stdin_eof: bool = False

    @property
    def admission_enabled(self) -> bool:
        """Whether rejection is on: N or W set (either enables it, as in Dynamo)."""
        limits = (self.engine_request_limit, self.engine_request_waiting_limit)
        return limits != (None, None)

    @property
    def engine_slots(self) -> int:
        """Slots of the gate in force: N, or 10000 when N is unset."""
        if self.engine_request_limit is None:
            return UNLIMITED_ENGINE_SLOTS
        return self.engine_request_limit

    @property
    def queue_limit(self) -> int:
        """Q in force: as configured when N or W is set, else 40000."""
        if not self.admission_enabled:
            return UNLIMITED_QUEUE_LIMIT
        return self.request_queue_limit
