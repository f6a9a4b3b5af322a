"""pids.config through the running vmanager: found from cgroups in every layout, sorted int32, refreshed."""

from __future__ import annotations

import array
import os
from pathlib import Path

import grpc
import pytest

from libs.bus import Bus
from libs.config import Settings
from services.vmanager.app import VmanagerService
from tests.builders.cgroups import add_container, container_path, enter_container
from tests.vmanager.helpers import (
    FakeWatchdog,
    Ledger,
    granted,
    new_container_id,
    new_pod_uid,
    pod,
    prepared,
    raw_register,
    register,
)


def pids_in(path: Path) -> list[int]:
    return list(array.array("i", path.read_bytes()))


@pytest.mark.parametrize(("hierarchy", "driver", "runtime", "qos"), [
    ("v1", "cgroupfs", "docker", "Guaranteed"),
    ("v1", "systemd", "cri-o", "BestEffort"),
    ("v2", "systemd", "containerd", "Burstable"),
    ("v2", "cgroupfs", "cri-o", "Guaranteed"),
    ("hybrid", "systemd", "docker", "Burstable"),
    ("v1", "containerd-misconfigured", "containerd", "Burstable"),  # gpu-manager #164
])
async def test_pids_config_in_every_layout(
    settings: Settings, workdir: Path, ledger: Ledger, vmanager: VmanagerService, watchdog: FakeWatchdog,
    client_bus: Bus, hierarchy: str, driver: str, runtime: str, qos: str,
) -> None:
    uid, cid = new_pod_uid(), new_container_id()
    watchdog.add(pod(uid, {"main": cid}, qos=qos))
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    pids = enter_container(workdir, uid, cid, others=(90001, 12, 4242), hierarchy=hierarchy, driver=driver,
                           runtime=runtime, qos=qos)
    code, details = await raw_register(sock, pod_uid=uid, container_id=cid)
    assert code == grpc.StatusCode.OK, details
    path = settings.vm_root / uid / cid / "pids.config"
    assert pids_in(path) == pids == sorted([os.getpid(), 90001, 12, 4242])
    assert os.stat(path).st_mode & 0o777 == 0o644


async def test_refreshed_on_every_registration(
    settings: Settings, workdir: Path, ledger: Ledger, vmanager: VmanagerService, watchdog: FakeWatchdog,
    client_bus: Bus,
) -> None:
    uid, cid = new_pod_uid(), new_container_id()
    watchdog.add(pod(uid, {"main": cid}))
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    first = await register(sock, pod_uid=uid, container_id=cid, timeout=5)
    path = settings.vm_root / uid / cid / "pids.config"
    assert pids_in(path) == first
    # A second CUDA process starts in the container (in a nested cgroup, as v2 allows) and registers.
    rel = container_path(uid, cid, driver="systemd", runtime="containerd", qos="Burstable")
    add_container(workdir / "cgroup", "v2", rel, [*first, 777777], children={"worker": [3]})
    code, _ = await raw_register(sock, pod_uid=uid, container_id=cid)
    assert code == grpc.StatusCode.OK
    assert pids_in(path) == sorted([*first, 777777, 3])


async def test_legacy_name_registration_uses_the_callers_container(
    settings: Settings, workdir: Path, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus,
) -> None:
    uid, cid = new_pod_uid(), new_container_id()
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    pids = enter_container(workdir, uid, cid, hierarchy="v1", driver="cgroupfs", runtime="docker")
    code, _ = await raw_register(sock, pod_uid=uid, container_name="main")
    assert code == grpc.StatusCode.OK
    assert pids_in(settings.vm_root / uid / "main" / "pids.config") == pids


async def test_no_cgroup_found_writes_nothing(
    settings: Settings, workdir: Path, ledger: Ledger, vmanager: VmanagerService, watchdog: FakeWatchdog,
    client_bus: Bus,
) -> None:
    uid, cid = new_pod_uid(), new_container_id()
    watchdog.add(pod(uid, {"main": cid}))
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    enter_container(workdir, uid, cid, hierarchy="v2")
    # The caller's /proc says it is in the pod, but the cgroup tree is elsewhere (a wrong cgroup root).
    vmanager.registrations.cgroup_root = workdir / "empty"
    code, details = await raw_register(sock, pod_uid=uid, container_id=cid)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no processes found" in details and cid in details
    assert sorted(os.listdir(settings.vm_root / uid)) == [".spare", "vcuda.sock"]  # the spare not taken
