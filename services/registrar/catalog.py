"""The device IDs the registrar advertises, as gpu-manager names them (gpu-manager-reference.md 2.3).

vcore: 100 per GPU, ``tencent.com/vcuda-core-<i>``; vmemory: one per 256 MiB of the summed GPU memory,
``tencent.com/vcuda-memory-268435456-<i>``. The IDs mean nothing by themselves: the kubelet picks which
ones a container gets and only their count matters, which is why they are checked, never interpreted.
"""

from __future__ import annotations

import asyncio

from libs.config import MEMORY_BLOCK
from libs.events.schema import GpuInfo, InventoryRecorded
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY, vcore_device_ids

__all__ = ["DeviceCatalog", "InvalidDevices"]


class InvalidDevices(ValueError):
    pass


class DeviceCatalog:
    """What is advertised per resource; ListAndWatch streams wait on ``changed``."""

    def __init__(self) -> None:
        self.inventory: InventoryRecorded | None = None
        self.dra_gpus: frozenset[int] = frozenset()  # served by the DRA driver: not advertised here
        self.version = 0
        self.changed = asyncio.Condition()
        self._ids: dict[str, tuple[str, ...]] = {RESOURCE_VCORE: (), RESOURCE_VMEMORY: ()}
        self._known: dict[str, frozenset[str]] = {RESOURCE_VCORE: frozenset(), RESOURCE_VMEMORY: frozenset()}

    @property
    def device_plugin_gpus(self) -> list[GpuInfo]:
        """The GPUs the device plugin advertises: the inventory's, less those DRA serves."""
        return [g for g in self.inventory.gpus if g.index not in self.dra_gpus] if self.inventory else []

    async def update(self, inventory: InventoryRecorded, dra_gpus: frozenset[int] = frozenset()) -> None:
        if inventory == self.inventory and dra_gpus == self.dra_gpus:
            return
        kept = [g for g in inventory.gpus if g.index not in dra_gpus]
        gpus = len(kept)
        blocks = sum(g.memory for g in kept) // MEMORY_BLOCK
        self._ids = {
            RESOURCE_VCORE: vcore_device_ids(gpus * 100),
            RESOURCE_VMEMORY: tuple(f"{RESOURCE_VMEMORY}-{MEMORY_BLOCK}-{i}" for i in range(blocks)),
        }
        self._known = {name: frozenset(ids) for name, ids in self._ids.items()}
        async with self.changed:
            self.inventory = inventory
            self.dra_gpus = dra_gpus
            self.version += 1
            self.changed.notify_all()

    def ids(self, resource: str) -> tuple[str, ...]:
        return self._ids[resource]

    def check(self, resource: str, device_ids: list[str]) -> None:
        """Refuse what the kubelet could never have sent: nothing, duplicates, IDs never advertised."""
        if not device_ids:
            raise InvalidDevices(f"no {resource} device IDs in the request")
        if len(set(device_ids)) != len(device_ids):
            dupes = sorted({d for d in device_ids if device_ids.count(d) > 1})
            raise InvalidDevices(f"duplicate device IDs: {', '.join(dupes[:5])}")
        known = self._known[resource]
        if len(device_ids) > len(known):
            raise InvalidDevices(f"{len(device_ids)} {resource} devices asked, {len(known)} exist on this node")
        unknown = [d for d in device_ids if d not in known]
        if unknown:
            shown = ", ".join(repr(d[:80]) for d in unknown[:3])
            raise InvalidDevices(f"device IDs never advertised for {resource}: {shown}"
                                 + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""))
