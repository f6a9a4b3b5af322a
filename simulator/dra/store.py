"""Storage for the ``resource.k8s.io/v1`` objects of the simulated cluster: one store per kind.

DeviceClass and ResourceSlice are cluster-scoped (namespace ""), ResourceClaim and
ResourceClaimTemplate namespaced. Every store draws its resourceVersions from the pod store's
counter, so one number orders every object, as etcd's revision does, and a watch on any kind
resumes from a version the same way pod watches do (same ``Event``/``Watcher`` shapes, so the API
server's watch loop serves all of them).
"""

from __future__ import annotations

import copy
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from ..errors import ApiError
from ..notify import Changes
from ..store import DROP, Event, PodStore, Watcher, now_rfc3339

__all__ = ["GROUP_VERSION", "KINDS", "DraObjects", "KindStore"]

GROUP_VERSION = "resource.k8s.io/v1"

# plural -> (kind, namespaced)
KINDS: dict[str, tuple[str, bool]] = {
    "deviceclasses": ("DeviceClass", False),
    "resourceslices": ("ResourceSlice", False),
    "resourceclaims": ("ResourceClaim", True),
    "resourceclaimtemplates": ("ResourceClaimTemplate", True),
}

Obj = dict[str, Any]


class KindStore:
    """Objects of one kind keyed by (namespace, name), with watch history like ``PodStore``."""

    def __init__(self, plural: str, counter: PodStore, history: int = 1000, shared: Changes | None = None) -> None:
        self.plural = plural
        self._shared = shared  # also woken on every change (the scheduler waits on all kinds at once)
        self.kind, self.namespaced = KINDS[plural]
        self._counter = counter
        self._objs: dict[tuple[str, str], Obj] = {}
        self._order: dict[str, int] = {}
        self._history: deque[Event] = deque(maxlen=max(1, history))
        self._compacted_rv = 0
        self._watchers: set[Watcher] = set()
        self.changes = Changes()
        self._closed = False

    @property
    def resource_version(self) -> int:
        return self._counter.resource_version

    def get(self, namespace: str, name: str) -> Obj | None:
        obj = self._objs.get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def peek(self, namespace: str, name: str) -> Obj | None:
        return self._objs.get((namespace, name))

    def list(self, predicate: Callable[[Obj], bool] | None = None) -> list[Obj]:
        objs = sorted(self._objs.values(), key=lambda o: self._order[o["metadata"]["uid"]])
        return [copy.deepcopy(o) for o in objs if predicate is None or predicate(o)]

    def create(self, obj: Obj) -> Obj:
        obj = copy.deepcopy(obj)
        obj["apiVersion"], obj["kind"] = GROUP_VERSION, self.kind
        meta = obj.setdefault("metadata", {})
        namespace = (meta.get("namespace") or "default") if self.namespaced else ""
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError.invalid(self.plural, "",
                                       "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = (namespace, meta["name"])
        if key in self._objs:
            raise ApiError.already_exists(self.plural, key[1])
        for field in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp"):
            meta.pop(field, None)
        if self.namespaced:
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["resourceVersion"] = str(self._counter.next_rv())
        meta.setdefault("generation", 1)
        self._order[meta["uid"]] = time.monotonic_ns()
        self._objs[key] = copy.deepcopy(obj)
        self._emit("ADDED", obj, None)
        return copy.deepcopy(obj)

    def update(self, namespace: str, name: str, mutate: Callable[[Obj], Obj | None]) -> Obj:
        current = self._objs.get((namespace, name))
        if current is None:
            raise ApiError.not_found(self.plural, name)
        draft = copy.deepcopy(current)
        result = mutate(draft)
        new = result if result is not None else draft
        meta = new.setdefault("metadata", {})
        for field in ("name", "namespace", "uid", "creationTimestamp", "generation"):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
        if new.get("spec") != current.get("spec"):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        new["apiVersion"], new["kind"] = GROUP_VERSION, self.kind
        meta["resourceVersion"] = str(self._counter.next_rv())
        self._objs[(namespace, name)] = new
        self._emit("MODIFIED", new, current)
        return copy.deepcopy(new)

    def remove(self, namespace: str, name: str) -> Obj:
        current = self._objs.pop((namespace, name), None)
        if current is None:
            raise ApiError.not_found(self.plural, name)
        self._order.pop(current["metadata"]["uid"], None)
        current = copy.deepcopy(current)
        current["metadata"]["resourceVersion"] = str(self._counter.next_rv())
        self._emit("DELETED", current, None)
        return copy.deepcopy(current)

    # -- watch (the same contract as PodStore's) -----------------------------------------------

    def _emit(self, type_: str, obj: Obj, previous: Obj | None) -> None:
        event = Event(int(obj["metadata"]["resourceVersion"]), type_, copy.deepcopy(obj),
                      copy.deepcopy(previous) if previous else None)
        if len(self._history) == self._history.maxlen:
            self._compacted_rv = self._history[0].rv
        self._history.append(event)
        for watcher in self._watchers:
            watcher.queue.put_nowait(event)
        self.changes.notify()
        if self._shared is not None:
            self._shared.notify()

    def watch(self, since: int | None) -> tuple[Watcher, list[Event]]:
        if since is not None and since < self._compacted_rv:
            raise ApiError.expired(f"too old resource version: {since} ({self._compacted_rv + 1})")
        watcher = Watcher()
        if self._closed:
            watcher.queue.put_nowait(None)
        self._watchers.add(watcher)
        return watcher, [e for e in self._history if since is not None and e.rv > since]

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def drop_watches(self) -> int:
        for watcher in self._watchers:
            watcher.queue.put_nowait(DROP)
        return len(self._watchers)

    def close(self) -> None:
        self._closed = True
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)


class DraObjects:
    """The four DRA kinds, sharing the pod store's resourceVersion counter."""

    def __init__(self, counter: PodStore, history: int = 1000) -> None:
        self.changes = Changes()  # any DRA object changed (the scheduler retries on it)
        self.stores = {plural: KindStore(plural, counter, history, self.changes) for plural in KINDS}

    @property
    def classes(self) -> KindStore:
        return self.stores["deviceclasses"]

    @property
    def slices(self) -> KindStore:
        return self.stores["resourceslices"]

    @property
    def claims(self) -> KindStore:
        return self.stores["resourceclaims"]

    @property
    def templates(self) -> KindStore:
        return self.stores["resourceclaimtemplates"]

    def drop_watches(self) -> int:
        return sum(s.drop_watches() for s in self.stores.values())

    def close(self) -> None:
        for store in self.stores.values():
            store.close()

