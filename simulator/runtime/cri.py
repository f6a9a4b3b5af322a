"""A CRI ``runtime.v1`` client over the runtime's unix socket (our own stubs, ``libs/cri/v1``)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc

from libs.cri.v1 import api_pb2 as cri
from libs.cri.v1 import api_pb2_grpc as cri_grpc

__all__ = ["CriClient", "cri"]


class CriClient:
    """Thin: one channel, both services, a deadline on every call (``timeout`` seconds)."""

    def __init__(self, socket: Path, timeout: float = 60.0) -> None:
        self.socket = Path(socket)
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
        self.runtime = cri_grpc.RuntimeServiceStub(self._channel)
        self.images = cri_grpc.ImageServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def version(self) -> cri.VersionResponse:
        return await self.runtime.Version(cri.VersionRequest(version="v1"), timeout=self.timeout)

    async def image_present(self, image: str) -> bool:
        reply = await self.images.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=image)),
                                              timeout=self.timeout)
        return bool(reply.image.id)

    async def run_pod_sandbox(self, config: cri.PodSandboxConfig) -> str:
        reply = await self.runtime.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=self.timeout)
        return reply.pod_sandbox_id

    async def stop_pod_sandbox(self, sandbox_id: str) -> None:
        await self.runtime.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id),
                                          timeout=self.timeout)

    async def remove_pod_sandbox(self, sandbox_id: str) -> None:
        await self.runtime.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
                                            timeout=self.timeout)

    async def create_container(self, sandbox_id: str, config: cri.ContainerConfig,
                               sandbox_config: cri.PodSandboxConfig) -> str:
        reply = await self.runtime.CreateContainer(cri.CreateContainerRequest(
            pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox_config), timeout=self.timeout)
        return reply.container_id

    async def start_container(self, container_id: str) -> None:
        await self.runtime.StartContainer(cri.StartContainerRequest(container_id=container_id),
                                          timeout=self.timeout)

    async def stop_container(self, container_id: str, grace: int) -> None:
        await self.runtime.StopContainer(cri.StopContainerRequest(container_id=container_id, timeout=grace),
                                         timeout=self.timeout + grace)

    async def remove_container(self, container_id: str) -> None:
        await self.runtime.RemoveContainer(cri.RemoveContainerRequest(container_id=container_id),
                                           timeout=self.timeout)

    async def container_status(self, container_id: str, *, verbose: bool = False) -> cri.ContainerStatusResponse:
        return await self.runtime.ContainerStatus(
            cri.ContainerStatusRequest(container_id=container_id, verbose=verbose), timeout=self.timeout)

    async def container_pid(self, container_id: str) -> int:
        """The host pid of the container's first process (verbose status ``info``)."""
        reply = await self.container_status(container_id, verbose=True)
        return int(json.loads(reply.info.get("info", "{}")).get("pid", 0))

    async def exec_sync(self, container_id: str, cmd: list[str], timeout: int = 30) -> cri.ExecSyncResponse:
        return await self.runtime.ExecSync(cri.ExecSyncRequest(container_id=container_id, cmd=cmd, timeout=timeout),
                                           timeout=timeout + 10)

    async def list_containers(self, sandbox_id: str = "") -> list[cri.Container]:
        flt = cri.ContainerFilter(pod_sandbox_id=sandbox_id)
        reply = await self.runtime.ListContainers(cri.ListContainersRequest(filter=flt), timeout=self.timeout)
        return list(reply.containers)

    async def list_pod_sandboxes(self) -> list[cri.PodSandbox]:
        reply = await self.runtime.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=self.timeout)
        return list(reply.items)
