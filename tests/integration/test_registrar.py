"""The registrar stays registered: a recreated kubelet.sock alone (sockets not wiped) is enough to re-register."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import grpc

from libs.bus.server import NatsServer
from libs.config import Settings
from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from services.allocator import app as allocator_app
from services.registrar import app as registrar_app
from tests.polling import eventually


class Kubelet(pb_grpc.RegistrationServicer):
    """Just the kubelet's Registration service: records what registers, dials back for the options."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.registered: list[tuple[str, str, bool]] = []
        self.server: grpc.aio.Server | None = None

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        async with grpc.aio.insecure_channel(f"unix://{self.directory / request.endpoint}") as ch:
            options = await pb_grpc.DevicePluginStub(ch).GetDevicePluginOptions(pb.Empty(), timeout=5)
        self.registered.append((request.resource_name, request.endpoint, options.pre_start_required))
        return pb.Empty()

    async def start(self) -> None:
        self.server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server:
            await self.server.stop(0)
        (self.directory / "kubelet.sock").unlink(missing_ok=True)


async def test_registers_then_reregisters_when_only_kubelet_sock_is_recreated(
    nats_server: NatsServer, short_dir: Path
) -> None:
    dp = short_dir / "dp"
    dp.mkdir()
    kubelet = Kubelet(dp)
    settings = Settings(node_name="n1", state_dir=str(short_dir / "s"), device_plugin_dir=str(dp),
                        nats_url=nats_server.url, gpus="fake", kubeconfig="/nonexistent")
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(allocator_app.service(settings))
        registrar = await stack.enter_async_context(registrar_app.service(settings))
        await asyncio.sleep(0.3)
        assert kubelet.registered == []  # no kubelet yet: nothing to register with, and no crash
        await kubelet.start()
        stack.push_async_callback(kubelet.stop)
        await eventually(lambda: len(kubelet.registered) == 2, timeout=5, interval=0.02, what="both registered")
        assert sorted(kubelet.registered) == [("tencent.com/vcuda-core", "vcore.sock", True),
                                              ("tencent.com/vcuda-memory", "vmemory.sock", False)]

        await kubelet.stop()  # a new kubelet, same path; our sockets stay where they are
        await kubelet.start()
        start = asyncio.get_running_loop().time()
        await eventually(lambda: len(kubelet.registered) == 4, timeout=5, interval=0.02,
                         what="both resources registered again")
        took = asyncio.get_running_loop().time() - start
        assert took < 2.0
        # The kubelet records a Register before the registrar has its answer and counts the round.
        await eventually(lambda: registrar.kubelet.registrations == 2, timeout=5, interval=0.02,
                         what="the registrar counting its second registration")
        assert registrar.kubelet.registrations == 2
        assert (dp / "vcore.sock").is_socket() and (dp / "vmemory.sock").is_socket()
