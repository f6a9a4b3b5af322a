"""The registrar's metrics: what it advertises to the kubelet, and how long the kubelet's calls take."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.config import Settings
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from libs.metrics import hop_histogram, serving, timed
from services.registrar.catalog import DeviceCatalog
from services.registrar.health import DeviceHealth
from services.registrar.plugin import DevicePlugin

__all__ = ["RegistrarCollector", "observe"]

KUBELET_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RegistrarCollector(Collector):
    def __init__(self, catalog: DeviceCatalog, health: DeviceHealth, plugins: list[DevicePlugin]) -> None:
        self.catalog = catalog
        self.health = health
        self.prestarts = [p.prestart for p in plugins if p.prestart is not None]
        self.lister = next((p.lister for p in plugins if p.lister is not None), None)  # the plugins share one

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        fam = GaugeMetricFamily("gpuledger_advertised_devices",
                                "Device IDs advertised to the kubelet in ListAndWatch, by health",
                                labels=["resource", "health"])
        for resource in (RESOURCE_VCORE, RESOURCE_VMEMORY):
            states = self.health.states(resource, self.catalog.ids(resource))
            for state in ("Healthy", "Unhealthy"):
                fam.add_metric([resource, state], sum(s == state for s in states))
        yield fam
        verdicts = CounterMetricFamily("gpuledger_prestart_verdicts",
                                       "PreStartContainer calls, by how they were answered: with the verdict asked "
                                       "ahead after the Allocate, or asked when the kubelet called", labels=["how"])
        for how in ("ahead", "asked"):
            verdicts.add_metric([how], sum(p.answered[how] for p in self.prestarts))
        yield verdicts
        if self.lister is None:
            return
        lists = CounterMetricFamily("gpuledger_registrar_kubelet_lists",
                                    "pod-resources Lists asked at vcore Allocates, by outcome: a failed one (the "
                                    "kubelet past its rate limit, away) leaves its grant unchecked",
                                    labels=["outcome"])
        lists.add_metric(["answered"], self.lister.answered)
        lists.add_metric(["failed"], self.lister.failures.occurrences)
        yield lists


@asynccontextmanager
async def observe(settings: Settings, plugins: list[DevicePlugin], catalog: DeviceCatalog,
                  health: DeviceHealth) -> AsyncIterator[CollectorRegistry]:
    """Instrument the plugins' kubelet calls (before they are served) and serve /metrics."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    calls = Histogram("gpuledger_kubelet_request_duration_seconds",
                      "Allocate and PreStartContainer calls from the kubelet, as the kubelet waits for them",
                      ["method", "resource", "outcome"], buckets=KUBELET_BUCKETS, registry=registry)
    hops = hop_histogram(registry)
    total, bus = hops.labels(hop="registrar_total"), hops.labels(hop="bus_round_trip")
    check = hops.labels(hop="check")

    def allocated(total_s: float, bus_s: float, check_s: float) -> None:
        total.observe(total_s)
        bus.observe(bus_s)
        check.observe(check_s)

    for plugin in plugins:
        plugin.on_allocated = allocated
        for method in ("Allocate", "PreStartContainer"):
            def outcome(exc: BaseException | None, method: str = method, resource: str = plugin.resource,
                        ) -> dict[str, str]:
                return {"method": method, "resource": resource, "outcome": "ok" if exc is None else "error"}

            setattr(plugin, method, timed(getattr(plugin, method), calls, outcome))
    registry.register(RegistrarCollector(catalog, health, plugins))
    async with serving(settings, "registrar", registry):
        yield registry
