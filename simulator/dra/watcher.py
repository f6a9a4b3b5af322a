"""The kubelet's plugin watcher for DRA drivers, and the client of one registered driver.

Upstream (``pkg/kubelet/pluginmanager``) watches ``<root>/plugins_registry`` with inotify; the
simulator rescans it every ``interval`` seconds, which sees the same events a little later:

* a new ``*.sock`` (names starting with ``.`` are ignored) is a registration socket: the watcher
  dials it, calls ``Registration.GetInfo`` (1 s), checks ``type == "DRAPlugin"`` and picks the newest
  version it speaks from ``supported_versions`` (``v1.DRAPlugin`` before ``v1beta1.DRAPlugin``),
  dials the ``endpoint`` (the registration socket itself when empty), and reports the outcome with
  ``NotifyRegistrationStatus``. A failed registration is tried again on a later scan, with backoff.
* a socket that disappears deregisters its instance; one that is recreated (new inode or mtime: a
  restarted plugin) is deregistered and registered again.
* several instances of one driver may be registered; calls go to the newest connected one.

Every RPC the watcher and the clients make lands in the simulator's call log (resource = driver).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from libs.kubelet.dra.v1 import api_pb2 as v1
from libs.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from libs.kubelet.dra.v1beta1 import api_pb2 as v1beta1
from libs.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from libs.kubelet.pluginregistration.v1 import api_pb2 as reg
from libs.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc

from ..calls import CallLog, message_dict
from ..logger import logger
from ..notify import Changes

__all__ = ["DraPluginClient", "PluginWatcher", "PrepareResult"]

_logger = logger("plugin-watcher")
DRA_PLUGIN_TYPE = "DRAPlugin"
# What the simulated kubelet speaks, newest first (it picks the first one the plugin lists).
KUBELET_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
GET_INFO_TIMEOUT = 1.0  # the plugin watcher's GetInfo deadline
RETRY_BACKOFF = (0.5, 5.0)  # first and largest wait before a failed registration is tried again


@dataclass
class PrepareResult:
    devices: list[dict[str, Any]] = field(default_factory=list)  # request_names, pool_name, device_name, ...
    error: str = ""


class DraPluginClient:
    """One registered instance of a DRA driver: a long-lived channel to its endpoint."""

    def __init__(self, driver: str, endpoint: str, version: str, registration: Path, calls: CallLog) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.version = version  # "v1.DRAPlugin" or "v1beta1.DRAPlugin"
        self.registration = registration
        self.registered_at = time.monotonic()
        self._calls = calls
        self._pb: Any = v1 if version.startswith("v1.") else v1beta1
        self.channel = grpc.aio.insecure_channel(f"unix://{endpoint}",
                                                 options=[("grpc.default_authority", "localhost")])
        stub_class = v1_grpc.DRAPluginStub if self._pb is v1 else v1beta1_grpc.DRAPluginStub
        self._stub = stub_class(self.channel)

    async def dial(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except TimeoutError:
            raise ConnectionError(f"failed to dial DRA plugin endpoint {self.endpoint}: "
                                  "context deadline exceeded") from None

    def _claims(self, claims: list[tuple[str, str, str]]) -> list[Any]:
        return [self._pb.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]

    async def prepare(self, claims: list[tuple[str, str, str]], timeout: float) -> dict[str, PrepareResult]:
        """NodePrepareResources for (namespace, uid, name) claims: claim uid -> result, as answered."""
        request = self._pb.NodePrepareResourcesRequest(claims=self._claims(claims))
        with self._calls.record("NodePrepareResources", self.driver, request, self.endpoint) as call:
            response = await self._stub.NodePrepareResources(request, timeout=timeout)
            call.response = message_dict(response)
        out = {}
        for uid, entry in response.claims.items():
            devices = [{"request_names": list(d.request_names), "pool_name": d.pool_name,
                        "device_name": d.device_name, "cdi_device_ids": list(d.cdi_device_ids),
                        "share_id": getattr(d, "share_id", "") or ""} for d in entry.devices]
            out[uid] = PrepareResult(devices=devices, error=entry.error)
        return out

    async def unprepare(self, claims: list[tuple[str, str, str]], timeout: float) -> dict[str, str]:
        request = self._pb.NodeUnprepareResourcesRequest(claims=self._claims(claims))
        with self._calls.record("NodeUnprepareResources", self.driver, request, self.endpoint) as call:
            response = await self._stub.NodeUnprepareResources(request, timeout=timeout)
            call.response = message_dict(response)
        return {uid: entry.error for uid, entry in response.claims.items()}

    async def close(self) -> None:
        await self.channel.close()


@dataclass
class _Seen:
    identity: tuple[int, int]  # (inode, mtime_ns) of the socket when it was handled
    client: DraPluginClient | None = None
    failures: int = 0
    retry_at: float = 0.0


class PluginWatcher:
    def __init__(self, directory: Path, calls: CallLog, *, interval: float = 0.1, dial_timeout: float = 10.0) -> None:
        self.directory = Path(directory)
        self.interval = interval
        self.dial_timeout = dial_timeout
        self._calls = calls
        self._seen: dict[str, _Seen] = {}
        self.plugins: dict[str, list[DraPluginClient]] = {}  # driver -> instances, oldest first
        self.changes = Changes()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self.directory.mkdir(mode=0o750, parents=True, exist_ok=True)
        await self.scan()
        self._task = asyncio.create_task(self._loop(), name="plugin-watcher")

    async def stop(self) -> None:
        """Forget every plugin (a kubelet going away); the sockets stay for the next watcher."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seen in self._seen.values():
            if seen.client is not None:
                await seen.client.close()
        self._seen.clear()
        self.plugins.clear()
        self.changes.notify()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.scan()
            except asyncio.CancelledError:
                raise
            except Exception:
                _logger.exception("plugin watcher scan failed")

    # -- queries -----------------------------------------------------------------------------------

    def client(self, driver: str) -> DraPluginClient | None:
        """The newest registered instance of the driver, or None."""
        instances = self.plugins.get(driver) or []
        return instances[-1] if instances else None

    # -- one pass over the directory ---------------------------------------------------------------

    def _sockets(self) -> dict[str, tuple[int, int]]:
        found = {}
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return found
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(".sock"):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                found[entry.path] = (st.st_ino, st.st_mtime_ns)
        return found

    async def scan(self) -> None:
        sockets = self._sockets()
        for path in [p for p, seen in self._seen.items() if sockets.get(p) != seen.identity]:
            await self._deregister(path)  # gone, or recreated by a restarted plugin
        now = time.monotonic()
        for path, identity in sockets.items():
            seen = self._seen.get(path)
            if seen is not None and (seen.client is not None or now < seen.retry_at):
                continue
            if seen is None:
                seen = self._seen[path] = _Seen(identity)
            seen.client = await self._register(Path(path))
            if seen.client is None:
                seen.failures += 1
                seen.retry_at = now + min(RETRY_BACKOFF[0] * 2 ** (seen.failures - 1), RETRY_BACKOFF[1])

    async def _deregister(self, path: str) -> None:
        seen = self._seen.pop(path)
        client = seen.client
        if client is None:
            return
        instances = self.plugins.get(client.driver) or []
        if client in instances:
            instances.remove(client)
        if not instances:
            self.plugins.pop(client.driver, None)
        await client.close()
        _logger.info("DRA plugin deregistered", driver=client.driver, socket=path)
        self.changes.notify()

    async def _register(self, path: Path) -> DraPluginClient | None:
        async with grpc.aio.insecure_channel(f"unix://{path}",
                                             options=[("grpc.default_authority", "localhost")]) as channel:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                with self._calls.record("GetInfo", "", reg.InfoRequest(), str(path)) as call:
                    info = await stub.GetInfo(reg.InfoRequest(), timeout=GET_INFO_TIMEOUT)
                    call.resource = info.name
                    call.response = message_dict(info)
            except grpc.aio.AioRpcError as err:
                _logger.info("plugin registration: GetInfo failed", socket=str(path), error=err.details())
                return None
            client, error = await self._connect(info, path)
            status = reg.RegistrationStatus(plugin_registered=client is not None, error=error)
            try:
                with self._calls.record("NotifyRegistrationStatus", info.name, status, str(path)):
                    await stub.NotifyRegistrationStatus(status, timeout=GET_INFO_TIMEOUT)
            except grpc.aio.AioRpcError as err:
                _logger.info("plugin registration: NotifyRegistrationStatus failed", socket=str(path),
                             error=err.details())
        if client is None:
            _logger.warning("DRA plugin registration refused", socket=str(path), driver=info.name, error=error)
            return None
        self.plugins.setdefault(client.driver, []).append(client)
        _logger.info("DRA plugin registered", driver=client.driver, endpoint=client.endpoint, version=client.version)
        self.changes.notify()
        return client

    async def _connect(self, info: Any, path: Path) -> tuple[DraPluginClient | None, str]:
        """Validate the PluginInfo and dial the endpoint: (client, "") or (None, why not)."""
        if info.type != DRA_PLUGIN_TYPE:
            return None, f"plugin type {info.type!r} is not handled by this kubelet (only {DRA_PLUGIN_TYPE})"
        if not info.name:
            return None, "plugin name is empty"
        version = next((v for v in KUBELET_VERSIONS if v in info.supported_versions), None)
        if version is None:
            return None, (f"none of the versions {list(info.supported_versions)} is supported "
                          f"(kubelet: {list(KUBELET_VERSIONS)})")
        client = DraPluginClient(info.name, info.endpoint or str(path), version, path, self._calls)
        try:
            await client.dial(self.dial_timeout)
        except ConnectionError as err:
            await client.close()
            return None, str(err)
        return client, ""
