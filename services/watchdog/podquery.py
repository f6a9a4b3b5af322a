"""Answering ``watchdog.pods``: the node's pods, from the watch cache or fresh from the API server."""

from __future__ import annotations

import asyncio

from libs.commands import PodsReply, PodsRequest
from libs.errors import ServiceError
from libs.kube.pods import Pod
from libs.kube.source import PodSource

__all__ = ["PodQuery"]


class PodQuery:
    def __init__(self, source: PodSource, timeout: float) -> None:
        self.source = source
        self.timeout = timeout

    async def __call__(self, req: PodsRequest) -> PodsReply:
        if bool(req.namespace) != bool(req.name):
            raise ServiceError(400, "a pod is named by its namespace and its name, both")
        try:
            if req.name and (req.fresh or not self.source.synced.is_set()):
                pods = await asyncio.wait_for(self._get(req.namespace, req.name), self.timeout)
            elif req.fresh or not self.source.synced.is_set():
                pods = await asyncio.wait_for(self.source.list_fresh(), self.timeout)
            else:
                pods = list(self.source.pods.values())
        except Exception as exc:
            raise ServiceError(503, f"cannot list pods from the API server: {exc}") from exc
        if req.name:
            pods = [p for p in pods if (p.metadata.namespace, p.metadata.name) == (req.namespace, req.name)]
        if req.uid:
            pods = [p for p in pods if p.uid == req.uid]
        if req.phase:
            pods = [p for p in pods if p.status.phase == req.phase]
        return PodsReply(pods=pods)

    async def _get(self, namespace: str, name: str) -> list[Pod]:
        """The one pod (a GET costs the API server far less than listing the node's pods), if it is ours."""
        pod = await self.source.get(namespace, name)
        return [pod] if pod is not None and pod.spec.node_name == self.source.node else []
