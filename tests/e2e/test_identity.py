"""Authoritative pod identity from the kubelet's pod-resources API.

Two pods ask for the same 60 vcuda-core but different memory. The kubelet admits pod B first (it was
created first) while pod A carries the earlier ``tencent.com/predicate-time``: gpu-manager, which
cannot tell equal requests apart, gives B's devices to A and A's devices to B (its issue #109).
- At Allocate, pod-resources lists only the pods the kubelet has taken up, so the guess is right.
- Without it, the guess is wrong; the next PreStartContainer, or the periodic check, reads the
  kubelet's record and moves both grants: each pod ends up with its own memory limit in the log,
  on the right GPU, in the pod annotations and in vcuda.config.
"""

from __future__ import annotations

import asyncio

from libs.kube.pods import RESOURCE_VCORE
from libs.ledger.state import LedgerState
from libs.store import replay
from libs.vcuda.client import register_vdevice
from libs.vcuda.config import decode
from tests.e2e.helpers import Node, opposite_order, prepares_seen, prestart


async def test_the_kubelets_admission_order_decides_at_allocate(node: Node) -> None:
    # The kubelet's pod-resources lists only the pods it has taken up: while it admits B, A is not
    # known yet, so B gets B's grant at once (gpu-manager would give it A's, issue #109) and what
    # the kubelet hands each container is right from the start.
    uid, want = await opposite_order(node)
    snap = await node.snapshot()
    assert not node.tap.of("alloc.corrected")
    for alloc in snap.allocations:
        name = alloc.pod_name
        assert alloc.pod_uid == uid[name] and alloc.memory == want[name]
        assert sorted(alloc.device_ids) == sorted(node.sim.allocated_device_ids(uid[name], "main", RESOURCE_VCORE))
        given = node.sim.container_run_options("default", name, "main")
        assert given["annotations"]["tencent.com/vcuda-memory"] == str(want[name])
        assert {m["container_path"]: m["host_path"] for m in given["mounts"]}["/etc/vcuda"] == str(
            node.settings.vm_root / uid[name])
    assert {a.pod_name for a in snap.allocations} == {"pod-a", "pod-b"}


async def test_a_wrong_guess_is_corrected_at_prestart(node: Node) -> None:
    # Without pod-resources during admission the allocator guesses as gpu-manager does, and gets
    # both pods wrong. At the next PreStartContainer (a container restart) the kubelet's record is
    # back, and both grants move to the pods that really hold their devices.
    assert node.sim.pod_resources is not None
    await node.sim.pod_resources.stop()
    uid, want = await opposite_order(node)
    snap = await node.snapshot()
    assert {a.pod_name: sorted(a.device_ids) for a in snap.allocations} == {
        "pod-a": sorted(node.sim.allocated_device_ids(uid["pod-b"], "main", RESOURCE_VCORE)),
        "pod-b": sorted(node.sim.allocated_device_ids(uid["pod-a"], "main", RESOURCE_VCORE))}
    await node.sim.pod_resources.start()
    async with prepares_seen(node) as seen:
        await prestart(node, node.sim.allocated_device_ids(uid["pod-b"], "main", RESOURCE_VCORE))

    # The guess was wrong both ways and was corrected both ways.
    corrected = await node.tap.wait("alloc.corrected", 2, timeout=10)
    assert {(r.data["previous_pod_uid"], r.data["pod_uid"]) for r in corrected} == {
        (uid["pod-a"], uid["pod-b"]), (uid["pod-b"], uid["pod-a"])}
    assert {r.data["reason"] for r in corrected} == {"prestart"}
    # The vmanager served the socket of the pod its log named first (the wrong one), then, asked again,
    # that of the pod the check corrected the grant to, with the corrections folded.
    assert [r.pod_uid for r in seen] == ["", uid["pod-b"]]
    assert seen[1].alloc_seq >= max(r.seq for r in corrected)

    # The ledger: each pod's grant holds exactly the device IDs the kubelet gave it, and its memory.
    snap = await node.snapshot()
    by_pod = {a.pod_name: a for a in snap.allocations}
    assert set(by_pod) == {"pod-a", "pod-b"}
    for name in ("pod-a", "pod-b"):
        alloc = by_pod[name]
        assert alloc.pod_uid == uid[name]
        assert sorted(alloc.device_ids) == sorted(node.sim.allocated_device_ids(uid[name], "main", RESOURCE_VCORE))
        assert alloc.memory == want[name]
        assert alloc.shares[0].memory == want[name]
        assert alloc.response.annotations["tencent.com/vcuda-memory"] == str(want[name])
        assert alloc.response.mounts[1].host_path == str(node.settings.vm_root / uid[name])
        assert alloc.corrected_seq > 0
    # Each GPU is charged for the container that really runs on it: the one whose device node the
    # kubelet hands over (from the Allocate response it stored for that container).
    used = {g.minor: (g.cores_used, g.memory_used) for g in snap.gpus if g.cores_used}
    for name in ("pod-a", "pod-b"):
        devices = node.sim.container_run_options("default", name, "main")["devices"]
        assert devices[0]["container_path"] == f"/dev/nvidia{by_pod[name].shares[0].minor}"
        assert used[by_pod[name].shares[0].minor] == (60, want[name])
    assert len(used) == 2

    # Replaying the log reproduces the corrected state.
    replayed = LedgerState()
    replay(node.settings.log_path, replayed.apply)
    assert replayed.snapshot() == snap

    # What the vmanager writes for each pod's container follows the corrected grant.
    for name in ("pod-a", "pod-b"):
        vm_dir = node.settings.vm_root / uid[name]
        pod = node.sim.get_pod("default", name)
        assert pod is not None
        cid = str(pod["status"]["containerStatuses"][0]["containerID"]).split("://", 1)[1]
        node.enter_container(uid[name], cid)  # the caller: a process of the pod (the vmanager checks)
        await register_vdevice(str(vm_dir / "vcuda.sock"), pod_uid=uid[name], container_name="main", timeout=5)
        cfg = decode((vm_dir / "main" / "vcuda.config").read_bytes())
        assert (cfg.pod_uid, cfg.gpu_memory, cfg.utilization) == (uid[name], want[name], 60)

    # The pods carry the allocator's choice for the scheduler extender, assigned after PreStart.
    for name in ("pod-a", "pod-b"):
        minor = str(by_pod[name].shares[0].minor)
        pod = await node.sim.wait_for_pod(
            "default", name, lambda p, m=minor: p["metadata"].get("annotations", {}).get(
                "tencent.com/gpu-assigned") == "true"
            and p["metadata"]["annotations"].get("tencent.com/predicate-gpu-idx-0") == m, 15)
        assert pod["metadata"]["annotations"]["tencent.com/predicate-gpu-idx-0"] == minor


