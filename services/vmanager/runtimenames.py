"""Container id -> Kubernetes container name, from the CRI runtime (gpu-manager's way).

The kubelet labels every container it creates with ``io.kubernetes.container.name`` and
``io.kubernetes.pod.uid``; the runtime knows them from the moment the container exists, while the
pod's status only names the container's id once the kubelet has written it (after the start). So
with a runtime endpoint configured, one ``ContainerStatus`` answers a registration at once. The
answer must name the socket's pod. A runtime that is absent, slow or does not know the container
(another runtime's, no kubelet labels) answers None: the caller falls back to the watchdog.

The call is made with ``h2`` (grpcchannel.py), as the vcuda.sock calls are answered: the vmanager loads
no grpcio. The CRI messages are imported only when an endpoint is configured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from libs.grpcchannel import UnaryChannel
from libs.grpcwire import CallFailed
from libs.logger import get_logger
from services.vmanager.containers import ContainerRef, ContainerUnknown

__all__ = ["CONTAINER_NAME_LABEL", "POD_UID_LABEL", "RUNTIME_TIMEOUT", "RuntimeNames"]

_logger = get_logger("vmanager")

POD_UID_LABEL = "io.kubernetes.pod.uid"
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"
RUNTIME_TIMEOUT = 1.0  # seconds: a local runtime answers in a millisecond; longer means it is stuck
CONTAINER_STATUS = "/runtime.v1.RuntimeService/ContainerStatus"


class RuntimeNames:
    """Asks the runtime at ``socket`` (a unix socket) for a container's labels, ``timeout`` seconds at most."""

    def __init__(self, socket: Path, *, timeout: float) -> None:
        from libs.cri.v1 import api_pb2

        self.socket = socket
        self.timeout = timeout
        self._pb: Any = api_pb2
        self._channel = UnaryChannel(socket)  # dialled at the first call
        self._answering = True  # warn once when the runtime stops answering, not on every registration

    async def close(self) -> None:
        await self._channel.close()

    async def lookup(self, pod_uid: str, container_id: str, *, timeout: float | None = None,
                     quiet: bool = False) -> ContainerRef | None:
        """The container's name (pod QoS class unknown: ""), None when the runtime cannot say;
        ContainerUnknown when the runtime says it is another pod's container. ``quiet``: asked ahead
        (namesahead.py), where an id that is no container (a pod sandbox's) is expected: no warning."""
        wait = self.timeout if timeout is None else min(self.timeout, timeout)
        request = self._pb.ContainerStatusRequest(container_id=container_id).SerializeToString()
        try:
            answer = await self._channel.call(CONTAINER_STATUS, request, timeout=max(wait, 0.01))
            reply = self._pb.ContainerStatusResponse.FromString(answer)
        except CallFailed as exc:
            if not quiet:
                self._failed(container_id, f"{exc.code.name}: {exc.message}")
            return None
        except DecodeError as exc:
            if not quiet:
                self._failed(container_id, f"the runtime's answer does not parse: {exc}")
            return None
        status = reply.status
        labels = status.labels
        name = labels.get(CONTAINER_NAME_LABEL) or status.metadata.name
        owner = labels.get(POD_UID_LABEL, "")
        if not name or not owner:
            if not quiet:
                self._failed(container_id, "the container has no Kubernetes labels")
            return None
        if not self._answering:
            _logger.info("the container runtime answers again", endpoint=str(self.socket))
            self._answering = True
        if owner != pod_uid:
            raise ContainerUnknown(
                f"container id {container_id} is a container of pod {owner}, not of pod {pod_uid} (runtime)")
        return ContainerRef(name=name, qos_class="", via="runtime")

    def _failed(self, container_id: str, why: str) -> None:
        if self._answering:
            _logger.warning("the container runtime cannot name a container; asking the watchdog",
                            endpoint=str(self.socket), container_id=container_id, error=why)
        self._answering = False
