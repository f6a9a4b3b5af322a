"""The watchdog's metrics: the pods it sees on the node and how often its watch had to relist."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.config import Settings
from libs.kube.source import PodSource
from libs.metrics import serving

__all__ = ["WatchdogCollector", "observe"]


class WatchdogCollector(Collector):
    def __init__(self, source: PodSource) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pods = GaugeMetricFamily("gpuledger_watchdog_pods", "Pods of this node in the watch cache, by phase",
                                 labels=["phase"])
        phases: dict[str, int] = {}
        for pod in list(self.source.pods.values()):
            phases[pod.status.phase] = phases.get(pod.status.phase, 0) + 1
        for phase, count in sorted(phases.items()):
            pods.add_metric([phase], count)
        yield pods
        for name, doc, value in (
            ("gpuledger_watchdog_synced", "1 once the pod watch has listed the node's pods",
             1 if self.source.synced.is_set() else 0),
            ("gpuledger_watchdog_relists", "Times the pod watch had to list again (expired or broken watch)",
             self.source.relists),
        ):
            fam = GaugeMetricFamily(name, doc)
            fam.add_metric([], value)
            yield fam


@asynccontextmanager
async def observe(settings: Settings, source: PodSource) -> AsyncIterator[CollectorRegistry]:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(WatchdogCollector(source))
    async with serving(settings, "watchdog", registry):
        yield registry
