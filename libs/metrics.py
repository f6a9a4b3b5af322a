"""Each service's HTTP endpoint: Prometheus ``/metrics`` (and gpu-manager's ``/metric``), plus JSON routes.

Every service has its own `CollectorRegistry` (several services share one process in tests) and its
own port: the base ``--metrics-port`` plus the service's offset. Collectors read in-memory state only;
nothing on a scrape touches NVML or the disk (gpu-manager's per-scrape NVML queries overloaded nodes,
upstream #99): GPU usage is sampled in the background and the scrape reads the last sample.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from libs.config import Settings
from libs.http_endpoint import HttpEndpoint, Route
from libs.logger import get_logger

__all__ = ["HOP_BUCKETS", "HOP_METRIC", "PORT_OFFSETS", "MetricsServer", "hop_histogram", "metrics_port",
           "serving", "timed"]

PORT_OFFSETS = {"allocator": 0, "registrar": 1, "vmanager": 2, "watchdog": 3, "fleet": 4}  # fleet: the recorder

_logger = get_logger("metrics")


# The per-hop breakdown of a granted Allocate, one histogram name in the registrar (hops
# "registrar_total", "bus_round_trip", "check": the wait for its kubelet List after the allocator's reply)
# and the allocator ("decide", "append_fsync", "confirm": the wait for its own List, "reply"): an
# operator sums by hop to see where a slow Allocate spent its time. Sub-millisecond buckets: the
# whole path is a few milliseconds.
HOP_METRIC = "gpuledger_allocate_hop_duration_seconds"
HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025,
               0.05, 0.1, 0.25, 1.0)


def hop_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram(HOP_METRIC, "One step of a granted Allocate, by hop (registrar: total, bus round trip, check "
                     "against its kubelet List; allocator: decide, append_fsync, confirm, reply)", ["hop"],
                     buckets=HOP_BUCKETS, registry=registry)


def metrics_port(settings: Settings, service: str) -> int:
    """The service's port; 0 when metrics are off."""
    return settings.metrics_port + PORT_OFFSETS[service] if settings.metrics_port else 0


class MetricsServer:
    def __init__(self, service: str, registry: CollectorRegistry, *, host: str, port: int,
                 routes: dict[str, Route] | None = None) -> None:
        self.service = service
        self.registry = registry
        self.host = host
        self.port = port
        self._routes = routes or {}
        self._http: HttpEndpoint | None = None

    async def start(self) -> bool:
        """Serve; False (with an error logged) when the port cannot be bound.

        Not fatal on purpose: a device plugin that crash-loops over a busy metrics port (say, gpu-manager
        still on 5678 during a migration) takes the node's GPUs away; a missing scrape target only raises
        an alert.
        """
        http = HttpEndpoint(self.registry, self._routes, host=self.host, port=self.port)
        try:
            await http.start()
        except OSError as exc:
            _logger.error("metrics are NOT served: cannot listen; pick another --metrics-port (0 turns it off)",
                       host=self.host, port=self.port, error=exc.strerror or str(exc))
            return False
        self._http = http
        self.port = http.port
        _logger.info("serving metrics", port=self.port, paths=["/metrics", *self._routes])
        return True

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()
            self._http = None


@asynccontextmanager
async def serving(settings: Settings, service: str, registry: CollectorRegistry,
                  routes: dict[str, Route] | None = None) -> AsyncIterator[MetricsServer | None]:
    """The service's metrics server for the duration of the block (None when metrics are off)."""
    port = metrics_port(settings, service)
    if not port:
        yield None
        return
    server = MetricsServer(service, registry, host=settings.metrics_host, port=port, routes=routes)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def timed(fn: Callable[..., Awaitable[Any]], histogram: Histogram,
          outcome: Callable[[BaseException | None], dict[str, str]]) -> Callable[..., Awaitable[Any]]:
    """``fn`` with each call's duration observed in ``histogram``, labelled by ``outcome(error)``. The
    observation is made on the loop's next turn: a gRPC handler's response is on its way by then."""

    children: dict[tuple[str, ...], Histogram] = {}  # by label values: ``labels`` costs a lock and a sort

    def observe(exc: BaseException | None, seconds: float) -> None:
        labels = outcome(exc)
        if not labels:
            histogram.observe(seconds)
            return
        key = tuple(labels.values())
        child = children.get(key)
        if child is None:
            child = children[key] = histogram.labels(**labels)
        child.observe(seconds)

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:
            observe(exc, time.perf_counter() - start)
            raise
        asyncio.get_running_loop().call_soon(observe, None, time.perf_counter() - start)
        return result

    return wrapper
