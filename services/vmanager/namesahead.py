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
import errno
import os
from collections import OrderedDict
from pathlib import Path

from inotify_simple import INotify, flags

from libs.cgroups import hierarchy_roots, owner_of_path, pod_cgroup_paths
from libs.logger import get_logger
from libs.runtime import discard
from services.vmanager.containers import ContainerRef
from services.vmanager.runtimenames import RuntimeNames

__all__ = ["QOS_PARENTS", "NamesAhead", "watched_hierarchy"]

_logger = get_logger("vmanager")

# Where the kubelet puts pod cgroups, per QoS class (Guaranteed pods directly in kubepods). Paths here
# are strings relative to the watched hierarchy: this runs for every cgroup made on the node.
QOS_PARENTS = ("kubepods", "kubepods/burstable", "kubepods/besteffort",
               "kubepods.slice", "kubepods.slice/kubepods-burstable.slice", "kubepods.slice/kubepods-besteffort.slice")
_PARENT_SET = frozenset(QOS_PARENTS)
_ON_THE_WAY = frozenset(p.rsplit("/", i)[0] for p in QOS_PARENTS for i in range(p.count("/") + 1))
_ROOT = "."
_NEW_DIR = flags.CREATE | flags.ONLYDIR
MAX_KNOWN = 1024  # names kept ahead (a few per pod being started); the oldest go first


def _parent(rel: str) -> str:
    return rel.rpartition("/")[0] or _ROOT


def _child(rel: str, name: str) -> str:
    return name if rel == _ROOT else f"{rel}/{name}"


def watched_hierarchy(cgroup_root: Path) -> Path | None:
    """The one hierarchy to watch: v2's, else v1's memory (then the other v1 ones, unified last)."""
    roots = hierarchy_roots(cgroup_root)
    v1_first = [r for r in roots if r.name != "unified"] + [r for r in roots if r.name == "unified"]
    return v1_first[0] if v1_first else None


