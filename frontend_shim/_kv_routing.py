"""What the HTTP side does per request in ``--router-mode kv``: one tokenisation, the router's
guess of what it sent, and the hit metrics.

Rules:

1. Only ``kv`` tokenises, once per request, before the first pick: the prompt of a chat or a
   completion becomes token ids by :func:`shim_common.prefix.prompt_token_ids` with the
   tokeniser the workers use (the mocker's word tokeniser, or ``--tokenizer``'s
   ``tokenizer.json``), and ``prompt`` given as token ids is used as is. Block names are computed
   lazily per block size (:class:`~frontend_shim._kv_cost.Prompt`). A body whose prompt cannot be
   read is routed by load alone and judged by the worker: the frontend never refuses what the
   worker might accept. Embeddings are not tokenised.
2. When a request is sent to the chosen rank, the index is told
   (:meth:`~frontend_shim._kv_index.KvIndex.predict`), before the worker has even read it: the
   next turn of the same conversation, arriving a moment later, finds its prefix there.
3. When the worker starts the request, the choice is counted:
   ``dynamo_frontend_kv_hit_rate`` observes the chosen rank's predicted cached share of the
   prompt's tokens, and ``dynamo_frontend_kv_selected_cached_prefix_tokens_total`` adds the
   predicted cached tokens, both by model.
4. The index's own counts (:class:`~frontend_shim._kv_index.IndexStats`: events, snapshots and
   their parts, gaps, events skipped or naming no rank, names over a rank's cap) and the first
   block names it remembers are exported as ``dynamo_frontend_kv_index_*``, read at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from frontend_shim._kv_cost import NO_PROMPT, KvChoice, Prompt
from frontend_shim._kv_index import KvIndex
from shim_common import wire
from shim_common.prefix import PromptTokenizer, prompt_token_ids

__all__ = ["KvMetrics", "KvRouting"]

_HIT_BUCKETS: Final = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class KvMetrics:
    """The ``kv`` router's metrics (rule 3), in the frontend's registry, and those of its
    index (what the workers' KV events told it, read at scrape time)."""

    def __init__(self, registry: CollectorRegistry, index: KvIndex | None = None) -> None:
        self._hit_rate = Histogram(
            "dynamo_frontend_kv_hit_rate",
            "Predicted share of each routed prompt's tokens cached on the chosen worker (0-1)",
            ["model"],
            buckets=_HIT_BUCKETS,
            registry=registry,
        )
        self._cached_tokens = Counter(
            "dynamo_frontend_kv_selected_cached_prefix_tokens",
            "Prompt tokens predicted cached on the workers chosen",
            ["model"],
            registry=registry,
        )
        self._children: dict[str, tuple[Histogram, Counter]] = {}
        if index is not None:
            registry.register(_IndexCollector(index))

    def observe(self, model: str, cached_tokens: int, prompt_tokens: int) -> None:
        """One routed request: its predicted cached tokens out of its prompt's."""
        children = self._children.get(model)
        if children is None:
            children = (self._hit_rate.labels(model), self._cached_tokens.labels(model))
            self._children[model] = children
        hit_rate, cached = children
        if prompt_tokens > 0:
            hit_rate.observe(min(1.0, cached_tokens / prompt_tokens))
        cached.inc(cached_tokens)


class _IndexCollector(Collector):
    """The index's counts (:class:`~frontend_shim._kv_index.IndexStats`): plain integers, read
    as they stand (a scrape formatted in a worker thread reads no structure of the index)."""

    def __init__(self, index: KvIndex) -> None:
        self._index = index

    def collect(self) -> Iterator[Metric]:
        stats = self._index.stats
        for name, help_text, value in (
            ("events", "KV events the index took from the workers", stats.events),
            ("snapshots", "KV snapshots put in use (a snapshot in parts once)", stats.snapshots),
            ("snapshot_parts", "Parts of KV snapshots applied", stats.snapshot_parts),
            ("gaps", "Gaps seen in a worker's KV events (each may ask for a snapshot)", stats.gaps),
            ("skipped_events", "KV events already covered by a snapshot", stats.skipped),
            ("invalid_events", "KV events naming a rank the worker does not have", stats.invalid),
            ("overflow_blocks", "Block names not kept: a rank's layer was full", stats.overflow),
        ):
            yield CounterMetricFamily(f"dynamo_frontend_kv_index_{name}", help_text, value=value)
        yield GaugeMetricFamily(
            "dynamo_frontend_kv_index_first_blocks",
            "First block names whose holders the index remembers",
            value=self._index.remembered,
        )


class KvRouting:
    """The per-request part of ``--router-mode kv`` (rules at the top of the module).

    Args:
        index: the index the router scores with (fed by the links).
        tokenizer: the tokeniser the workers cut prompts with.
        metrics: where choices are counted.
    """

    def __init__(self, index: KvIndex, tokenizer: PromptTokenizer, metrics: KvMetrics) -> None:
        self.index = index
        self._tokenizer = tokenizer
        self._metrics = metrics

    def prompt(self, endpoint: wire.Endpoint, body: Mapping[str, object]) -> Prompt:
        """The request's prompt as token ids (rule 1); :data:`NO_PROMPT` when there is none."""
        if endpoint == "embeddings":
            return NO_PROMPT
        try:
            return Prompt(prompt_token_ids(endpoint, body, self._tokenizer))
        except ValueError:
            return NO_PROMPT

    def sent(self, choice: KvChoice, now: float) -> None:
        """The request went to the chosen rank (rule 2)."""
        self.index.predict(choice.worker.config.worker_id, choice.dp_rank, choice.names, now)

    def started(self, model: str, choice: KvChoice, prompt: Prompt) -> None:
        """The chosen worker started the request (rule 3)."""
        cached = choice.cached_blocks * max(1, choice.worker.config.block_size)
        tokens = len(prompt.tokens)
        self._metrics.observe(model, min(cached, tokens), tokens)
