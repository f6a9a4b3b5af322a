"""Release, restart recovery, garbage collection and shutdown of the per-pod servers and directories."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from libs.bus import Bus
from libs.commands import PrepareReply, PrepareRequest
from libs.config import Settings
from libs.vcuda import VcudaClientError
from services.vmanager.app import VmanagerService
from services.vmanager.cleanup import remove_pod_dir, scan_vm_root
from tests.vmanager.helpers import Ledger, folded, granted, inventory, new_pod_uid, register, released, running_vmanager


async def prepare(bus: Bus, uid: str, seq: int) -> Path:
    reply = await bus.request(bus.subjects.prepare, PrepareRequest(pod_uid=uid, alloc_seq=seq), PrepareReply,
                              timeout=5)
    return Path(reply.socket)


async def test_release_stops_server_and_removes_directory(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    main, side = granted(uid, "main"), granted(uid, "side", index=1)
    sock = await prepare(client_bus, uid, await ledger.append(inventory(), main, side))
    await register(sock, pod_uid=uid, container_name="main", timeout=5)

    # One container released: the pod still holds the other, everything stays.
    await folded(vmanager, await ledger.append(released(main)))
    assert sock.is_socket() and uid in vmanager.sockets.servers

    await folded(vmanager, await ledger.append(released(side)))
    assert not (settings.vm_root / uid).exists()
    assert uid not in vmanager.sockets.servers
    with pytest.raises(VcudaClientError, match="no socket"):
        await register(sock, pod_uid=uid, container_name="main", timeout=0.3)


async def test_restart_recovers_live_pods_and_collects_the_rest(
    settings: Settings, ledger: Ledger, client_bus: Bus
) -> None:
    vm = settings.vm_root
    live, gone, never = new_pod_uid(), new_pod_uid(), new_pod_uid()
    live_grant, gone_grant = granted(live, "main"), granted(gone, "main")
    async with running_vmanager(settings) as svc:
        seq = await ledger.append(inventory(), live_grant, gone_grant)
        await prepare(client_bus, live, seq)
        await prepare(client_bus, gone, seq)
        await register(vm / live / "vcuda.sock", pod_uid=live, container_name="main", timeout=5)
        assert set(svc.sockets.servers) == {live, gone}
    # Shutdown stopped the servers but kept the directories: the pods' containers mount them.
    assert (vm / live / "main" / "vcuda.config").exists() and (vm / gone).is_dir()
    with pytest.raises(VcudaClientError):
        await register(vm / live / "vcuda.sock", pod_uid=live, container_name="main",
                               timeout=0.3)

    # While the vmanager is down: a pod goes away, leftovers and foreign entries appear.
    await ledger.append(released(gone_grant))
    (vm / never / "abc").mkdir(parents=True)
    (vm / never / "abc" / "vcuda.config").write_bytes(b"x")
    (vm / "lost+found").mkdir()
    (vm / "README").write_text("operator notes")
    (vm / "not-a-uuid-0000").mkdir()
    live_dir_inode = os.lstat(vm / live).st_ino

    async with running_vmanager(settings) as svc:
        assert set(svc.sockets.servers) == {live}
        assert sorted(os.listdir(vm)) == sorted([live, "lost+found", "README", "not-a-uuid-0000"])
        assert os.lstat(vm / live).st_ino == live_dir_inode  # same directory: existing mounts still see it
        assert (vm / live / "vcuda.sock").is_socket()
        await register(vm / live / "vcuda.sock", pod_uid=live, container_name="main", timeout=5)
        assert (vm / "README").read_text() == "operator notes"


async def test_empty_log_collects_nothing(settings: Settings, ledger: Ledger) -> None:
    """With no event at all, nothing proves a directory's pod is gone (e.g. a stream not yet republished)."""
    uid = new_pod_uid()
    (settings.vm_root / uid).mkdir(parents=True)
    async with running_vmanager(settings):
        assert (settings.vm_root / uid).is_dir()


async def test_starts_before_the_stream_exists(settings: Settings, nats: object) -> None:
    async with running_vmanager(settings) as svc:
        assert svc.tracker.target == 0 and svc.state.seq == 0


async def test_shutdown_is_clean(settings: Settings, ledger: Ledger, client_bus: Bus) -> None:
    uid = new_pod_uid()
    async with running_vmanager(settings) as svc:
        sock = await prepare(client_bus, uid, await ledger.append(granted(uid, "main")))
    assert svc.sockets.servers == {}
    assert svc.bus.is_closed
    assert svc.supervisor.failure.done()
    with pytest.raises(VcudaClientError) as info:
        await register(sock, pod_uid=uid, container_name="main", timeout=0.3)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_removal_touches_only_uuid_paths(workdir: Path) -> None:
    vm = workdir / "vm"
    outside = workdir / "precious"
    outside.mkdir()
    (outside / "data").write_text("keep")
    vm.mkdir()
    uid = new_pod_uid()
    (vm / uid).symlink_to(outside, target_is_directory=True)  # a link named like a pod: unlink, never follow
    assert scan_vm_root(vm) == ({uid}, set())
    assert remove_pod_dir(vm, uid)
    assert (outside / "data").read_text() == "keep" and not (vm / uid).exists()
    for bad in ("../precious", "precious", "", "/tmp"):
        with pytest.raises(ValueError, match="not a pod UID"):
            remove_pod_dir(vm, bad)
    assert not remove_pod_dir(vm, new_pod_uid())
    assert scan_vm_root(workdir / "missing") == (set(), set())
