"""A multi-container GPU pod, end to end: admitted, recorded, published, registered, deleted, recycled."""

from __future__ import annotations

import array
import asyncio
from pathlib import Path

from libs.config import MEMORY_BLOCK
from libs.store import iter_events, open_reader
from libs.vcuda.client import register_vdevice
from libs.vcuda.config import decode
from tests.builders import gpu_pod
from tests.e2e.helpers import Node


def log_types(node: Node) -> list[str]:
    conn = open_reader(node.settings.log_path)
    try:
        return [e.type for e in iter_events(conn)]
    finally:
        conn.close()


async def test_two_container_pod_end_to_end(node: Node) -> None:
    pod = await node.run_pod(gpu_pod("train", ("trainer", 50, 4), ("evaluator", 100, 0)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    uid = pod["metadata"]["uid"]
    snap = await node.snapshot()
    by_container = {a.container: a for a in snap.allocations}
    share, whole = by_container["trainer"].shares[0], by_container["evaluator"].shares[0]
    uuids = {g.index: g.uuid for g in snap.gpus}

    trainer = node.sim.container_run_options("default", "train", "trainer")
    assert [d["container_path"] for d in trainer["devices"]] == [f"/dev/nvidia{share.minor}", "/dev/nvidiactl",
                                                                 "/dev/nvidia-uvm"]
    assert all(d["host_path"] == d["container_path"] and d["permissions"] == "rwm" for d in trainer["devices"])
    assert trainer["envs"] == {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
                               "NVIDIA_VISIBLE_DEVICES": uuids[share.index]}
    vm_dir = node.settings.vm_root / uid
    assert [(m["container_path"], m["host_path"], m["read_only"]) for m in trainer["mounts"]] == [
        ("/usr/local/nvidia", str(node.settings.vdriver_root / "nvidia"), True),
        ("/etc/vcuda", str(vm_dir), True),
    ]
    assert trainer["annotations"] == {"tencent.com/vcuda-core": "50",
                                      "tencent.com/vcuda-memory": str(4 * MEMORY_BLOCK),
                                      "tencent.com/vcuda-device": f"/dev/nvidia{share.minor}"}

    evaluator = node.sim.container_run_options("default", "train", "evaluator")
    assert whole.index != share.index and whole.cores == 100
    assert evaluator["devices"][0]["container_path"] == f"/dev/nvidia{whole.minor}"
    assert evaluator["mounts"][0]["host_path"] == str(node.settings.vdriver_root / "origin")
    assert evaluator["annotations"]["tencent.com/vcuda-core"] == "100"
    assert evaluator["annotations"]["tencent.com/vcuda-memory"] == "0"

    # Recorded before the kubelet was answered, and published on NATS under the documented subjects.
    assert log_types(node) == ["inventory.recorded", "alloc.granted", "alloc.granted"]
    granted = await node.tap.wait("alloc.granted", 2)
    assert [(r.seq, r.data["container"]) for r in granted] == [(2, "trainer"), (3, "evaluator")]
    assert "gpuledger.node-1_2Eexample.alloc.granted" in node.tap.subjects

    # PreStartContainer made the pod's vcuda.sock; the CUDA library's registration writes vcuda.config.
    assert (vm_dir / "vcuda.sock").is_socket()
    cid = next(s["containerID"] for s in pod["status"]["containerStatuses"] if s["name"] == "trainer")
    cid = cid.split("://", 1)[1]
    pids = node.enter_container(uid, cid)
    await register_vdevice(str(vm_dir / "vcuda.sock"), pod_uid=uid, container_id=cid, timeout=5)
    assert list(array.array("i", (vm_dir / cid / "pids.config").read_bytes())) == pids
    config = (vm_dir / cid / "vcuda.config").read_bytes()
    assert len(config) == 8240
    cfg = decode(config)
    assert (cfg.pod_uid, cfg.container_name, cfg.utilization, cfg.gpu_memory) == (uid, "trainer", 50, 4 * MEMORY_BLOCK)
    assert (cfg.limit, cfg.hard_limit, cfg.enable) == (0, 1, 1)


async def test_a_deleted_pods_gpu_goes_to_the_next_pod(node: Node) -> None:
    pods = [await node.run_pod(gpu_pod(f"full-{i}", ("c", 100, 0))) for i in range(4)]
    assert all(p["status"]["phase"] == "Running" for p in pods)
    refused = await node.run_pod(gpu_pod("one-too-many", ("c", 100, 0)))
    assert refused["status"]["phase"] == "Failed"
    assert refused["status"]["reason"] == "UnexpectedAdmissionError"

    before = await node.snapshot()
    victim = pods[2]["metadata"]["uid"]
    freed = next(a.shares[0].index for a in before.allocations if a.pod_uid == victim)
    await node.sim.delete_pod("default", "full-2")
    released = await node.tap.wait("alloc.released", 1)
    assert released[0].data["pod_uid"] == victim and released[0].data["reason"] == "deleted"

    again = await node.run_pod(gpu_pod("next", ("c", 100, 0)))
    assert again["status"]["phase"] == "Running", again["status"]
    after = await node.snapshot()
    got = next(a for a in after.allocations if a.pod_uid == again["metadata"]["uid"])
    assert got.shares[0].index == freed
    assert victim not in {a.pod_uid for a in after.allocations}
    assert not (node.settings.vm_root / victim).exists()


async def test_finished_pods_release_at_once_and_replay_matches(node: Node) -> None:
    pod = await node.run_pod(gpu_pod("job", ("worker", 30, 2)))
    uid = pod["metadata"]["uid"]
    await node.sim.set_pod_phase("default", "job", "Succeeded")
    released = await node.tap.wait("alloc.released", 1)
    assert released[0].data == {"alloc_id": released[0].data["alloc_id"], "pod_uid": uid,
                                "container": "worker", "reason": "succeeded"}
    snap = await node.snapshot()
    assert snap.allocations == [] and all(g.cores_used == 0 for g in snap.gpus)
    from gpuledger.inspect import replay_state

    replayed = replay_state(Path(node.settings.log_path))
    assert replayed == snap


async def test_kubelet_restart_reregisters_within_two_seconds(node: Node) -> None:
    pod = await node.run_pod(gpu_pod("before", ("c", 50, 2)))
    assert pod["status"]["phase"] == "Running"
    before = await node.snapshot()
    keeper = node.services["registrar"].kubelet
    count = keeper.registrations
    loop = asyncio.get_running_loop()
    started = loop.time()
    await node.sim.restart_kubelet()
    await node.sim.wait_for_resource("tencent.com/vcuda-core", 400, timeout=2)
    await node.sim.wait_for_resource("tencent.com/vcuda-memory", 256, timeout=2)
    assert loop.time() - started < 2.0
    assert keeper.registrations == count + 1
    assert (await node.snapshot()).allocations == before.allocations
    after = await node.run_pod(gpu_pod("after", ("c", 50, 2)))
    assert after["status"]["phase"] == "Running", after["status"]
