"""Where a Kubernetes container lives in the cgroup tree, who is in it, and which pod a process belongs to.

Pure path logic plus small reads under a configurable root, so tests run on fake trees (directories
with ``cgroup.procs`` files). gpu-manager-reference.md 5.6 gives gpu-manager's formula; it only
knows cgroup v1's memory hierarchy and one runtime prefix per node, and its library misreads the
containerd + systemd path (upstream #164, #184). Here every layout is tried:

- hierarchies: cgroup v2 (``<root>`` itself holds ``cgroup.controllers``), v1 (``<root>/memory``,
  then ``pids``, ``cpu,cpuacct``, ``systemd``) and hybrid (``<root>/unified``);
- drivers: cgroupfs ``kubepods[/burstable|/besteffort]/pod<uid>/<id>`` and systemd
  ``kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/<prefix>-<id>.scope``;
- runtimes: docker (``<id>`` / ``docker-<id>.scope``), containerd (``<id>`` / ``cri-containerd-<id>.scope``),
  CRI-O (``crio-<id>`` / ``crio-<id>.scope``);
- containerd with ``SystemdCgroup = false`` under a systemd kubelet, which puts the container at
  ``system.slice/containerd.service/kubepods-burstable-pod<uid_>.slice:cri-containerd:<id>``.

The pod's QoS class picks the first parent tried; the other classes follow, so a wrong or
missing class costs a few ``stat`` calls, never a miss.
"""

from __future__ import annotations

import array
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = [
    "QOS_CLASSES",
    "AmbiguousCgroup",
    "CgroupOwner",
    "container_cgroup_paths",
    "encode_pids",
    "find_container_cgroup",
    "hierarchy_roots",
    "owner_of_path",
    "owner_of_process",
    "parse_proc_cgroup",
    "pod_cgroup_paths",
    "read_pids",
    "unified_only",
]

QOS_CLASSES = ("Guaranteed", "Burstable", "BestEffort")
SYSTEMD_SCOPE_PREFIXES = ("cri-containerd", "crio", "docker")
V1_HIERARCHIES = ("memory", "pids", "cpu,cpuacct", "systemd")
MAX_WALK_DIRS = 4096  # a container's cgroup has a handful of children; never walk a whole tree

_HEX = "[0-9a-fA-F]"
_UUID = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
_UUID_US = _UUID.replace("}-", "}_")  # systemd unit names spell the UID's dashes as underscores
_CGROUPFS_POD = re.compile(rf"pod({_UUID})")
_SYSTEMD_POD = re.compile(rf"kubepods(?:-burstable|-besteffort)?-pod({_UUID_US})\.slice(?::.*)?")
_ID = r"[0-9a-zA-Z][0-9a-zA-Z_.-]*"
_CONTAINER_LEAF = [
    re.compile(rf"(?:cri-containerd|crio|docker)-({_ID})\.scope"),
    re.compile(rf"kubepods[^:]*\.slice:(?:cri-containerd|crio|docker):({_ID})"),
    re.compile(rf"crio-({_ID})"),
    re.compile(r"([0-9a-f]{64})"),
]


def _qos_order(qos: str | None) -> list[str]:
    known = next((q for q in QOS_CLASSES if qos and q.lower() == qos.lower()), None)
    return ([known] if known else []) + [q for q in QOS_CLASSES if q != known]


def _cgroupfs_pod(pod_uid: str, qos: str) -> PurePosixPath:
    parent = PurePosixPath("kubepods") if qos == "Guaranteed" else PurePosixPath("kubepods", qos.lower())
    return parent / f"pod{pod_uid}"


def _systemd_slice(pod_uid: str, qos: str) -> tuple[PurePosixPath, str]:
    """(parent slices, the pod's slice name): systemd spells each level's full prefix again."""
    uid = pod_uid.replace("-", "_")
    if qos == "Guaranteed":
        return PurePosixPath("kubepods.slice"), f"kubepods-pod{uid}.slice"
    q = qos.lower()
    return PurePosixPath("kubepods.slice", f"kubepods-{q}.slice"), f"kubepods-{q}-pod{uid}.slice"


def pod_cgroup_paths(pod_uid: str, qos: str | None = None) -> list[PurePosixPath]:
    """The pod's cgroup relative to a hierarchy root: per QoS class, cgroupfs then systemd."""
    out: list[PurePosixPath] = []
    for q in _qos_order(qos):
        parent, name = _systemd_slice(pod_uid, q)
        out += [_cgroupfs_pod(pod_uid, q), parent / name]
    return out


def container_cgroup_paths(pod_uid: str, container_id: str, qos: str | None = None) -> list[PurePosixPath]:
    """Every place a runtime may have put the container, the likeliest (given the QoS class) first."""
    out: list[PurePosixPath] = []
    for q in _qos_order(qos):
        pod = _cgroupfs_pod(pod_uid, q)
        out += [pod / container_id, pod / f"crio-{container_id}"]
        parent, name = _systemd_slice(pod_uid, q)
        out += [parent / name / f"{p}-{container_id}.scope" for p in SYSTEMD_SCOPE_PREFIXES]
        out.append(PurePosixPath("system.slice", "containerd.service", f"{name}:cri-containerd:{container_id}"))
    return out


def unified_only(cgroup_root: Path = Path("/sys/fs/cgroup")) -> bool:
    """cgroup v2 alone (not v1, not hybrid): where runtimes give each container a cgroup namespace."""
    # os.path, not pathlib: a registration asks this, and pathlib stats cost it tens of us.
    return os.path.isfile(os.path.join(os.fspath(cgroup_root), "cgroup.controllers"))


