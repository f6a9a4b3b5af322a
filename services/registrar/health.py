"""Which advertised device IDs are Unhealthy: those standing for a GPU the log marks unhealthy.

The registrar learns health from the committed ``gpu.health`` events (core NATS, the moment they are
published) and, so that nothing missed while it was away or disconnected stays wrong, from the
allocator's state at start and every ``resync`` seconds. A change bumps the catalog's version, which
wakes every ListAndWatch stream to send the new list at once.

The IDs mean nothing to the kubelet beyond their count, so each GPU owns a fixed slice of them:
vcore IDs 100*i .. 100*i+99 for the i-th GPU, and vmemory IDs in GPU order, memory // 256 MiB each.
Marking a slice Unhealthy takes exactly that GPU's capacity out of the node's allocatable.
"""

from __future__ import annotations

import asyncio

from libs.bus.client import Bus
from libs.commands import StateReply, StateRequest
from libs.config import MEMORY_BLOCK
from libs.errors import BusError
from libs.events.codec import StoredEvent
from libs.events.schema import GpuHealthChanged
from libs.kube.pods import RESOURCE_VCORE
from libs.logger import get_logger
from services.registrar.catalog import DeviceCatalog

__all__ = ["DeviceHealth"]

_logger = get_logger("registrar")

HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


class DeviceHealth:
    def __init__(self, catalog: DeviceCatalog) -> None:
        self.catalog = catalog
        self.unhealthy: frozenset[str] = frozenset()  # GPU uuids
        self.seq = 0  # the log position this view reflects: an older state reply must not undo a newer event

    async def set_unhealthy(self, uuids: frozenset[str]) -> None:
        if uuids == self.unhealthy:
            return
        _logger.warning("GPU health changed", unhealthy=sorted(uuids))
        async with self.catalog.changed:
            self.unhealthy = uuids
            self.catalog.version += 1
            self.catalog.changed.notify_all()

    def states(self, resource: str, ids: tuple[str, ...]) -> list[str]:
        """Healthy/Unhealthy for each ID, in order."""
        inv = self.catalog.inventory
        out = [HEALTHY] * len(ids)
        if inv is None or not self.unhealthy:
            return out
        start = 0
        for gpu in self.catalog.device_plugin_gpus:
            size = 100 if resource == RESOURCE_VCORE else gpu.memory // MEMORY_BLOCK
            if gpu.uuid in self.unhealthy:
                out[start : start + size] = [UNHEALTHY] * len(out[start : start + size])
            start += size
        return out

    async def run(self, bus: Bus, timeout: float, resync: float = 30.0) -> None:
        async def on_health(stored: StoredEvent) -> None:
            ev = stored.event
            if isinstance(ev, GpuHealthChanged) and stored.seq > self.seq:
                self.seq = stored.seq
                await self.set_unhealthy(self.unhealthy - {ev.uuid} if ev.healthy else self.unhealthy | {ev.uuid})

        sub = await bus.subscribe_events(bus.subjects.event("gpu.health"), on_health)
        try:
            while True:
                try:
                    reply = await bus.request(bus.subjects.state, StateRequest(), StateReply, timeout=timeout)
                    if reply.snapshot.seq >= self.seq:
                        self.seq = reply.snapshot.seq
                        await self.set_unhealthy(frozenset(g.uuid for g in reply.snapshot.gpus if not g.healthy))
                except BusError as exc:
                    _logger.debug("health resync failed; retrying", error=str(exc))
                    await asyncio.sleep(min(resync, 1.0))
                    continue
                await asyncio.sleep(resync)
        finally:
            await sub.unsubscribe()
