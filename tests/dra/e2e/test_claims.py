"""Claims through the whole node: the simulated control plane allocates them from the registrar's
ResourceSlice, the simulated kubelet prepares them through the registered DRA plugin before the
containers start and resolves the CDI IDs into the container's devices, mounts and envs, the vmanager
serves the claim's limits in vcuda.config, and the claim is unprepared once the pod is gone."""

from __future__ import annotations

import json
from pathlib import Path

from libs.cdi import device_id, spec_file_name
from libs.config import MEMORY_BLOCK
from libs.dra import DRIVER_NAME
from libs.vcuda.client import register_vdevice
from libs.vcuda.config import decode
from tests.dra.e2e.helpers import DraNode, claim_pod, container_id
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
    vm_dir = node.settings.vm_root / uid
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
