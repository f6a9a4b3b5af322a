"""Allocator composition root: log -> replayed state -> GPU inventory -> NATS handlers -> outbox relay,
plus the kubelet's pod-resources client (pod identity) and the API client (extender annotations)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from libs.bus import Bus, Relay
from libs.config import Settings
from libs.gpu import load_inventory
from libs.kube.source import make_client
from libs.ledger.snapshot import SnapshotKeeper, load_state
from libs.log import get_logger
from libs.runtime import Supervisor
from libs.store import EventLog
from services.allocator.extender import AnnotationWriter
from services.allocator.extraconfig import default_devices
from services.allocator.handlers import Allocator
from services.allocator.inventory import inventory_event
from services.allocator.metrics import Observability, observe
from services.allocator.podcache import PodCache
from services.allocator.podresources import KubeletPodResources

__all__ = ["AllocatorService", "service"]

_POD_RESYNC = 30.0  # seconds between full resyncs of the allocator's pod cache from the watchdog


@dataclass
class AllocatorService:
    handlers: Allocator
    relay: Relay
    supervisor: Supervisor
    observability: Observability | None = None  # issue 7: metrics, health, usage


@asynccontextmanager
async def service(settings: Settings) -> AsyncIterator[AllocatorService]:
    log = get_logger("allocator")
    async with AsyncExitStack() as stack:
        extra_devices = default_devices(settings.extra_config)  # a bad file stops the start, first
        events = await EventLog.open(settings.log_path)
        stack.push_async_callback(events.close)
        restored = await asyncio.to_thread(load_state, settings.log_path)  # snapshot + the log's tail
        state = restored.state
        log.info("state replayed", seq=state.seq, allocations=len(state.allocations),
                 snapshot_seq=restored.snapshot_seq, replayed=restored.replayed)
        snapshots = SnapshotKeeper(settings.log_path, state, saved_seq=restored.snapshot_seq)
        stack.push_async_callback(snapshots.save)  # at a clean stop, so the next start replays nothing

        found = await asyncio.to_thread(load_inventory, settings.gpus)
        if (changed := inventory_event(settings.node_name, found, state)) is not None:
            for stored in await events.append([changed]):
                state.apply(stored)
        log.info("gpus", backend=found.backend, count=len(found.gpus))

        bus = await Bus.connect(settings.nats_url, name="allocator", node=settings.node_name)
        stack.push_async_callback(bus.close)
        supervisor = Supervisor("allocator")
        stack.push_async_callback(supervisor.aclose)
        kubelet = KubeletPodResources(settings.pod_resources_socket, timeout=settings.request_timeout)
        stack.push_async_callback(kubelet.close)
        try:
            client = make_client(settings.kubeconfig)
        except Exception as exc:  # no API access: allocate anyway, without writing annotations
            log.warning("no Kubernetes API client: extender annotations will not be written", error=str(exc))
            client = None
        else:
            stack.push_async_callback(client.close)
        annotations = AnnotationWriter(client, state.pod_allocations)
        pod_cache = PodCache(bus)
        await pod_cache.start(timeout=min(1.0, settings.request_timeout))
        handlers = Allocator(settings, events, state, bus, kubelet=kubelet, annotations=annotations,
                             pod_cache=pod_cache, extra_devices=extra_devices)
        relay = Relay(bus, events)
        supervisor.spawn(relay.run(), "relay")
        obs = await stack.enter_async_context(observe(settings, handlers, relay, found, supervisor))
        supervisor.spawn(snapshots.run(), "snapshots")
        supervisor.spawn(annotations.run(), "annotations")
        supervisor.spawn(pod_cache.resync_forever(_POD_RESYNC, settings.request_timeout), "pod-cache")
        if settings.identity_check_period > 0:
            supervisor.spawn(handlers.reconcile_forever(settings.identity_check_period), "identity-check")
        await handlers.serve()
        yield AllocatorService(handlers=handlers, relay=relay, supervisor=supervisor, observability=obs)
