"""The floor for the Allocate benchmark: a bare device plugin that answers Allocate at once.

It registers ``bench.gpuledger.io/echo`` with the (simulated) kubelet, advertises 1,000 devices and
answers every Allocate with a fixed response of the same shape as ours (three device nodes, two
env vars, two mounts, three annotations), without NATS, placement, pod lookup or log. Pods that
request it go through exactly the same kubelet admission path, so the difference between its
Allocate time and gpuledger's is what gpuledger itself costs.

With ``--bus NATS_URL`` it is the second floor, the one the product's promise sets: the same plugin
under the resource ``bench.gpuledger.io/echo-durable``, whose Allocate first makes one NATS request
to bench/echo_ledger.py (one fsync'd SQLite append, then the reply) and only then answers: a bare
plugin plus one bus round trip and one durable append, nothing else.

    python -m bench.echo_plugin DEVICE_PLUGIN_DIR [--bus NATS_URL]   (prints "ready" once registered)
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import nats
from nats.aio.client import Client

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

RESOURCE = "bench.gpuledger.io/echo"
SOCKET = "bench-echo.sock"
DURABLE_RESOURCE = "bench.gpuledger.io/echo-durable"
DURABLE_SOCKET = "bench-echo-durable.sock"
APPEND_SUBJECT = "bench.echo.append"  # bench/echo_ledger.py answers it

_RESPONSE = pb.ContainerAllocateResponse(
    envs={"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64", "NVIDIA_VISIBLE_DEVICES": "GPU-0"},
    mounts=[pb.Mount(container_path="/usr/local/nvidia", host_path="/vd/nvidia", read_only=True),
            pb.Mount(container_path="/etc/vcuda", host_path="/vm/pod", read_only=True)],
    devices=[pb.DeviceSpec(container_path=p, host_path=p, permissions="rwm")
             for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")],
    annotations={"tencent.com/vcuda-core": "10", "tencent.com/vcuda-memory": "268435456",
                 "tencent.com/vcuda-device": "/dev/nvidia0"},
)


DEVICES = 1000


class EchoPlugin(pb_grpc.DevicePluginServicer):
    """Answers every call at once: Allocate with ``response`` for each container (after one request to
    the echo ledger when ``bus`` is given), PreStartContainer with nothing."""

    def __init__(self, bus: Client | None = None, *, response: pb.ContainerAllocateResponse = _RESPONSE,
                 pre_start_required: bool = False, id_prefix: str = "echo") -> None:
        self.bus = bus  # None: answer at once; else after one request to the echo ledger
        self.response = response
        self.options = pb.DevicePluginOptions(pre_start_required=pre_start_required)
        self.id_prefix = id_prefix

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        return self.options

    async def ListAndWatch(self, request: pb.Empty, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[pb.ListAndWatchResponse]:
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=f"{self.id_prefix}-{i}", health="Healthy")
                                               for i in range(DEVICES)])
        await asyncio.Event().wait()  # the stream stays open, as a plugin's does

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        if self.bus is not None:
            ids = ",".join(d for c in request.container_requests for d in c.devices_ids)
            await self.bus.request(APPEND_SUBJECT, ids.encode(), timeout=10)
        return pb.AllocateResponse(container_responses=[self.response for _ in request.container_requests])

    async def PreStartContainer(self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext
                                ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


async def serve_registered(plugin: EchoPlugin, directory: Path, socket: str, resource: str) -> grpc.aio.Server:
    """``plugin`` served on ``directory/socket`` and registered with the kubelet there as ``resource``."""
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(plugin, server)
    (directory / socket).unlink(missing_ok=True)
    server.add_insecure_port(f"unix://{directory / socket}")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{directory / 'kubelet.sock'}") as ch:
        await pb_grpc.RegistrationStub(ch).Register(pb.RegisterRequest(
            version="v1beta1", endpoint=socket, resource_name=resource, options=plugin.options), timeout=10)
    return server


async def main(directory: Path, bus_url: str | None) -> None:
    bus = await nats.connect(bus_url) if bus_url else None
    resource, socket = (DURABLE_RESOURCE, DURABLE_SOCKET) if bus else (RESOURCE, SOCKET)
    server = await serve_registered(EchoPlugin(bus), directory, socket, resource)
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--bus", default=None, help="NATS URL: be the durable floor (see the module's text)")
    args = parser.parse_args()
    asyncio.run(main(args.directory, args.bus))
