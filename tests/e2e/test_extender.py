"""Scheduler-extender compatibility (gpu-admission, gpu-manager-reference.md 3.3), through the simulator.

A predicated pod carries ``predicate-time``, ``gpu-assigned=false`` and ``predicate-gpu-idx-<i>``.
In share mode its GPU is the extender's when the share fits there, else the Allocate fails with
gpu-manager's "Nvidia node mismatch" text; a missing index fails with "failed to find predicate idx".
Every pod ends up annotated with the allocator's choice and ``gpu-assigned=true`` once started.
"""

from __future__ import annotations

import re
from typing import Any

from libs.config import MEMORY_BLOCK
from libs.vcuda.client import register_vdevice
from libs.vcuda.config import decode
from tests.builders import gpu_pod
from tests.e2e.helpers import Node


def predicated(name: str, *containers: tuple[str, int, int], idx: dict[int, str] | None = None,
               **extra: str) -> dict[str, Any]:
    ann = {"tencent.com/predicate-time": "1700000000000000000", "tencent.com/gpu-assigned": "false", **extra}
    ann.update({f"tencent.com/predicate-gpu-idx-{i}": v for i, v in (idx or {}).items()})
    return gpu_pod(name, *containers, annotations=ann)


async def annotated(node: Node, name: str) -> dict[str, str]:
    pod = await node.sim.wait_for_pod(
        "default", name, lambda p: p["metadata"].get("annotations", {}).get("tencent.com/gpu-assigned") == "true", 15)
    return pod["metadata"]["annotations"]


async def test_the_extenders_gpu_is_used_when_the_share_fits(node: Node) -> None:
    # Best fit alone would put the second share next to the first one (GPU 0); the extender said GPU 2.
    first = await node.run_pod(gpu_pod("first", ("main", 50, 4)))
    assert first["status"]["phase"] == "Running"
    pod = await node.run_pod(predicated("chosen", ("main", 20, 2), idx={0: "2"}))
    assert pod["status"]["phase"] == "Running", pod["status"]
    snap = await node.snapshot()
    alloc = next(a for a in snap.allocations if a.pod_name == "chosen")
    assert [s.minor for s in alloc.shares] == [2]
    ann = await annotated(node, "chosen")
    assert ann["tencent.com/predicate-gpu-idx-0"] == "2"


async def test_a_full_predicated_gpu_fails_with_gpu_managers_text(node: Node) -> None:
    full = await node.run_pod(predicated("filler", ("main", 90, 4), idx={0: "3"}))
    assert full["status"]["phase"] == "Running"
    pod = await node.run_pod(predicated("late", ("main", 20, 2), idx={0: "3"}))
    assert pod["status"]["phase"] == "Failed"
    assert pod["status"]["reason"] == "UnexpectedAdmissionError"
    assert re.search(r"Nvidia node mismatch for pod late\(main\), pick up:/dev/nvidia[0-2]  predicate: /dev/nvidia3",
                     pod["status"]["message"]), pod["status"]["message"]


async def test_a_predicated_pod_without_its_index_fails(node: Node) -> None:
    pod = await node.run_pod(predicated("noidx", ("main", 20, 2)))
    assert pod["status"]["phase"] == "Failed"
    assert f"failed to find predicate idx for pod {pod['metadata']['uid']}" in pod["status"]["message"]


async def test_pods_nobody_predicated_get_the_allocators_choice_written_back(node: Node) -> None:
    pod = await node.run_pod(gpu_pod("mine", ("a", 30, 2), ("b", 100, 0), ("c", 40, 1)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    snap = await node.snapshot()
    minors = {a.container: ",".join(str(s.minor) for s in a.shares) for a in snap.allocations}
    ann = await annotated(node, "mine")
    assert {k: v for k, v in ann.items() if k.startswith("tencent.com/predicate-gpu-idx-")} == {
        "tencent.com/predicate-gpu-idx-0": minors["a"],
        "tencent.com/predicate-gpu-idx-1": minors["b"],
        "tencent.com/predicate-gpu-idx-2": minors["c"],
    }


async def test_core_limit_annotation_becomes_a_soft_limit(node: Node) -> None:
    pod = await node.run_pod(gpu_pod("soft", ("main", 30, 2), annotations={"tencent.com/vcuda-core-limit": "150"}))
    assert pod["status"]["phase"] == "Running", pod["status"]
    uid = pod["metadata"]["uid"]
    snap = await node.snapshot()
    assert snap.allocations[0].core_limit == 100  # clamped to <= 100, as gpu-manager does
    vm_dir = node.settings.vm_root / uid
    node.enter_container(uid, _container_id(pod))  # the caller: a process of the pod (the vmanager checks)
    await register_vdevice(str(vm_dir / "vcuda.sock"), pod_uid=uid, container_name="main", timeout=5)
    cfg = decode((vm_dir / "main" / "vcuda.config").read_bytes())
    assert (cfg.limit, cfg.hard_limit, cfg.utilization, cfg.gpu_memory) == (100, 0, 30, 2 * MEMORY_BLOCK)


def _container_id(pod: dict) -> str:  # type: ignore[type-arg]
    return str(pod["status"]["containerStatuses"][0]["containerID"]).split("://", 1)[1]
