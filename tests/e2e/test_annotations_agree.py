"""The allocator and the watchdog agree on a pod's extender annotations (one rule, libs/kube/annotations.py).

Through the simulator's API over HTTP, with the four real services: once the allocator has written a
running pod's annotations, the watchdog's reconciliation passes never patch the pod again (its PATCHes
are counted in the simulator's call log), and a hand-edited annotation is put back to exactly the
value the allocator wrote, once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from libs.kube.annotations import ready_annotations
from services.watchdog import annotations as watchdog_annotations
from tests.builders import gpu_pod
from tests.e2e.helpers import WatchdogNode

IDX = "tencent.com/predicate-gpu-idx-"
ASSIGNED = "tencent.com/gpu-assigned"


def pod_patches(node: WatchdogNode, name: str) -> int:
    return sum(1 for c in node.sim.calls
               if c.method == "PATCH" and c.resource == "pods" and c.request["name"] == name and c.ok)


def ours(annotations: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in annotations.items() if k.startswith(IDX) or k == ASSIGNED}


async def test_a_running_pods_annotations_are_stable_and_repaired_to_the_allocators_values(
        wnode: WatchdogNode, monkeypatch: pytest.MonkeyPatch) -> None:
    # An init container, a shared GPU and a two-GPU container: every case of the rule at once.
    manifest = gpu_pod("stable", ("shared", 30, 2), ("wide", 200, 0))
    manifest["spec"]["initContainers"] = [{"name": "setup", "image": "cuda", "resources": {
        "limits": {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "1"}}}]
    pod = await wnode.run_pod(manifest)
    assert pod["status"]["phase"] == "Running", pod["status"]
    written = await wnode.sim.wait_for_pod(
        "default", "stable", lambda p: p["metadata"].get("annotations", {}).get(ASSIGNED) == "true", 15)
    writer = wnode.services["allocator"].handlers.annotations
    await asyncio.wait_for(writer.queue.join(), 15)  # every patch the allocator decided has been sent
    written = wnode.sim.get_pod("default", "stable")
    assert written is not None
    allocator_wrote = ours(written["metadata"]["annotations"])

    snap = await wnode.snapshot()
    held = [a for a in snap.allocations if a.pod_name == "stable"]
    by_container = {a.container: a for a in held}
    assert set(by_container) == {"setup", "shared", "wide"}
    assert allocator_wrote == {
        f"{IDX}0": ",".join(str(s.minor) for s in by_container["shared"].shares),
        f"{IDX}1": ",".join(str(s.minor) for s in by_container["wide"].shares),
        ASSIGNED: "true",
    } == ready_annotations(held, assigned=True)
    assert "," in allocator_wrote[f"{IDX}1"]  # two minors

    # Two reconciliation passes: the watchdog agrees, and patches nothing (the pod is no longer one
    # whose annotations it leaves to the allocator: that write is in).
    monkeypatch.setattr(watchdog_annotations, "ALLOCATOR_WRITES_FOR_S", 0.0)
    before = pod_patches(wnode, "stable")
    assert before >= 1  # the allocator's own writes are counted too
    await wnode.passes(2)
    assert pod_patches(wnode, "stable") == before
    assert "default/stable" not in wnode.watchdog.recycler.annotations.patched  # type: ignore[union-attr]

    # A hand edit: the next pass writes back exactly what the allocator wrote, in one patch, and leaves
    # other annotations alone; later passes patch nothing more.
    wnode.sim.store.update("default", "stable", lambda p: p["metadata"]["annotations"].update(
        {f"{IDX}1": "9", ASSIGNED: "false", "note": "x"}))
    await wnode.passes(2)
    repaired = wnode.sim.get_pod("default", "stable")
    assert repaired is not None
    assert ours(repaired["metadata"]["annotations"]) == allocator_wrote
    assert repaired["metadata"]["annotations"]["note"] == "x"
    assert pod_patches(wnode, "stable") == before + 1
    await wnode.passes(2)
    assert pod_patches(wnode, "stable") == before + 1


async def test_a_pod_started_soon_after_its_allocate_is_patched_once(wnode: WatchdogNode) -> None:
    """The Allocate's write (gpu-assigned=false) waits, the PreStart's replaces it and waits too: one
    PATCH, gpu-assigned=true, after the containers started; the watchdog's passes meanwhile (one a
    second here) leave the young pod to that write instead of repairing it first."""
    writer = wnode.services["allocator"].handlers.annotations
    writer.defer_for = 1.5
    pod = await wnode.run_pod(gpu_pod("quick", ("c", 20, 1)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    await wnode.passes(1)  # within the write's wait
    assert pod_patches(wnode, "quick") == 0
    await wnode.sim.wait_for_pod(
        "default", "quick", lambda p: p["metadata"].get("annotations", {}).get(ASSIGNED) == "true", 15)
    await asyncio.wait_for(writer.queue.join(), 15)
    await wnode.passes(2)
    assert pod_patches(wnode, "quick") == 1
    settled = wnode.sim.get_pod("default", "quick")
    assert settled is not None and settled["metadata"]["annotations"][ASSIGNED] == "true"


async def test_an_allocate_time_write_lands_after_its_delay_when_no_prestart_replaces_it(
        wnode: WatchdogNode) -> None:
    writer = wnode.services["allocator"].handlers.annotations
    pod = await wnode.run_pod(gpu_pod("slow", ("c", 20, 1)))
    await asyncio.wait_for(writer.queue.join(), 15)
    wnode.sim.store.update("default", "slow", lambda p: p["metadata"]["annotations"].clear())
    writer.defer_for = 0.3
    writer.publish("default", "slow", pod["metadata"]["uid"], assigned=False, defer=True)
    await asyncio.sleep(0.1)
    early = wnode.sim.get_pod("default", "slow")
    assert early is not None and ASSIGNED not in early["metadata"]["annotations"]  # not yet
    late = await wnode.sim.wait_for_pod(
        "default", "slow", lambda p: p["metadata"].get("annotations", {}).get(ASSIGNED) == "false", 5)
    held = [a for a in (await wnode.snapshot()).allocations if a.pod_name == "slow"]
    assert ours(late["metadata"]["annotations"]) == ready_annotations(held, assigned=False)
