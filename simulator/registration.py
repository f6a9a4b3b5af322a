"""The kubelet's registration server on `<dir>/kubelet.sock` (upstream `plugin/v1beta1/server.go`).

Three behaviour profiles (kubelet-device-plugin.md 2.2, 4.1):

* `1.25-1.36` (default): Register is synchronous (dial, GetDevicePluginOptions, then return), clients
  are keyed by resource name only, and the cleanup after a stream ends looks the client up by name.
  So when a plugin registers again while its old stream still runs, the old stream's end disconnects
  the *new* client (kubernetes/kubernetes #121994, #127803); we reproduce that on purpose.
* `legacy-1.24`: Register answers at once; dialling and the endpoint happen in the background, with
  the options taken from `RegisterRequest.options`. A re-registration replaces and stops the old
  endpoint (devices carried over). At start the kubelet removes every non-directory file in the dir
  except its checkpoint, not only sockets.
* `main-2026`: clients are tracked per (resource, socket path). Registering a socket that is still
  tracked succeeds without dialling again; several sockets for one resource coexist, the newest is
  the primary, and when one stream ends a survivor is promoted, so the resource stays healthy until
  the last one goes. (Upstream's device reservations are not modelled.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc

from .calls import CallLog, describe_error
from .checkpoint import CHECKPOINT_FILE
from .config import LEGACY_PROFILE, MAIN_PROFILE, SimConfig
from .devicemanager import DeviceManager
from .endpoints import DialError, Endpoint, PluginClient
from .logger import logger
from .names import register_request_error

__all__ = ["KUBELET_SOCKET", "RegistrationServer", "prepare_socket_dir", "remove_socket", "wipe_sockets"]

KUBELET_SOCKET = "kubelet.sock"

_logger = logger("registration")


def prepare_socket_dir(directory: Path, *, legacy: bool = False) -> list[str]:
    """Kubelet start: create the dir (0750) and wipe the sockets in it (before 1.25: every file but
    the checkpoint); returns what was removed."""
    directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    return wipe_files(directory) if legacy else wipe_sockets(directory)


def wipe_files(directory: Path) -> list[str]:
    removed = []
    for entry in os.scandir(directory):
        if entry.name != CHECKPOINT_FILE and not entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed


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
        self._profile = cfg.profile
        self._dir = cfg.device_plugin_dir
        self._manager = manager
        self._calls = calls
        self._server: grpc.aio.Server | None = None
        self.started_at = 0.0
        self.clients: dict[str, PluginClient] = {}
        # Every connection still open, including replaced ones the kubelet never closes itself.
        self._open: set[PluginClient] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Bumped at every stop: stream-end cleanups of an earlier "kubelet process" do nothing.
        self._generation = 0
        # main-2026: resource -> socket -> (client, endpoint), in registration order (newest last).
        self._sockets: dict[str, dict[str, tuple[PluginClient, Endpoint]]] = {}

    @property
    def socket_path(self) -> Path:
        return self._dir / KUBELET_SOCKET

    async def start(self) -> None:
        removed = prepare_socket_dir(self._dir, legacy=self._profile == LEGACY_PROFILE)
        if removed:
            _logger.info("wiped sockets", dir=str(self._dir), sockets=removed)
        server = grpc.aio.server()  # plain server: no options, default 4 MiB receive limit
        dp_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        self.started_at = time.monotonic()  # when kubelet.sock answers: plugins may register from here
        _logger.info("serving registration", socket=str(self.socket_path))

    async def stop(self) -> None:
        """Close every plugin connection (marking resources unhealthy), then stop serving."""
        self._generation += 1
        self._sockets.clear()
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
            _logger.info("registration request", resource=name, endpoint=request.endpoint,
                      version=request.version)
            error = register_request_error(request.version, name)
            if error is None and self._profile == LEGACY_PROFILE:
                self._spawn(self._connect_later(name, request.endpoint, request.options), f"register-{name}")
            elif error is None and self._profile == MAIN_PROFILE and self._socket_of(request.endpoint) in \
                    self._sockets.get(name, {}):
                rec.response = {"deduplicated": True}  # already connected: no second dial
                return dp.Empty()
            elif error is None:
                error = await self._connect_client(name, request.endpoint)
            if error is not None:
                rec.error = error
                _logger.info("registration refused", resource=name, error=error)
                # Plain Go errors reach the plugin as UNKNOWN with the text as message.
                await context.abort(grpc.StatusCode.UNKNOWN, error)
            rec.response = {}
            return dp.Empty()

    def _socket_of(self, endpoint: str) -> str:
        # Joined like Go's filepath.Join and never validated: "/x" or "../x" land wherever they land.
        return os.path.normpath(f"{self._dir}/{endpoint}")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect_later(self, name: str, endpoint: str, options: dp.DevicePluginOptions) -> None:
        """Before 1.25: Register has already answered; a failure here only shows in the kubelet log."""
        old = self.clients.get(name)
        error = await self._connect_client(name, endpoint, options)
        if error is not None:
            _logger.info("registration failed after Register returned", resource=name, error=error)
        elif old is not None:
            await self._close(old)  # the replaced endpoint is stopped; its devices carry over

    async def _connect_client(self, name: str, endpoint: str,
                              options: dp.DevicePluginOptions | None = None) -> str | None:
        socket = self._socket_of(endpoint)
        if self._profile == MAIN_PROFILE and socket in self._sockets.get(name, {}):
            return f"device plugin already connected: {socket}"
        client = PluginClient(name, socket, self._calls)
        # Upstream registers the client before connecting: a newer registration replaces an
        # older one at once, and a failed connect removes whatever is under the name.
        self.clients[name] = client
        try:
            await client.dial(self._cfg.dial_timeout)
            self._open.add(client)
            await self._manager.plugin_connected(name, client, options)
        except Exception as err:
            self.clients.pop(name, None)
            self._promote_survivor(name)
            await self._close(client)
            return str(err) if isinstance(err, (DialError, ConnectionError)) else describe_error(err)
        if self._profile == MAIN_PROFILE:
            self._sockets.setdefault(name, {})[socket] = (client, self._manager.endpoints[name])
        self._spawn(self._run_client(name, client, self._generation), f"law-{name}")
        return None

    def _promote_survivor(self, name: str) -> bool:
        """main-2026: the newest connection still tracked for the resource becomes the primary."""
        tracked = self._sockets.get(name)
        if not tracked:
            return False
        client, endpoint = list(tracked.values())[-1]
        if self.clients.get(name) is not client:
            _logger.info("promoted a surviving plugin connection", resource=name, socket=client.socket)
        self.clients[name] = client
        self._manager.endpoints[name] = endpoint
        self._manager.changes.notify()
        return True

    async def _run_client(self, name: str, client: PluginClient, generation: int) -> None:
        await client.run(self._manager.plugin_snapshot)
        if generation != self._generation:
            await self._close(client)
            return
        if self._profile == LEGACY_PROFILE:
            if self.clients.get(name) is client:
                await self._disconnect_client(name, client)
            else:
                await self._close(client)  # replaced earlier; already stopped
            return
        if self._profile == MAIN_PROFILE:
            tracked = self._sockets.get(name, {})
            if tracked.get(client.socket, (None,))[0] is client:
                del tracked[client.socket]
            await self._close(client)
            if not self._promote_survivor(name) and self.clients.get(name) is client:
                await self._disconnect_client(name, client)
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
