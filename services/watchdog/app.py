"""Watchdog composition root: Kubernetes pod source -> recycling, admission cleanup, annotation repair,
node labels, pod queries on NATS (announced on ``watchdog.ready`` at start and at each reconnect), and
(DRA driver on) the reconciliation of prepared claims."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from libs.bus import Bus
from libs.commands import PodsRequest
from libs.config import Settings
from libs.kube.claims import ClaimSource
from libs.kube.source import PodSource, make_client
from libs.runtime import Supervisor
from services.watchdog.admission import AdmissionCleanup
from services.watchdog.annotations import AnnotationRepair
from services.watchdog.announce import ReadyAnnouncer
from services.watchdog.claims import ClaimReconciler
from services.watchdog.kubeletpods import KubeletPods
from services.watchdog.labels import NodeLabeler
from services.watchdog.metrics import observe
from services.watchdog.podquery import PodQuery
from services.watchdog.recycling import Recycler

__all__ = ["WatchdogService", "service"]


@dataclass
class WatchdogService:
    source: PodSource
    recycler: Recycler
    supervisor: Supervisor


@asynccontextmanager
async def service(settings: Settings, *, reconcile_period: float | None = None) -> AsyncIterator[WatchdogService]:
    async with AsyncExitStack() as stack:
        bus = await Bus.connect(settings.nats_url, name="watchdog", node=settings.node_name)
        stack.push_async_callback(bus.close)
        client = make_client(settings.kubeconfig)
        stack.push_async_callback(client.close)
        source = PodSource(client, settings.node_name)
        claims = None
        if settings.dra_gpus:  # the DRA driver is on: its prepared claims are reconciled too
            claims = ClaimReconciler(bus, ClaimSource(client), source, settings.request_timeout)
        recycler = Recycler(
            bus, settings.request_timeout, source,
            admission=AdmissionCleanup(client),
            annotations=AnnotationRepair(client),
            labeler=NodeLabeler(client, settings.node_name, settings.node_label_map),
            kubelet=KubeletPods(settings.pod_resources_socket, settings.request_timeout),
            claims=claims,
        )
        bus.on_reconnect.append(recycler.kick)  # reconcile as soon as the broker is back
        await bus.serve(bus.subjects.pods, PodsRequest, PodQuery(source, settings.request_timeout))
        ready = ReadyAnnouncer(bus)  # copies of the pod view (the allocator's) resync when we answer again
        bus.on_reconnect.append(ready.on_reconnect)
        await ready.announce("start")
        await stack.enter_async_context(observe(settings, source))  # /metrics
        supervisor = Supervisor("watchdog")
        stack.push_async_callback(supervisor.aclose)
        supervisor.spawn(source.run(recycler.on_change), "pod-watch")
        period = reconcile_period if reconcile_period is not None else settings.allocation_check_period
        supervisor.spawn(recycler.reconcile_forever(period), "reconcile")
        yield WatchdogService(source=source, recycler=recycler, supervisor=supervisor)
