"""The node's pods from the Kubernetes API: one list + watch loop (a small informer), via lightkube.

The same code runs against a real API server (in-cluster service account or a kubeconfig) and
against the simulator's API: only the kubeconfig differs. The cache is keyed by pod UID; every change
reaches ``on_change(kind, old, new)``. Any watch failure (a dropped connection, a 410 Gone for a
too-old resourceVersion, an API server that is down) leads to a fresh list after a backoff, and the
fresh list is diffed against the cache so that changes missed meanwhile still produce callbacks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx2
import msgspec
from lightkube import AsyncClient, KubeConfig
from lightkube.resources.core_v1 import Pod as KubePod

from libs.kube.pods import Pod
from libs.log import get_logger

__all__ = ["ChangeHandler", "PodSource", "make_client"]

ChangeHandler = Callable[[str, Pod | None, Pod | None], Awaitable[None]]
_log = get_logger("pods")


def make_client(kubeconfig: str = "") -> AsyncClient:
    """``kubeconfig`` path, else in-cluster config, else $KUBECONFIG / ~/.kube/config."""
    config = KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_env()
    return AsyncClient(config=config, timeout=httpx2.Timeout(10.0))


def to_pod(obj: KubePod) -> Pod:
    return msgspec.convert(obj.to_dict(), Pod)


class PodSource:
    def __init__(self, client: AsyncClient, node: str, on_change: ChangeHandler) -> None:
        self.client = client
        self.node = node
        self.on_change = on_change
        self.pods: dict[str, Pod] = {}
        self.synced = asyncio.Event()
        self.relists = 0

    async def list_fresh(self) -> list[Pod]:
        """The node's pods straight from the API server (not the cache)."""
        return [to_pod(o) async for o in self.client.list(KubePod, namespace="*", fields={"spec.nodeName": self.node})]

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                version = await self._relist()
                backoff = 0.2
                async for kind, obj in self.client.watch(
                    KubePod, namespace="*", fields={"spec.nodeName": self.node}, resource_version=version
                ):
                    await self._apply(kind, to_pod(obj))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: back off, then list again from scratch
                _log.warning("pod watch interrupted; listing again", error=str(exc) or type(exc).__name__,
                             retry_in=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _relist(self) -> str:
        listing = self.client.list(KubePod, namespace="*", fields={"spec.nodeName": self.node})
        fresh = {p.uid: p async for p in _pods(listing)}
        version = listing.resourceVersion
        self.relists += 1
        for uid in [u for u in self.pods if u not in fresh]:
            await self._apply("DELETED", self.pods[uid])
        for pod in fresh.values():
            old = self.pods.get(pod.uid)
            if old is None:
                await self._apply("ADDED", pod)
            elif old != pod:
                await self._apply("MODIFIED", pod)
        self.synced.set()
        return version

    async def _apply(self, kind: str, pod: Pod) -> None:
        if kind == "BOOKMARK":
            return
        old = self.pods.get(pod.uid)
        if kind == "DELETED":
            self.pods.pop(pod.uid, None)
            new = None
        else:
            self.pods[pod.uid] = pod
            new = pod
        try:
            await self.on_change(kind, old, new)
        except Exception as exc:  # a handler failure must not stop the watch
            _log.error("pod change handler failed", pod=pod.key, kind=kind, error=str(exc), exc_info=exc)


async def _pods(listing):  # type: ignore[no-untyped-def]
    async for obj in listing:
        yield to_pod(obj)
