"""Registrar composition root: NATS -> device catalog (from the allocator) -> plugin servers -> kubelet.

Each vcore Allocate also asks the kubelet's pod-resources List, to check the grant (kubeletlist.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from libs.bus import Bus
from libs.commands import InventoryReply, InventoryRequest
from libs.config import Settings
from libs.errors import BusError
from libs.events.codec import StoredEvent
from libs.events.schema import GpuModeChanged, InventoryRecorded
from libs.kube.claims import ClaimSource
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from libs.logger import get_logger
from libs.runtime import Supervisor
from services.registrar.catalog import DeviceCatalog
from services.registrar.cdispecs import CdiSpecs
from services.registrar.dra import DraPlugin, DraServers, rebuild_cdi
from services.registrar.health import DeviceHealth
from services.registrar.kubelet import KubeletRegistration
from services.registrar.kubeletlist import KubeletLister
from services.registrar.metrics import observe
from services.registrar.plugin import DevicePlugin

__all__ = ["RegistrarService", "service"]

_logger = get_logger("registrar")


@dataclass
class RegistrarService:
    catalog: DeviceCatalog
    kubelet: KubeletRegistration
    supervisor: Supervisor
    health: DeviceHealth | None = None  # GPU health in ListAndWatch
    dra: DraServers | None = None       # the DRA kubelet plugin, when dra_gpus names GPUs


async def _load_catalog(bus: Bus, catalog: DeviceCatalog, timeout: float) -> None:
    """Ask the allocator for the inventory until it answers (it may start after us)."""
    delay, waited = 0.1, 0.0
    while True:
        try:
            reply = await bus.request(bus.subjects.inventory, InventoryRequest(), InventoryReply, timeout=timeout)
            await catalog.update(reply.inventory, frozenset(reply.dra_gpus))
            return
        except BusError as exc:
            if waited >= 5.0:
                _logger.info("waiting for the allocator's GPU inventory", error=str(exc))
                waited = 0.0
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 2.0)


async def _serve(bus: Bus, catalog: DeviceCatalog, kubelet: KubeletRegistration, timeout: float) -> None:
    async def on_inventory(stored: StoredEvent) -> None:
        # A new inventory or a GPU moved between the device plugin and DRA: ask for both again.
        if isinstance(stored.event, InventoryRecorded | GpuModeChanged):
            await _load_catalog(bus, catalog, timeout)

    await bus.subscribe_events(bus.subjects.event("inventory.recorded"), on_inventory)
    await bus.subscribe_events(bus.subjects.event("gpu.mode"), on_inventory)
    await _load_catalog(bus, catalog, timeout)
    await kubelet.run()


@asynccontextmanager
async def service(settings: Settings) -> AsyncIterator[RegistrarService]:
    async with AsyncExitStack() as stack:
        bus = await Bus.connect(settings.nats_url, name="registrar", node=settings.node_name)
        stack.push_async_callback(bus.close)
        supervisor = Supervisor("registrar")
        stack.push_async_callback(supervisor.aclose)
        catalog = DeviceCatalog()
        health = DeviceHealth(catalog)  # GPU health in ListAndWatch, metrics
        lister = KubeletLister(settings.pod_resources_socket, bus, timeout=settings.request_timeout)
        stack.push_async_callback(lister.close)
        plugins = [DevicePlugin(RESOURCE_VCORE, catalog, bus, settings, health=health, lister=lister),
                   DevicePlugin(RESOURCE_VMEMORY, catalog, bus, settings, health=health)]
        for plugin in plugins:
            stack.push_async_callback(plugin.close)
        kubelet = KubeletRegistration(Path(settings.device_plugin_dir), plugins)
        await stack.enter_async_context(observe(settings, plugins, catalog, health))
        supervisor.spawn(health.run(bus, settings.request_timeout), "gpu-health")
        supervisor.spawn(_serve(bus, catalog, kubelet, settings.request_timeout), "kubelet")
        dra = None
        if settings.dra_gpus:
            from libs.kube.source import make_client  # lightkube, only when DRA is on
            from services.registrar.slices import SlicePublisher

            client = make_client(settings.kubeconfig)
            stack.push_async_callback(client.close)
            # the node's ResourceSlice, kept current with inventory and health
            supervisor.spawn(SlicePublisher(client, catalog, health).run(), "resource-slices")
            specs = CdiSpecs(Path(settings.cdi_dir))
            plugin = DraPlugin(bus, ClaimSource(client), specs, node=settings.node_name,
                               timeout=settings.dra_prepare_timeout, request_timeout=settings.request_timeout)
            dra = DraServers(plugin, catalog, health, node=settings.node_name,
                             endpoint=settings.dra_plugin_socket, registration=settings.dra_registration_socket)
            await _until_answered(lambda: rebuild_cdi(bus, specs, settings.request_timeout))  # before any prepare
            await dra.start()
            stack.push_async_callback(dra.stop)
        yield RegistrarService(catalog=catalog, kubelet=kubelet, supervisor=supervisor, health=health, dra=dra)


async def _until_answered(call: Callable[[], Awaitable[object]], *, patience: float = 60.0) -> None:
    """Retry a request to the allocator (it may start after us) for up to ``patience`` seconds."""
    waited, delay = 0.0, 0.1
    while True:
        try:
            await call()
            return
        except BusError:
            if waited >= patience:
                raise
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 2.0)
