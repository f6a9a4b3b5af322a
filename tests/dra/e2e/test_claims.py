"""Claims through the whole node: the simulated control plane allocates them from the registrar's
ResourceSlice, the simulated kubelet prepares them through the registered DRA plugin before the
containers start and resolves the CDI IDs into the container's devices, mounts and envs, the vmanager
serves the claim's limits in vcuda.config, and the claim is unprepared once the pod is gone."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest

from libs.bus.server import NatsServer
from libs.cdi import device_id, spec_file_name
from libs.config import MEMORY_BLOCK
from libs.dra import DRIVER_NAME
from libs.vcuda.client import VcudaClientError, register_vdevice
from libs.vcuda.config import decode
from tests.builders import gpu_pod
from tests.dra.e2e.helpers import DraNode, claim_pod, container_id, dra_settings, start_dra_node
from tests.polling import eventually

GIB = 1 << 30


async def test_share_claim_runs_with_its_limits_and_is_unprepared_after_the_pod(dra_node: DraNode) -> None:
    node = dra_node
    pod = await node.run_pod(claim_pod("share", "gpu-share"))
    assert pod["status"]["phase"] == "Running", pod["status"]
    uid = pod["metadata"]["uid"]
    claim = node.claim_of("share")
    claim_uid = claim["metadata"]["uid"]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == DRIVER_NAME and result["device"] in ("gpu-0", "gpu-1")  # DRA GPUs only
    index = int(result["device"].removeprefix("gpu-"))

    # Prepared once, through the registered plugin (v1), before the container started.
    assert node.prepared_uids() == [claim_uid]
    grant = (await node.claim_grants())[claim_uid]
    assert [(s.index, s.cores, s.memory) for s in grant.shares] == [(index, 30, 4 * GIB)]
    assert (Path(node.settings.cdi_dir) / spec_file_name(claim_uid)).is_file()

    # What the container got: the claim's CDI device, resolved by the kubelet before CreateContainer.
    opts = node.sim.container_run_options("default", "share", "main")
    assert opts["cdi_devices"] == [device_id(claim_uid)] and opts["cdi_resolved"] is True
    assert opts["envs"]["NVIDIA_VISIBLE_DEVICES"] == grant.shares[0].uuid
    vm_dir = node.settings.vm_root / claim_uid  # the claim's own vcuda directory
    vcuda = [m for m in opts["mounts"] if m["container_path"] == "/etc/vcuda"]
    assert [m["host_path"] for m in vcuda] == [str(vm_dir)]
    assert f"/dev/nvidia{grant.shares[0].minor}" in {d["container_path"] for d in opts["devices"]}

    # The container registers through its vcuda.sock and reads the claim's cores and memory.
    node.enter_container(uid, container_id(pod))
    await register_vdevice(str(vm_dir / "vcuda.sock"), pod_uid=uid, container_name="main", timeout=5)
    cfg = decode((vm_dir / "main" / "vcuda.config").read_bytes())
    assert (cfg.utilization, cfg.gpu_memory) == (30, 16 * MEMORY_BLOCK)

    # Pod gone: NodeUnprepareResources, the grant released, the CDI spec removed, the kubelet's cache empty.
    await node.sim.delete_pod("default", "share")
    await eventually(lambda: node.sim.dra is not None and not node.sim.dra.claims, timeout=10, interval=0.05,
                     what="the kubelet's DRA manager unpreparing the claim")
    (unprepare,) = node.calls("NodeUnprepareResources")
    assert unprepare.ok and [c["uid"] for c in unprepare.request["claims"]] == [claim_uid]
    assert claim_uid not in await node.claim_grants()
    assert not (Path(node.settings.cdi_dir) / spec_file_name(claim_uid)).exists()
    assert node.sim.dra is not None and json.loads(node.sim.dra.checkpoint_path.read_text())["entries"] == []


async def test_a_claim_shared_by_two_pods_serves_each_pod_through_the_claims_socket(dra_node: DraNode) -> None:
    # A ResourceClaim of its own, used by two pods: the kubelet prepares it once (for the first pod), and
    # both pods' containers mount the claim's vcuda directory through its CDI spec. Each registers as
    # itself (the second one although it was reserved after the prepare), and a pod that does not use
    # the claim is refused there.
    node = dra_node
    node.sim.dra_objects.claims.create({"metadata": {"name": "shared", "namespace": "default"}, "spec": {
        "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER_NAME, "capacity": {
            "requests": {"cores": "30", "memory": "1Gi"}}}}]}}})
    first = await node.run_pod(claim_pod("first", claim="shared"))
    second = await node.run_pod(claim_pod("second", claim="shared"))
    other = await node.run_pod(claim_pod("other", "gpu-share"))
    assert [p["status"]["phase"] for p in (first, second, other)] == ["Running"] * 3
    claim_uid = node.claim_of("first")["metadata"]["uid"]
    assert len(node.calls("NodePrepareResources")) == 2  # "shared" once, "other"'s own claim once
    claim_dir = node.settings.vm_root / claim_uid
    for pod in (first, second):
        opts = node.sim.container_run_options("default", pod["metadata"]["name"], "main")
        assert [m["host_path"] for m in opts["mounts"] if m["container_path"] == "/etc/vcuda"] == [str(claim_dir)]

    for pod in (first, second):
        uid, cid = pod["metadata"]["uid"], container_id(pod)
        node.enter_container(uid, cid)
        await register_vdevice(str(claim_dir / "vcuda.sock"), pod_uid=uid, container_id=cid, timeout=5)
        cfg = decode((claim_dir / cid / "vcuda.config").read_bytes())
        assert (cfg.utilization, cfg.gpu_memory) == (30, 4 * MEMORY_BLOCK)

    # A pod that does not use the claim cannot register through its socket, not even naming itself.
    uid, cid = other["metadata"]["uid"], container_id(other)
    node.enter_container(uid, cid)
    with pytest.raises(VcudaClientError, match=f"PERMISSION_DENIED.*pod {uid} does not use claim default/shared"):
        await register_vdevice(str(claim_dir / "vcuda.sock"), pod_uid=uid, container_id=cid, timeout=5)
    # Nor may a pod that uses it register a container of another pod.
    node.enter_container(second["metadata"]["uid"], container_id(second))
    with pytest.raises(VcudaClientError, match="INVALID_ARGUMENT"):
        await register_vdevice(str(claim_dir / "vcuda.sock"), pod_uid=first["metadata"]["uid"],
                               container_id=container_id(first), timeout=5)

    # The claim's directory lives as long as the claim is prepared: the first pod going leaves it served.
    await node.sim.delete_pod("default", "first")
    await node.sim.delete_pod("default", "other")
    await eventually(lambda: len(node.calls("NodeUnprepareResources")) == 1, timeout=10, interval=0.05,
                     what="the other pod's claim unprepared")
    assert claim_uid in await node.claim_grants() and (claim_dir / "vcuda.sock").exists()
    await node.sim.delete_pod("default", "second")
    await eventually(lambda: not claim_dir.exists(), timeout=10, interval=0.05,
                     what="the claim's directory removed once it is unprepared")


@pytest.fixture
async def extra_node(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[DraNode]:
    extra = short_dir / "extra-config.json"
    extra.write_text(json.dumps({"default": {"devices": ["/dev/nvidia-modeset"]}}))
    settings = msgspec.structs.replace(dra_settings(short_dir, nats_server.url, dra_gpus="0,1"),
                                       extra_config=str(extra))
    async with AsyncExitStack() as stack:
        yield await start_dra_node(stack, short_dir, nats_server.url, settings, device_plugin_cores=200,
                                   dra_devices=2)


async def test_a_claim_gets_the_extra_config_devices_as_a_device_plugin_grant_does(extra_node: DraNode) -> None:
    # gpu-manager's --extra-config adds device nodes to every GPU container. On a node that serves GPUs
    # both ways, a container given its GPU by a claim (through the claim's CDI spec) gets them too,
    # as one given its GPU through the device plugin does.
    node = extra_node
    claimed = await node.run_pod(claim_pod("claimed", "gpu-share"))
    plugged = await node.run_pod(gpu_pod("plugged", ("main", 10, 1)))
    for name, pod in (("claimed", claimed), ("plugged", plugged)):
        assert pod["status"]["phase"] == "Running", pod["status"]
        devices = [d["container_path"] for d in node.sim.container_run_options("default", name, "main")["devices"]]
        assert devices[-3:] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-modeset"], (name, devices)
    claim_uid = node.claim_of("claimed")["metadata"]["uid"]
    spec = json.loads((Path(node.settings.cdi_dir) / spec_file_name(claim_uid)).read_text())
    assert "/dev/nvidia-modeset" in json.dumps(spec)
