"""One pod must not read or change another's limits: the vcuda.sock caller check, through the running vmanager.

The test process is the caller; which pod it is "in" is decided by the fake ``<workdir>/proc/<pid>/cgroup``
the vmanager reads (Settings.proc_root), exactly as it would read the host's /proc.
"""

from __future__ import annotations

import array
import asyncio
import os
import sys
import uuid
from pathlib import Path

import grpc
import structlog

from libs.bus import Bus
from libs.config import Settings
from services.vmanager.app import VmanagerService
from services.vmanager.peergate import check_caller
from tests.builders.cgroups import enter_container, leave_pods, write_proc
from tests.polling import eventually
from tests.vmanager.helpers import (
    FakeWatchdog,
    Ledger,
    granted,
    new_container_id,
    new_pod_uid,
    pod,
    prepared,
    raw_register,
    tree,
)


async def _refused(sock: Path, workdir: Path, **request: str) -> str:
    before = tree(workdir / "vm")
    with structlog.testing.capture_logs() as logs:
        code, details = await raw_register(sock, **request)
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
    assert tree(workdir / "vm") == before  # nothing written
    assert any(e["event"] == "vcuda.sock caller refused" for e in logs) or any(
        e["event"] == "registration refused" and e.get("code") == "PERMISSION_DENIED" for e in logs)
    return details


async def test_caller_outside_any_pod_is_refused(
    workdir: Path, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    leave_pods(workdir)
    details = await _refused(sock, workdir, pod_uid=uid, container_name="main")
    assert "no pod" in details and str(os.getpid()) in details and "session-2.scope" in details


async def test_caller_in_another_pod_is_refused(
    workdir: Path, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus, watchdog: FakeWatchdog
) -> None:
    mine, theirs = new_pod_uid(), new_pod_uid()
    cid = new_container_id()
    watchdog.add(pod(mine, {"main": cid}))
    sock = await prepared(ledger, client_bus, mine, granted(mine, "main"), granted(theirs, "main"))
    # A process of the other pod somehow reaching this pod's socket (e.g. a shared hostPath).
    enter_container(workdir, theirs, new_container_id())
    for request in ({"pod_uid": mine, "container_id": cid}, {"pod_uid": theirs, "container_name": "main"},
                    {"pod_uid": mine, "container_name": "main"}):
        details = await _refused(sock, workdir, **request)
        assert f"pod {theirs}" in details and f"serves pod {mine}" in details


async def test_caller_may_only_register_its_own_container(
    workdir: Path, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus, watchdog: FakeWatchdog
) -> None:
    uid, main_id, side_id = new_pod_uid(), new_container_id(), new_container_id()
    watchdog.add(pod(uid, {"main": main_id, "side": side_id}))
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"), granted(uid, "side", index=1))
    enter_container(workdir, uid, side_id)
    details = await _refused(sock, workdir, pod_uid=uid, container_id=main_id)
    assert f"is container {side_id}" in details
    code, _ = await raw_register(sock, pod_uid=uid, container_id=side_id)
    assert code == grpc.StatusCode.OK


async def test_unknown_or_ambiguous_callers_are_refused(
    workdir: Path, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    uid = new_pod_uid()
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    proc = workdir / "proc" / str(os.getpid())
    if proc.exists():
        (proc / "cgroup").unlink()
    assert "process gone" in await _refused(sock, workdir, pod_uid=uid, container_name="main")
    other = str(uuid.uuid4())
    write_proc(workdir / "proc", os.getpid(),
               f"12:memory:/kubepods/pod{uid}/{'a' * 64}\n11:pids:/kubepods/pod{other}/{'a' * 64}\n")
    assert "several pods" in await _refused(sock, workdir, pod_uid=uid, container_name="main")


async def test_the_pods_sockets_are_the_only_way_in(
    settings: Settings, workdir: Path, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus
) -> None:
    """The gate answers the calls itself: no private server listens anywhere that a process could
    reach around it, and a verdict lives only as long as its connection."""
    uid = new_pod_uid()
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    sockets = [p for root in (Path(settings.state_dir), settings.vm_root) for p in root.rglob("*") if p.is_socket()]
    assert sockets == [sock]
    enter_container(workdir, new_pod_uid(), new_container_id())  # a process of another pod
    code, details = await raw_register(sock, pod_uid=uid, container_name="main")
    assert code == grpc.StatusCode.PERMISSION_DENIED and "this socket serves pod" in details
    await eventually(lambda: len(vmanager.sockets.callers) == 0, timeout=5, interval=0.01,
                     what="the verdict dropped with its connection")


async def test_gpu_client_process_in_the_pod_is_accepted(
    settings: Settings, workdir: Path, ledger: Ledger, vmanager: VmanagerService, client_bus: Bus,
    watchdog: FakeWatchdog,
) -> None:
    """A separate process (its own pid, read by SO_PEERCRED) that is in the pod registers; this test
    process, outside any pod, is refused on the same socket."""
    uid, cid = new_pod_uid(), new_container_id()
    watchdog.add(pod(uid, {"main": cid}))
    sock = await prepared(ledger, client_bus, uid, granted(uid, "main"))
    leave_pods(workdir)
    script = (
        "import os, sys\nfrom pathlib import Path\nfrom tests.builders.cgroups import enter_container\n"
        f"enter_container(Path({str(workdir)!r}), {uid!r}, {cid!r}, others=())\n"
        "from gpuledger.cli import main\n"
        f"main(['gpu-client', '--addr', {str(sock)!r}, '--bus-id', '', '--pod-uid', {uid!r}, "
        f"'--cont-id', {cid!r}, '--timeout', '20'])\n"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, cwd=Path(__file__).parents[2])
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert b"registered" in out
    written = array.array("i", (settings.vm_root / uid / cid / "pids.config").read_bytes())
    assert list(written) == [proc.pid]  # the client's own pid, not this test's
    code, _ = await raw_register(sock, pod_uid=uid, container_id=cid)
    assert code == grpc.StatusCode.PERMISSION_DENIED


def test_check_caller_verdicts(workdir: Path) -> None:
    uid, cid = new_pod_uid(), new_container_id()
    proc = workdir / "proc"
    assert "pid namespace" in (check_caller(proc, uid, 0, 0).refusal or "")
    enter_container(workdir, uid, cid, pid=4321)
    ok = check_caller(proc, uid, 4321, 1000)
    assert ok.refusal is None and ok.owner is not None and ok.owner.container_id == cid and ok.uid == 1000
    other = check_caller(proc, new_pod_uid(), 4321, 0)
    assert other.refusal is not None and f"pod {uid}" in other.refusal
