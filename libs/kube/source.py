"""The node's pods from the Kubernetes API: one list + watch loop (a small informer), via lightkube.

The same code runs against a real API server (in-cluster service account or a kubeconfig) and
against the simulator's API: only the kubeconfig differs. The cache is keyed by pod UID; every change
reaches the ``on_change(kind, old, new)`` handed to ``run``. The handler is an argument of the loop,
not of the source, because its usual consumer (the watchdog's recycler) reads the source too: both
are then built whole, the source first.

Informer rules, as client-go's reflector: list (field selector ``spec.nodeName``), then watch from the
list's resourceVersion with ``allowWatchBookmarks``; remember the resourceVersion of every event,
bookmarks included, so a dropped watch resumes where it stopped without listing again. Only a 410 Gone
(the version was compacted away) forces a fresh list, which is diffed against the cache so changes
missed meanwhile still produce callbacks. Connection failures (an API server that is down) are retried
with exponential backoff, capped at ``MAX_BACKOFF``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx2
import msgspec
from lightkube import ALL_NS, ApiError, AsyncClient, KubeConfig
from lightkube.resources.core_v1 import Pod as KubePod

from libs.kube.pods import Pod
from libs.logger import get_logger

__all__ = ["ChangeHandler", "PodSource", "make_client"]

ChangeHandler = Callable[[str, Pod | None, Pod | None], Awaitable[None]]
_logger = get_logger("pods")
MIN_BACKOFF = 0.2
MAX_BACKOFF = 5.0
WATCH_TIMEOUT = 300  # seconds the server keeps one watch request open (lightkube re-issues it)


def make_client(kubeconfig: str = "") -> AsyncClient:
    """``kubeconfig`` path, else in-cluster config, else $KUBECONFIG / ~/.kube/config."""
    config = KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_env()
    return AsyncClient(config=config, timeout=httpx2.Timeout(10.0))


def to_pod(obj: KubePod) -> Pod:
    return msgspec.convert(obj.to_dict(), Pod)


class PodSource:
    def __init__(self, client: AsyncClient, node: str) -> None:
        self.client = client
        self.node = node
        self.pods: dict[str, Pod] = {}
        self.synced = asyncio.Event()
        self.resource_version = ""  # of the newest event seen (bookmarks included)
        # Counters, for logs and tests: full lists, watches resumed from a version, 410s, bookmarks.
        self.relists = 0
        self.resumes = 0
        self.expired = 0
        self.bookmarks = 0

    @property
    def _fields(self) -> dict[str, str]:
        return {"spec.nodeName": self.node}

    async def list_fresh(self) -> list[Pod]:
        """The node's pods straight from the API server (not the cache)."""
        return [to_pod(o) async for o in self.client.list(KubePod, namespace=ALL_NS, fields=self._fields)]

    async def get(self, namespace: str, name: str) -> Pod | None:
        """One pod by name, on any node, straight from the API server; None when it does not exist."""
        try:
            return to_pod(await self.client.get(KubePod, name, namespace=namespace))
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise

    async def run(self, on_change: ChangeHandler) -> None:
        backoff = MIN_BACKOFF
        version = ""
        while True:
            try:
                if not version:
                    version = await self._relist(on_change)
                else:
                    self.resumes += 1
                backoff = MIN_BACKOFF
                async for kind, obj in self._watch(version):
                    version = self.resource_version = obj.metadata.resourceVersion or version
                    if kind == "BOOKMARK":
                        self.bookmarks += 1
                        continue
                    await self._apply(on_change, kind, to_pod(obj))
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if exc.status.code == 410:  # our version was compacted away: list again, at once
                    self.expired += 1
                    _logger.info("pod watch expired (410 Gone); listing again", resource_version=version)
                    version = ""
                    continue
                _logger.warning("pod watch failed", error=str(exc), code=exc.status.code, retry_in=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
            except Exception as exc:  # connection trouble: back off, then resume from `version`
                _logger.warning("pod watch interrupted; resuming", error=str(exc) or type(exc).__name__,
                             resource_version=version, retry_in=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    def _watch(self, version: str):  # type: ignore[no-untyped-def]
        # AsyncClient.watch has no allowWatchBookmarks parameter; the request is built the same way,
        # through lightkube's own request builder, with that one parameter added.
        generic = self.client._client
        request = generic.prepare_request(
            "list", res=KubePod, namespace=ALL_NS, watch=True,
            params={"timeoutSeconds": WATCH_TIMEOUT, "resourceVersion": version, "allowWatchBookmarks": "true",
                    "fieldSelector": f"spec.nodeName={self.node}"},
        )
        return generic.watch(request)

    async def _relist(self, on_change: ChangeHandler) -> str:
        listing = self.client.list(KubePod, namespace=ALL_NS, fields=self._fields)
        fresh = {p.uid: p async for p in _pods(listing)}
        version = listing.resourceVersion
        self.relists += 1
        for uid in [u for u in self.pods if u not in fresh]:
            await self._apply(on_change, "DELETED", self.pods[uid])
        for pod in fresh.values():
            old = self.pods.get(pod.uid)
            if old is None:
                await self._apply(on_change, "ADDED", pod)
            elif old != pod:
                await self._apply(on_change, "MODIFIED", pod)
        self.resource_version = version
        self.synced.set()
        return version

    async def _apply(self, on_change: ChangeHandler, kind: str, pod: Pod) -> None:
        old = self.pods.get(pod.uid)
        if kind == "DELETED":
            self.pods.pop(pod.uid, None)
            new = None
        else:
            self.pods[pod.uid] = pod
            new = pod
        try:
            await on_change(kind, old, new)
        except Exception as exc:  # a handler failure must not stop the watch
            _logger.error("pod change handler failed", pod=pod.key, kind=kind, error=str(exc), exc_info=exc)


async def _pods(listing):  # type: ignore[no-untyped-def]
    async for obj in listing:
        yield to_pod(obj)