class NamesAhead:
    def __init__(self, runtime: RuntimeNames, cgroup_root: Path) -> None:
        self.runtime = runtime
        self.cgroup_root = cgroup_root
        self.hierarchy: str | None = None  # found at the first pod served
        self._inotify: INotify | None = None
        self._dirs: dict[int, tuple[str, str]] = {}  # watch -> (directory, its pod's uid or "")
        self._parents_watched = False  # the QoS parents, or where a missing one will be made
        self._watched_parents: set[str] = set()  # those of QOS_PARENTS watched now
        self._pod_watches: dict[str, set[int]] = {}
        # pod cgroup watch -> its sandbox's cgroup: the name found when the watch was placed, or None
        # (the pod cgroup was empty: the next child made is the sandbox's)
        self._sandbox: dict[int, str | None] = {}
        self._expected: set[str] = set()
        # container id -> (its pod, the runtime's answer, asked when its cgroup appeared)
        self._known: OrderedDict[str, tuple[str, asyncio.Task[ContainerRef | None]]] = OrderedDict()
        self.asked = 0  # runtime calls made as containers' cgroups appeared (metrics, tests)
        self.used = 0  # registrations that found their container's answer asked ahead
        self._out_of_watches = False  # said once

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
            found = watched_hierarchy(self.cgroup_root)
            if found is None:
                return
            self.hierarchy = str(found)
        self._expected.add(pod_uid)
        if not self._parents_watched:  # first the parents, so that a pod cgroup made meanwhile is seen
            self._parents_watched = True
            for parent in QOS_PARENTS:
                self._watch_or_ancestor(parent)
        for path in pod_cgroup_paths(pod_uid):  # then the pod's, if there already (usually not yet)
            rel = str(path)
            if _parent(rel) in self._watched_parents and os.path.isdir(f"{self.hierarchy}/{rel}"):
                self._watch(rel, pod_uid)

    def _watch_or_ancestor(self, rel: str) -> None:
        """Watch a QoS parent; one that does not exist yet (a node whose first pod is still to come),
        its nearest existing ancestor, whose event for its making leads here again."""
        while not self._watch(rel, "") and rel != _ROOT:
            rel = _parent(rel)

    def forget(self, pod_uid: str) -> None:
        """The pod is no longer served."""
        self._expected.discard(pod_uid)
        for wd in self._pod_watches.pop(pod_uid, set()):
            self._unwatch(wd)
        for cid in [c for c, (pod, _t) in self._known.items() if pod == pod_uid]:
            discard(self._known.pop(cid)[1])

    def answer_for(self, pod_uid: str, container_id: str, *,
                   timeout: float | None = None) -> asyncio.Future[ContainerRef | None] | None:
        """The runtime's answer for the container, asked ahead (a new future each time: the caller may
        drop it); None when nothing was asked or the answer was no name. An answer still on its way
        that brings no name is asked again (``timeout``: that call's)."""
        known = self._known.get(container_id)
        if known is None or known[0] != pod_uid:
            return None
        task = known[1]
        if not task.done():
            self.used += 1
            return asyncio.ensure_future(self._awaited(task, pod_uid, container_id, timeout))
        ref = None if task.cancelled() or task.exception() is not None else task.result()
        if ref is None:
            return None
        self.used += 1
        answer: asyncio.Future[ContainerRef | None] = asyncio.get_running_loop().create_future()
        answer.set_result(ref)
        return answer

    async def _awaited(self, task: asyncio.Task[ContainerRef | None], pod_uid: str, container_id: str,
                       timeout: float | None) -> ContainerRef | None:
        try:
            ref = await asyncio.shield(task)
        except Exception:  # asked again below, where a failure is reported
            ref = None
        return ref if ref is not None else await self.runtime.lookup(pod_uid, container_id, timeout=timeout)

    # --- inotify ---
    def _watch(self, rel: str, pod_uid: str) -> bool:
        """Whether the directory is watched now (it exists)."""
        assert self._inotify is not None and self.hierarchy is not None
        try:
            wd = self._inotify.add_watch(f"{self.hierarchy}/{rel}", _NEW_DIR)
        except OSError as exc:  # not there (yet): its parent's watch sees it made
            if exc.errno == errno.ENOSPC and not self._out_of_watches:  # fs.inotify.max_user_watches
                self._out_of_watches = True
                _logger.warning("no inotify watch left: containers are named when they register",
                                directory=rel, error=str(exc))
            return False
        fresh = wd not in self._dirs
        self._dirs[wd] = (rel, pod_uid)
        if rel in _PARENT_SET:
            self._watched_parents.add(rel)
        if pod_uid and fresh:
            self._pod_watches.setdefault(pod_uid, set()).add(wd)
            # The kubelet starts a pod's sandbox before any of its containers (a new sandbox, new
            # containers): a pod cgroup's oldest child is the sandbox's, of which the runtime knows no
            # container. Still to come when the pod cgroup is empty.
            # A sandbox made between the watch and this look is seen here and by its event too.
            children = self._children(f"{self.hierarchy}/{rel}")
            self._sandbox[wd] = children[0] if children else None
            for name in children[1:]:  # containers made before the watch was in place
                self._appeared(_child(rel, name), pod_uid)
        elif not pod_uid and fresh:  # a QoS parent (or its ancestor) made meanwhile: its children too
            for name in self._children(f"{self.hierarchy}/{rel}"):
                self._made(_child(rel, name), name)
        return True

    @staticmethod
    def _children(directory: str) -> list[str]:
        """Subdirectories' names, oldest first (looked up only when there are several).

        The kernel's file clock is coarse (a tick of a few ms): a sandbox and its container made in
        one tick have the same ctime. A cgroup's inode number breaks the tie: cgroupfs (kernfs)
        numbers its nodes in the order it makes them (a 64-bit id whose upper half counts wraps)."""
        with contextlib.suppress(OSError):
            with os.scandir(directory) as entries:
                found = [e for e in entries if e.is_dir(follow_symlinks=False)]
            if len(found) == 1:
                return [found[0].name]
            timed = []
            for entry in found:
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    timed.append((st.st_ctime_ns, st.st_ino, entry.name))
            return [name for _ctime, _ino, name in sorted(timed)]
        return []

    def _unwatch(self, wd: int) -> None:
        self._forget_watch(wd)
        if self._inotify is not None:
            with contextlib.suppress(OSError):  # gone with its directory already
                self._inotify.rm_watch(wd)

    def _forget_watch(self, wd: int) -> None:
        rel, pod_uid = self._dirs.pop(wd, (None, ""))
        self._sandbox.pop(wd, None)
        if pod_uid:
            self._pod_watches.get(pod_uid, set()).discard(wd)
        elif rel is not None:
            self._watched_parents.discard(rel)
            self._parents_watched = False  # a parent removed: watched again (or its ancestor) at the next pod

    def _on_events(self) -> None:
        assert self._inotify is not None
        try:
            events = self._inotify.read(timeout=0)
        except OSError as exc:
            _logger.warning("reading cgroup events failed", error=str(exc))
            return
        for event in events:
            if event.mask & flags.IGNORED:  # the directory is gone
                self._forget_watch(event.wd)
                continue
            where = self._dirs.get(event.wd)
            if where is None or not event.name or not event.mask & flags.ISDIR:
                continue
            rel, pod_uid = where
            if event.wd in self._sandbox and self._sandbox.pop(event.wd) in (None, event.name):
                continue  # the pod's first child: its sandbox's cgroup
            if pod_uid:
                self._appeared(_child(rel, event.name), pod_uid)
            else:
                self._made(_child(rel, event.name), event.name)

    def _made(self, rel: str, name: str) -> None:
        """A directory ``name`` made in a QoS parent or an ancestor of one: a QoS parent, or a pod's
        cgroup (watched when it is a served pod's)."""
        if rel in _ON_THE_WAY:
            self._watch_or_ancestor(rel)
            return
        owner = owner_of_path(name)
        if owner.pod_uid in self._expected and owner.container_id is None and _parent(rel) in _PARENT_SET:
            self._watch(rel, owner.pod_uid)

    def _appeared(self, rel: str, pod_uid: str) -> None:
        """A cgroup made in a served pod's: a container's."""
        cid = owner_of_path(rel).container_id
        if cid is None or pod_uid not in self._expected or cid in self._known:
            return
        self.asked += 1
        # A sandbox's cgroup may still come by (one restarted, or found at the watch): answered None.
        task = asyncio.ensure_future(self.runtime.lookup(pod_uid, cid, quiet=True))
        self._known[cid] = (pod_uid, task)
        while len(self._known) > MAX_KNOWN:
            discard(self._known.popitem(last=False)[1][1])
