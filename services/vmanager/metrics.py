"""The vmanager's metrics: how far it has followed the log, and the pods whose vcuda.sock it serves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.config import Settings
from libs.metrics import serving
from services.vmanager.containers import ContainerNames
from services.vmanager.podsockets import PodSockets
from services.vmanager.tracker import AllocationTracker

if TYPE_CHECKING:
    from services.vmanager.namesahead import NamesAhead

__all__ = ["VmanagerCollector", "observe"]


class VmanagerCollector(Collector):
    def __init__(self, tracker: AllocationTracker, sockets: PodSockets, names: ContainerNames | None = None,
                 ahead: NamesAhead | None = None) -> None:
        self.tracker = tracker
        self.sockets = sockets
        self.names = names
        self.ahead = ahead

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for name, doc, value in (
            ("gpuledger_vmanager_followed_seq", "Seq of the last log event the vmanager has folded",
             self.tracker.follower.last_seq),
            ("gpuledger_vmanager_caught_up", "1 once the vmanager has caught up with the log at start",
             1 if self.tracker.caught_up.is_set() else 0),
            ("gpuledger_vmanager_pod_sockets", "Pods whose vcuda.sock the vmanager serves", len(self.sockets.servers)),
        ):
            fam = GaugeMetricFamily(name, doc)
            fam.add_metric([], value)
            yield fam
        if self.names is not None:
            lookups = CounterMetricFamily(
                "gpuledger_vmanager_container_names",
                "Registering container ids named, by who named them (runtime: CRI ContainerStatus; "
                "watchdog: the pod's status)", labels=["via"])
            for via in ("runtime", "watchdog"):
                lookups.add_metric([via], self.names.resolved[via])
            yield lookups
        if self.ahead is not None:
            ahead = CounterMetricFamily(
                "gpuledger_vmanager_container_names_ahead",
                "The runtime asked for a container's name as its cgroup appeared (asked), and registrations "
                "that found that answer (used)", labels=["step"])
            ahead.add_metric(["asked"], self.ahead.asked)
            ahead.add_metric(["used"], self.ahead.used)
            yield ahead


@asynccontextmanager
async def observe(settings: Settings, tracker: AllocationTracker, sockets: PodSockets,
                  names: ContainerNames | None = None, ahead: NamesAhead | None = None,
                  ) -> AsyncIterator[CollectorRegistry]:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(VmanagerCollector(tracker, sockets, names, ahead))
    async with serving(settings, "vmanager", registry):
        yield registry
