"""A small scriptable device plugin for the simulator tests: a real grpc.aio DevicePlugin server on
a unix socket, which registers like a real plugin and records every call it receives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc


@dataclass
class Received:
    method: str
    request: Any
    at: float = field(default_factory=time.monotonic)


def device(dev_id: str, health: str = "Healthy", numa: list[int] | None = None) -> dp.Device:
    topology = dp.TopologyInfo(nodes=[dp.NUMANode(ID=n) for n in numa]) if numa else None
    return dp.Device(ID=dev_id, health=health, topology=topology)


class FakePlugin(dp_grpc.DevicePluginServicer):
    def __init__(
        self,
        plugin_dir: Path,
        resource: str = "example.com/gpu",
        *,
        count: int = 4,
        socket_name: str | None = None,
        pre_start_required: bool = False,
        get_preferred_allocation_available: bool = False,
        prefix: str = "dev",
    ) -> None:
        self.dir = plugin_dir
        self.resource = resource
        self.socket_name = socket_name or resource.replace("/", "-") + ".sock"
        self.options = dp.DevicePluginOptions(
            pre_start_required=pre_start_required,
            get_preferred_allocation_available=get_preferred_allocation_available,
        )
        self.devices = [device(f"{prefix}{i}") for i in range(count)]
        self.received: list[Received] = []
        # Scripting knobs.
        self.allocate_error: str | None = None
        self.allocate_empty = False
        self.allocate_delay = 0.0
        self.allocate_response: Callable[[list[str]], dp.ContainerAllocateResponse] | None = None
        self.prestart_error: str | None = None
        self.prestart_delay = 0.0
        self.preferred: Callable[[dp.ContainerPreferredAllocationRequest], list[str]] | None = None
        self.options_delay = 0.0
        self._server: grpc.aio.Server | None = None
        self._version = 0
        self._changed = asyncio.Event()
        self._finish = asyncio.Event()
        self.streams_open = 0

    @property
    def socket(self) -> Path:
        return self.dir / self.socket_name

    def calls(self, method: str) -> list[Received]:
        return [r for r in self.received if r.method == method]

    # -- server --------------------------------------------------------------------------------

    async def start(self) -> None:
        server = grpc.aio.server()
        dp_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        self.end_streams()
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(0)

    async def register(
        self,
        *,
        version: str = "v1beta1",
        resource: str | None = None,
        endpoint: str | None = None,
        options: dp.DevicePluginOptions | None = None,
        timeout: float = 15.0,
    ) -> float:
        """Register with the simulated kubelet; returns the monotonic time Register returned."""
        async with grpc.aio.insecure_channel(f"unix://{self.dir / 'kubelet.sock'}") as channel:
            stub = dp_grpc.RegistrationStub(channel)
            await stub.Register(
                dp.RegisterRequest(
                    version=version,
                    endpoint=self.socket_name if endpoint is None else endpoint,
                    resource_name=self.resource if resource is None else resource,
                    options=options if options is not None else self.options,
                ),
                timeout=timeout,
            )
            return time.monotonic()

    async def start_and_register(self) -> None:
        await self.start()
        await self.register()

    def set_devices(self, devices: list[dp.Device]) -> None:
        """Publish a new snapshot on every open ListAndWatch stream."""
        self.devices = list(devices)
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def set_health(self, dev_id: str, health: str) -> None:
        self.set_devices([
            dp.Device(ID=d.ID, health=health if dev_id == d.ID else d.health, topology=d.topology)
            for d in self.devices
        ])

    def end_streams(self) -> None:
        """Make every open ListAndWatch return (what a crashing plugin looks like to the kubelet);
        streams opened later run normally."""
        self._finish.set()
        self._finish = asyncio.Event()

    # -- DevicePlugin --------------------------------------------------------------------------

    async def GetDevicePluginOptions(
        self, request: dp.Empty, context: Any
    ) -> dp.DevicePluginOptions:
        self.received.append(Received("GetDevicePluginOptions", request))
        if self.options_delay:
            await asyncio.sleep(self.options_delay)
        return self.options

    async def ListAndWatch(
        self, request: dp.Empty, context: Any
    ) -> AsyncIterator[dp.ListAndWatchResponse]:
        self.received.append(Received("ListAndWatch", request))
        self.streams_open += 1
        try:
            sent = -1
            finish = self._finish
            while not finish.is_set():
                if sent != self._version:
                    sent = self._version
                    yield dp.ListAndWatchResponse(devices=self.devices)
                changed = asyncio.ensure_future(self._changed.wait())
                finished = asyncio.ensure_future(finish.wait())
                try:
                    await asyncio.wait({changed, finished}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                    finished.cancel()
        finally:
            self.streams_open -= 1

    async def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: Any
    ) -> dp.PreferredAllocationResponse:
        self.received.append(Received("GetPreferredAllocation", request))
        creq = request.container_requests[0]
        if self.preferred is not None:
            ids = self.preferred(creq)
        else:
            ids = sorted(creq.must_include_deviceIDs) + sorted(
                set(creq.available_deviceIDs) - set(creq.must_include_deviceIDs)
            )
            ids = ids[: creq.allocation_size]
        return dp.PreferredAllocationResponse(
            container_responses=[dp.ContainerPreferredAllocationResponse(deviceIDs=ids)]
        )

    async def Allocate(
        self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> dp.AllocateResponse:
        self.received.append(Received("Allocate", request))
        if self.allocate_delay:
            await asyncio.sleep(self.allocate_delay)
        if self.allocate_error is not None:
            await context.abort(grpc.StatusCode.UNKNOWN, self.allocate_error)
        if self.allocate_empty:
            return dp.AllocateResponse()
        responses = []
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            if self.allocate_response is not None:
                responses.append(self.allocate_response(ids))
            else:
                responses.append(
                    dp.ContainerAllocateResponse(
                        envs={"FAKE_VISIBLE_DEVICES": ",".join(sorted(ids))},
                        devices=[
                            dp.DeviceSpec(container_path=f"/dev/{i}", host_path=f"/dev/{i}", permissions="rw")
                            for i in sorted(ids)
                        ],
                        mounts=[
                            dp.Mount(container_path="/usr/local/fake", host_path="/opt/fake", read_only=True)
                        ],
                        annotations={"fake/allocated": ",".join(sorted(ids))},
                    )
                )
        return dp.AllocateResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: dp.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> dp.PreStartContainerResponse:
        self.received.append(Received("PreStartContainer", request))
        if self.prestart_delay:
            await asyncio.sleep(self.prestart_delay)
        if self.prestart_error is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.prestart_error)
        return dp.PreStartContainerResponse()
