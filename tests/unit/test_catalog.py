"""Advertised device IDs and the checks on what the kubelet sends back."""

from __future__ import annotations

import pytest

from libs.events.schema import GpuInfo, InventoryRecorded
from services.registrar.catalog import DeviceCatalog, InvalidDevices

GIB = 1 << 30


@pytest.fixture
async def catalog() -> DeviceCatalog:
    cat = DeviceCatalog()
    gpus = tuple(GpuInfo(index=i, minor=i, uuid=f"GPU-{i}", memory=m) for i, m in enumerate((16 * GIB, 8 * GIB + 100)))
    await cat.update(InventoryRecorded(node="n", backend="fake", gpus=gpus))
    return cat


async def test_ids_follow_gpu_manager(catalog: DeviceCatalog) -> None:
    vcore = catalog.ids("tencent.com/vcuda-core")
    vmem = catalog.ids("tencent.com/vcuda-memory")
    assert len(vcore) == 200 and vcore[0] == "tencent.com/vcuda-core-0" and vcore[-1] == "tencent.com/vcuda-core-199"
    assert len(vmem) == (24 * GIB + 100) // (256 << 20) == 96  # summed memory, then divided
    assert vmem[0] == "tencent.com/vcuda-memory-268435456-0"


@pytest.mark.parametrize(
    ("ids", "text"),
    [
        ([], "no tencent.com/vcuda-core device IDs"),
        (["tencent.com/vcuda-core-1", "tencent.com/vcuda-core-1"], "duplicate device IDs"),
        (["tencent.com/vcuda-core-200"], "never advertised"),
        (["../../etc/passwd"], "never advertised"),
        (["tencent.com/vcuda-memory-268435456-0"], "never advertised"),
        ([f"tencent.com/vcuda-core-{i}" for i in range(201)], "201 tencent.com/vcuda-core devices asked, 200 exist"),
    ],
)
async def test_bad_ids_are_refused(catalog: DeviceCatalog, ids: list[str], text: str) -> None:
    with pytest.raises(InvalidDevices, match=text):
        catalog.check("tencent.com/vcuda-core", ids)


async def test_same_inventory_is_not_a_change(catalog: DeviceCatalog) -> None:
    version = catalog.version
    assert catalog.inventory is not None
    await catalog.update(catalog.inventory)
    assert catalog.version == version
