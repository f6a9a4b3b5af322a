"""What a real-runtime run puts outside its temp dir, written down before it is made, and removed.

The runtime writes ``<work>/leftovers.json`` (atomically) before each thing it makes outside its work
directory: the containerd pid, each pod's cgroup parent, each fake ``/dev`` node a test makes,
whether ``/run/containerd`` existed. ``clean()`` removes all of it, idempotently: containerd (by pid),
the shims that carry our socket path, every process left in our pod cgroups, mounts under the work
dir, the pod cgroups in every hierarchy (runc leaves them, as the kubelet owns them), the ``/dev``
nodes, ``/run/containerd`` when we made it.

A *reaper* process makes that hold even when the test process is killed: ``python -m
simulator.runtime.leftovers FILE`` waits until its stdin reaches end of file (the parent exited, by
any means, SIGKILL included), then cleans. ``survivors()`` lists what is still there, for the test
that asserts nothing is.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from libs.lifeline import command_line

__all__ = ["Leftovers", "cgroup_mounts", "clean", "start_reaper", "stop_reaper", "survivors"]

RUN_CONTAINERD = Path("/run/containerd")
_MNT_DETACH = 2


@dataclass
class Leftovers:
    path: Path  # <work>/leftovers.json
    work: str = ""
    socket: str = ""
    containerd_pid: int = 0
    cgroup_parents: list[str] = field(default_factory=list)  # "/kubepods/besteffort/pod<uid>"
    created_cgroups: list[str] = field(default_factory=list)  # "/kubepods" etc. when absent before
    dev_nodes: list[str] = field(default_factory=list)
    run_containerd_created: bool = False
    remove_work: bool = False

    @functools.cached_property
    def _mounts(self) -> list[str]:
        """The cgroup mounts, read once (not saved)."""
        return cgroup_mounts()

    def save(self) -> None:
        data = asdict(self)
        data["path"] = str(self.path)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, path: Path) -> Leftovers:
        data = json.loads(path.read_text())
        data["path"] = Path(data["path"])
        return cls(**data)

    def add_cgroup_parent(self, parent: str) -> None:
        if parent in self.cgroup_parents:
            return
        # The QoS-level parents runc makes on the way: removed at the end only if we made them.
        parts = parent.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            level = "/" + "/".join(parts[: i + 1])
            if level not in self.created_cgroups and not any(
                    (Path(m) / level.lstrip("/")).exists() for m in self._mounts):
                self.created_cgroups.append(level)
        self.cgroup_parents.append(parent)
        self.save()

    def drop_cgroup_parent(self, parent: str) -> None:
        """The pod's cgroups are gone: stop naming them, so the record holds the pods still there and
        is not rewritten whole, ever longer, at every pod a long run starts. Written with the next
        save: until then the file names cgroups that are gone, which the cleaning skips."""
        with contextlib.suppress(ValueError):
            self.cgroup_parents.remove(parent)

    def add_dev_node(self, path: str) -> None:
        if path not in self.dev_nodes:
            self.dev_nodes.append(path)
            self.save()


def cgroup_mounts() -> list[str]:
    """Every cgroup (v1) and cgroup2 mount point of this mount namespace."""
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] in ("cgroup", "cgroup2"):
                points.append(_unescape(left.split(" ")[4]))
    return points


def _unescape(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _mounts_under(prefix: str) -> list[str]:
    if not prefix:
        return []
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = _unescape(line.split(" ")[4])
            if point == prefix or point.startswith(prefix.rstrip("/") + "/"):
                found.append(point)
    return found


def _cmdline(pid: int) -> str:
    return " ".join(command_line(pid))


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _our_processes(lo: Leftovers) -> list[int]:
    """containerd (still ours: its command line names our config) and the shims that carry our socket."""
    found = []
    for pid in _pids():
        cmd = _cmdline(pid)
        ours = pid == lo.containerd_pid and lo.work and lo.work in cmd
        if ours or (lo.socket and lo.socket in cmd and "containerd-shim" in cmd):
            found.append(pid)
    return found


def _pod_cgroup_dirs(lo: Leftovers) -> list[Path]:
    """Every existing cgroup directory of our pods, deepest first."""
    dirs: list[Path] = []
    for mount in cgroup_mounts():
        for parent in lo.cgroup_parents:
            top = Path(mount) / parent.lstrip("/")
            if top.is_dir():
                dirs += [Path(root) for root, _, _ in os.walk(top)]
    return sorted(dirs, key=lambda p: len(p.parts), reverse=True)


def _cgroup_pids(dirs: list[Path]) -> set[int]:
    pids: set[int] = set()
    for d in dirs:
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
    return pids


def _shim_sockets(lo: Leftovers) -> list[Path]:
    """The shims' sockets: containerd 1.6 names them /run/containerd/s/<sha256 of
    "<containerd socket>/<namespace>/<task id>">, outside any directory we choose; a killed shim
    leaves its socket there."""
    tasks = Path(lo.work) / "state" / "io.containerd.runtime.v2.task"
    found = []
    if lo.work and tasks.is_dir():
        for ns in tasks.iterdir():
            for task in ns.iterdir():
                digest = hashlib.sha256(f"{lo.socket}/{ns.name}/{task.name}".encode()).hexdigest()
                if (RUN_CONTAINERD / "s" / digest).exists():
                    found.append(RUN_CONTAINERD / "s" / digest)
    return found


def _kill(pids: list[int] | set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _umount(point: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(point.encode(), _MNT_DETACH) != 0:
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=10)


def clean(lo: Leftovers, *, timeout: float = 10.0) -> None:
    """Remove everything ``lo`` names (safe to call twice, and while parts are already gone)."""
    deadline = time.monotonic() + timeout
    if lo.containerd_pid and lo.containerd_pid in _our_processes(lo):
        with contextlib.suppress(ProcessLookupError):
            os.kill(lo.containerd_pid, signal.SIGTERM)
        while time.monotonic() < deadline - timeout / 2 and lo.containerd_pid in _our_processes(lo):
            time.sleep(0.05)
    while (procs := _our_processes(lo)) or _cgroup_pids(_pod_cgroup_dirs(lo)):
        _kill(procs)
        _kill(_cgroup_pids(_pod_cgroup_dirs(lo)))
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for sock in _shim_sockets(lo):
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
    for point in sorted(_mounts_under(lo.work), key=len, reverse=True):
        _umount(point)
    for d in _pod_cgroup_dirs(lo):
        with contextlib.suppress(OSError):
            d.rmdir()
    for level in sorted(lo.created_cgroups, key=len, reverse=True):
        for mount in cgroup_mounts():
            with contextlib.suppress(OSError):
                (Path(mount) / level.lstrip("/")).rmdir()  # only when empty: another run may use it
    for node in lo.dev_nodes:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(node)
    if lo.run_containerd_created:
        for d in (RUN_CONTAINERD / "s", RUN_CONTAINERD / "runc" / "k8s.io", RUN_CONTAINERD / "runc", RUN_CONTAINERD):
            with contextlib.suppress(OSError):
                d.rmdir()
    if lo.remove_work and lo.work:
        shutil.rmtree(lo.work, ignore_errors=True)


def survivors(lo: Leftovers) -> list[str]:
    """What of ``lo`` is still there, one line each (empty when the run left nothing behind)."""
    found = [f"process {pid}: {_cmdline(pid)[:200]}" for pid in _our_processes(lo)]
    found += [f"process {pid} in a pod cgroup" for pid in _cgroup_pids(_pod_cgroup_dirs(lo))]
    found += [f"mount {p}" for p in _mounts_under(lo.work)]
    found += [f"cgroup {d}" for d in _pod_cgroup_dirs(lo)]
    for level in lo.created_cgroups:
        found += [f"cgroup {Path(m) / level.lstrip('/')}" for m in cgroup_mounts()
                  if (Path(m) / level.lstrip("/")).exists()]
    found += [f"device node {n}" for n in lo.dev_nodes if os.path.lexists(n)]
    found += [f"shim socket {s}" for s in _shim_sockets(lo)]
    if lo.run_containerd_created and RUN_CONTAINERD.exists():
        found.append(f"directory {RUN_CONTAINERD}")
    return found


def start_reaper(lo: Leftovers) -> subprocess.Popen[bytes]:
    """A process that cleans ``lo`` once this process is gone; ``stop_reaper`` after a clean stop."""
    return subprocess.Popen(
        [sys.executable, "-m", "simulator.runtime.leftovers", str(lo.path)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the test's process group must not stop the cleaner first
        cwd=str(Path(__file__).resolve().parents[2]),
    )


def stop_reaper(reaper: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError, ValueError):
        assert reaper.stdin is not None
        reaper.stdin.write(b"done")
        reaper.stdin.close()
    try:
        reaper.wait(timeout=10)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait(timeout=5)


def _reap(path: Path) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    said = sys.stdin.buffer.read()  # blocks until the parent closes the pipe or dies
    if said != b"done" and path.exists():  # "done": the parent cleaned up itself
        clean(Leftovers.load(path))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m simulator.runtime.leftovers LEFTOVERS_JSON")
    _reap(Path(sys.argv[1]))
