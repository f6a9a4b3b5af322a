"""The registrar's ResourceSlice publisher against the simulator's API server (real HTTP): the slice
follows the inventory and health, keeps device-plugin GPUs out, and the scheduler-side allocator of
the simulator can place claims on what it published."""

from __future__ import annotations

import asyncio
from pathlib import Path

import lightkube
import pytest

from libs.dra import DRIVER_NAME
from libs.dra_objects import UNHEALTHY_TAINT, device_class
from libs.events.schema import InventoryRecorded
from libs.gpu.fake import FakeBackend
from libs.kube.pods import RESOURCE_VCORE
from services.registrar.catalog import DeviceCatalog
from services.registrar.health import DeviceHealth
from services.registrar.slices import SlicePublisher
from simulator import NodeSimulator, SimConfig
from simulator.dra.allocator import allocate
from tests.polling import eventually

PROFILE = Path(__file__).resolve().parents[2] / "libs" / "gpu" / "profiles" / "dgx-a100-8gpu.yaml"


def inventory() -> InventoryRecorded:
    found = FakeBackend(PROFILE).inventory()
    return InventoryRecorded(node="sim-node", backend="fake", driver_version=found.driver_version,
                             gpus=found.gpus, links=found.links)


@pytest.fixture
async def sim(short_dir: Path):
    async with NodeSimulator(SimConfig(device_plugin_dir=short_dir / "dp")) as node:
        yield node


async def test_slice_follows_inventory_and_health(sim) -> None:
    catalog = DeviceCatalog()
    health = DeviceHealth(catalog)
    client = lightkube.AsyncClient(config=sim.lightkube_config())
    inv = inventory()
    publisher = SlicePublisher(client, catalog, health)
    task = asyncio.create_task(publisher.run())
    slices = sim.dra_objects.slices
    try:
        await catalog.update(inv, frozenset({4, 5, 6, 7}))  # GPUs 0-3 stay with the device plugin
        await eventually(lambda: slices.list(), timeout=10, interval=0.05, what="the slice is published")
        (published,) = slices.list()
        spec = published["spec"]
        assert spec["driver"] == DRIVER_NAME and spec["nodeName"] == "sim-node"
        assert [d["name"] for d in spec["devices"]] == ["gpu-4", "gpu-5", "gpu-6", "gpu-7"]
        gpu4 = spec["devices"][0]
        assert gpu4["allowMultipleAllocations"] is True
        assert gpu4["capacity"]["cores"]["requestPolicy"]["validRange"] == {"min": "1", "max": "100", "step": "1"}
        assert gpu4["capacity"]["memory"]["value"] == str(80 * 2**30)
        assert gpu4["attributes"]["uuid"]["string"] == inv.gpus[4].uuid
        assert gpu4["attributes"]["nvlinkPeers"]["string"] == "0,1,2,3,5,6,7"
        assert gpu4["attributes"]["driverVersion"]["string"] == "535.161.08"
        first_generation = spec["pool"]["generation"]

        await health.set_unhealthy(frozenset({inv.gpus[5].uuid}))
        await eventually(lambda: slices.list()[0]["spec"]["pool"]["generation"] > first_generation,
                         timeout=10, interval=0.05, what="a new generation after the health change")
        devices = {d["name"]: d for d in slices.list()[0]["spec"]["devices"]}
        assert devices["gpu-5"]["taints"][0]["key"] == UNHEALTHY_TAINT
        assert "taints" not in devices["gpu-4"]

        # The simulator's scheduler-side allocator places a share on what was published, off the tainted GPU.
        claim = {"spec": {"devices": {"requests": [{"name": "g", "exactly": {
            "deviceClassName": DRIVER_NAME, "capacity": {"requests": {"cores": "50"}},
            "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER_NAME}"].index >= 5'}}]}}]}}}
        got = allocate(claim, {DRIVER_NAME: device_class()}, slices.list(), [], "sim-node")
        assert got["devices"]["results"][0]["device"] == "gpu-6"

        writes = publisher.writes
        await health.set_unhealthy(frozenset({inv.gpus[5].uuid}))  # no change: no write
        await asyncio.sleep(0.3)
        assert publisher.writes == writes
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()


async def test_no_dra_gpu_means_no_slice(sim) -> None:
    catalog = DeviceCatalog()
    client = lightkube.AsyncClient(config=sim.lightkube_config())
    publisher = SlicePublisher(client, catalog, DeviceHealth(catalog))
    try:
        await catalog.update(inventory())
        await publisher.publish_once()
        assert sim.dra_objects.slices.list() == []
    finally:
        await client.close()


def _advertised_gpus(catalog: DeviceCatalog) -> int:
    return len(catalog.ids(RESOURCE_VCORE)) // 100


async def test_the_slice_and_the_device_plugin_follow_the_ledgers_modes_disjointly(sim) -> None:
    # The ledger's modes, not the setting: a GPU moved at run time (or kept by the device plugin because
    # it was busy when the setting changed) is in exactly one of the slice and the advertised capacity.
    catalog = DeviceCatalog()
    client = lightkube.AsyncClient(config=sim.lightkube_config())
    publisher = SlicePublisher(client, catalog, DeviceHealth(catalog))
    slices = sim.dra_objects.slices
    inv = inventory()
    try:
        for dra in ({6, 7}, {5, 6, 7}, {7}, set()):
            await catalog.update(inv, frozenset(dra))
            await publisher.publish_once()
            published = {d["name"] for s in slices.list() for d in s["spec"]["devices"]}
            device_plugin = {f"gpu-{g.index}" for g in catalog.device_plugin_gpus}
            assert published == {f"gpu-{i}" for i in dra}
            assert published.isdisjoint(device_plugin) and published | device_plugin == {f"gpu-{i}" for i in range(8)}
            assert _advertised_gpus(catalog) == 8 - len(dra)
    finally:
        await client.close()
