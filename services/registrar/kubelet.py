"""Serving the plugin sockets and staying registered with the kubelet, across kubelet restarts.

A restarting kubelet deletes every socket in its device-plugin directory (ours included) and creates a
new ``kubelet.sock``. The keeper notices either sign by polling file identities (a few stat calls every 200 ms,
no inotify dependency), re-creates its listeners and registers again, without the process exiting —
gpu-manager exits and waits for the DaemonSet to restart it.

Order per (re)start, as the kubelet requires (kubelet-device-plugin.md 2.2): listen, prove the socket
answers by dialling it, then Register; the kubelet dials back and calls GetDevicePluginOptions before
its Register reply comes, which a grpc.aio server answers from the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from libs.logger import get_logger
from libs.unixsock import SocketPathTooLong, check_socket_path, file_identity
from services.registrar.plugin import DevicePlugin

__all__ = ["KubeletRegistration", "PluginServer"]

_logger = get_logger("registrar")
POLL = 0.2
REGISTER_TIMEOUT = 15.0  # the kubelet dials back within 10 s


class PluginServer:
    """One resource's gRPC server on ``<device-plugin-dir>/<socket>``."""

    def __init__(self, plugin: DevicePlugin, directory: Path) -> None:
        self.plugin = plugin
        self.path = directory / plugin.socket_name
        self.identity: tuple[int, int] | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        check_socket_path(self.path)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self.plugin, server)
        server.add_insecure_port(f"unix://{self.path}")
        await server.start()
        self._server = server
        self.identity = file_identity(self.path)
        async with grpc.aio.insecure_channel(f"unix://{self.path}") as channel:  # prove it answers
            await pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=5)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=0.5)
        if self.identity is not None and file_identity(self.path) == self.identity:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.identity = None

    def wiped(self) -> bool:
        return self._server is not None and file_identity(self.path) != self.identity


class KubeletRegistration:
    def __init__(self, directory: Path, plugins: list[DevicePlugin]) -> None:
        self.directory = directory
        self.kubelet_socket = directory / "kubelet.sock"
        self.servers = [PluginServer(p, directory) for p in plugins]
        self.registrations = 0  # successful (re)registrations, for tests and status
        self.registered = asyncio.Event()

    async def run(self) -> None:
        kubelet_identity: tuple[int, int] | None = None
        delay = POLL
        try:
            while True:
                current = file_identity(self.kubelet_socket)
                stale = current != kubelet_identity or any(s.wiped() for s in self.servers)
                if current is not None and stale:
                    if await self._serve_and_register():
                        kubelet_identity = current
                        delay = POLL
                    else:
                        delay = min(delay * 2, 5.0)
                elif current is None and kubelet_identity is not None:
                    _logger.warning("kubelet.sock disappeared; waiting for the kubelet", path=str(self.kubelet_socket))
                    kubelet_identity = None
                    self.registered.clear()
                await asyncio.sleep(delay)
        finally:
            for server in self.servers:
                await server.stop()

    async def _serve_and_register(self) -> bool:
        self.registered.clear()
        try:
            for server in self.servers:
                await server.stop()
                await server.start()
            async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                stub = pb_grpc.RegistrationStub(channel)
                for server in self.servers:
                    await stub.Register(
                        pb.RegisterRequest(
                            version="v1beta1", endpoint=server.path.name,
                            resource_name=server.plugin.resource, options=server.plugin.options,
                        ),
                        timeout=REGISTER_TIMEOUT,
                    )
        except (grpc.aio.AioRpcError, OSError, SocketPathTooLong) as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            _logger.warning("registration with the kubelet failed; retrying", error=detail)
            return False
        self.registrations += 1
        self.registered.set()
        _logger.info("registered with the kubelet", resources=[s.plugin.resource for s in self.servers],
                  times=self.registrations)
        return True
