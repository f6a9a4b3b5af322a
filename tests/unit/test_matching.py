"""Which pod an Allocate belongs to: order, continuation, init containers, mismatches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from libs.errors import ServiceError
from libs.events.codec import StoredEvent
from libs.events.schema import (
    AllocationCorrected,
    AllocationGranted,
    ContainerResponse,
    GpuInfo,
    GpuShare,
    InventoryRecorded,
)
from libs.kube.pods import Pod
from libs.kubelet.podresources.v1 import api_pb2 as pr
from libs.ledger.state import LedgerState
from libs.placement.hami_response import HamiDelivery
from libs.placement.recorded import ResponseSettings
from services.allocator.identity import can_settle, misattributed, plan_corrections, settled_grants, suspects
from services.allocator.matching import find_candidate
from services.allocator.podresources import holders
from services.allocator.prestart import check_allocation

_VCUDA = ResponseSettings.of(Path("/vm"), Path("/vd"))
_HAMI = ResponseSettings.of(Path("/vm"), Path("/vd"), hami=HamiDelivery(
    library="/usr/local/vgpu/libvgpu.so", mount_dir="/usr/local/vgpu", lock_dir="/tmp/vgpulock",
    preload="/vm/_hami/ld.so.preload", origin_volume="/vd/origin", vm_root=Path("/vm")))


def pod(name: str, containers: list[tuple[str, int, int]], *, created: str = "2026-11-22T10:00:00Z",
        annotations: dict[str, str] | None = None, phase: str = "Pending",
        init: list[tuple[str, int, int]] = ()) -> Pod:  # type: ignore[assignment]
    def spec(c: tuple[str, int, int]) -> dict[str, Any]:
        limits = {"tencent.com/vcuda-core": str(c[1])}
        if c[2]:
            limits["tencent.com/vcuda-memory"] = str(c[2])
        return {"name": c[0], "resources": {"limits": limits}}

    return msgspec.convert({
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "creationTimestamp": created,
                     "annotations": annotations or {}},
        "spec": {"containers": [spec(c) for c in containers], "initContainers": [spec(c) for c in init]},
        "status": {"phase": phase},
    }, Pod)


def state_with(grants: list[tuple[str, str]]) -> LedgerState:
    state = LedgerState()
    gpu = GpuInfo(index=0, minor=0, uuid="GPU-0", memory=1 << 34)
    inventory = InventoryRecorded(node="n", backend="fake", gpus=(gpu,), links=(("X",),))
    state.apply(StoredEvent(seq=1, recorded_at=1, stream_id="inventory", version=1, event_id="0" * 32,
                            event=inventory))
    for i, (uid, container) in enumerate(grants, start=2):
        grant = AllocationGranted(
            alloc_id=f"a{i}", request_id=f"r{i}", pod_uid=uid, namespace="default", pod_name=uid,
            container=container, container_index=0, cores=10, memory=1,
            device_ids=(f"tencent.com/vcuda-core-{i}",),
            shares=(GpuShare(index=0, uuid="GPU-0", minor=0, cores=10, memory=1),), response=ContainerResponse(),
        )
        state.apply(StoredEvent(seq=i, recorded_at=i, stream_id=f"pod:{uid}", version=1, event_id="0" * 32,
                                event=grant))
    return state


def test_oldest_predicate_time_wins() -> None:
    a = pod("a", [("c", 50, 1)], annotations={"tencent.com/predicate-time": "200"})
    b = pod("b", [("c", 50, 1)], annotations={"tencent.com/predicate-time": "100"})
    cand = find_candidate([a, b], LedgerState(), 50)
    assert cand is not None and cand.pod.metadata.name == "b"


def test_creation_time_then_name_break_ties_deterministically() -> None:
    a = pod("a", [("c", 50, 1)], created="2026-11-22T10:00:01Z")
    b = pod("b", [("c", 50, 1)], created="2026-11-22T10:00:00Z")
    c = pod("c", [("c", 50, 1)], created="2026-11-22T10:00:00Z")
    for order in ([a, b, c], [c, b, a], [b, c, a]):
        cand = find_candidate(order, LedgerState(), 50)
        assert cand is not None and cand.pod.metadata.name == "b"


def test_first_container_with_equal_request_and_skips_allocated_ones() -> None:
    p = pod("p", [("small", 50, 2), ("big", 100, 0), ("small2", 50, 2)])
    cand = find_candidate([p], LedgerState(), 100)
    assert cand is not None and (cand.container.name, cand.index, cand.init) == ("big", 1, False)
    state = state_with([("uid-p", "small")])
    cand = find_candidate([p], state, 100)
    assert cand is not None and cand.container.name == "big"
    state = state_with([("uid-p", "small"), ("uid-p", "big")])
    cand = find_candidate([p], state, 50)
    assert cand is not None and cand.container.name == "small2"


def test_a_pod_part_way_through_admission_comes_first_and_must_match() -> None:
    older = pod("older", [("c", 100, 0)], created="2026-11-22T09:00:00Z")
    started = pod("started", [("x", 50, 2), ("y", 100, 0)], created="2026-11-22T10:00:00Z")
    state = state_with([("uid-started", "x")])
    cand = find_candidate([older, started], state, 100)
    assert cand is not None and (cand.pod.metadata.name, cand.container.name) == ("started", "y")
    with pytest.raises(ServiceError) as err:
        find_candidate([older, started], state, 200)
    assert err.value.code == 409 and "allocation request mismatch" in err.value.message


def test_init_containers_come_first() -> None:
    p = pod("p", [("app", 100, 0)], init=[("setup", 100, 0)])
    cand = find_candidate([p], LedgerState(), 100)
    assert cand is not None and (cand.container.name, cand.init) == ("setup", True)
    cand = find_candidate([p], state_with([("uid-p", "setup")]), 100)
    assert cand is not None and (cand.container.name, cand.init) == ("app", False)


def test_ignores_running_assigned_and_gpu_less_pods() -> None:
    pods = [
        pod("running", [("c", 50, 1)], phase="Running"),
        pod("assigned", [("c", 50, 1)], annotations={"tencent.com/gpu-assigned": "true"}),
        pod("cpu", [("c", 0, 0)]),
    ]
    assert find_candidate(pods, LedgerState(), 50) is None


# --- authoritative identity: the kubelet's record against the guess (services/allocator/identity.py) ---

BLOCK = 256 << 20


def _grant_state(grants: list[tuple[str, str, int, int, int, list[str]]], *, gpus: int = 2,
                 init: frozenset[str] = frozenset()) -> LedgerState:
    """grants: (pod, container, cores, memory blocks, gpu, device ids); each GPU holds 16 GiB."""
    state = LedgerState()
    infos = tuple(GpuInfo(index=i, minor=i, uuid=f"GPU-{i}", memory=64 * BLOCK) for i in range(gpus))
    state.apply(StoredEvent(seq=1, recorded_at=1, stream_id="inventory", version=1, event_id="0" * 32,
                            event=InventoryRecorded(node="n", backend="fake", gpus=infos)))
    for seq, (name, ctr, cores, blocks, gpu, ids) in enumerate(grants, start=2):
        grant = AllocationGranted(
            alloc_id=f"a-{name}-{ctr}", request_id=f"r{seq}", pod_uid=f"uid-{name}", namespace="default",
            pod_name=name, container=ctr, container_index=0, init_container=ctr in init, cores=cores,
            memory=blocks * BLOCK, device_ids=tuple(ids),
            shares=(GpuShare(index=gpu, uuid=f"GPU-{gpu}", minor=gpu, cores=min(cores, 100),
                             memory=blocks * BLOCK if cores < 100 else 64 * BLOCK),),
            response=ContainerResponse(),
        )
        state.apply(StoredEvent(seq=seq, recorded_at=seq, stream_id="s", version=1, event_id="0" * 32, event=grant))
    return state


def _listing(*entries: tuple[str, str, list[str], int]) -> pr.ListPodResourcesResponse:
    pods: dict[str, list[pr.ContainerResources]] = {}
    for name, ctr, ids, vmem in entries:
        devices = [pr.ContainerDevices(resource_name="tencent.com/vcuda-core", device_ids=[i]) for i in ids]
        devices += [pr.ContainerDevices(resource_name="tencent.com/vcuda-memory", device_ids=[f"m-{name}-{k}"])
                    for k in range(vmem)]
        pods.setdefault(name, []).append(pr.ContainerResources(name=ctr, devices=devices))
    return pr.ListPodResourcesResponse(pod_resources=[
        pr.PodResources(name=n, namespace="default", containers=c) for n, c in pods.items()])


def _apply(state: LedgerState, events: list[AllocationCorrected]) -> None:
    for ev in events:
        state.apply(StoredEvent(seq=state.seq + 1, recorded_at=state.seq + 1, stream_id="s", version=1,
                                event_id="0" * 32, event=ev))


def test_holders_collect_ids_per_container_and_count_vmemory() -> None:
    found = holders(_listing(("p", "c", ["v1", "v2"], 3), ("p", "gpuless", [], 0)))
    assert list(found) == [frozenset({"v1", "v2"})]
    h = found[frozenset({"v1", "v2"})]
    assert (h.namespace, h.pod_name, h.container, h.vmemory) == ("default", "p", "c", 3)


def test_a_swap_is_corrected_both_ways_on_the_same_gpu() -> None:
    # The kubelet gave pod b ids x, pod a ids y; the allocator guessed the other way round.
    state = _grant_state([("a", "main", 50, 4, 0, ["x"]), ("b", "main", 50, 60, 0, ["y"])])
    pods = [pod("a", [("main", 50, 4)]), pod("b", [("main", 50, 60)])]
    found = holders(_listing(("b", "main", ["x"], 60), ("a", "main", ["y"], 4)))
    assert [a.alloc_id for a in suspects(state, found)] == ["a-a-main", "a-b-main"]
    wrong = misattributed(state, found, pods)
    events = plan_corrections(state, wrong, share_mode=True, responses=_VCUDA, reason="test")
    assert [(e.previous_pod_uid, e.pod_uid, e.memory) for e in events] == [
        ("uid-a", "uid-b", 60 * BLOCK), ("uid-b", "uid-a", 4 * BLOCK)]
    assert all(e.shares[0].index == 0 for e in events)  # the memory still fits where they are
    assert events[0].response.mounts[1].host_path == "/vm/uid-b"
    assert events[0].response.annotations["tencent.com/vcuda-memory"] == str(60 * BLOCK)
    _apply(state, events)
    assert state.gpus[0].memory_used == 64 * BLOCK and state.gpus[0].cores_used == 100
    assert {a.pod_name: a.memory for a in state.allocations.values()} == {"b": 60 * BLOCK, "a": 4 * BLOCK}
    assert not suspects(state, found)


def test_a_correction_that_no_longer_fits_its_gpu_moves_or_fails() -> None:
    # GPU 0 is nearly full of other pods; the real owner wants more memory than is left there.
    state = _grant_state([("other", "main", 40, 58, 0, ["o"]), ("a", "main", 50, 2, 0, ["x"])])
    pods = [pod("a", [("main", 50, 2)]), pod("b", [("main", 50, 10)])]
    found = holders(_listing(("b", "main", ["x"], 10)))
    wrong = misattributed(state, found, pods)
    [moved] = plan_corrections(state, wrong, share_mode=True, responses=_VCUDA, reason="test")
    assert moved.shares[0].index == 1 and moved.memory == 10 * BLOCK

    full = _grant_state([("other", "main", 40, 58, 0, ["o"]), ("a", "main", 50, 2, 0, ["x"])], gpus=1)
    with pytest.raises(ServiceError, match=r"the kubelet gave the devices of this grant to pod default/b"):
        plan_corrections(full, misattributed(full, found, pods), share_mode=True, responses=_VCUDA,
                         reason="test")


def test_a_correction_under_hami_core_delivery_carries_the_hami_response() -> None:
    # A node delivering limits through HAMi-core must record corrections in that form too, with the
    # real owner's cache directory, not gpu-manager's vcuda response.
    state = _grant_state([("a", "main", 50, 4, 0, ["x"])])
    pods = [pod("a", [("main", 50, 4)]), pod("b", [("worker", 50, 8)])]
    found = holders(_listing(("b", "worker", ["x"], 8)))
    [moved] = plan_corrections(state, misattributed(state, found, pods), share_mode=True, responses=_HAMI,
                               reason="test")
    envs = moved.response.envs
    assert envs["CUDA_DEVICE_SM_LIMIT"] == "50"
    assert envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{8 * BLOCK >> 20}m"
    assert envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"].startswith("/usr/local/vgpu/")
    hosts = {m.container_path: m.host_path for m in moved.response.mounts}
    assert hosts["/usr/local/nvidia"] == "/vd/origin"
    assert hosts["/usr/local/vgpu"] == "/vm/uid-b/_hami/worker"
    assert "/etc/vcuda" not in hosts
    # the vcuda node's correction stays gpu-manager's response
    [plain] = plan_corrections(state, misattributed(state, found, pods), share_mode=True, responses=_VCUDA,
                               reason="test")
    assert "CUDA_DEVICE_SM_LIMIT" not in plain.response.envs
    assert {m.container_path for m in plain.response.mounts} == {"/usr/local/nvidia", "/etc/vcuda"}


def test_reused_init_devices_are_not_a_wrong_guess() -> None:
    state = _grant_state([("p", "setup", 100, 0, 0, ["x"]), ("p", "main", 100, 0, 0, ["x"])],
                         init=frozenset({"setup"}))
    assert not state.allocations["a-p-setup"].charged
    assert state.gpus[0].cores_used == 100  # once, not twice
    found = holders(_listing(("p", "main", ["x"], 0)))
    assert suspects(state, found) == []


def test_only_grants_the_kubelet_lists_as_themselves_are_settled() -> None:
    # a: listed as itself; b: its ids listed under another pod (a wrong guess); c: not listed yet; the
    # init container's ids are listed under the app container that reused them, never as itself.
    state = _grant_state([("a", "main", 50, 4, 0, ["x"]), ("b", "main", 20, 1, 1, ["y"]),
                          ("c", "main", 20, 1, 1, ["z"]), ("p", "setup", 10, 0, 1, ["w"])],
                         init=frozenset({"setup"}))
    found = holders(_listing(("a", "main", ["x"], 4), ("other", "main", ["y"], 1), ("p", "app", ["w"], 0)))
    assert list(settled_grants(state, found)) == ["a-a-main"]
    assert [a.alloc_id for a in suspects(state, found)] == ["a-b-main"]
    assert [a.alloc_id for a in state.allocations.values() if not can_settle(a)] == ["a-p-setup"]


def test_a_grant_listed_before_the_kubelet_recorded_its_memory_is_not_settled() -> None:
    # The kubelet records vcore, then asks for and records vmemory: a List between the two shows the
    # container's vcore IDs with no vmemory. Settled then, its PreStart would skip the kubelet's
    # record and warn of a vmemory count that differs from the pod spec's.
    state = _grant_state([("a", "main", 50, 4, 0, ["x"])])
    assert settled_grants(state, holders(_listing(("a", "main", ["x"], 0)))) == {}
    assert list(settled_grants(state, holders(_listing(("a", "main", ["x"], 4))))) == ["a-a-main"]


def test_prestart_check_follows_gpu_manager() -> None:
    state = _grant_state([("a", "main", 50, 4, 0, ["x"]), ("w", "main", 200, 0, 0, ["y"] * 1)])
    alloc = state.allocations["a-a-main"]
    spec = pod("a", [("main", 50, 4)])
    assert check_allocation(alloc, spec, cores=50, vmemory=4) is None
    assert check_allocation(alloc, spec, cores=50, vmemory=None) is None  # from the spec
    assert "memory 1073741824 recorded, the kubelet holds 1342177280" in check_allocation(
        alloc, spec, cores=50, vmemory=5)
    assert "50 cores recorded, the kubelet holds 60" in check_allocation(alloc, spec, cores=60, vmemory=4)
    whole = state.allocations["a-w-main"]
    assert "1 GPU(s) recorded for 200 cores, 2 expected" in check_allocation(
        whole, pod("w", [("main", 200, 0)]), cores=200, vmemory=0)


def test_the_kubelet_may_be_admitting_only_pods_it_lists_without_devices() -> None:
    from services.allocator.podresources import record

    listing = _listing(("done", "main", ["x"], 1), ("half", "a", ["y"], 1), ("half", "b", [], 0),
                       ("fresh", "main", [], 0))
    rec = record(listing)
    assert not rec.admitting(pod("done", [("main", 10, 1)]))            # every GPU container has devices
    assert rec.admitting(pod("half", [("a", 10, 1), ("b", 10, 1)]))     # part-way through admission
    assert rec.admitting(pod("fresh", [("main", 10, 1)]))               # taken up, nothing given yet
    assert not rec.admitting(pod("queued", [("main", 10, 1)]))          # not taken up by the kubelet yet
    # Ordinary init containers are never listed: a pod with GPU init containers may be in admission.
    assert rec.admitting(pod("done", [("main", 10, 1)], init=[("setup", 10, 1)]))
    # gpu-manager's guess picks the oldest predicate time; narrowed to the kubelet's pods, it picks right.
    older = pod("queued", [("main", 10, 1)], annotations={"tencent.com/predicate-time": "1"})
    admitted_now = pod("fresh", [("main", 10, 1)], annotations={"tencent.com/predicate-time": "2"})
    state = LedgerState()
    assert find_candidate([older, admitted_now], state, 10).pod.metadata.name == "queued"
    narrowed = [p for p in (older, admitted_now) if rec.admitting(p)]
    assert find_candidate(narrowed, state, 10).pod.metadata.name == "fresh"


def test_the_registrars_check_of_a_grant_agrees_with_the_allocators() -> None:
    """The registrar checks a grant the allocator recorded before any List was read, with the check the
    reply carries over the bus and the List as the kubelet sent it: same answers as the allocator's."""
    from libs.kubelet.admission import AdmissionCheck
    from services.allocator.podresources import record
    from services.registrar.kubeletlist import KubeletLister

    listing = _listing(("done", "main", ["x"], 1), ("half", "a", ["y"], 1), ("half", "b", [], 0),
                       ("fresh", "main", [], 0), ("side", "proxy", [], 0), ("side", "main", ["z"], 1))
    sidecar = msgspec.convert({
        "metadata": {"name": "side", "namespace": "default", "uid": "uid-side"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {"tencent.com/vcuda-core": "10"}}}],
                 "initContainers": [{"name": "proxy", "restartPolicy": "Always",
                                     "resources": {"limits": {"tencent.com/vcuda-core": "10"}}}]}}, Pod)
    cases = [pod("done", [("main", 10, 1)]), pod("half", [("a", 10, 1), ("b", 10, 1)]),
             pod("fresh", [("main", 10, 1)]), pod("queued", [("main", 10, 1)]),
             pod("done", [("main", 10, 1)], init=[("setup", 10, 1)]), sidecar]
    sent = listing.SerializeToString()
    answers = []
    for p in cases:
        check = msgspec.json.decode(msgspec.json.encode(AdmissionCheck.of(p)), type=AdmissionCheck)
        answers.append(KubeletLister.admits(sent, check))
    assert answers == [record(listing).admitting(p) for p in cases] == [False, True, True, False, True, True]
    # A List that does not parse checks nothing (as one that failed): the grant stands as matched.
    assert KubeletLister.admits(b"\xff\xff\xff", AdmissionCheck.of(cases[0])) is None