def hierarchy_roots(cgroup_root: Path) -> list[Path]:
    """The hierarchies to look in: the unified one (v2, hybrid) and the v1 ones that exist."""
    if unified_only(cgroup_root):
        return [cgroup_root]
    root = os.fspath(cgroup_root)
    return [cgroup_root / name for name in ("unified", *V1_HIERARCHIES) if os.path.isdir(os.path.join(root, name))]


def find_container_cgroup(
    cgroup_root: Path, pod_uid: str, container_id: str, qos: str | None = None,
    likely: Iterable[PurePosixPath] = (),
) -> Path | None:
    """The container's cgroup directory. ``likely`` paths are tried first, in every hierarchy: where
    the registering process lives, which is its container's cgroup when the cgroup's name is the
    container's, found with one look instead of one per layout and QoS class (and found too in
    layouts no formula knows). Then the layouts' formulas, in the first hierarchy that has one; they
    are only spelled out when needed (twenty paths: most of a registration's lookup)."""
    hierarchies = hierarchy_roots(cgroup_root)
    inside = [rel for rel in likely if not rel.is_absolute() and ".." not in rel.parts]
    return (_first_with_procs(hierarchies, inside)
            or _first_with_procs(hierarchies, container_cgroup_paths(pod_uid, container_id, qos)))


def _first_with_procs(hierarchies: list[Path], rels: list[PurePosixPath]) -> Path | None:
    """The first ``<hierarchy>/<rel>`` holding ``cgroup.procs``, hierarchy by hierarchy."""
    for hierarchy in hierarchies:
        for rel in rels:
            path = os.path.join(hierarchy, rel)
            if os.path.isfile(os.path.join(path, "cgroup.procs")):
                return Path(path)
    return None


def _walk(top: Path) -> Iterator[Path]:
    # os.walk does not follow symlinks by default
    for seen, (dirpath, dirnames, _files) in enumerate(os.walk(top), 1):
        if seen > MAX_WALK_DIRS:
            raise OSError(f"{top} has more than {MAX_WALK_DIRS} cgroups below it; not a container cgroup")
        dirnames.sort()
        yield Path(dirpath)


def read_pids(cgroup_dir: Path) -> list[int]:
    """Every pid in the cgroup and its descendants (v2 containers may nest), ascending, unique."""
    pids: set[int] = set()
    for directory in _walk(cgroup_dir):
        try:
            text = (directory / "cgroup.procs").read_text()
        except FileNotFoundError:  # a child removed while walking
            continue
        pids.update(int(tok) for tok in text.split() if tok.isdigit())
    return sorted(p for p in pids if 0 < p < 2**31)


def encode_pids(pids: Iterable[int]) -> bytes:
    """pids.config: native int32s, ascending (the library ``bsearch``es them), no header."""
    return array.array("i", sorted(set(pids))).tobytes()


# --- which pod a process is in ---------------------------------------------------------------

def parse_proc_cgroup(text: str) -> list[tuple[str, str, str]]:
    """``/proc/<pid>/cgroup`` lines as (hierarchy id, controllers, path); malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
    return out


@dataclass(frozen=True)
class CgroupOwner:
    pod_uid: str | None
    container_id: str | None
    path: str = ""  # the cgroup path the answer came from


def owner_of_path(path: str) -> CgroupOwner:
    """The pod UID and container id a cgroup path names, from its components (relative ``/../``
    prefixes, seen from another cgroup namespace, do not matter)."""
    pod_uid = container_id = None
    parts = [p for p in path.split("/") if p and p != ".."]
    for part in parts:
        m = _CGROUPFS_POD.fullmatch(part)
        if m:
            pod_uid = m.group(1).lower()
            continue
        m = _SYSTEMD_POD.fullmatch(part)
        if m:
            pod_uid = m.group(1).replace("_", "-").lower()
    if parts and pod_uid is not None:
        leaf = parts[-1]
        for pattern in _CONTAINER_LEAF:
            m = pattern.fullmatch(leaf)
            if m:
                container_id = m.group(1)
                break
    return CgroupOwner(pod_uid=pod_uid, container_id=container_id, path=path)


class AmbiguousCgroup(ValueError):
    pass


def owner_of_process(proc_root: Path, pid: int) -> CgroupOwner:
    """The pod (and container) of a process, from every line of ``<proc_root>/<pid>/cgroup``.

    All lines that name a pod must name the same one (and the same container); a process whose
    hierarchies disagree is refused (AmbiguousCgroup). No pod at all: ``pod_uid`` is None.
    FileNotFoundError when the process does not exist (any more).
    """
    with open(os.path.join(proc_root, str(pid), "cgroup"), encoding="utf-8") as f:
        lines = parse_proc_cgroup(f.read())
    # cgroup v1 gives one line per hierarchy, mostly with the same path: each path is parsed once.
    by_path = {path: owner_of_path(path) for path in {path for _h, _c, path in lines}}
    owners = [by_path[path] for _h, _c, path in lines]
    pods = {o.pod_uid for o in owners if o.pod_uid}
    if len(pods) > 1:
        raise AmbiguousCgroup(f"process {pid} is in cgroups of several pods: {sorted(pods)}")
    if not pods:
        return CgroupOwner(pod_uid=None, container_id=None, path=owners[0].path if owners else "")
    named = [o for o in owners if o.pod_uid]
    containers = {o.container_id for o in named if o.container_id}
    if len(containers) > 1:
        raise AmbiguousCgroup(f"process {pid} is in cgroups of several containers: {sorted(containers)}")
    # Prefer the unified (v2) line, else v1 memory, for the path a caller is reported at.
    best = next((o for (h, c, _p), o in zip(lines, owners, strict=True)
                 if o.pod_uid and (h == "0" or "memory" in c.split(","))), named[0])
    return CgroupOwner(pod_uid=next(iter(pods)), container_id=next(iter(containers), None), path=best.path)
