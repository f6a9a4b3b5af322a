"""Kubelet restart (spec 2.10, 4.1) and the checkpoint file."""

from __future__ import annotations

import base64
import json

import grpc
import pytest

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from simulator import NodeSimulator, SimConfig
from tests.builders import ctr, phase_is, pod_manifest
from tests.polling import eventually
from tests.simulator.fakeplugin import FakePlugin

GPU = "example.com/gpu"


async def test_restart_wipes_plugin_socket_and_needs_reregistration(make_plugin, sim: NodeSimulator) -> None:
    plugin = await make_plugin(count=2, pre_start_required=True)
    pod = await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 1})]))
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    uid = pod["metadata"]["uid"]
    ids = sim.allocated_device_ids(uid, "a", GPU)
    assert plugin.socket.exists()

    await sim.restart_kubelet()

    assert not plugin.socket.exists()  # the plugin's listening socket was deleted
    assert sim.registration.socket_path.exists()
    assert sim.capacity(GPU) == 0 and sim.allocatable(GPU) == 0
    info = sim.registered_resources()[GPU]
    assert info.stopped is True and info.pre_start_required is False  # rebuilt from the checkpoint
    assert sim.allocated_device_ids(uid, "a", GPU) == ids  # allocations survive
    # Registering through the old (unlinked) socket path cannot work: the plugin must re-bind.
    with pytest.raises(grpc.aio.AioRpcError) as info_err:
        await plugin.register()
    assert "failed to dial device plugin" in info_err.value.details()
    await plugin.stop()
    await plugin.start()
    await plugin.register()
    await sim.wait_for_resource(GPU, 2, timeout=5)
    assert sim.registered_resources()[GPU].stopped is False
    # The restarted kubelet still knows the running pod's devices.
    await sim.create_pod(pod_manifest("q", [ctr("a", {GPU: 2})]))
    failed = await sim.wait_for_pod("default", "q", phase_is("Failed"), timeout=5)
    assert "Requested: 2, Available: 1" in failed["status"]["message"]


async def test_restart_over_http(make_plugin, sim) -> None:
    import httpx2

    await make_plugin(count=1)
    async with httpx2.AsyncClient(base_url=sim.api_url) as client:
        resp = await client.post("/simulator/v1/kubelet/restart")
        assert resp.status_code == 200
        resources = (await client.get("/simulator/v1/resources")).json()
    assert resources[GPU]["capacity"] == 0 and resources[GPU]["stopped"] is True


async def test_checkpoint_file_layout(make_plugin, sim) -> None:
    await make_plugin(count=2)
    pod = await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 2})]))
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    doc = json.loads((sim.cfg.device_plugin_dir / "kubelet_internal_checkpoint").read_text())
    assert set(doc) == {"Data", "Checksum"}
    (entry,) = doc["Data"]["PodDeviceEntries"]
    assert entry["PodUID"] == pod["metadata"]["uid"] and entry["ContainerName"] == "a"
    assert entry["ResourceName"] == GPU
    assert sorted(entry["DeviceIDs"]["-1"]) == ["dev0", "dev1"]
    resp = dp.ContainerAllocateResponse()
    resp.ParseFromString(base64.b64decode(entry["AllocResp"]))
    assert resp.envs["FAKE_VISIBLE_DEVICES"] == "dev0,dev1"
    assert sorted(doc["Data"]["RegisteredDevices"][GPU]) == ["dev0", "dev1"]


async def test_checkpoint_seeds_a_new_simulator(plugin_dir) -> None:
    cfg = SimConfig(device_plugin_dir=plugin_dir / "dp", seed=5, endpoint_grace=60)
    async with NodeSimulator(cfg) as sim:
        plugin = FakePlugin(cfg.device_plugin_dir, count=2)
        await plugin.start()
        try:
            await plugin.register()
            await sim.wait_for_resource(GPU, 2, timeout=5)
            pod = await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 1})]))
            await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
        finally:
            await plugin.stop()
    # A "node reboot": the new kubelet knows the resource (capacity 0, stopped) and the old
    # allocation, which GC drops at the first allocation since that pod no longer exists.
    async with NodeSimulator(cfg) as sim2:
        assert sim2.capacity(GPU) == 0 and GPU in sim2.registered_resources()
        assert sim2.allocated_device_ids(pod["metadata"]["uid"], "a", GPU)
        await sim2.create_pod(pod_manifest("q", [ctr("a", {GPU: 1})]))
        failed = await sim2.wait_for_pod("default", "q", phase_is("Failed"), timeout=5)
        assert "no healthy devices present" in failed["status"]["message"]
        assert sim2.allocated_device_ids(pod["metadata"]["uid"], "a", GPU) == []


async def test_corrupt_checkpoint_starts_empty(plugin_dir) -> None:
    dp_dir = plugin_dir / "dp"
    dp_dir.mkdir()
    (dp_dir / "kubelet_internal_checkpoint").write_text("{not json")
    async with NodeSimulator(SimConfig(device_plugin_dir=dp_dir)) as sim:
        assert sim.registered_resources() == {}


async def test_restart_during_prestart_fails_that_container_only(make_plugin, sim) -> None:
    plugin = await make_plugin(count=2, pre_start_required=True)
    plugin.prestart_delay = 5
    await sim.create_pod(pod_manifest("slow", [ctr("a", {GPU: 1})]))
    await eventually(lambda: plugin.calls("PreStartContainer"), timeout=2, interval=0.02,
                     what="PreStartContainer reaching the plugin")
    await sim.restart_kubelet()

    def config_error(pod):
        sts = (pod.get("status") or {}).get("containerStatuses") or []
        return bool(sts) and sts[0]["state"].get("waiting", {}).get("reason") == "CreateContainerConfigError"

    pod = await sim.wait_for_pod("default", "slow", config_error, timeout=5)
    message = pod["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
    assert "grpc: the client connection is closing" in message
    # The kubelet goes on admitting pods once the plugin is back.
    await plugin.stop()
    plugin.prestart_delay = 0
    await plugin.start()
    await plugin.register()
    await sim.wait_for_resource(GPU, 2, timeout=5)
    await sim.create_pod(pod_manifest("next", [ctr("a", {GPU: 1})]))
    await sim.wait_for_pod("default", "next", phase_is("Running"), timeout=5)
