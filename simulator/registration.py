"""The kubelet's registration server on `<dir>/kubelet.sock` (upstream `plugin/v1beta1/server.go`).

Profile 1.25-1.36: Register is synchronous (dial, GetDevicePluginOptions, then return), clients are
keyed by resource name only, and the cleanup after a stream ends looks the client up by name. So
when a plugin registers again while its old stream still runs, the old stream's end disconnects
the *new* client (kubernetes/kubernetes #121994, #127803); we reproduce that on purpose.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import grpc
import grpc.aio

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc

from .calls import CallLog, describe_error
from .config import SimConfig
from .devicemanager import DeviceManager
from .endpoints import DialError, PluginClient
from .log import logger
from .names import register_request_error

__all__ = ["KUBELET_SOCKET", "RegistrationServer", "prepare_socket_dir", "remove_socket", "wipe_sockets"]

KUBELET_SOCKET = "kubelet.sock"

_log = logger("registration")


def prepare_socket_dir(directory: Path) -> list[str]:
    """Kubelet start: create the dir (0750) and wipe the sockets in it; returns what was removed."""
    directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    return wipe_sockets(directory)


def remove_socket(path: Path) -> None:
    path.unlink(missing_ok=True)


def wipe_sockets(directory: Path) -> list[str]:
    """Remove every unix socket in the directory; keep regular files (the checkpoint) and dirs."""
    removed = []
    for entry in os.scandir(directory):
        try:
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                os.unlink(entry.path)
                removed.append(entry.name)
        except FileNotFoundError:
            continue
    return removed


class RegistrationServer(dp_grpc.RegistrationServicer):
    def __init__(self, cfg: SimConfig, manager: DeviceManager, calls: CallLog) -> None:
        self._cfg = cfg
        self._dir = cfg.device_plugin_dir
        self._manager = manager
        self._calls = calls
        self._server: grpc.aio.Server | None = None
        self.clients: dict[str, PluginClient] = {}
        # Every connection still open, including replaced ones the kubelet never closes itself.
        self._open: set[PluginClient] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Bumped at every stop: stream-end cleanups of an earlier "kubelet process" do nothing.
        self._generation = 0

    @property
    def socket_path(self) -> Path:
        return self._dir / KUBELET_SOCKET

    async def start(self) -> None:
        removed = prepare_socket_dir(self._dir)
        if removed:
            _log.info("wiped sockets", dir=str(self._dir), sockets=removed)
        server = grpc.aio.server()  # plain server: no options, default 4 MiB receive limit
        dp_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        _log.info("serving registration", socket=str(self.socket_path))

    async def stop(self) -> None:
        """Close every plugin connection (marking resources unhealthy), then stop serving."""
        self._generation += 1
        for name, client in list(self.clients.items()):
            await self._disconnect_client(name, client)
        for client in list(self._open):
            await self._close(client)
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=5)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(0)
        # grpc unlinks its socket on stop; make sure, since a plugin watches for it.
        remove_socket(self.socket_path)

    async def Register(
        self, request: dp.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> dp.Empty:
        name = request.resource_name
        with self._calls.record("Register", name, request, str(self.socket_path)) as rec:
            _log.info("registration request", resource=name, endpoint=request.endpoint,
                      version=request.version)
            error = register_request_error(request.version, name)
            if error is None:
                error = await self._connect_client(name, request.endpoint)
            if error is not None:
                rec.error = error
                _log.info("registration refused", resource=name, error=error)
                # Plain Go errors reach the plugin as UNKNOWN with the text as message.
                await context.abort(grpc.StatusCode.UNKNOWN, error)
            rec.response = {}
            return dp.Empty()

    async def _connect_client(self, name: str, endpoint: str) -> str | None:
        # Joined like Go's filepath.Join and never validated: "/x" or "../x" land wherever they land.
        socket = os.path.normpath(f"{self._dir}/{endpoint}")
        client = PluginClient(name, socket, self._calls)
        # Upstream registers the client before connecting: a newer registration replaces an
        # older one at once, and a failed connect removes whatever is under the name.
        self.clients[name] = client
        try:
            await client.dial(self._cfg.dial_timeout)
            self._open.add(client)
            await self._manager.plugin_connected(name, client)
        except (DialError, ConnectionError) as err:
            self.clients.pop(name, None)
            await self._close(client)
            return str(err)
        except Exception as err:
            self.clients.pop(name, None)
            await self._close(client)
            return describe_error(err)
        task = asyncio.create_task(self._run_client(name, client, self._generation), name=f"law-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return None

    async def _run_client(self, name: str, client: PluginClient, generation: int) -> None:
        await client.run(self._manager.plugin_snapshot)
        if generation != self._generation:
            await self._close(client)
            return
        current = self.clients.get(name)
        if current is not None:
            # The 1.25-1.36 bug: `current` may be a newer client than the one whose stream ended.
            await self._disconnect_client(name, current)
        if current is not client:
            # Upstream leaks this connection; closing it changes nothing a plugin could rely on.
            await self._close(client)

    async def _disconnect_client(self, name: str, client: PluginClient) -> None:
        self.clients.pop(name, None)
        await self._close(client)
        self._manager.plugin_disconnected(name)

    async def _close(self, client: PluginClient) -> None:
        self._open.discard(client)
        await client.close()
