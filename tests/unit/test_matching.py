"""Which pod an Allocate belongs to: order, continuation, init containers, mismatches."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from libs.errors import ServiceError
from libs.events.codec import StoredEvent
from libs.events.schema import AllocationGranted, ContainerResponse, GpuInfo, GpuShare, InventoryRecorded
from libs.kube.pods import Pod
from libs.ledger.state import LedgerState
from services.allocator.matching import find_candidate


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
