"""Containers named before they call: a served pod's cgroup is watched, and the runtime is asked for a
container's name as soon as the container's cgroup appears.

runc makes a container's cgroup while the container starts, tens of milliseconds before its process
runs (on a busy 2-CPU node, about 80 ms before the first registration), so the runtime's
``ContainerStatus`` is answered long before the container's first CUDA call instead of inside it
(where it cost the registration 1 to 3 ms of a GPU pod's start, issue 14).

inotify on one hierarchy (v2's, else v1's memory, the one every runtime uses): the QoS parents
(``kubepods``, ``burstable``, ``besteffort``, in cgroupfs's and systemd's spelling) for a served pod's
cgroup to appear, then the pod's cgroup for its containers'. A name found ahead is only a head start:
a registration takes it only for the container id its caller's own cgroup names, and it is the same
runtime answer it would have asked for itself. Whatever is missed (inotify unavailable, a layout
not watched, a slow or failing runtime) leaves the registration asking the runtime as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import OrderedDict
from pathlib import Path, PurePosixPath

from inotify_simple import INotify, flags

from libs.cgroups import hierarchy_roots, owner_of_path, pod_cgroup_paths
from libs.logger import get_logger
from libs.runtime import discard
from services.vmanager.containers import ContainerRef
from services.vmanager.runtimenames import RuntimeNames

__all__ = ["QOS_PARENTS", "NamesAhead", "watched_hierarchy"]

_logger = get_logger("vmanager")

# Where the kubelet puts pod cgroups, per QoS class (Guaranteed pods directly in kubepods).
QOS_PARENTS = tuple(PurePosixPath(p) for p in (
    "kubepods", "kubepods/burstable", "kubepods/besteffort",
    "kubepods.slice", "kubepods.slice/kubepods-burstable.slice", "kubepods.slice/kubepods-besteffort.slice"))
_NEW_DIR = flags.CREATE | flags.ONLYDIR
MAX_KNOWN = 1024  # names kept ahead (a few per pod being started); the oldest go first


def watched_hierarchy(cgroup_root: Path) -> Path | None:
    """The one hierarchy to watch: v2's, else v1's memory (then the other v1 ones, unified last)."""
    roots = hierarchy_roots(cgroup_root)
    v1_first = [r for r in roots if r.name != "unified"] + [r for r in roots if r.name == "unified"]
    return v1_first[0] if v1_first else None


class NamesAhead:
    def __init__(self, runtime: RuntimeNames, cgroup_root: Path) -> None:
        self.runtime = runtime
        self.cgroup_root = cgroup_root
        self.hierarchy: Path | None = None  # found at the first pod served
        self._inotify: INotify | None = None
        self._dirs: dict[int, tuple[PurePosixPath, str]] = {}  # watch -> (directory, its pod's uid or "")
        self._pod_watches: dict[str, set[int]] = {}
        self._sandbox_next: set[int] = set()  # pod cgroups watched empty: the next child is the sandbox's
        self._expected: set[str] = set()
        # container id -> (its pod, the runtime's answer, asked when its cgroup appeared)
        self._known: OrderedDict[str, tuple[str, asyncio.Task[ContainerRef | None]]] = OrderedDict()
        self.asked = 0  # runtime calls made ahead (tests, metrics)

    def start(self) -> None:
        try:
            self._inotify = INotify()
        except OSError as exc:
            _logger.warning("cannot watch cgroups (inotify): containers are named when they register",
                            error=str(exc))
            return
        asyncio.get_running_loop().add_reader(self._inotify.fileno(), self._on_events)

    def close(self) -> None:
        for _pod, task in self._known.values():
            discard(task)
        self._known.clear()
        if self._inotify is not None:
            asyncio.get_running_loop().remove_reader(self._inotify.fileno())
            self._inotify.close()
            self._inotify = None

    # --- what the vmanager tells it ---
    def expect(self, pod_uid: str) -> None:
        """A pod is served: name its containers as their cgroups appear."""
        if self._inotify is None or pod_uid in self._expected:
            return
        if self.hierarchy is None:
            self.hierarchy = watched_hierarchy(self.cgroup_root)
            if self.hierarchy is None:
                return
        self._expected.add(pod_uid)
        for parent in QOS_PARENTS:  # first the parents, so that a pod cgroup made meanwhile is seen
            self._watch(parent, "")
        for rel in pod_cgroup_paths(pod_uid):
            self._watch(rel, pod_uid)

    def forget(self, pod_uid: str) -> None:
        """The pod is no longer served."""
        self._expected.discard(pod_uid)
        for wd in self._pod_watches.pop(pod_uid, set()):
            self._unwatch(wd)
        for cid in [c for c, (pod, _t) in self._known.items() if pod == pod_uid]:
            discard(self._known.pop(cid)[1])

    def answer_for(self, pod_uid: str, container_id: str) -> asyncio.Future[ContainerRef | None] | None:
        """The runtime's answer for the container, asked ahead (a new future each time: the caller may
        drop it); None when nothing was asked or the answer was no name."""
        known = self._known.get(container_id)
        if known is None or known[0] != pod_uid:
            return None
        task = known[1]
        if task.done() and (task.cancelled() or task.exception() is not None or task.result() is None):
            return None
        if task.done():
            answer: asyncio.Future[ContainerRef | None] = asyncio.get_running_loop().create_future()
            answer.set_result(task.result())
            return answer
        return asyncio.ensure_future(self._awaited(task, pod_uid, container_id))

    async def _awaited(self, task: asyncio.Task[ContainerRef | None], pod_uid: str,
                       container_id: str) -> ContainerRef | None:
        try:
            ref = await asyncio.shield(task)
        except Exception:  # asked again below, where a failure is reported
            ref = None
        return ref if ref is not None else await self.runtime.lookup(pod_uid, container_id)

    # --- inotify ---
    def _watch(self, rel: PurePosixPath, pod_uid: str, *, born: bool = False) -> None:
        """``born``: a pod cgroup seen made just now (its first child, if already there, is its sandbox)."""
        assert self._inotify is not None and self.hierarchy is not None
        try:
            wd = self._inotify.add_watch(self.hierarchy / rel, _NEW_DIR)
        except OSError:  # not there (yet): its parent's watch sees it made
            return
        fresh = wd not in self._dirs
        self._dirs[wd] = (rel, pod_uid)
        if pod_uid and fresh:
            self._pod_watches.setdefault(pod_uid, set()).add(wd)
            # The kubelet starts a pod's sandbox before any of its containers: the first cgroup made in
            # a new or empty pod cgroup is the sandbox's, of which the runtime knows no container.
            # (runc may make the pod's cgroup and the sandbox's at once: both are there by now.)
            children = self._children(self.hierarchy / rel)
            if not children:
                self._sandbox_next.add(wd)
            elif born and (len(children) == 1 or children[0][0] < children[1][0]):
                children = children[1:]  # the oldest (timestamps can tie: then nothing is skipped)
            for _ctime, name in children:  # containers made before the watch was in place
                self._appeared(rel / name)

    @staticmethod
    def _children(directory: Path) -> list[tuple[int, str]]:
        """Subdirectories (ctime, name), oldest first."""
        found = []
        with contextlib.suppress(OSError):
            for entry in os.scandir(directory):
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        found.append((entry.stat(follow_symlinks=False).st_ctime_ns, entry.name))
        return sorted(found)

    def _unwatch(self, wd: int) -> None:
        self._dirs.pop(wd, None)
        self._sandbox_next.discard(wd)
        if self._inotify is not None:
            with contextlib.suppress(OSError):  # gone with its directory already
                self._inotify.rm_watch(wd)

    def _on_events(self) -> None:
        assert self._inotify is not None
        try:
            events = self._inotify.read(timeout=0)
        except OSError as exc:
            _logger.warning("reading cgroup events failed", error=str(exc))
            return
        for event in events:
            if event.mask & flags.IGNORED:  # the directory is gone
                _rel, pod_uid = self._dirs.pop(event.wd, (None, ""))
                self._sandbox_next.discard(event.wd)
                if pod_uid:
                    self._pod_watches.get(pod_uid, set()).discard(event.wd)
                continue
            where = self._dirs.get(event.wd)
            if where is None or not event.name or not event.mask & flags.ISDIR:
                continue
            rel, pod_uid = where
            if event.wd in self._sandbox_next:
                self._sandbox_next.discard(event.wd)
            elif pod_uid:
                self._appeared(rel / event.name)
            else:
                owner = owner_of_path(str(rel / event.name))
                if owner.pod_uid in self._expected and owner.container_id is None:
                    self._watch(rel / event.name, owner.pod_uid, born=True)

    def _appeared(self, rel: PurePosixPath) -> None:
        owner = owner_of_path(str(rel))
        cid, pod_uid = owner.container_id, owner.pod_uid
        if cid is None or pod_uid is None or pod_uid not in self._expected or cid in self._known:
            return
        self.asked += 1
        # A sandbox's cgroup may still come by (one restarted, or found at the watch): answered None.
        task = asyncio.ensure_future(self.runtime.lookup(pod_uid, cid, quiet=True))
        self._known[cid] = (pod_uid, task)
        while len(self._known) > MAX_KNOWN:
            discard(self._known.popitem(last=False)[1][1])
