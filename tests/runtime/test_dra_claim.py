"""A claim pod as a real container: the simulated kubelet prepares the claim through the registered DRA
plugin, resolves its CDI device (containerd 1.6 has no CDI support) into device nodes, mounts and envs
for CreateContainer, and the container registers through the mounted vcuda.sock and reads its own
vcuda.config with the claim's cores and memory."""

from __future__ import annotations

from libs.dra import DRIVER_NAME
from tests.polling import eventually
from tests.runtime.helpers import RtNode, pod


async def test_claim_container_reads_its_own_vcuda_config(rt_dra_node: RtNode) -> None:
    node = rt_dra_node
    watcher = node.sim.plugin_watcher
    assert watcher is not None
    await eventually(lambda: watcher.client(DRIVER_NAME) is not None and node.sim.dra_objects.slices.list(),
                     timeout=20, interval=0.05, what="the DRA driver registered and its ResourceSlice published")
    manifest = pod("claim", {"name": "cuda", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}})
    manifest["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu-share"}]
    running = await node.run_pod(manifest)
    assert running["status"]["phase"] == "Running", running["status"]

    code, out = await node.sh("claim", "cuda", "echo $NVIDIA_VISIBLE_DEVICES; ls /etc/vcuda; ls /dev")
    assert code == 0, out
    assert out.splitlines()[0].startswith("GPU-"), out
    assert "vcuda.sock" in out
    (grant,) = await node.allocations()
    assert grant.alloc_id.startswith("claim:") and [s.cores for s in grant.shares] == [30]
    assert out.splitlines()[0] == grant.shares[0].uuid
    assert f"nvidia{grant.shares[0].minor}" in out.split()  # the device node from the claim's CDI spec

    code, out = await node.register("claim", "cuda")
    assert (code, out.strip()) == (0, "registered"), out
    cfg = await node.read_vcuda_config("claim", "cuda")
    assert (cfg.pod_uid, cfg.utilization, cfg.gpu_memory) == (running["metadata"]["uid"], 30, 4 << 30)
