"""``vmanager.prepare``: waits for the grant, creates the pod directory and one socket server, once."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.commands import PrepareReply, PrepareRequest
from libs.config import Settings
from libs.errors import RemoteError
from services.vmanager.app import VmanagerService
from tests.vmanager.helpers import (
    Ledger,
    folded,
    granted,
    inventory,
    new_pod_uid,
    raw_register,
    released,
    running_vmanager,
    tree,
)


async def prepare(bus: Bus, pod_uid: str, seq: int = 0) -> PrepareReply:
    return await bus.request(bus.subjects.prepare, PrepareRequest(pod_uid=pod_uid, alloc_seq=seq),
                             PrepareReply, timeout=5)


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


async def test_prepare_creates_directory_and_socket(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    seq = await ledger.append(inventory(), granted(uid, "main"))
    reply = await prepare(client_bus, uid, seq)
    assert reply.directory == str(settings.vm_root / uid)
    assert reply.socket == str(settings.vm_root / uid / "vcuda.sock")
    assert stat.S_ISDIR(os.lstat(reply.directory).st_mode) and mode(reply.directory) == 0o755
    assert stat.S_ISSOCK(os.lstat(reply.socket).st_mode) and mode(reply.socket) == 0o666
    # The server answers (this test process is in no pod: refused, but answered).
    code, _ = await raw_register(reply.socket, pod_uid=uid, container_name="nobody")
    assert code.name == "PERMISSION_DENIED"


async def test_prepare_is_idempotent(ledger: Ledger, vmanager: VmanagerService, client_bus: Bus) -> None:
    uid = new_pod_uid()
    seq = await ledger.append(granted(uid, "main"), granted(uid, "sidecar", index=1))
    first = await prepare(client_bus, uid, seq)
    server = vmanager.sockets.servers[uid].server
    inode = os.lstat(first.socket).st_ino
    for _ in range(3):  # one PreStartContainer per container start
        again = await prepare(client_bus, uid, seq)
        assert again == first
    assert list(vmanager.sockets.servers) == [uid]
    assert vmanager.sockets.servers[uid].server is server
    assert os.lstat(first.socket).st_ino == inode


async def test_concurrent_ensures_start_one_server(ledger: Ledger, vmanager: VmanagerService) -> None:
    uid = new_pod_uid()
    await folded(vmanager, await ledger.append(granted(uid, "main")))
    await vmanager.sockets.teardown(uid)  # start from nothing, then race five starts
    await folded(vmanager, await ledger.append(granted(uid, "side", index=1)))
    await vmanager.sockets.close()
    results = await asyncio.gather(*(vmanager.sockets.ensure(uid) for _ in range(5)))
    assert len(set(results)) == 1 and list(vmanager.sockets.servers) == [uid]


async def test_grant_prepares_before_prestart(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService
) -> None:
    uid = new_pod_uid()
    seq = await ledger.append(granted(uid, "main"))
    await folded(vmanager, seq)
    assert (settings.vm_root / uid / "vcuda.sock").is_socket()
    assert uid in vmanager.sockets.servers


async def test_vanished_socket_is_restarted(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    seq = await ledger.append(granted(uid, "main"))
    reply = await prepare(client_bus, uid, seq)
    os.unlink(reply.socket)
    again = await prepare(client_bus, uid, seq)
    assert Path(again.socket).is_socket() and mode(again.socket) == 0o666


async def test_pod_without_allocation_is_404(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    with pytest.raises(RemoteError) as info:
        await prepare(client_bus, uid)
    assert info.value.code == 404 and uid in info.value.message
    grant = granted(uid, "main")
    await ledger.append(grant)
    seq = await ledger.append(released(grant))
    with pytest.raises(RemoteError) as info:
        await prepare(client_bus, uid, seq)
    assert info.value.code == 404
    assert not (settings.vm_root / uid).exists()


async def test_prepare_by_devices_serves_the_pod_that_holds_them(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    # PreStartContainer's registrar names the grant's devices while the allocator checks it.
    uid, other = new_pod_uid(), new_pod_uid()
    grant = granted(uid, "main", cores=20)
    seq = await ledger.append(inventory(), granted(other, "main", cores=10), grant)
    await folded(vmanager, seq)
    reply = await client_bus.request(client_bus.subjects.prepare, PrepareRequest(device_ids=list(grant.device_ids)),
                                     PrepareReply, timeout=5)
    assert (reply.pod_uid, reply.socket) == (uid, str(settings.vm_root / uid / "vcuda.sock"))
    assert stat.S_ISSOCK(os.lstat(reply.socket).st_mode)


async def test_prepare_by_devices_nobody_holds_is_404_and_waits_for_nothing(
    ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    seq = await ledger.append(inventory(), granted(new_pod_uid(), "main", cores=20))
    await folded(vmanager, seq)
    for ids in (["tencent.com/vcuda-core-0"], [f"tencent.com/vcuda-core-{i}" for i in range(21)]):
        with pytest.raises(RemoteError) as info:
            await client_bus.request(client_bus.subjects.prepare, PrepareRequest(device_ids=ids), PrepareReply,
                                     timeout=5)
        assert info.value.code == 404
        assert f"no grant holds these {len(ids)} devices in the log folded so far (seq {seq})" in info.value.message
    with pytest.raises(RemoteError) as info:
        await client_bus.request(client_bus.subjects.prepare, PrepareRequest(device_ids=["x"] * 100_000),
                                 PrepareReply, timeout=5)
    assert info.value.code == 400 and "100000 device IDs" in info.value.message


@pytest.mark.parametrize("bad", ["../../etc", "..", "", "3F9C2A8E1B7D4C5E9A0F6D2E8B1C4A7F",
                                 "3f9c2a8e-1b7d-4c5e-9a0f-6d2e8b1c4a7f\n",
                                 "3f9c2a8e-1b7d-4c5e-9a0f-6d2e8b1c4a7f/.."])
async def test_pod_uid_must_be_a_uuid(
    settings: Settings, workdir: Path, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus, bad: str
) -> None:
    await folded(vmanager, await ledger.append(granted(new_pod_uid(), "main")))
    before = tree(workdir / "vm")
    with pytest.raises(RemoteError) as info:
        await prepare(client_bus, bad)
    assert info.value.code == 400 and "UUID" in info.value.message
    assert tree(workdir / "vm") == before
    assert sorted(os.listdir(workdir)) == ["state", "vm"]


async def test_uppercase_uuid_is_a_pod_uid(
    ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid().upper()
    seq = await ledger.append(granted(uid, "main"))
    reply = await prepare(client_bus, uid, seq)
    assert Path(reply.socket).is_socket()


async def test_waits_for_the_grant_bounded(
    settings: Settings, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    seq = await ledger.append(granted(uid, "main"))
    with pytest.raises(RemoteError) as info:
        await prepare(client_bus, uid, seq + 5)  # never committed: give up after request_timeout
    assert info.value.code == 504 and str(seq + 5) in info.value.message


async def test_socket_path_too_long(
    settings: Settings, workdir: Path, ledger: Ledger, client_bus: Bus
) -> None:
    long_vm = workdir / ("v" * 70)
    long_settings = settings.replace(vm_dir=str(long_vm))
    async with running_vmanager(long_settings):
        uid = new_pod_uid()
        seq = await ledger.append(granted(uid, "main"))
        with pytest.raises(RemoteError) as info:
            await prepare(client_bus, uid, seq)
        assert info.value.code == 500 and "too long" in info.value.message and "107" in info.value.message
        assert not (long_vm / uid / "vcuda.sock").exists()
