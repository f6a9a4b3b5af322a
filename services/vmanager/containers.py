"""Container id -> Kubernetes container name: from the CRI runtime when one is configured
(runtimenames.py, gpu-manager's way), else from the pod's status as the watchdog sees it.

The watchdog (``watchdog.pods``) answers with the pod; the container status (init or app) whose
``containerID`` is ``<runtime>://<id>`` names it. The kubelet posts a new container's id shortly
*after* starting it, while the CUDA library registers as soon as the process initialises CUDA, so a
miss is retried (listing fresh from the API server) for a bounded time. The runtime knows the
container from its creation: no such race, one local call.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from libs.bus.client import Bus
from libs.commands import PodsReply, PodsRequest
from libs.errors import BusError, RemoteError
from libs.kube.pods import Pod

if TYPE_CHECKING:
    from services.vmanager.runtimenames import RuntimeNames

__all__ = ["ContainerNames", "ContainerRef", "ContainerUnknown", "WatchdogUnavailable", "find_container"]


class ContainerUnknown(LookupError):
    pass


class WatchdogUnavailable(Exception):
    pass


@dataclass(frozen=True)
class ContainerRef:
    name: str
    qos_class: str  # the pod's status.qosClass ("" when not reported): where its cgroup lives
    via: str = "watchdog"  # who named it: "runtime" (CRI ContainerStatus) or "watchdog" (the pod's status)


def find_container(pods: list[Pod], pod_uid: str, container_id: str) -> ContainerRef | None:
    for pod in pods:
        if pod.uid != pod_uid:
            continue
        for status in pod.all_statuses():
            if status.container_id and status.runtime_id == container_id:
                return ContainerRef(name=status.name, qos_class=pod.status.qos_class)
    return None


class ContainerNames:
    def __init__(self, bus: Bus, *, timeout: float, runtime: RuntimeNames | None = None) -> None:
        self.bus = bus
        self.timeout = timeout
        self.runtime = runtime
        self.resolved: Counter[str] = Counter()  # via -> names found (the vmanager's metrics)

    async def lookup(self, pod_uid: str, container_id: str, *, patience: float,
                     runtime_answer: asyncio.Future[ContainerRef | None] | None = None) -> ContainerRef:
        """The container's name (and pod QoS class from the watchdog); the runtime first when configured,
        then the pod's status, retried for up to ``patience`` seconds while it lacks the id.
        ``runtime_answer``: the runtime was asked already (its answer is shared, not consumed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(patience, 0.0)
        if self.runtime is not None:
            # Half the patience at most: a silent runtime leaves the watchdog time to answer.
            wait = max(patience, 0.0) / 2
            if runtime_answer is None:
                ref = await self.runtime.lookup(pod_uid, container_id, timeout=wait)
            else:
                try:
                    ref = await asyncio.wait_for(asyncio.shield(runtime_answer), wait)
                except TimeoutError:
                    ref = None
            if ref is not None:
                self.resolved[ref.via] += 1
                return ref
        ref = await self._from_watchdog(pod_uid, container_id, deadline)
        self.resolved[ref.via] += 1
        return ref

    async def _from_watchdog(self, pod_uid: str, container_id: str, deadline: float) -> ContainerRef:
        loop = asyncio.get_running_loop()
        delay, fresh = 0.02, False  # the status usually lands within a few ms of the container's start
        while True:
            remaining = max(deadline - loop.time(), 0.05)
            try:
                reply = await self.bus.request(
                    self.bus.subjects.pods, PodsRequest(uid=pod_uid, fresh=fresh), PodsReply,
                    timeout=min(self.timeout, remaining),
                )
                pods = reply.pods
            except RemoteError as exc:
                if exc.code != 404:  # 404: the watchdog does not know the pod (yet)
                    message = f"the watchdog cannot list pod {pod_uid}: {exc.message}"
                    raise WatchdogUnavailable(message) from exc
                pods = []
            except BusError as exc:
                raise WatchdogUnavailable(f"the watchdog did not answer for pod {pod_uid}: {exc}") from exc
            ref = find_container(pods, pod_uid, container_id)
            if ref is not None:
                return ref
            if not fresh and loop.time() < deadline:
                # The watch cache may lag the kubelet's status write by a moment (a container registers
                # as soon as it runs): ask the API server through the watchdog at once, pause only after.
                fresh = True
                continue
            if loop.time() + delay >= deadline:
                raise ContainerUnknown(f"container id {container_id} is not a container of pod {pod_uid}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
