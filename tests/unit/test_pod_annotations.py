"""The one rule for a pod's extender annotations (libs/kube/annotations.py), shared by the allocator's
writer and the watchdog's repair: if they differed, each would undo the other's patch forever."""

from __future__ import annotations

from libs.events.schema import ContainerResponse, GpuShare
from libs.kube.annotations import disagreeing, extender_indexes, ready_annotations, started
from libs.ledger.state import MODE_DEVICE_PLUGIN, MODE_DRA, Allocation, GpuUsage

IDX = "tencent.com/predicate-gpu-idx-"
ASSIGNED = "tencent.com/gpu-assigned"


def share(index: int, minor: int, cores: int = 100) -> GpuShare:
    return GpuShare(index=index, uuid=f"GPU-{index}", minor=minor, cores=cores, memory=0)


def alloc(container_index: int, *shares: GpuShare, init: bool = False, seq: int = 1) -> Allocation:
    return Allocation(
        alloc_id=f"a{seq}", request_id="r", pod_uid="u", namespace="default", pod_name="p", container=f"c{seq}",
        container_index=container_index, init_container=init, cores=sum(s.cores for s in shares), memory=0,
        device_ids=(f"vcore-{seq}",), shares=shares, core_limit=None, response=ContainerResponse(),
        granted_seq=seq, granted_at=seq)


def test_minor_numbers_per_app_container_index_in_the_grants_order() -> None:
    # Ledger index and minor differ on purpose: the annotation carries minors (/dev/nvidia<minor>).
    held = [alloc(2, share(0, 7, 40), seq=3), alloc(0, share(3, 1), share(1, 5), seq=1)]
    assert ready_annotations(held, assigned=True) == {f"{IDX}0": "1,5", f"{IDX}2": "7", ASSIGNED: "true"}
    assert ready_annotations(reversed(held), assigned=False) == {f"{IDX}0": "1,5", f"{IDX}2": "7",
                                                                 ASSIGNED: "false"}


def test_init_containers_and_unknown_indexes_carry_no_index_but_the_pod_is_assigned() -> None:
    held = [alloc(0, share(0, 0), init=True, seq=1), alloc(-1, share(1, 1), seq=2)]
    assert ready_annotations(held, assigned=True) == {ASSIGNED: "true"}
    # An init container at index 0 does not hide app container 0.
    held.append(alloc(0, share(2, 2), seq=3))
    assert ready_annotations(held, assigned=True) == {f"{IDX}0": "2", ASSIGNED: "true"}


def test_two_grants_of_one_container_list_each_minor_once_oldest_first() -> None:
    held = [alloc(1, share(1, 4, 50), seq=5), alloc(1, share(0, 3, 50), share(1, 4, 50), seq=2)]
    assert ready_annotations(held, assigned=True)[f"{IDX}1"] == "3,4"


def test_a_pod_holding_nothing_carries_nothing() -> None:
    assert ready_annotations([], assigned=True) == {}


def test_disagreeing_names_missing_and_different_keys_only() -> None:
    wanted = {f"{IDX}0": "1", ASSIGNED: "true"}
    assert disagreeing({f"{IDX}0": "1", ASSIGNED: "true", "other": "x"}, wanted) == {}
    assert disagreeing({f"{IDX}0": "9", "other": "x"}, wanted) == wanted
    assert started("Running") and not started("Pending") and not started("Succeeded")


def gpu(index: int, minor: int, mode: str = MODE_DEVICE_PLUGIN) -> GpuUsage:
    return GpuUsage(index=index, uuid=f"GPU-{index}", minor=minor, memory_total=1 << 34, mode=mode)


def test_the_extender_numbers_the_device_plugin_gpus_by_minor_and_never_a_dra_gpu() -> None:
    # Without DRA GPUs (minors 0..n-1) the extender's number is the minor, as under gpu-manager.
    assert extender_indexes([gpu(i, i) for i in range(4)]) == {0: 0, 1: 1, 2: 2, 3: 3}
    # With GPUs 0 and 2 in DRA mode the extender sees two GPUs (200 vcuda-core): minors 1 and 3.
    gpus = [gpu(0, 0, MODE_DRA), gpu(1, 1), gpu(2, 2, MODE_DRA), gpu(3, 3)]
    assert extender_indexes(gpus) == {1: 0, 3: 1}
    held = [alloc(0, share(3, 3), seq=1), alloc(1, share(1, 1), seq=2)]
    assert ready_annotations(held, assigned=True, indexes=extender_indexes(gpus)) == {
        f"{IDX}0": "1", f"{IDX}1": "0", ASSIGNED: "true"}
