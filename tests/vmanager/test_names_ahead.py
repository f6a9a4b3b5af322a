"""Containers named before they call (namesahead.py): the vmanager watches a served pod's cgroup and
asks the runtime for a container's name as soon as runc makes the container's cgroup, so that the
container's registration finds it known instead of waiting for ``ContainerStatus``.

The cgroup tree is a directory tree under the test's cgroup root (inotify sees ``mkdir`` there as it
does on cgroupfs); the runtime is a real gRPC server answering ``ContainerStatus``; the vmanager and
its ledger are the usual real parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

import grpc
import pytest

from libs.bus import Bus
from libs.config import Settings
from libs.vcuda import VcudaClientError
from services.vmanager.metrics import VmanagerCollector
from services.vmanager.namesahead import NamesAhead, watched_hierarchy
from tests.builders.cgroups import container_path, hierarchy_dirs
from tests.polling import eventually
from tests.root import require_root
from tests.vmanager.helpers import (
    FakeRuntime,
    FakeWatchdog,
    Ledger,
    granted,
    new_container_id,
    new_pod_uid,
    prepared,
    register,
    released,
    running_vmanager,
    with_runtime,
)


@pytest.fixture
def cgroup(settings: Settings) -> Path:
    """A v2 hierarchy with the QoS parents a kubelet makes at its start (systemd driver)."""
    root = Path(settings.cgroup_root)
    hierarchy_dirs(root, "v2")
    (root / "kubepods.slice" / "kubepods-burstable.slice").mkdir(parents=True)
    return root


def runc_makes(cgroup: Path, pod_uid: str, container_id: str) -> Path:
    """The container's cgroup as runc makes it when the container starts (the pod's too, if new)."""
    path = cgroup / container_path(pod_uid, container_id, driver="systemd", runtime="containerd", qos="Burstable")
    path.mkdir(parents=True)
    return path


async def sandbox_then(cgroup: Path, pod_uid: str, sandbox: str, *containers: str) -> None:
    """A pod started as the kubelet starts it: the sandbox, then (tens of ms later) its containers.
    The pause makes their timestamps differ (the kernel's file clock ticks every few ms)."""
    runc_makes(cgroup, pod_uid, sandbox)
    for cid in containers:
        await asyncio.sleep(0.03)
        runc_makes(cgroup, pod_uid, cid)


async def test_a_container_is_named_when_its_cgroup_appears_and_its_registration_asks_nothing(
    settings: Settings, ledger: Ledger, watchdog: FakeWatchdog, client_bus: Bus, runtime: FakeRuntime,
    cgroup: Path,
) -> None:
    uid, cid, sandbox = new_pod_uid(), new_container_id(), new_container_id()
    runtime.add(cid, "trainer", uid)
    async with running_vmanager(with_runtime(settings, runtime.socket)) as svc:
        # Served before its pod's cgroup exists (the grant comes before the sandbox).
        sock = await prepared(ledger, client_bus, uid, granted(uid, "trainer", cores=30))
        assert runtime.calls == []
        # The pod sandbox comes first (the kubelet's order): the runtime knows no container by its id,
        # so it is not asked; its container's cgroup is asked at once.
        await sandbox_then(cgroup, uid, sandbox, cid)
        await eventually(lambda: runtime.calls == [cid], timeout=5, interval=0.01, what="asked as its cgroup appeared")
        assert svc.registrations.ahead is not None and svc.registrations.ahead.asked == 1

        await register(sock, pod_uid=uid, container_id=cid, timeout=5)
        assert (settings.vm_root / uid / cid / "vcuda.config").read_bytes()[0x1000:0x1007] == b"trainer"
        assert runtime.calls == [cid]  # the registration asked nothing more
        assert svc.registrations.names.resolved == {"runtime": 1}
        assert watchdog.calls == []
        # /metrics says so
        collected = {f.name: f for f in VmanagerCollector(
            svc.tracker, svc.sockets, svc.registrations.names, svc.registrations.ahead).collect()}
        samples = {s.labels["step"]: s.value for s in collected["gpuledger_vmanager_container_names_ahead"].samples}
        assert samples == {"asked": 1, "used": 1}


async def test_containers_already_there_when_the_pod_is_served_are_named_too(
    settings: Settings, ledger: Ledger, client_bus: Bus, runtime: FakeRuntime, cgroup: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A vmanager restarted while the pod runs: its cgroups exist before the watch. The oldest is the
    # sandbox's (not asked); a sandbox asked all the same (its cgroup not the oldest: one restarted)
    # would answer "not found", which is expected there, so no warning.
    uid, sandbox, cid, restarted = new_pod_uid(), new_container_id(), new_container_id(), new_container_id()
    runtime.add(cid, "trainer", uid)
    runtime.add(restarted, "trainer", uid)
    await sandbox_then(cgroup, uid, sandbox, cid)
    async with running_vmanager(with_runtime(settings, runtime.socket)) as svc:
        await prepared(ledger, client_bus, uid, granted(uid, "trainer", cores=30))
        await eventually(lambda: runtime.calls == [cid], timeout=5, interval=0.01, what="asked for what was found")
        runc_makes(cgroup, uid, restarted)  # a later container of the pod (restarted): asked
        await eventually(lambda: runtime.calls == [cid, restarted], timeout=5, interval=0.01,
                         what="asked for the new one")
        assert svc.registrations.names.runtime is not None and svc.registrations.names.runtime._answering
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "runtime" in r.getMessage()]


async def test_a_sandbox_made_between_the_watch_and_the_first_look_is_not_asked(
    settings: Settings, ledger: Ledger, client_bus: Bus, runtime: FakeRuntime, cgroup: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # runc can make the sandbox's cgroup just after the pod cgroup's watch is placed and just before
    # the watch looks at what is there: the sandbox is then both found by that look and reported by
    # its event. It is one sandbox, not asked either way (a real-runtime test in CI saw it asked).
    uid, sandbox, cid = new_pod_uid(), new_container_id(), new_container_id()
    runtime.add(cid, "trainer", uid)
    sandbox_dir = cgroup / container_path(uid, sandbox, driver="systemd", runtime="containerd", qos="Burstable")
    looked = NamesAhead._children

    def sandbox_just_made(directory: str) -> list[str]:
        if directory == str(sandbox_dir.parent) and not sandbox_dir.exists():
            sandbox_dir.mkdir()  # after the watch (its event comes), before the look (it is found)
        return looked(directory)

    monkeypatch.setattr(NamesAhead, "_children", staticmethod(sandbox_just_made))
    async with running_vmanager(with_runtime(settings, runtime.socket)) as svc:
        await prepared(ledger, client_bus, uid, granted(uid, "trainer", cores=30))
        sandbox_dir.parent.mkdir(parents=True)  # the pod's cgroup, empty when made
        await eventually(lambda: sandbox_dir.exists(), timeout=5, interval=0.01, what="the pod cgroup watched")
        await asyncio.sleep(0.03)
        runc_makes(cgroup, uid, cid)
        await eventually(lambda: runtime.calls == [cid], timeout=5, interval=0.01, what="the container asked")
        await asyncio.sleep(0.1)  # anything asked for the sandbox would be in by now
        assert runtime.calls == [cid]
        assert svc.registrations.ahead is not None and svc.registrations.ahead.asked == 1


async def test_a_name_found_ahead_counts_only_for_that_pod(
    settings: Settings, ledger: Ledger, watchdog: FakeWatchdog, client_bus: Bus, runtime: FakeRuntime,
    cgroup: Path,
) -> None:
    # The runtime says the container in this pod's cgroup is another pod's: the answer found ahead is
    # no name, the registration asks again and is refused as it always was.
    uid, other, cid = new_pod_uid(), new_pod_uid(), new_container_id()
    runtime.add(cid, "trainer", other)
    async with running_vmanager(with_runtime(settings, runtime.socket)):
        sock = await prepared(ledger, client_bus, uid, granted(uid, "trainer", cores=30))
        await sandbox_then(cgroup, uid, new_container_id(), cid)
        await eventually(lambda: runtime.calls == [cid], timeout=5, interval=0.01, what="asked ahead")
        with pytest.raises(VcudaClientError) as err:
            await register(sock, pod_uid=uid, container_id=cid, timeout=5)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert f"is a container of pod {other}" in str(err.value)
        assert runtime.calls == [cid, cid]
        assert not (settings.vm_root / uid / cid).exists()


async def test_a_pod_no_longer_served_is_no_longer_watched(
    settings: Settings, ledger: Ledger, client_bus: Bus, runtime: FakeRuntime, cgroup: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uid, first, later, stranger = new_pod_uid(), new_container_id(), new_container_id(), new_container_id()
    async with running_vmanager(with_runtime(settings, runtime.socket)) as svc:
        grant = granted(uid, "trainer", cores=30)
        await prepared(ledger, client_bus, uid, grant)
        await sandbox_then(cgroup, uid, new_container_id(), first)
        await eventually(lambda: runtime.calls == [first], timeout=5, interval=0.01, what="asked while served")
        # a pod the vmanager does not serve: nothing asked for its containers
        runc_makes(cgroup, new_pod_uid(), stranger)
        await ledger.append(released(grant))
        await eventually(lambda: uid not in svc.sockets.servers, timeout=5, interval=0.01,
                         what="the pod's socket stopped")
        runc_makes(cgroup, uid, later)
        await asyncio.sleep(0.2)
        assert runtime.calls == [first]
        ahead = svc.registrations.ahead
        assert ahead is not None and ahead.answer_for(uid, first) is None  # its names forgotten too
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "runtime" in r.getMessage()]


async def test_on_a_node_whose_first_pod_is_still_to_come_the_qos_parents_are_waited_for(
    settings: Settings, ledger: Ledger, client_bus: Bus, runtime: FakeRuntime,
) -> None:
    # No kubepods tree yet (the kubelet, or here runc, makes it with the first pod): the vmanager
    # watches the hierarchy's root for it, then the parents as they appear, then the pod's cgroup.
    root = Path(settings.cgroup_root)
    hierarchy_dirs(root, "v2")
    uid, sandbox, cid = new_pod_uid(), new_container_id(), new_container_id()
    runtime.add(cid, "trainer", uid)
    async with running_vmanager(with_runtime(settings, runtime.socket)) as svc:
        await prepared(ledger, client_bus, uid, granted(uid, "trainer", cores=30))
        assert not (root / "kubepods.slice").exists()
        await sandbox_then(root, uid, sandbox, cid)  # makes kubepods.slice/kubepods-burstable.slice/...
        await eventually(lambda: runtime.calls == [cid], timeout=5, interval=0.01, what="asked as it appeared")
        assert svc.registrations.ahead is not None and svc.registrations.ahead.asked == 1


async def test_a_registration_that_comes_while_the_answer_is_on_its_way_waits_for_that_answer(
    settings: Settings, ledger: Ledger, client_bus: Bus, runtime: FakeRuntime, cgroup: Path,
) -> None:
    uid, cid = new_pod_uid(), new_container_id()
    runtime.add(cid, "trainer", uid)
    runtime.delay = 0.3  # a busy runtime: the container connects before it has answered
    async with running_vmanager(with_runtime(settings, runtime.socket)) as svc:
        sock = await prepared(ledger, client_bus, uid, granted(uid, "trainer", cores=30))
        await sandbox_then(cgroup, uid, new_container_id(), cid)
        await eventually(lambda: runtime.calls == [cid], timeout=5, interval=0.01, what="asked ahead")
        await register(sock, pod_uid=uid, container_id=cid, timeout=5)
        assert runtime.calls == [cid]  # the answer on its way was awaited, not asked for again
        assert svc.registrations.names.resolved == {"runtime": 1}
        assert svc.registrations.ahead is not None and svc.registrations.ahead.used == 1


def test_on_cgroupfs_a_sandbox_and_its_container_made_in_one_tick_are_told_apart() -> None:
    # The kernel's file clock is coarse: runc can make a sandbox's cgroup and its container's within
    # one tick, with equal ctimes. A vmanager whose watch is placed after both were made must still
    # skip the sandbox (asking the runtime about it too failed a real-runtime test in CI). On a real
    # cgroup hierarchy (root only), pairs made back to back must come out oldest first.
    require_root("making cgroups")
    hierarchy = watched_hierarchy(Path("/sys/fs/cgroup"))
    assert hierarchy is not None, "no cgroup hierarchy under /sys/fs/cgroup"
    top = hierarchy / f"gpuledger-test-{os.getpid()}-{new_pod_uid()[:8]}"
    tied = 0
    try:
        top.mkdir()
        for i in range(40):
            pod = top / f"pod{i}"
            pod.mkdir()
            # names whose order says nothing: the second made sorts first by name
            (pod / "z-sandbox").mkdir()
            (pod / "a-container").mkdir()
            tied += (pod / "z-sandbox").stat().st_ctime_ns == (pod / "a-container").stat().st_ctime_ns
            assert NamesAhead._children(str(pod)) == ["z-sandbox", "a-container"], f"pair {i}"
    finally:
        for pod in sorted(top.glob("pod*")) if top.exists() else []:
            for child in ("a-container", "z-sandbox"):
                with contextlib.suppress(FileNotFoundError):
                    (pod / child).rmdir()
            pod.rmdir()
        with contextlib.suppress(FileNotFoundError):
            top.rmdir()
    assert tied, "no pair had equal ctimes: the tie this test is about never happened"