async def test_the_periodic_check_corrects_what_prestart_could_not_see(node: Node) -> None:
    # pod-resources is down while the pods start, so PreStartContainer keeps the (wrong) guess;
    # once it is back, the periodic reconciliation corrects the record.
    assert node.sim.pod_resources is not None
    await node.sim.pod_resources.stop()
    uid, want = await opposite_order(node)

    def kubelet_ids(name: str) -> list[str]:
        return sorted(node.sim.allocated_device_ids(uid[name], "main", RESOURCE_VCORE))

    snap = await node.snapshot()  # the guess stood: each record holds the other pod's devices
    assert {a.pod_name: sorted(a.device_ids) for a in snap.allocations} == {
        "pod-a": kubelet_ids("pod-b"), "pod-b": kubelet_ids("pod-a")}

    await node.sim.pod_resources.start()
    allocator = node.services["allocator"].handlers
    loop = asyncio.create_task(allocator.reconcile_forever(0.2))
    try:
        await node.tap.wait("alloc.corrected", 2, timeout=15)
    finally:
        loop.cancel()
    snap = await node.snapshot()
    assert {a.pod_name: a.memory for a in snap.allocations} == want
    assert {r.data["reason"] for r in node.tap.of("alloc.corrected")} == {"reconcile"}
    assert {a.pod_name: sorted(a.device_ids) for a in snap.allocations} == {
        "pod-a": kubelet_ids("pod-a"), "pod-b": kubelet_ids("pod-b")}


async def test_a_release_never_takes_a_grant_the_kubelet_gave_another_pod(node: Node) -> None:
    # Issue 13 (the chaos test, seed 2): a grant guessed for the wrong pod, then that pod deleted
    # before any check corrected the guess. Releasing everything recorded under the deleted pod
    # would take the devices the kubelet gave the pod that stays, which then runs on devices the
    # ledger holds for nobody (its next PreStartContainer fails). The release corrects first.
    assert node.sim.pod_resources is not None
    await node.sim.pod_resources.stop()
    uid, want = await opposite_order(node)

    def kubelet_ids(name: str) -> list[str]:
        return sorted(node.sim.allocated_device_ids(uid[name], "main", RESOURCE_VCORE))

    a_ids = kubelet_ids("pod-a")
    snap = await node.snapshot()  # the guess stood: pod-b's record holds pod-a's devices
    assert {a.pod_name: sorted(a.device_ids) for a in snap.allocations}["pod-b"] == a_ids

    await node.sim.pod_resources.start()
    await node.sim.delete_pod("default", "pod-b")
    corrected = await node.tap.wait("alloc.corrected", 1, timeout=15)
    assert corrected[0].data["reason"] == "release"
    async with asyncio.timeout(15):
        snap = await node.snapshot()
        while uid["pod-b"] in {a.pod_uid for a in snap.allocations}:
            await asyncio.sleep(0.1)
            snap = await node.snapshot()
    holding_a = [a for a in snap.allocations if sorted(a.device_ids) == a_ids]
    assert [(a.pod_uid, a.container, a.memory) for a in holding_a] == [(uid["pod-a"], "main", want["pod-a"])]
    # pod-a's container still passes its PreStartContainer check on the devices it was given.
    await prestart(node, a_ids)
    # The other half of the swap (pod-b's devices, recorded under pod-a) is held by nobody now; the
    # kubelet no longer lists pod-b, so nothing says whose it was: it stays charged to pod-a until
    # pod-a goes (over-reserved for a while, never lost), and then everything is free.
    await node.sim.delete_pod("default", "pod-a")
    async with asyncio.timeout(15):
        snap = await node.snapshot()
        while snap.allocations:
            await asyncio.sleep(0.1)
            snap = await node.snapshot()
