"""Watchdog composition root: Kubernetes pod source -> recycling + pod queries on NATS."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from libs.bus import Bus
from libs.commands import PodsRequest
from libs.config import Settings
from libs.kube.source import PodSource, make_client
from libs.runtime import Supervisor
from services.watchdog.metrics import observe
from services.watchdog.podquery import PodQuery
from services.watchdog.recycling import Recycler

__all__ = ["RECONCILE_PERIOD", "WatchdogService", "service"]

RECONCILE_PERIOD = 30.0  # gpu-manager's --allocation-check-period default


@dataclass
class WatchdogService:
    source: PodSource
    recycler: Recycler
    supervisor: Supervisor


@asynccontextmanager
async def service(settings: Settings, *, reconcile_period: float = RECONCILE_PERIOD) -> AsyncIterator[WatchdogService]:
    async with AsyncExitStack() as stack:
        bus = await Bus.connect(settings.nats_url, name="watchdog", node=settings.node_name)
        stack.push_async_callback(bus.close)
        client = make_client(settings.kubeconfig)
        stack.push_async_callback(client.close)
        recycler = Recycler(bus, settings.request_timeout)
        source = PodSource(client, settings.node_name, recycler.on_change)
        recycler.source = source
        await bus.serve(bus.subjects.pods, PodsRequest, PodQuery(source, settings.request_timeout))
        await stack.enter_async_context(observe(settings, source))  # issue 7: /metrics
        supervisor = Supervisor("watchdog")
        stack.push_async_callback(supervisor.aclose)
        supervisor.spawn(source.run(), "pod-watch")
        supervisor.spawn(recycler.reconcile_forever(reconcile_period), "reconcile")
        yield WatchdogService(source=source, recycler=recycler, supervisor=supervisor)
