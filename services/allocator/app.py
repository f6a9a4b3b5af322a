"""Allocator composition root: log (a half-done archive finished) -> replayed state -> the ledger (the
one writer) -> GPU inventory -> NATS handlers -> outbox relay -> archiver -> GPU health and usage ->
metrics, plus the kubelet's pod-resources client (pod identity) and the API client (extender
annotations)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from libs.bus import Bus, Relay
from libs.config import Settings
from libs.gpu import load_inventory
from libs.gpu.backends import open_monitor
from libs.kube.source import make_client
from libs.kubelet.checkpoint import CHECKPOINT_FILE
from libs.ledger.snapshot import SnapshotKeeper, load_state
from libs.logger import get_logger
from libs.metrics import MetricsServer
from libs.placement.recorded import ResponseSettings
from libs.runtime import Supervisor
from libs.store import EventLog
from libs.store.archive import finish as finish_archive
from libs.witness.node import Checkpointer, open_checkpointer
from services.allocator.archiver import Archiver
from services.allocator.claims import ClaimHandlers, apply_mode_setting
from services.allocator.extender import AnnotationWriter
from services.allocator.extraconfig import default_devices
from services.allocator.handlers import Allocator
from services.allocator.health import HealthWatcher
from services.allocator.inventory import record_inventory
from services.allocator.ledger import Ledger
from services.allocator.metrics import AllocatorMetrics, serving_metrics
from services.allocator.podcache import PodCache
from services.allocator.podresources import KubeletCheckpoint, KubeletPodResources
from services.allocator.usage import UsageSampler

__all__ = ["AllocatorService", "service"]

_POD_RESYNC = 30.0  # seconds between full resyncs of the allocator's pod cache from the watchdog


@dataclass
class AllocatorService:
    ledger: Ledger
    handlers: Allocator
    relay: Relay
    supervisor: Supervisor
    health: HealthWatcher
    usage: UsageSampler
    metrics: AllocatorMetrics
    archiver: Archiver
    metrics_server: MetricsServer | None = None  # None when metrics are off
    checkpointer: Checkpointer | None = None     # None when checkpoint_every is 0


@asynccontextmanager
async def service(settings: Settings) -> AsyncIterator[AllocatorService]:
    logger = get_logger("allocator")
    async with AsyncExitStack() as stack:
        extra_devices = default_devices(settings.extra_config)  # a bad file stops the start, first
        recorded = ResponseSettings.for_node(settings, extra_devices)
        # Inline commits: every append goes through the ledger's lock, so a writer thread would never
        # group two of them, only add two hand-offs to each (libs/store/writer.py).
        events = await EventLog.open(settings.log_path, response_settings=recorded, inline=True)
        stack.push_async_callback(events.close)
        await asyncio.to_thread(finish_archive, settings.log_path)  # a stop mid-archive: finish it first
        restored = await asyncio.to_thread(load_state, settings.log_path)  # snapshot + the log's tail
        state = restored.state
        logger.info("state replayed", seq=state.seq, allocations=len(state.allocations),
                 snapshot_seq=restored.snapshot_seq, replayed=restored.replayed)
        snapshots = SnapshotKeeper(settings.log_path, state, saved_seq=restored.snapshot_seq)
        stack.push_async_callback(snapshots.save)  # at a clean stop, so the next start replays nothing
        metrics = AllocatorMetrics()
        ledger = Ledger(events, state, observer=metrics)

        found = await asyncio.to_thread(load_inventory, settings.gpus)
        await record_inventory(ledger, settings.node_name, found)
        logger.info("gpus", backend=found.backend, count=len(found.gpus))

        bus = await Bus.connect(settings.nats_url, name="allocator", node=settings.node_name)
        stack.push_async_callback(bus.close)
        supervisor = Supervisor("allocator")
        stack.push_async_callback(supervisor.aclose)
        kubelet = KubeletPodResources(settings.pod_resources_socket, timeout=settings.request_timeout,
                                      on_list=metrics.kubelet_listed)
        stack.push_async_callback(kubelet.close)
        try:
            client = make_client(settings.kubeconfig)
        except Exception as exc:  # no API access: allocate anyway, without writing annotations
            logger.warning("no Kubernetes API client: extender annotations will not be written", error=str(exc))
            client = None
        else:
            stack.push_async_callback(client.close)
        annotations = AnnotationWriter(client, state.pod_allocations, lambda: state.gpus.values())
        stack.callback(annotations.close)  # the writes still waiting: a running pod's are repaired by the watchdog
        pod_cache = PodCache(bus)
        await pod_cache.start(timeout=min(1.0, settings.request_timeout))
        handlers = Allocator(settings, ledger, bus, kubelet=kubelet, annotations=annotations,
                             pod_cache=pod_cache, observer=metrics, responses=recorded,
                             checkpoint=KubeletCheckpoint(Path(settings.device_plugin_dir) / CHECKPOINT_FILE))
        stack.push_async_callback(handlers.close)
        relay = Relay(bus, events, replies_out=handlers.replies.wait)
        supervisor.spawn(relay.run(), "relay")
        checkpointer = open_checkpointer(settings, bus, events)  # signed checkpoints for the outside witness
        if checkpointer is not None:
            supervisor.spawn(checkpointer.run(), "checkpointer")
        archiver = Archiver(settings.log_path, snapshots, lambda: relay.published,
                            retention=settings.log_retention_events)
        monitor = await asyncio.to_thread(open_monitor, found, Path(settings.proc_root))
        stack.callback(monitor.close)  # after the watcher's thread stopped
        usage = UsageSampler(monitor, bus, interval=settings.usage_interval, timeout=settings.request_timeout)
        health = HealthWatcher(settings, monitor, ledger, bus)
        stack.push_async_callback(health.stop)
        watching = [supervisor.spawn(usage.run(), "usage-sampler"), *await health.start(supervisor)]
        stack.push_async_callback(_cancel, watching)  # nothing may use the monitor once it is closed
        server = await stack.enter_async_context(serving_metrics(settings, metrics, state, events, relay, usage))
        supervisor.spawn(snapshots.run(), "snapshots")
        supervisor.spawn(annotations.run(), "annotations")
        supervisor.spawn(pod_cache.resync_forever(_POD_RESYNC, settings.request_timeout), "pod-cache")
        if settings.identity_check_period > 0:
            supervisor.spawn(handlers.reconcile_forever(settings.identity_check_period), "identity-check")
        if settings.log_retention_events:
            supervisor.spawn(archiver.retention_forever(lambda: events.last_seq), "log-retention")
        await archiver.serve(bus)
        await apply_mode_setting(ledger, settings.dra_gpus)  # which GPUs DRA serves (idle ones only move)
        claims = ClaimHandlers(settings, ledger, bus, responses=recorded)  # the grants' form, for claims
        await handlers.serve()
        await claims.serve()
        yield AllocatorService(ledger=ledger, handlers=handlers, relay=relay, supervisor=supervisor, health=health,
                               usage=usage, metrics=metrics, archiver=archiver, metrics_server=server,
                               checkpointer=checkpointer)


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
