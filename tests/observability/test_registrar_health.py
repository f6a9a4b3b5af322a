"""Which advertised IDs a GPU's health covers: its 100 vcore IDs and its own slice of vmemory IDs."""

from __future__ import annotations

from libs.config import MEMORY_BLOCK
from libs.events.schema import GpuInfo, InventoryRecorded
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from services.registrar.catalog import DeviceCatalog
from services.registrar.health import DeviceHealth


async def test_unhealthy_gpu_covers_its_slices() -> None:
    catalog = DeviceCatalog()
    gpus = (GpuInfo(index=0, minor=0, uuid="GPU-a", memory=4 * MEMORY_BLOCK),
            GpuInfo(index=1, minor=1, uuid="GPU-b", memory=2 * MEMORY_BLOCK + 5),  # a partial block
            GpuInfo(index=2, minor=2, uuid="GPU-c", memory=3 * MEMORY_BLOCK))
    await catalog.update(InventoryRecorded(node="n", backend="fake", gpus=gpus))
    health = DeviceHealth(catalog)
    vcore, vmem = catalog.ids(RESOURCE_VCORE), catalog.ids(RESOURCE_VMEMORY)
    assert set(health.states(RESOURCE_VCORE, vcore)) == {"Healthy"}

    before = catalog.version
    await health.set_unhealthy(frozenset({"GPU-b"}))
    assert catalog.version == before + 1  # wakes every ListAndWatch stream
    states = health.states(RESOURCE_VCORE, vcore)
    assert [i for i, s in enumerate(states) if s == "Unhealthy"] == list(range(100, 200))
    states = health.states(RESOURCE_VMEMORY, vmem)
    assert len(vmem) == 9
    assert [i for i, s in enumerate(states) if s == "Unhealthy"] == [4, 5]

    await health.set_unhealthy(frozenset({"GPU-b"}))
    assert catalog.version == before + 1  # no change, no wake-up
    await health.set_unhealthy(frozenset())
    assert set(health.states(RESOURCE_VMEMORY, vmem)) == {"Healthy"}
