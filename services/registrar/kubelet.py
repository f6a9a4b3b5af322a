"""Serving the plugin sockets and staying registered with the kubelet, across kubelet restarts.

A restarting kubelet deletes every socket in its device-plugin directory (ours included) and creates a
new ``kubelet.sock``. The keeper notices either sign by comparing file identities (a few stat calls),
re-creates its listeners and registers again, without the process exiting — gpu-manager exits and
waits for the DaemonSet to restart it. It looks whenever inotify reports ``kubelet.sock`` or one of
its own sockets created, deleted or moved, and every 5 s besides (an event it could have missed);
while the directory cannot be watched (it does not exist yet, no inotify), every 200 ms. An idle
node then wakes the registrar for nothing, where a 200 ms poll woke it five times a second.

Order per (re)start, as the kubelet requires (kubelet-device-plugin.md 2.2): listen, prove the socket
answers by dialling it, then Register; the kubelet dials back and calls GetDevicePluginOptions before
its Register reply comes, which a grpc.aio server answers from the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
from inotify_simple import INotify, flags

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from libs.logger import get_logger
from libs.unixsock import SocketPathTooLong, check_socket_path, file_identity
from services.registrar.plugin import DevicePlugin

__all__ = ["KubeletRegistration", "PluginDirWatch", "PluginServer"]

_logger = get_logger("registrar")
POLL = 0.2  # while the directory is not watched
WATCHED_POLL = 5.0  # while it is
_DIR_CHANGES = (flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | flags.DELETE_SELF
                | flags.MOVE_SELF)
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
        watch = PluginDirWatch(self.directory, kubelet=self.kubelet_socket.name,
                                own={server.path.name for server in self.servers})
        try:
            while True:
                watched = watch.ensure()
                current = file_identity(self.kubelet_socket)
                stale = current != kubelet_identity or any(s.wiped() for s in self.servers)
                if current is not None and stale:
                    with watch.ignoring_own():  # our sockets made afresh are no news
                        registered = await self._serve_and_register()
                    if registered:
                        kubelet_identity = current
                        delay = POLL
                    else:
                        delay = min(delay * 2, 5.0)
                elif current is None and kubelet_identity is not None:
                    _logger.warning("kubelet.sock disappeared; waiting for the kubelet", path=str(self.kubelet_socket))
                    kubelet_identity = None
                    self.registered.clear()
                await watch.changed(WATCHED_POLL if watched and delay == POLL else delay)
        finally:
            watch.close()
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


class PluginDirWatch:
    """inotify on the device-plugin directory: what makes the keeper look again. Only ``kubelet.sock``
    and the keeper's own sockets are news (not while the keeper itself makes them afresh): the kubelet
    rewrites its checkpoint file in the same directory at every admission, and other plugins' sockets
    live there too; a wake-up for each of them would take the CPU at the moment of an Allocate."""

    def __init__(self, directory: Path, *, kubelet: str, own: set[str]) -> None:
        self.directory = directory
        self.kubelet = kubelet
        self.own = own
        self._inotify: INotify | None = None
        self._event = asyncio.Event()
        self._ignoring = False
        self._warned = False

    def ensure(self) -> bool:
        """Watch the directory if it is not watched yet; whether it is watched now."""
        if self._inotify is not None:
            return True
        try:
            inotify = INotify()
        except OSError as exc:
            self._warn(exc)
            return False
        try:
            inotify.add_watch(self.directory, _DIR_CHANGES)
        except OSError as exc:  # the directory is not there yet, or no watch is left
            inotify.close()
            self._warn(exc)
            return False
        asyncio.get_running_loop().add_reader(inotify.fileno(), self._on_events)
        self._inotify = inotify
        self._warned = False
        return True

    def _warn(self, exc: OSError) -> None:
        if not self._warned:
            _logger.info("cannot watch the device-plugin directory: looking every 200 ms",
                         path=str(self.directory), error=str(exc))
            self._warned = True

    @contextlib.contextmanager
    def ignoring_own(self) -> Iterator[None]:
        """What happens to our own sockets inside is no news. The kernel queues an event before the
        call that caused it returns, so whatever is still unread at the end is read here."""
        self._ignoring = True
        try:
            yield
        finally:
            if self._inotify is not None:
                self._on_events()
            self._ignoring = False

    def _on_events(self) -> None:
        assert self._inotify is not None
        events = self._inotify.read(timeout=0)
        if any(e.mask & (flags.IGNORED | flags.DELETE_SELF | flags.MOVE_SELF) for e in events):
            self.close()  # the directory itself went: watched again once it is back
            self._event.set()
        elif any(e.name == self.kubelet or (e.name in self.own and not self._ignoring) for e in events):
            self._event.set()

    async def changed(self, timeout: float) -> None:
        """Until an entry of the directory changes, or ``timeout`` passes."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._event.wait()
        self._event.clear()

    def close(self) -> None:
        if self._inotify is not None:
            asyncio.get_running_loop().remove_reader(self._inotify.fileno())
            self._inotify.close()
            self._inotify = None
