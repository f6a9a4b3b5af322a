"""The API server's storage for this node's objects: pods, resourceVersions and watch events.

One global resourceVersion counter (as etcd's revision), a bounded history of pod events so a
watch can resume from a resourceVersion, and per-watcher queues. Objects are stored and handed
out as deep copies, so nobody mutates stored state by accident. A stored object is never changed in
place (an update stores a new one), so the watch events share the objects they name instead of
copying them again (a pod start emits half a dozen events, and the copies were most of the emulated
API server's time).
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .errors import ApiError
from .notify import Changes

__all__ = ["DROP", "Event", "PodStore", "Watcher", "now_rfc3339"]

Pod = dict[str, Any]


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    object: Pod
    previous: Pod | None  # the object before a MODIFIED, for selector transitions


DROP = "drop"  # in a watcher's queue: cut the connection without ending the stream properly


class Watcher:
    """One watch stream's inbox. `None` in the queue means "the server is closing"; `DROP` means
    "cut the connection" (fault injection: what a client sees when a proxy or the server dies)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event | str | None] = asyncio.Queue()


class PodStore:
    def __init__(self, history: int = 1000) -> None:
        self._rv = 0
        self._pods: dict[tuple[str, str], Pod] = {}
        self._by_uid: dict[str, tuple[str, str]] = {}
        # uid -> (wall-clock ns, sequence): creation order finer than creationTimestamp's seconds.
        self._created: dict[str, tuple[int, int]] = {}
        self._seq = 0
        self._history: deque[Event] = deque(maxlen=max(1, history))
        self._compacted_rv = 0  # rv of the newest event dropped from the history
        self._watchers: set[Watcher] = set()
        self.changes = Changes()
        self._closed = False

    # -- resourceVersion -----------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        return self._rv

    def next_rv(self) -> int:
        """Also used for the Node object: one counter for everything, like etcd."""
        self._rv += 1
        return self._rv

    # -- reads ---------------------------------------------------------------------------------

    def get(self, namespace: str, name: str) -> Pod | None:
        pod = self.peek(namespace, name)
        return copy.deepcopy(pod) if pod is not None else None

    def get_by_uid(self, uid: str) -> Pod | None:
        pod = self.peek_by_uid(uid)
        return copy.deepcopy(pod) if pod is not None else None

    def peek(self, namespace: str, name: str) -> Pod | None:
        """The stored object itself, read-only by convention (no copy, for hot predicates)."""
        return self._pods.get((namespace, name))

    def peek_by_uid(self, uid: str) -> Pod | None:
        key = self._by_uid.get(uid)
        return self.peek(*key) if key else None

    def list(self, predicate: Callable[[Pod], bool] | None = None) -> list[Pod]:
        """Matching pods in creation order."""
        return [copy.deepcopy(p) for p in self.peek_all(predicate)]

    def peek_all(self, predicate: Callable[[Pod], bool] | None = None) -> list[Pod]:
        """``list`` without the copies, read-only by convention: for the kubelet's hot paths (every
        Allocate's garbage collection, every pod-resources List), where a Go kubelet reads its own
        pod manager's objects in microseconds and copying every pod cost milliseconds."""
        pods = sorted(self._pods.values(), key=lambda p: self._created[p["metadata"]["uid"]])
        return [p for p in pods if predicate is None or predicate(p)]

    def creation_order(self, uid: str) -> tuple[int, int]:
        return self._created.get(uid, (0, 0))

    # -- writes --------------------------------------------------------------------------------

    def create(self, pod: Pod) -> Pod:
        """Store a new pod; metadata gets uid, creationTimestamp and resourceVersion."""
        pod = copy.deepcopy(pod)
        meta = pod.setdefault("metadata", {})
        key = (meta.get("namespace") or "default", meta.get("name") or "")
        if key in self._pods:
            raise ApiError.already_exists("pods", key[1])
        meta["namespace"] = key[0]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["resourceVersion"] = str(self.next_rv())
        self._seq += 1
        self._created[meta["uid"]] = (time.time_ns(), self._seq)
        self._pods[key] = pod
        self._by_uid[meta["uid"]] = key
        self._emit("ADDED", pod, None)
        return copy.deepcopy(pod)

    def update(self, namespace: str, name: str, mutate: Callable[[Pod], Pod | None]) -> Pod:
        """Apply `mutate` to a copy (it may return a replacement), bump the rv, emit MODIFIED.

        Identity fields cannot be changed through here, whatever the mutation does.
        """
        current = self._pods.get((namespace, name))
        if current is None:
            raise ApiError.not_found("pods", name)
        draft = copy.deepcopy(current)
        result = mutate(draft)
        new = result if result is not None else draft
        meta = new.setdefault("metadata", {})
        for field in ("name", "namespace", "uid", "creationTimestamp"):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
        if current["metadata"].get("deletionTimestamp"):
            meta["deletionTimestamp"] = current["metadata"]["deletionTimestamp"]
        new.setdefault("kind", "Pod")
        new.setdefault("apiVersion", "v1")
        meta["resourceVersion"] = str(self.next_rv())
        self._pods[(namespace, name)] = new
        self._emit("MODIFIED", new, current)
        return copy.deepcopy(new)

    def remove(self, namespace: str, name: str) -> Pod:
        current = self._pods.pop((namespace, name), None)
        if current is None:
            raise ApiError.not_found("pods", name)
        uid = current["metadata"]["uid"]
        self._by_uid.pop(uid, None)
        self._created.pop(uid, None)
        # A DELETED event carries the last state with a fresh resourceVersion, as etcd does (on a copy:
        # earlier events share the object).
        current = copy.deepcopy(current)
        current["metadata"]["resourceVersion"] = str(self.next_rv())
        self._emit("DELETED", current, None)
        return copy.deepcopy(current)

    # -- watch ---------------------------------------------------------------------------------

    def _emit(self, type_: str, obj: Pod, previous: Pod | None) -> None:
        """``obj`` and ``previous``: objects nobody changes any more (stored ones, or replaced ones)."""
        event = Event(self._rv, type_, obj, previous)
        if len(self._history) == self._history.maxlen:
            self._compacted_rv = self._history[0].rv
        self._history.append(event)
        for watcher in self._watchers:
            watcher.queue.put_nowait(event)
        self.changes.notify()

    def watch(self, since: int | None) -> tuple[Watcher, list[Event]]:
        """Subscribe. With `since`, also return the stored events after it (in order).

        Raises ApiError 410 Expired when events after `since` were already dropped.
        """
        if since is not None and since < self._compacted_rv:
            raise ApiError.expired(f"too old resource version: {since} ({self._compacted_rv + 1})")
        watcher = Watcher()
        if self._closed:
            watcher.queue.put_nowait(None)
        self._watchers.add(watcher)
        backlog = [e for e in self._history if since is not None and e.rv > since]
        return watcher, backlog

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    # -- fault injection -----------------------------------------------------------------------

    def drop_watches(self) -> int:
        """Cut every open watch connection; return how many there were."""
        for watcher in self._watchers:
            watcher.queue.put_nowait(DROP)
        return len(self._watchers)

    def expire_history(self) -> int:
        """Forget every stored event (as etcd compaction does): a watch resuming from any version
        older than now gets 410 Gone. Returns the compaction point."""
        self._history.clear()
        self._compacted_rv = self._rv
        return self._rv

    def close(self) -> None:
        """End every watch stream (server shutdown)."""
        self._closed = True
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)
