"""One ``/metrics`` for a frontend of several processes: their samples summed (pure).

With ``--processes N`` every HTTP process counts its own requests in a registry of its own, and
the host process exports the fleet's gauges. A scrape of any process gets the whole frontend:

1. Sum. The samples of every process and of the host are summed by sample name and labels: a
   counter or histogram is the frontend's total, the in-flight gauge the frontend's in flight.
   Families only the host has (the per-worker gauges, the links, the event budget) come through
   as they are.
2. Never backwards, never twice. A process that exits or crashes takes its counts with it, so
   the host keeps, per process, the counters and histograms of its last snapshot, and adds them
   to :class:`Retired` when the process is gone (its gauges are dropped: what it had in flight
   is gone with it). A restarted process counts from zero again; the sum is its retired totals
   plus its new counts, so no counter goes down. What a process counted after its last snapshot
   and before it died is lost (the host takes snapshots at every scrape and every few seconds),
   never counted twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from frontend_shim._host_wire import SampleFamily
from shim_common._status import render_registry

__all__ = ["Retired", "families_of", "merge", "render"]

#: Families whose samples only ever grow: kept when their process is gone (rule 2).
_CUMULATIVE = frozenset({"counter", "histogram", "summary"})

_Key = tuple[str, tuple[tuple[str, str], ...]]


def families_of(registry: CollectorRegistry) -> list[SampleFamily]:
    """Every family of ``registry`` as plain samples."""
    return [
        SampleFamily(
            metric.name,
            metric.type,
            metric.documentation,
            [(sample.name, dict(sample.labels), float(sample.value)) for sample in metric.samples],
        )
        for metric in registry.collect()
    ]


def merge(sources: Iterable[list[SampleFamily]]) -> list[SampleFamily]:
    """The families of every source, samples with the same name and labels summed (rule 1)."""
    heads: dict[str, tuple[str, str]] = {}
    values: dict[str, dict[_Key, float]] = {}
    for families in sources:
        for family in families:
            heads.setdefault(family.name, (family.type, family.documentation))
            summed = values.setdefault(family.name, {})
            for name, labels, value in family.samples:
                key = (name, tuple(sorted(labels.items())))
                summed[key] = summed.get(key, 0.0) + value
    return [
        SampleFamily(
            name,
            kind,
            documentation,
            [(sample, dict(labels), value) for (sample, labels), value in values[name].items()],
        )
        for name, (kind, documentation) in heads.items()
    ]


class Retired:
    """The cumulative totals of processes that are gone (rule 2)."""

    def __init__(self) -> None:
        self._families: list[SampleFamily] = []

    def add(self, last_snapshot: list[SampleFamily]) -> None:
        """A process is gone; ``last_snapshot`` is the last that the host took of it."""
        kept = [family for family in last_snapshot if family.type in _CUMULATIVE]
        self._families = merge([self._families, kept])

    def families(self) -> list[SampleFamily]:
        return self._families


class _Families(Collector):
    def __init__(self, families: list[SampleFamily]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            metric = Metric(family.name, family.documentation, family.type)
            for name, labels, value in family.samples:
                metric.add_sample(name, labels, value)
            yield metric


def render(families: list[SampleFamily], accept_header: str | None) -> tuple[bytes, str]:
    """The exposition of ``families`` in the format the ``Accept`` header asks for."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return render_registry(registry, accept_header)
