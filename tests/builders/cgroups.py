"""Fake cgroup trees and /proc/<pid>/cgroup files, laid out exactly as the kernel, kubelet and runtimes do.

A tree is directories with ``cgroup.procs`` files under a root that stands in for /sys/fs/cgroup.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

HIERARCHIES = ("v1", "v2", "hybrid")
DRIVERS = ("cgroupfs", "systemd")
RUNTIMES = ("docker", "containerd", "cri-o")
QOS = ("Guaranteed", "Burstable", "BestEffort")


def container_path(pod_uid: str, container_id: str, *, driver: str, runtime: str, qos: str) -> PurePosixPath:
    """The container's cgroup relative to a hierarchy root, as the runtime creates it."""
    q = qos.lower()
    if driver == "cgroupfs":
        parent = PurePosixPath("kubepods") if qos == "Guaranteed" else PurePosixPath("kubepods", q)
        leaf = f"crio-{container_id}" if runtime == "cri-o" else container_id
        return parent / f"pod{pod_uid}" / leaf
    if driver == "containerd-misconfigured":  # runc cgroupfs under a systemd kubelet
        uid = pod_uid.replace("-", "_")
        slice_ = f"kubepods-pod{uid}.slice" if qos == "Guaranteed" else f"kubepods-{q}-pod{uid}.slice"
        return PurePosixPath("system.slice", "containerd.service", f"{slice_}:cri-containerd:{container_id}")
    uid = pod_uid.replace("-", "_")
    prefix = {"docker": "docker", "containerd": "cri-containerd", "cri-o": "crio"}[runtime]
    if qos == "Guaranteed":
        pod = PurePosixPath("kubepods.slice", f"kubepods-pod{uid}.slice")
    else:
        pod = PurePosixPath("kubepods.slice", f"kubepods-{q}.slice", f"kubepods-{q}-pod{uid}.slice")
    return pod / f"{prefix}-{container_id}.scope"


def hierarchy_dirs(root: Path, hierarchy: str) -> list[Path]:
    """Create the hierarchy roots of a cgroup mount; the first one holds the container."""
    if hierarchy == "v2":
        root.mkdir(parents=True, exist_ok=True)
        (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
        return [root]
    names = ["memory", "pids", "cpu,cpuacct", "systemd"]
    if hierarchy == "hybrid":
        names = ["unified", *names]
    dirs = [root / n for n in names]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return dirs


def add_container(root: Path, hierarchy: str, rel: PurePosixPath, pids: list[int],
                  children: dict[str, list[int]] | None = None) -> Path:
    """Put the container (with ``pids``, in cgroup.procs order) in every hierarchy of the mount."""
    first: Path | None = None
    for h in hierarchy_dirs(root, hierarchy):
        d = h / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
        for name, child_pids in (children or {}).items():
            (d / name).mkdir(exist_ok=True)
            (d / name / "cgroup.procs").write_text("".join(f"{p}\n" for p in child_pids))
        first = first or d
    assert first is not None
    return first


def proc_cgroup_text(rel: PurePosixPath, hierarchy: str, *, relative_prefix: str = "") -> str:
    """What /proc/<pid>/cgroup shows for a process of that container."""
    path = relative_prefix + "/" + str(rel)
    if hierarchy == "v2":
        return f"0::{path}\n"
    lines = [
        f"12:memory:{path}", f"11:pids:{path}", f"10:cpu,cpuacct:{path}", "9:devices:/",
        f"1:name=systemd:{path}",
    ]
    if hierarchy == "hybrid":
        lines.append(f"0::{path}")
    return "\n".join(lines) + "\n"


def write_proc(proc_root: Path, pid: int, text: str) -> None:
    (proc_root / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc_root / str(pid) / "cgroup").write_text(text)


def enter_container(root: Path, pod_uid: str, container_id: str, *, pid: int | None = None,
                    others: tuple[int, ...] = (4242, 31), hierarchy: str = "v2", driver: str = "systemd",
                    runtime: str = "containerd", qos: str = "Burstable") -> list[int]:
    """Make ``pid`` (default: this test process) a process of that container, as the vmanager sees it
    through ``<root>/proc`` and ``<root>/cgroup`` (Settings.proc_root / cgroup_root). The container's
    cgroup also lists ``others``. Returns the container's pids, ascending."""
    pid = os.getpid() if pid is None else pid
    rel = container_path(pod_uid, container_id, driver=driver, runtime=runtime, qos=qos)
    pids = [pid, *others]
    add_container(root / "cgroup", hierarchy, rel, pids)
    write_proc(root / "proc", pid, proc_cgroup_text(rel, hierarchy))
    return sorted(pids)


def leave_pods(root: Path, *, pid: int | None = None) -> None:
    """Make ``pid`` a host process outside any pod."""
    write_proc(root / "proc", os.getpid() if pid is None else pid, "0::/user.slice/user-1000.slice/session-2.scope\n")
