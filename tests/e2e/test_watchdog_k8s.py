"""The watchdog on the (simulated) Kubernetes API over real HTTP, with the real allocator, registrar and
vmanager on a real nats-server: repairs after a watchdog outage, admission-failure cleanup,
annotation repair and node labels."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import nats
import pytest

from libs.bus.server import NatsServer
from libs.commands import PodChanged, ReleaseRequest
from libs.kube.pods import RESOURCE_VCORE
from services.watchdog import annotations as watchdog_annotations
from services.watchdog import app as watchdog_app
from services.watchdog.labels import MANAGED_ANNOTATION, MODEL_LABEL
from tests.builders import gpu_pod, pod_manifest, settings_for
from tests.e2e.helpers import WatchdogNode, base_node, seen_on
from tests.polling import eventually


def owned(manifest: dict[str, Any]) -> dict[str, Any]:
    manifest["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs",
                                                "uid": "rs-uid", "controller": True}]
    return manifest


async def test_a_pod_deleted_while_the_watchdog_was_down_is_released_with_a_reason(wnode: WatchdogNode) -> None:
    kept = await wnode.run_pod(gpu_pod("kept", ("c", 50, 2)))
    gone = await wnode.run_pod(gpu_pod("gone", ("c", 100, 0)))
    assert kept["status"]["phase"] == gone["status"]["phase"] == "Running"
    await wnode.stop_watchdog()
    await wnode.sim.delete_pod("default", "gone")
    await asyncio.sleep(0.5)
    assert {a.pod_name for a in (await wnode.snapshot()).allocations} == {"kept", "gone"}  # nobody noticed

    await wnode.start_watchdog()
    released = await wnode.tap.wait("alloc.released", 1)
    assert released[0].data["pod_uid"] == gone["metadata"]["uid"]
    assert released[0].data["reason"] == "reconcile: pod deleted"
    assert {a.pod_name for a in (await wnode.snapshot()).allocations} == {"kept"}
    await wnode.passes(2)
    assert len(wnode.tap.of("alloc.released")) == 1  # the running pod is never touched


async def test_a_deleted_pod_is_released_once(wnode: WatchdogNode) -> None:
    """A deleted pod is MODIFIED (deletionTimestamp, containers stopped), then DELETED: released at the
    first, the second asks the allocator nothing more (it used to ask again, to release nothing)."""
    pod = await wnode.run_pod(gpu_pod("once", ("c", 50, 1)))
    assert pod["status"]["phase"] == "Running"
    subjects = wnode.bus.subjects
    async with seen_on(wnode, subjects.release, ReleaseRequest) as asked, \
            seen_on(wnode, subjects.pod_fact("deleted"), PodChanged) as deleted:
        await wnode.sim.delete_pod("default", "once")
        released = await wnode.tap.wait("alloc.released", 1)
        assert released[0].data["pod_uid"] == pod["metadata"]["uid"]
        # the DELETED has been handled (its fact goes out first)
        await eventually(lambda: deleted, timeout=10, interval=0.05, what="the pod's DELETED")
        await wnode.passes(1)  # time enough for a second request to come
    assert [r.pod_uid for r in asked] == [pod["metadata"]["uid"]]
    assert len(wnode.tap.of("alloc.released")) == 1


async def test_a_pod_without_gpus_is_notified_when_it_comes_and_goes_only(wnode: WatchdogNode) -> None:
    """The allocator's pod cache gets every change of a GPU pod, and of any other pod its arrival and
    its deletion only: its status updates would cost the allocator a decode each for nothing."""
    subjects = wnode.bus.subjects

    def kinds(facts: list[PodChanged], name: str) -> list[str]:
        return [f.kind for f in facts if f.pod.metadata.name == name]

    async with seen_on(wnode, subjects.pod_fact("*"), PodChanged) as facts:
        assert (await wnode.run_pod(pod_manifest("plain")))["status"]["phase"] == "Running"
        assert (await wnode.run_pod(gpu_pod("gpu", ("c", 50, 1))))["status"]["phase"] == "Running"
        for name in ("plain", "gpu"):
            await wnode.sim.delete_pod("default", name)
        await eventually(lambda: {f.pod.metadata.name for f in facts if f.kind == "DELETED"} == {"plain", "gpu"},
                         timeout=15, interval=0.05, what="both pods' DELETED")
    assert kinds(facts, "plain") == ["ADDED", "DELETED"]
    gpu = kinds(facts, "gpu")
    assert gpu[0] == "ADDED" and gpu[-1] == "DELETED" and "MODIFIED" in gpu  # its phase, its deletion
    assert len(wnode.tap.of("alloc.released")) == 1  # the GPU pod, released as ever


async def test_an_owned_pod_that_failed_admission_is_deleted_and_a_naked_one_kept(wnode: WatchdogNode) -> None:
    for i in range(4):
        assert (await wnode.run_pod(gpu_pod(f"full-{i}", ("c", 100, 0))))["status"]["phase"] == "Running"
    naked = await wnode.run_pod(gpu_pod("naked", ("c", 100, 0)))
    assert naked["status"]["reason"] == "UnexpectedAdmissionError"
    created = await wnode.sim.create_pod(owned(gpu_pod("owned", ("c", 100, 0))))
    # The store has no event here.
    await eventually(lambda: wnode.sim.get_pod("default", "owned") is None, timeout=15, interval=0.05,
                     what="the owned pod deleted")
    assert "default/owned" in wnode.watchdog.recycler.admission.deleted  # type: ignore[union-attr]
    await wnode.passes(2)
    assert wnode.sim.get_pod("default", "naked")["status"]["phase"] == "Failed"  # type: ignore[index]
    assert created["metadata"]["uid"] not in {a.pod_uid for a in (await wnode.snapshot()).allocations}


async def test_annotations_that_disagree_with_the_ledger_are_patched(
        wnode: WatchdogNode, monkeypatch: pytest.MonkeyPatch) -> None:
    pod = await wnode.run_pod(gpu_pod("annotated", ("a", 30, 1), ("b", 100, 0)))
    snap = await wnode.snapshot()
    minors = {a.container: ",".join(str(s.minor) for s in a.shares) for a in snap.allocations}
    wanted = {"tencent.com/predicate-gpu-idx-0": minors["a"], "tencent.com/predicate-gpu-idx-1": minors["b"],
              "tencent.com/gpu-assigned": "true"}

    def annotations() -> dict[str, str]:
        current = wnode.sim.get_pod("default", "annotated")
        assert current is not None
        return current["metadata"].get("annotations") or {}

    await wnode.sim.wait_for_pod(  # the allocator's own write (after the containers started)
        "default", "annotated", lambda p: wanted.items() <= (p["metadata"].get("annotations") or {}).items(), 15)
    # Someone edits them: the next pass puts the recorded values back, and nothing else changes (the
    # pod is no longer one whose annotations the watchdog leaves to the allocator).
    monkeypatch.setattr(watchdog_annotations, "ALLOCATOR_WRITES_FOR_S", 0.0)
    wnode.sim.store.update("default", "annotated", lambda p: p["metadata"]["annotations"].update(
        {"tencent.com/predicate-gpu-idx-0": "9", "tencent.com/gpu-assigned": "false", "other": "x"}))
    await wnode.passes(2)
    assert wanted.items() <= annotations().items() and annotations()["other"] == "x"
    assert pod["metadata"]["uid"] in {a.pod_uid for a in (await wnode.snapshot()).allocations}


async def test_node_labels_are_set_kept_and_follow_the_configuration(wnode: WatchdogNode) -> None:
    def labels() -> dict[str, str]:
        return wnode.sim.node.render()["metadata"]["labels"]

    await wnode.passes(2)
    assert labels()[MODEL_LABEL] == "V100-SXM2-16GB"
    assert labels()["team"] == "ml" and labels()["tier"] == "gpu"
    assert labels()["kubernetes.io/hostname"] == wnode.settings.node_name  # others untouched

    # Someone removes one: it comes back. A label dropped from the configuration goes away.
    node = wnode.sim.node.render()
    del node["metadata"]["labels"]["team"]
    wnode.sim.node.replace(node)
    await wnode.passes(2)
    assert labels()["team"] == "ml"
    await wnode.stop_watchdog()
    await wnode.start_watchdog(wnode.settings.replace(node_labels="tier=gpu2"))
    await wnode.passes(2)
    assert "team" not in labels() and labels()["tier"] == "gpu2" and labels()[MODEL_LABEL] == "V100-SXM2-16GB"
    annotation = wnode.sim.node.render()["metadata"]["annotations"][MANAGED_ANNOTATION]
    assert annotation == f"{MODEL_LABEL},tier"


async def test_the_kubelet_view_matches_the_ledger_and_guards_releases(wnode: WatchdogNode) -> None:
    from services.watchdog.kubeletpods import KubeletPods
    from services.watchdog.recycling import _kubelet_still_runs

    pod = await wnode.run_pod(gpu_pod("viewed", ("c", 50, 2)))
    assert pod["status"]["phase"] == "Running"
    held = [a for a in (await wnode.snapshot()).allocations if a.pod_name == "viewed"]
    kubelet = KubeletPods(wnode.settings.pod_resources_socket, timeout=3)
    view = await kubelet.view()
    assert view is not None
    assert view[("default", "viewed", "c")][RESOURCE_VCORE] == set(held[0].device_ids)
    assert _kubelet_still_runs(view, held)  # a release would wait while the kubelet still runs it

    await wnode.sim.delete_pod("default", "viewed")
    await wnode.tap.wait("alloc.released", 1)
    view = await kubelet.view()
    assert view is not None and ("default", "viewed", "c") not in view
    assert not _kubelet_still_runs(view, held)
    assert await KubeletPods(str(wnode.settings.state_dir) + "/absent.sock", timeout=1).view() is None


async def test_the_first_reconciliation_retries_at_once_until_the_allocator_answers(
        nats_server: Any, short_dir: Any) -> None:
    """A watchdog that starts before the allocator (as on every `gpuledger up`) does not wait a whole
    period for its first pass: the node's GPU-model label appears as soon as the allocator answers."""
    from contextlib import AsyncExitStack

    from services.allocator import app as allocator_app
    from services.watchdog import app as watchdog_app
    from tests.builders import settings_for
    from tests.e2e.helpers import base_node

    settings = settings_for(short_dir, nats_server.url)
    async with AsyncExitStack() as stack:
        node = await base_node(stack, short_dir, nats_server.url, settings)
        watchdog = await stack.enter_async_context(watchdog_app.service(settings, reconcile_period=60))
        await asyncio.sleep(1.0)
        assert watchdog.recycler.passes == 0  # nothing answers allocator.state yet
        await stack.enter_async_context(allocator_app.service(settings))
        await eventually(lambda: watchdog.recycler.passes >= 1, timeout=10, interval=0.05,
                         what="the first reconciliation, well before the 60 s period")
        assert node.sim.node.render()["metadata"]["labels"][MODEL_LABEL] == "V100-SXM2-16GB"


