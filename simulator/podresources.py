"""The kubelet's PodResources v1 server (upstream `apis/podresources/server_v1.go`).

List: active pods the kubelet has taken up (its pod manager: a pod queued for admission behind
another is not listed yet), sidecars then app containers (ordinary init containers omitted), one
ContainerDevices per device and NUMA node, after running device GC. GetAllocatableResources: every
healthy device. Get: one pod by namespace/name. A token bucket (100/s, burst 10) shared by all
calls answers RESOURCE_EXHAUSTED "rejected by rate limit" beyond that.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import grpc.aio

from libs.kubelet.podresources.v1 import api_pb2 as pr
from libs.kubelet.podresources.v1 import api_pb2_grpc as pr_grpc

from .calls import CallLog, RpcCall
from .devicemanager import DeviceManager
from .kubelet import Kubelet
from .logger import logger
from .podspec import app_containers, init_containers, is_sidecar, pod_key, pod_uid
from .registration import remove_socket
from .store import PodStore

__all__ = ["PodResourcesServer", "TokenBucket"]

_logger = logger("podresources")


class TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False


def _prepare_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_socket(path)


def _topology(nodes: list[int]) -> pr.TopologyInfo | None:
    return pr.TopologyInfo(nodes=[pr.NUMANode(ID=n) for n in nodes]) if nodes else None


class PodResourcesServer(pr_grpc.PodResourcesListerServicer):
    def __init__(
        self, socket: Path, store: PodStore, kubelet: Kubelet, manager: DeviceManager, calls: CallLog,
        *, qps: float = 100.0, burst: int = 10,
    ) -> None:
        self._socket = socket
        self._store = store
        self._kubelet = kubelet
        self._manager = manager
        self._calls = calls
        self._limiter = TokenBucket(qps, burst)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        _prepare_socket(self._socket)
        server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self._socket}")
        await server.start()
        self._server = server
        _logger.info("serving pod resources", socket=str(self._socket))

    async def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(0)
        remove_socket(self._socket)

    async def _limit(self, context: grpc.aio.ServicerContext, rec: RpcCall) -> None:
        if not self._limiter.allow():
            rec.error = "rejected by rate limit"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")

    def _container_resources(self, uid: str, name: str) -> pr.ContainerResources:
        devices = [
            pr.ContainerDevices(resource_name=resource, device_ids=[dev_id],
                                topology=_topology([node] if node >= 0 else []))
            for resource, dev_id, node in self._manager.container_devices(uid, name)
        ]
        return pr.ContainerResources(name=name, devices=devices)

    def _pod_resources(self, pod: dict) -> pr.PodResources:  # type: ignore[type-arg]
        ns, name = pod_key(pod)
        uid = pod_uid(pod)
        shown = [c for c in init_containers(pod) if is_sidecar(c)] + app_containers(pod)
        containers = [self._container_resources(uid, c["name"]) for c in shown]
        return pr.PodResources(name=name, namespace=ns, containers=containers)

    async def List(
        self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        with self._calls.record("List", "", request, str(self._socket)) as rec:
            await self._limit(context, rec)
            self._manager.update_allocated_devices()
            resp = pr.ListPodResourcesResponse(
                pod_resources=[self._pod_resources(p) for p in self._kubelet.peek_active_pods()
                               if pod_uid(p) in self._kubelet.known]
            )
            rec.response = resp
            return resp

    async def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        with self._calls.record("GetAllocatableResources", "", request, str(self._socket)) as rec:
            await self._limit(context, rec)
            devices = []
            for resource, dev_id, nodes in self._manager.allocatable_devices():
                # One entry per NUMA node; devices without topology get one entry without it.
                for node_set in [[n] for n in nodes] or [[]]:
                    devices.append(pr.ContainerDevices(resource_name=resource, device_ids=[dev_id],
                                                       topology=_topology(node_set)))
            resp = pr.AllocatableResourcesResponse(devices=devices)
            rec.response = resp
            return resp

    async def Get(
        self, request: pr.GetPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr.GetPodResourcesResponse:
        with self._calls.record("Get", "", request, str(self._socket)) as rec:
            await self._limit(context, rec)
            pod = self._store.get(request.pod_namespace, request.pod_name)
            if pod is None or not self._kubelet.bound_here(pod) or pod_uid(pod) not in self._kubelet.known:
                error = f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
                rec.error = error
                await context.abort(grpc.StatusCode.UNKNOWN, error)
            resp = pr.GetPodResourcesResponse(pod_resources=self._pod_resources(pod))
            rec.response = resp
            return resp
