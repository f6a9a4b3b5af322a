"""realign.py on real files: after a correction, each vcuda.config in a pod directory follows the ledger."""

from __future__ import annotations

import os
from pathlib import Path

from libs.events.schema import ContainerResponse, GpuShare
from libs.ledger.state import Allocation, LedgerState
from libs.vcuda.config import config_for, decode, encode
from services.vmanager.realign import realign_pod_dir, wanted_configs

UID = "0b5e6c44-1f0a-4b7e-9a53-6f1f0f6d2a10"
MIB = 1 << 20


def grant(container: str, memory: int, seq: int) -> Allocation:
    return Allocation(
        alloc_id=f"a{seq}", request_id="r", pod_uid=UID, namespace="default", pod_name="p", container=container,
        container_index=0, init_container=False, cores=60, memory=memory, device_ids=(f"vcore-{seq}",),
        shares=(GpuShare(index=0, uuid="GPU-0", minor=0, cores=60, memory=memory),), core_limit=None,
        response=ContainerResponse(), granted_seq=seq, granted_at=seq)


def written(directory: Path, container: str, memory: int) -> Path:
    directory.mkdir()
    path = directory / "vcuda.config"
    path.write_bytes(encode(config_for(grant(container, memory, 1), container_name=container, driver_version="")))
    (directory / "pids.config").write_bytes(b"\0")
    return path


def test_wrong_limits_are_rewritten_and_a_container_without_a_grant_loses_its_entry(tmp_path: Path) -> None:
    state = LedgerState()
    state.allocations = {"a1": grant("main", 512 * MIB, 1), "a2": grant("main", 1024 * MIB, 2),
                         "a3": grant("side", 256 * MIB, 3)}
    pod_dir = tmp_path / UID
    pod_dir.mkdir()
    main = written(pod_dir / "main", "main", 4096 * MIB)             # limits of the guessed grant
    side = written(pod_dir / "c0ffee", "side", 256 * MIB)              # already right
    gone = written(pod_dir / "deadbeef", "helper", 256 * MIB)         # its grant moved to another container
    (pod_dir / "empty").mkdir()                                       # no vcuda.config: not ours to judge
    (pod_dir / "vcuda.sock").write_bytes(b"")
    outside = written(tmp_path / "outside", "helper", 1)
    os.symlink(outside.parent, pod_dir / "link")                     # never followed
    before_side = side.stat().st_mtime_ns

    done = realign_pod_dir(pod_dir, wanted_configs(state, UID))
    assert done.rewritten == ["main"] and done.removed == ["deadbeef"]
    assert decode(main.read_bytes()).gpu_memory == 1024 * MIB         # the newest grant of the container
    assert (main.parent / "pids.config").exists()
    assert not gone.parent.exists()
    assert side.stat().st_mtime_ns == before_side
    assert (pod_dir / "empty").is_dir() and (pod_dir / "vcuda.sock").exists() and outside.exists()

    again = realign_pod_dir(pod_dir, wanted_configs(state, UID))
    assert again.rewritten == [] and again.removed == []


def test_a_missing_pod_directory_is_nothing_to_do(tmp_path: Path) -> None:
    done = realign_pod_dir(tmp_path / UID, {})
    assert done.rewritten == [] and done.removed == []
