"""The pod model's rules and the ledger fold."""

from __future__ import annotations

import msgspec
import pytest

from libs.events.codec import StoredEvent
from libs.events.schema import (
    AllocationGranted,
    AllocationReleased,
    ContainerResponse,
    GpuInfo,
    GpuShare,
    InventoryRecorded,
)
from libs.kube.pods import Pod, is_active, parse_quantity, predicate_time
from libs.ledger.state import LedgerState


@pytest.mark.parametrize(("text", "value"), [("50", 50), (4, 4), ("2k", 2000), ("1Ki", 1024), (" 7 ", 7)])
def test_quantities(text: str | int, value: int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["0.5", "1e3", "-1", "abc", ""])
def test_bad_quantities(text: str) -> None:
    with pytest.raises(ValueError, match="whole-number"):
        parse_quantity(text)


def _pod(**status: object) -> Pod:
    meta = {"name": "p", "uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z"}
    if "deleting" in status:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
        status.pop("deleting")
    return msgspec.convert({"metadata": meta, "status": status}, Pod)


def test_active_follows_gpu_manager() -> None:
    assert is_active(_pod(phase="Pending"))
    assert is_active(_pod(phase="Running"))
    assert not is_active(_pod(phase="Succeeded"))
    assert not is_active(_pod(phase="Failed"))
    running = [{"name": "c", "state": {"running": {}}}]
    stopped = [{"name": "c", "state": {"terminated": {"exitCode": 0}}}]
    assert is_active(_pod(phase="Running", deleting=True, containerStatuses=running))
    assert not is_active(_pod(phase="Running", deleting=True, containerStatuses=stopped))
    assert not is_active(_pod(phase="Running", deleting=True))


def test_predicate_time_falls_back_to_creation() -> None:
    p = _pod(phase="Pending")
    assert predicate_time(p) == 1767225600 * 10**9
    p.metadata.annotations["tencent.com/predicate-time"] = "42"
    assert predicate_time(p) == 42


def _stored(seq: int, ev: object) -> StoredEvent:
    return StoredEvent(seq=seq, recorded_at=seq * 10, stream_id="s", version=seq, event_id="0" * 32, event=ev)  # type: ignore[arg-type]


def _grant(alloc_id: str, gpu: int, cores: int, memory: int) -> AllocationGranted:
    return AllocationGranted(
        alloc_id=alloc_id, request_id="r" + alloc_id, pod_uid="pod-" + alloc_id, namespace="ns", pod_name="p",
        container="c", container_index=0, cores=cores, memory=memory,
        device_ids=tuple(f"tencent.com/vcuda-core-{i}" for i in range(cores)),
        shares=(GpuShare(index=gpu, uuid=f"GPU-{gpu}", minor=gpu, cores=min(cores, 100), memory=memory),),
        response=ContainerResponse())


def test_fold_charges_and_refunds() -> None:
    state = LedgerState()
    inv = InventoryRecorded(node="n", backend="fake", gpus=tuple(
        GpuInfo(index=i, minor=i, uuid=f"GPU-{i}", memory=1000) for i in range(2)))
    state.apply(_stored(1, inv))
    state.apply(_stored(2, _grant("a", 0, 30, 100)))
    state.apply(_stored(3, _grant("b", 0, 50, 200)))
    assert (state.gpus[0].cores_used, state.gpus[0].memory_used) == (80, 300)
    found = state.find_by_devices([f"tencent.com/vcuda-core-{i}" for i in range(50)])
    assert found is not None and found.alloc_id == "b"
    state.apply(_stored(4, AllocationReleased(alloc_id="a", pod_uid="pod-a", container="c", reason="deleted")))
    assert (state.gpus[0].cores_used, state.gpus[0].memory_used, state.gpus[0].alloc_ids) == (50, 200, ["b"])
    duplicate = AllocationReleased(alloc_id="b", pod_uid="pod-b", container="c", reason="x")
    state.apply(_stored(4, duplicate))  # a seq already folded: ignored
    assert "b" in state.allocations
    with pytest.raises(ValueError, match="gap"):
        state.apply(_stored(9, AllocationReleased(alloc_id="b", pod_uid="pod-b", container="c", reason="x")))
    snap = state.snapshot()
    assert snap.seq == 4 and [a.alloc_id for a in snap.allocations] == ["b"]


def test_find_by_devices_matches_exactly_the_set_in_any_order_the_newest_first() -> None:
    state = LedgerState()
    inv = InventoryRecorded(node="n", backend="fake", gpus=tuple(
        GpuInfo(index=i, minor=i, uuid=f"GPU-{i}", memory=1000) for i in range(2)))
    state.apply(_stored(1, inv))
    state.apply(_stored(2, _grant("a", 0, 30, 100)))  # IDs 0..29
    state.apply(_stored(3, _grant("b", 1, 50, 200)))  # IDs 0..49: a superset of a's, same first ID
    ids = [f"tencent.com/vcuda-core-{i}" for i in range(50)]
    assert state.find_by_devices(list(reversed(ids))).alloc_id == "b"  # type: ignore[union-attr]
    assert state.find_by_devices(ids[:30][::-1]).alloc_id == "a"  # type: ignore[union-attr]
    assert state.find_by_devices(ids[1:30]) is None  # a subset of both
    assert state.find_by_devices([*ids, "tencent.com/vcuda-core-77"]) is None  # more than any grant holds
    newer = msgspec.structs.replace(_grant("c", 1, 30, 100), device_ids=tuple(ids[:30][::-1]))
    state.apply(_stored(4, newer))
    assert state.find_by_devices(ids[:30]).alloc_id == "c"  # type: ignore[union-attr]
