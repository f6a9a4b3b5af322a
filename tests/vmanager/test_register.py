"""RegisterVDevice over the real unix socket: the exact vcuda.config bytes, and every bad request refused."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest

from libs.bus import Bus
from libs.config import Settings
from libs.vcuda import VcudaClientError
from services.vmanager.app import VmanagerService
from services.vmanager.configfiles import has_spare
from services.vmanager.names import is_container_id
from tests.builders.cgroups import enter_container
from tests.polling import eventually
from tests.vmanager.helpers import (
    BLOCK,
    FakeWatchdog,
    Ledger,
    golden_config,
    granted,
    inventory,
    new_container_id,
    new_pod_uid,
    pod,
    prepared,
    raw_register,
    register,
    tree,
)


async def test_register_by_container_id(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, watchdog: FakeWatchdog, client_bus: Bus
) -> None:
    uid, cid, init_id = new_pod_uid(), new_container_id(), new_container_id()
    watchdog.add(pod(uid, {"trainer": cid, "logger": new_container_id()}, init={"warmup": init_id}))
    sock = await prepared(ledger, client_bus, uid, granted(uid, "trainer", cores=30, memory=3 * BLOCK),
                          granted(uid, "warmup", cores=50, memory=BLOCK, core_limit=80, init=True))

    await register(sock, pod_uid=uid, container_id=cid, timeout=5)
    written = settings.vm_root / uid / cid / "vcuda.config"
    assert written.read_bytes() == golden_config(
        pod_uid=uid, limit=0, container_name="trainer", gpu_memory=805306368, utilization=30, hard_limit=1,
        driver_major=550, driver_minor=54, enable=1,
    )
    assert os.stat(written).st_mode & 0o777 == 0o644
    assert os.stat(written.parent).st_mode & 0o777 == 0o755

    # An init container's id resolves through initContainerStatuses.
    await register(sock, pod_uid=uid, container_id=init_id, timeout=5)
    assert (settings.vm_root / uid / init_id / "vcuda.config").read_bytes() == golden_config(
        pod_uid=uid, limit=80, container_name="warmup", gpu_memory=BLOCK, utilization=50, hard_limit=0,
        driver_major=550, driver_minor=54, enable=1,
    )
    assert all(call.uid == uid for call in watchdog.calls)


async def test_register_by_container_name(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    grant = granted(uid, "main", cores=40, memory=8 * BLOCK, core_limit=60)
    sock = await prepared(ledger, client_bus, uid, grant)
    await register(sock, pod_uid=uid, container_name="main", bus_id="0000:17:00.0", timeout=5)
    assert (settings.vm_root / uid / "main" / "vcuda.config").read_bytes() == golden_config(
        pod_uid=uid, limit=60, container_name="main", gpu_memory=8 * 268435456, utilization=40, hard_limit=0,
        driver_major=550, driver_minor=54, enable=1,  # bus_id is ignored, as gpu-manager does
    )


async def test_whole_gpus_disable_limits(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    sock = await prepared(ledger, client_bus, uid, granted(uid, "big", cores=200, memory=0))
    await register(sock, pod_uid=uid, container_name="big", timeout=5)
    assert (settings.vm_root / uid / "big" / "vcuda.config").read_bytes() == golden_config(
        pod_uid=uid, limit=0, container_name="big", gpu_memory=0, utilization=200, hard_limit=1,
        driver_major=550, driver_minor=54, enable=0,
    )


async def test_rewrite_only_when_changed_and_no_temp_files(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, watchdog: FakeWatchdog, client_bus: Bus
) -> None:
    uid, cid = new_pod_uid(), new_container_id()
    watchdog.add(pod(uid, {"main": cid}))
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    spare = os.stat(settings.vm_root / uid / ".spare" / ".vcuda.config.tmp").st_ino  # made when served
    await register(sock, pod_uid=uid, container_id=cid, timeout=5)
    path = settings.vm_root / uid / cid / "vcuda.config"
    first = os.stat(path)
    assert first.st_ino == spare  # the first registration filled the spare's file
    for _ in range(3):  # every CUDA process of the container registers
        await register(sock, pod_uid=uid, container_id=cid, timeout=5)
    assert os.stat(path).st_ino == first.st_ino and os.stat(path).st_mtime_ns == first.st_mtime_ns

    # A newer grant for the same container (a restart re-allocated it) replaces the file atomically.
    await ledger.append(granted(uid, "main", cores=60, memory=2 * BLOCK))
    await register(sock, pod_uid=uid, container_id=cid, timeout=5)
    assert os.stat(path).st_ino != first.st_ino
    assert path.read_bytes()[0x2010:0x201C] == (2 * BLOCK).to_bytes(8, "little") + (60).to_bytes(4, "little")
    assert sorted(os.listdir(path.parent)) == ["pids.config", "vcuda.config"]
    # The first registration took the pod's spare directory; another is made for the next container.
    await eventually(lambda: has_spare(path.parent.parent), timeout=5, interval=0.01, what="the next spare")
    assert sorted(os.listdir(path.parent.parent)) == [".spare", cid, "vcuda.sock"]


async def test_uses_the_recorded_driver_version(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    await ledger.append(inventory(driver="535.183.01"))
    # prepared() records 550.54.15 again, then grants; the newest inventory is what counts
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    await ledger.append(inventory(driver="535.183.01"))
    await register(sock, pod_uid=uid, container_name="main", timeout=5)
    data = (settings.vm_root / uid / "main" / "vcuda.config").read_bytes()
    assert data[0x2020:0x2028] == (535).to_bytes(4, "little") + (183).to_bytes(4, "little")


OTHER_UID = "0b6f3c1e-9d2a-4e7b-8c5f-1a2b3c4d5e6f"


@pytest.mark.parametrize(("fields", "code", "says"), [
    ({"pod_uid": "../../etc", "container_name": "main"}, "INVALID_ARGUMENT", "not a pod UID"),
    ({"pod_uid": "", "container_name": "main"}, "INVALID_ARGUMENT", "not a pod UID"),
    ({"pod_uid": OTHER_UID, "container_name": "main"}, "INVALID_ARGUMENT", "serves pod"),
    ({"container_id": "../x"}, "INVALID_ARGUMENT", "not a container id"),
    ({"container_id": "a/b"}, "INVALID_ARGUMENT", "not a container id"),
    ({"container_id": ".."}, "INVALID_ARGUMENT", "not a container id"),
    ({"container_id": "/etc"}, "INVALID_ARGUMENT", "not a container id"),
    ({"container_id": "a" * 129}, "INVALID_ARGUMENT", "not a container id"),
    ({"container_id": "abc\n"}, "INVALID_ARGUMENT", "not a container id"),
    ({"container_name": "../x"}, "INVALID_ARGUMENT", "not a Kubernetes container name"),
    ({"container_name": "Main"}, "INVALID_ARGUMENT", "not a Kubernetes container name"),
    ({"container_name": "a/b"}, "INVALID_ARGUMENT", "not a Kubernetes container name"),
    # through the gate's relay (1 MiB: many reads, its buffers full), a clear answer all the same
    ({"container_name": "x" * 60_000}, "INVALID_ARGUMENT", "not a Kubernetes container name"),
    ({"container_name": "x" * (1 << 20)}, "RESOURCE_EXHAUSTED", "larger than max"),
    ({}, "INVALID_ARGUMENT", "both are empty"),
    ({"container_id": "PLACEHOLDER", "container_name": "main"}, "INVALID_ARGUMENT", "not both"),
    ({"container_id": "f" * 64}, "NOT_FOUND", "is not a container of pod"),
    ({"container_name": "sidecar"}, "NOT_FOUND", "no GPU allocation for container sidecar of pod"),
    ({"container_id": "PLACEHOLDER_SIDECAR"}, "NOT_FOUND", "no GPU allocation for container sidecar of pod"),
])
async def test_bad_requests_write_nothing(
    settings: Settings, workdir: Path, ledger: Ledger, vmanager: VmanagerService, watchdog: FakeWatchdog,
    client_bus: Bus, fields: dict[str, str], code: str, says: str,
) -> None:
    uid, cid, sidecar_id = new_pod_uid(), new_container_id(), new_container_id()
    watchdog.add(pod(uid, {"main": cid, "sidecar": sidecar_id}))
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    request = {"pod_uid": uid, **fields}
    if request.get("container_id") == "PLACEHOLDER":
        request["container_id"] = cid
    if request.get("container_id") == "PLACEHOLDER_SIDECAR":
        request["container_id"] = sidecar_id
    # The caller is a process of the container it names (when that is a well-formed id), else of main.
    own = request.get("container_id", "")
    enter_container(workdir, uid, own if is_container_id(own) else cid)
    before = tree(workdir / "vm")
    got, details = await raw_register(sock, **request)
    assert got.name == code
    assert says in details
    assert tree(workdir / "vm") == before
    assert sorted(os.listdir(workdir)) == ["cgroup", "proc", "state", "vm"]
    assert sorted(os.listdir(settings.vm_root)) == [uid]
    # the gate drops its verdict when the closed connection reaches it
    await eventually(lambda: len(vmanager.sockets.callers) == 0, timeout=1, interval=0.01,
                     what="the gate dropping the closed connection's verdict")
    assert len(vmanager.sockets.callers) == 0


async def test_unknown_container_names_id_and_pod(
    ledger: Ledger, vmanager: VmanagerService, watchdog: FakeWatchdog, client_bus: Bus
) -> None:
    uid, unknown = new_pod_uid(), new_container_id()
    watchdog.add(pod(uid, {"main": new_container_id()}))
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    with pytest.raises(VcudaClientError) as info:
        await register(sock, pod_uid=uid, container_id=unknown, timeout=5)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert unknown in info.value.message and uid in info.value.message
    assert any(call.fresh for call in watchdog.calls)  # retried against the API server, not only the cache


async def test_container_id_seen_late_is_found(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, watchdog: FakeWatchdog, client_bus: Bus
) -> None:
    """The kubelet posts a container's id after starting it; the CUDA library may register first."""
    uid, cid = new_pod_uid(), new_container_id()
    watchdog.add(pod(uid, {"main": new_container_id()}))  # the status still shows the previous container
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    calls_before = len(watchdog.calls)

    async def publish_later() -> None:
        await asyncio.sleep(0.3)
        watchdog.add(pod(uid, {"main": cid}))

    task = asyncio.create_task(publish_later())
    await register(sock, pod_uid=uid, container_id=cid, timeout=5)
    await task
    assert len(watchdog.calls) - calls_before >= 2
    assert (settings.vm_root / uid / cid / "vcuda.config").exists()


async def test_watchdog_unreachable_is_unavailable(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    with pytest.raises(VcudaClientError) as info:
        await register(sock, pod_uid=uid, container_id=new_container_id(), timeout=5)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "watchdog" in info.value.message
    assert sorted(os.listdir(settings.vm_root / uid)) == [".spare", "vcuda.sock"]
