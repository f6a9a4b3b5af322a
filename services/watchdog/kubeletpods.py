"""What the kubelet itself says is in use: the pod-resources ``List`` over its unix socket.

The reconciliation asks it before releasing an allocation whose pod the API server no longer reports
as active: if the kubelet still lists that container with the allocation's device IDs, the container
has not stopped yet and the shares stay held until a later pass.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import grpc.aio

from libs.kubelet.podresources.v1 import api_pb2 as pr
from libs.kubelet.podresources.v1 import api_pb2_grpc as pr_grpc
from libs.logger import get_logger

__all__ = ["KubeletPods", "KubeletView"]

_logger = get_logger("watchdog")

# (namespace, pod name, container) -> {resource name: device IDs}
KubeletView = dict[tuple[str, str, str], dict[str, set[str]]]


class KubeletPods:
    def __init__(self, socket: str, timeout: float) -> None:
        self.socket = Path(socket)
        self.timeout = timeout

    async def view(self) -> KubeletView | None:
        """The kubelet's device assignments, or None when its socket is absent or does not answer."""
        if not self.socket.exists():
            return None
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.socket}") as channel:
                reply = await pr_grpc.PodResourcesListerStub(channel).List(
                    pr.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            _logger.warning("pod-resources List failed", socket=str(self.socket), error=exc.details())
            return None
        view: KubeletView = {}
        for pod in reply.pod_resources:
            for ctr in pod.containers:
                devices = view.setdefault((pod.namespace, pod.name, ctr.name), {})
                for dev in ctr.devices:
                    devices.setdefault(dev.resource_name, set()).update(dev.device_ids)
        return view