async def test_a_release_the_allocator_does_not_answer_holds_up_no_later_pod(
    nats_server: NatsServer, short_dir: Path,
) -> None:
    """The watchdog announces the pods of its watch one after the other; a release it asks for is not
    awaited in that loop. With an allocator that takes the release and never answers, the next pod's
    notification still goes out at once, not after the request's 10 s timeout."""
    settings = settings_for(short_dir, nats_server.url, request_timeout=10.0)
    async with AsyncExitStack() as stack:
        node = await base_node(stack, short_dir, nats_server.url, settings)  # no allocator, no device plugin
        stuck = await nats.connect(nats_server.url)
        stack.push_async_callback(stuck.close)
        asked = await stuck.subscribe(node.bus.subjects.release)  # takes each release, answers none
        loop = asyncio.get_running_loop()
        added: dict[str, float] = {}

        async def on_fact(change: PodChanged) -> None:
            if change.kind == "ADDED":
                added.setdefault(change.pod.metadata.name, loop.time())

        await node.bus.subscribe(node.bus.subjects.pod_fact("*"), PodChanged, on_fact)
        watchdog = await stack.enter_async_context(watchdog_app.service(settings, reconcile_period=60))
        await asyncio.wait_for(watchdog.source.synced.wait(), 10)

        gone = await node.run_pod(gpu_pod("gone", ("c", 50, 1)))  # (no device plugin: nothing allocated)
        assert gone["status"]["phase"] == "Running"
        await node.sim.delete_pod("default", "gone")
        await asyncio.wait_for(asked.next_msg(timeout=10), 11)  # its release is asked for, and held
        created = loop.time()
        await node.sim.create_pod(gpu_pod("next", ("c", 50, 1)))
        await eventually(lambda: "next" in added, timeout=9, interval=0.01, what="the next pod announced")
        assert added["next"] - created < 3.0
