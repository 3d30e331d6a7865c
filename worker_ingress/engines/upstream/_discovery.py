"""What the ``openai`` engine asks its upstream outside requests: readiness, limits, load.

:class:`UpstreamDiscovery` owns a small connection pool of its own (a full request pool must not
starve it) and does the I/O around the sans-IO parsers of ``_probes`` and
``_metrics``:

1. :meth:`~UpstreamDiscovery.wait_until_ready`: ``GET /v1/models`` until it answers 200, with
   :class:`shim_common._net.Backoff` from 0.1 s up to 5 s, logging each failure;
2. :meth:`~UpstreamDiscovery.discover`: the limits, first source that answers wins: vLLM's
   ``/metrics``, SGLang's ``/get_server_info``, llama.cpp's ``/props`` (the engine's docstring
   says which values each gives); it also picks where the load is read (below) and warns when N
   exceeds what the upstream runs at once;
3. :meth:`~UpstreamDiscovery.used_blocks`: KV blocks in use, from a KV usage gauge of
   ``/metrics`` (vLLM, SGLang) or from llama.cpp's ``/slots``; ``None`` without a reading.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Final

import msgspec
import trio

from shim_common._net import Backoff
from shim_common._numbers import COUNT, NumberError
from worker_ingress.engines._base import EngineConfig
from worker_ingress.engines.upstream._client import Origin, UpstreamClient, UpstreamConnectionError
from worker_ingress.engines.upstream._metrics import parse_metrics_text
from worker_ingress.engines.upstream._probes import (
    UpstreamFacts,
    parse_llamacpp_props,
    parse_llamacpp_slots,
    parse_sglang_server_info,
)

__all__ = ["CONTROL_TIMEOUT", "Discovered", "UpstreamDiscovery"]

logger = logging.getLogger(__name__)

#: Backoff while waiting for the upstream to answer at start-up.
READY_BACKOFF_FIRST: Final = 0.1
READY_BACKOFF_MAX: Final = 5.0
#: Seconds allowed to start-up probes and load polls (not to requests).
CONTROL_TIMEOUT: Final = 5.0
#: Largest body of a probe or a poll.
MAX_CONTROL_BODY_BYTES: Final = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Discovered:
    """What :meth:`UpstreamDiscovery.discover` found."""

    #: The limits: the upstream's where it gave them, the fallback's elsewhere.
    config: EngineConfig
    #: Where they come from, for logs.
    source: str
    #: Where the load is read, for logs.
    load_source: str


class UpstreamDiscovery:
    """Readiness, limits and load of one upstream (the steps are in the module docstring).

    Args:
        origin: Where the upstream listens.
        model: The model name the worker serves (checked against ``/v1/models``).
        request_limit: N (``None`` when unset), compared with what the upstream runs at once.
    """

    def __init__(self, origin: Origin, *, model: str, request_limit: int | None) -> None:
        self._origin = origin
        self._model = model
        self._request_limit = request_limit
        self._control = UpstreamClient(
            origin, max_connections=2, connect_timeout=CONTROL_TIMEOUT, read_timeout=CONTROL_TIMEOUT
        )
        #: The KV usage gauge of ``/metrics`` to poll, if any.
        self._usage_gauge: str | None = None
        #: Whether llama.cpp's ``/slots`` is polled instead.
        self._slots_load = False

    @property
    def polls_load(self) -> bool:
        """Whether the upstream publishes a load worth polling (known after :meth:`discover`)."""
        return self._usage_gauge is not None or self._slots_load

    async def aclose(self) -> None:
        """Close the connections (works when cancelled)."""
        await self._control.aclose()

    async def wait_until_ready(self) -> None:
        """Return once ``GET /v1/models`` answers 200."""
        backoff = Backoff(initial=READY_BACKOFF_FIRST, cap=READY_BACKOFF_MAX)
        attempt = 0
        while True:
            attempt += 1
            try:
                status, body = await self._control.request(
                    "GET", "/v1/models", max_body_bytes=MAX_CONTROL_BODY_BYTES
                )
            except UpstreamConnectionError as exc:
                problem = str(exc)
            else:
                if status == 200:
                    self._check_model(body)
                    logger.info("upstream %s is ready (after %d attempts)", self._origin, attempt)
                    return
                problem = f"GET /v1/models answered {status}"
            delay = backoff.next_delay()
            logger.warning(
                "upstream %s not ready (attempt %d): %s; retrying in %.1f s",
                self._origin,
                attempt,
                problem,
                delay,
            )
            await trio.sleep(delay)

    def _check_model(self, body: bytes) -> None:
        try:
            listing = msgspec.json.decode(body)
            served = [entry["id"] for entry in listing["data"]]
        except (msgspec.DecodeError, KeyError, TypeError):
            return
        if self._model not in served:
            logger.warning(
                "upstream %s serves %s, not %r: requests are sent with the model name given",
                self._origin,
                served,
                self._model,
            )

    async def _get_json(self, target: str) -> object:
        try:
            status, body = await self._control.request(
                "GET", target, max_body_bytes=MAX_CONTROL_BODY_BYTES
            )
            if status != 200:
                return None
            return msgspec.json.decode(body)
        except (UpstreamConnectionError, msgspec.DecodeError):
            return None

    async def _get_metrics(self) -> UpstreamFacts | None:
        try:
            status, body = await self._control.request(
                "GET", "/metrics", max_body_bytes=MAX_CONTROL_BODY_BYTES
            )
        except UpstreamConnectionError:
            return None
        if status != 200:
            return None
        return parse_metrics_text(body.decode("utf-8", "replace"))

    async def discover(self, fallback: EngineConfig) -> Discovered:
        """Ask the upstream for its limits (best effort: what it does not say, ``fallback`` says).

        Args:
            fallback: The limits of the flags.

        Returns:
            The limits and where they and the load come from.
        """
        metrics = await self._get_metrics() or UpstreamFacts()
        self._usage_gauge = metrics.usage_gauge
        facts, source = metrics, "vLLM /metrics"
        if facts.kv_total_blocks is None:
            info = await self._get_json("/get_server_info")
            facts, source = parse_sglang_server_info(info), "SGLang /get_server_info"
        if facts.kv_total_blocks is None:
            props = await self._get_json("/props")
            facts, source = parse_llamacpp_props(props, fallback.block_size), "llama.cpp /props"
            if facts.kv_total_blocks is not None and self._usage_gauge is None:
                self._slots_load = parse_llamacpp_slots(await self._get_json("/slots")) is not None
        if facts.kv_total_blocks is None:
            source = "the --num-gpu-blocks/--block-size flags"
        if facts.max_num_seqs is not None:
            self._check_request_limit(facts.max_num_seqs, source)
        if self._usage_gauge is not None:
            load_source = f"its {self._usage_gauge} gauge"
        elif self._slots_load:
            load_source = "its /slots"
        else:
            load_source = "nothing: the estimate alone is reported"
        config = EngineConfig(
            kv_total_blocks=_count(facts.kv_total_blocks, "kv_total_blocks", source)
            or fallback.kv_total_blocks,
            block_size=_count(facts.block_size, "block_size", source) or fallback.block_size,
            max_num_batched_tokens=_count(
                facts.max_num_batched_tokens, "max_num_batched_tokens", source
            )
            or fallback.max_num_batched_tokens,
            max_num_seqs=_count(facts.max_num_seqs, "max_num_seqs", source)
            or fallback.max_num_seqs,
            data_parallel_size=1,
        )
        return Discovered(config=config, source=source, load_source=load_source)

    def _check_request_limit(self, upstream_limit: int, source: str) -> None:
        """Warn when the gate lets through more requests than the upstream runs at once."""
        if self._request_limit is None:
            logger.warning(
                "upstream %s runs at most %d requests at once (from %s) but "
                "--engine-request-limit is unset: requests past %d wait inside the upstream, "
                "where the gate neither sees nor sheds them; set --engine-request-limit %d",
                self._origin,
                upstream_limit,
                source,
                upstream_limit,
                upstream_limit,
            )
        elif self._request_limit > upstream_limit:
            logger.warning(
                "--engine-request-limit %d exceeds the %d requests upstream %s runs at once "
                "(from %s): %d requests may wait inside the upstream, where the gate neither "
                "sees nor sheds them; set --engine-request-limit %d",
                self._request_limit,
                upstream_limit,
                self._origin,
                source,
                self._request_limit - upstream_limit,
                upstream_limit,
            )

    async def used_blocks(self, config: EngineConfig) -> int | None:
        """KV blocks in use upstream, by its own numbers, in blocks of ``config``.

        Args:
            config: The limits announced (a usage fraction is scaled to their total, so the
                ratio stays right whatever was announced).

        Returns:
            The blocks, or ``None`` without a fresh reading.
        """
        if self._usage_gauge is not None:
            facts = await self._get_metrics()
            if facts is None or facts.kv_usage is None:
                return None
            return round(facts.kv_usage * config.kv_total_blocks)
        if self._slots_load:
            reading = parse_llamacpp_slots(await self._get_json("/slots"))
            if reading is None:
                return None
            return min(config.kv_total_blocks, -(-reading.tokens // config.block_size))
        return None


def _count(value: int | None, name: str, source: str) -> int | None:
    """A limit the upstream announced, if it is a count (shim_common._numbers) that the worker
    can compute with and announce in its hello; else ``None`` (the flag's value), with a warning.
    """
    if value is None:
        return None
    try:
        return COUNT.check(value)
    except NumberError as exc:
        logger.warning("upstream %s from %s %s; using the flag's value", name, source, exc)
        return None
