"""The kubelet's checkpoint file as a record that confirms grants (libs/kubelet/checkpoint.py,
services/allocator/podresources.py ``KubeletCheckpoint``, identity.py ``confirmed_grants``): every
layout the kubelet has written, a file this cannot read, a file replaced under the reader, and the
rule that only an entry naming the grant's own pod UID and container, with exactly its IDs and its
memory, confirms it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from libs.config import MEMORY_BLOCK
from libs.events.schema import ContainerResponse
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from libs.kubelet.checkpoint import CheckpointEntry, CheckpointUnreadable, checkpoint_entries
from libs.ledger.state import Allocation
from services.allocator.identity import confirmed_grants
from services.allocator.podresources import KubeletCheckpoint, RecordedDevices

UID = "6f1c2a4e-0c1d-4c51-9d62-3f0c2b1a7e10"


def entry(uid: str, container: str, resource: str, ids: list[str], layout: str = "numa") -> dict[str, object]:
    return {"PodUID": uid, "ContainerName": container, "ResourceName": resource,
            "DeviceIDs": {"0": ids[:1], "-1": ids[1:]} if layout == "numa" else ids, "AllocResp": "CgQKAmlk"}


def file_of(entries: list[dict[str, object]] | None, layout: str = "numa") -> bytes:
    data = {"PodDeviceEntries": entries, "RegisteredDevices": {RESOURCE_VCORE: ["vcore-0", "vcore-1"]}}
    return json.dumps(data if layout == "legacy" else {"Data": data, "Checksum": 1234}).encode()


@pytest.mark.parametrize("layout", ["numa", "flat", "legacy"])
def test_every_layout_gives_each_entry_with_all_its_ids(layout: str) -> None:
    raw = file_of([entry(UID, "c", RESOURCE_VCORE, ["vcore-3", "vcore-4", "vcore-5"], layout)], layout)
    assert checkpoint_entries(raw) == [CheckpointEntry(UID, "c", RESOURCE_VCORE, ("vcore-3", "vcore-4", "vcore-5"))]


def test_a_file_naming_no_entries_is_none_and_one_that_is_no_checkpoint_is_refused() -> None:
    assert checkpoint_entries(file_of(None)) is None  # the kubelet writes null for none
    assert checkpoint_entries(b'{"Data": {"RegisteredDevices": {}}}') is None
    for bad in (b"", b"not json", b"[1, 2]", b'{"Data": {"PodDeviceEntries": "later"}}',
                b'{"Data": {"PodDeviceEntries": [{"PodUID": 7}]}}'):
        with pytest.raises(CheckpointUnreadable):
            checkpoint_entries(bad)


def test_the_reader_joins_each_containers_vcore_and_vmemory(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    path.write_bytes(file_of([entry(UID, "c", RESOURCE_VCORE, ["vcore-3", "vcore-4"]),
                              entry(UID, "c", RESOURCE_VMEMORY, ["vmemory-0", "vmemory-1", "vmemory-2"]),
                              entry(UID, "d", RESOURCE_VCORE, ["vcore-9"]),
                              entry(UID, "e", RESOURCE_VMEMORY, ["vmemory-7"])]))
    assert KubeletCheckpoint(path).recorded() == {
        (UID, "c"): RecordedDevices(frozenset({"vcore-3", "vcore-4"}), 3),
        (UID, "d"): RecordedDevices(frozenset({"vcore-9"}), 0),
    }


def test_the_reader_follows_the_file_as_the_kubelet_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    reader = KubeletCheckpoint(path)
    assert reader.recorded() is None  # no file yet: nothing to confirm with, and no warning
    assert reader.unreadable.occurrences == 0
    path.write_bytes(file_of([entry(UID, "c", RESOURCE_VCORE, ["vcore-1"])]))
    assert set(reader.recorded() or {}) == {(UID, "c")}
    replacement = tmp_path / ".checkpoint-new"  # the kubelet writes a new file and renames it
    replacement.write_bytes(file_of([entry(UID, "c", RESOURCE_VCORE, ["vcore-1"]),
                                     entry(UID, "d", RESOURCE_VCORE, ["vcore-2"])]))
    os.replace(replacement, path)
    assert set(reader.recorded() or {}) == {(UID, "c"), (UID, "d")}
    path.write_bytes(b"\x00garbage")
    assert reader.recorded() is None
    assert reader.unreadable.occurrences == 1
    path.unlink()
    assert reader.recorded() is None


def test_an_absurdly_large_file_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    path.write_bytes(file_of([entry(UID, "c", RESOURCE_VCORE, ["vcore-1"])]))
    monkeypatch.setattr("services.allocator.podresources.MAX_CHECKPOINT_BYTES", 16)
    reader = KubeletCheckpoint(path)
    assert reader.recorded() is None
    assert reader.unreadable.occurrences == 1


def grant(alloc_id: str, container: str, ids: tuple[str, ...], memory_blocks: int, uid: str = UID) -> Allocation:
    return Allocation(
        alloc_id=alloc_id, request_id="r", pod_uid=uid, namespace="default", pod_name="p", container=container,
        container_index=0, init_container=False, cores=len(ids), memory=memory_blocks * MEMORY_BLOCK,
        device_ids=ids, shares=(), core_limit=None, response=ContainerResponse(), granted_seq=1, granted_at=1)


def test_only_the_grants_own_pod_container_ids_and_memory_confirm_it() -> None:
    recorded = {(UID, "c"): RecordedDevices(frozenset({"vcore-1", "vcore-2"}), 2)}
    right = grant("a1", "c", ("vcore-2", "vcore-1"), 2)
    confirmed = confirmed_grants([
        right,
        grant("a2", "c", ("vcore-1", "vcore-2"), 2, uid="0d4b1c9e-5f7a-4a3b-8c2d-1e0f9a8b7c6d"),  # another pod
        grant("a3", "other", ("vcore-1", "vcore-2"), 2),  # another container
        grant("a4", "c", ("vcore-1",), 2),  # not exactly its IDs
        grant("a5", "c", ("vcore-1", "vcore-2"), 1),  # not its memory
        grant("a6", "c", (), 0),  # no kubelet IDs recorded with the grant (an import)
    ], recorded)
    assert list(confirmed) == ["a1"]
    holder = confirmed["a1"]
    assert (holder.namespace, holder.pod_name, holder.container, holder.vcore_ids, holder.vmemory) == (
        "default", "p", "c", frozenset({"vcore-1", "vcore-2"}), 2)
