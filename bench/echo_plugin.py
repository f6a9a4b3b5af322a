"""The floor for the Allocate benchmark: a bare device plugin that answers Allocate at once.

It registers ``bench.gpuledger.io/echo`` with the (simulated) kubelet, advertises 1,000 devices and
answers every Allocate with a fixed response of the same shape as ours (three device nodes, two
env vars, two mounts, three annotations), without NATS, placement, pod lookup or log. Pods that
request it go through exactly the same kubelet admission path, so the difference between its
Allocate time and gpuledger's is what gpuledger itself costs.

    python -m bench.echo_plugin DEVICE_PLUGIN_DIR   (prints "ready" once registered)
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

RESOURCE = "bench.gpuledger.io/echo"
SOCKET = "bench-echo.sock"

_RESPONSE = pb.ContainerAllocateResponse(
    envs={"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64", "NVIDIA_VISIBLE_DEVICES": "GPU-0"},
    mounts=[pb.Mount(container_path="/usr/local/nvidia", host_path="/vd/nvidia", read_only=True),
            pb.Mount(container_path="/etc/vcuda", host_path="/vm/pod", read_only=True)],
    devices=[pb.DeviceSpec(container_path=p, host_path=p, permissions="rwm")
             for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")],
    annotations={"tencent.com/vcuda-core": "10", "tencent.com/vcuda-memory": "268435456",
                 "tencent.com/vcuda-device": "/dev/nvidia0"},
)


class EchoPlugin(pb_grpc.DevicePluginServicer):
    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions()

    async def ListAndWatch(self, request: pb.Empty, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[pb.ListAndWatchResponse]:
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=f"echo-{i}", health="Healthy") for i in range(1000)])
        await asyncio.Event().wait()  # the stream stays open, as a plugin's does

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        return pb.AllocateResponse(container_responses=[_RESPONSE for _ in request.container_requests])


async def main(directory: Path) -> None:
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(EchoPlugin(), server)
    (directory / SOCKET).unlink(missing_ok=True)
    server.add_insecure_port(f"unix://{directory / SOCKET}")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{directory / 'kubelet.sock'}") as ch:
        await pb_grpc.RegistrationStub(ch).Register(
            pb.RegisterRequest(version="v1beta1", endpoint=SOCKET, resource_name=RESOURCE), timeout=10)
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
