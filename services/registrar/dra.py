"""The DRA kubelet plugin: DRAPlugin v1 + v1beta1, DRAResourceHealth, and plugin-watcher registration.

It lives in the registrar because the registrar is the node's kubelet-facing service: it already
keeps the device plugin's sockets alive across kubelet restarts, follows the allocator's inventory
and GPU health, and forwards the kubelet's calls to the allocator over NATS. A DRA claim is one more
kind of kubelet call with the same shape: ask the allocator (the only writer of the ledger), answer.

Per NodePrepareResources, every claim asked gets an entry (devices or an error string), each claim
concurrently, the whole call bounded by ``dra_prepare_timeout`` (well under the kubelet's 45 s): read
the ResourceClaim (allocation result, reservedFor), have the allocator record ``claim.prepared``
(fsynced in the log before it answers), write the claim's CDI spec (atomically, not fsynced: the
ledger rebuilds it at start), answer. Unprepare records ``claim.unprepared`` then removes the spec.
Both are idempotent (the allocator answers a repeat from its state).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from libs.bus import Bus
from libs.commands import (
    ClaimPrepareReply,
    ClaimPrepareRequest,
    ClaimUnprepareReply,
    ClaimUnprepareRequest,
    StateReply,
    StateRequest,
)
from libs.dra import DRIVER_NAME, PLUGIN_TYPE, SUPPORTED_VERSIONS, device_name, pool_name
from libs.errors import BusError, RemoteError
from libs.kube.claims import ClaimNotFound, ClaimSource
from libs.kubelet.dra.v1 import api_pb2 as v1
from libs.kubelet.dra.v1 import api_pb2_grpc as v1_grpc
from libs.kubelet.dra.v1beta1 import api_pb2 as v1beta1
from libs.kubelet.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from libs.kubelet.drahealth.v1 import api_pb2 as hpb
from libs.kubelet.drahealth.v1 import api_pb2_grpc as hpb_grpc
from libs.kubelet.pluginregistration.v1 import api_pb2 as reg
from libs.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from libs.ledger.state import CLAIM_PREFIX
from libs.logger import get_logger
from libs.unixsock import check_socket_path
from services.registrar.catalog import DeviceCatalog
from services.registrar.cdispecs import CdiSpecs
from services.registrar.health import DeviceHealth

__all__ = ["DraPlugin", "DraServers", "rebuild_cdi"]

_logger = get_logger("registrar")
HEALTH_RESEND = 30.0  # a full device list at least this often, even with no change


class DraPlugin:
    """The version-independent logic; the v1 and v1beta1 servicers only translate messages."""

    def __init__(self, bus: Bus, claims: ClaimSource, specs: CdiSpecs, *, node: str, timeout: float,
                 request_timeout: float) -> None:
        self.bus = bus
        self.claims = claims
        self.specs = specs
        self.node = node
        self.timeout = timeout
        self.request_timeout = request_timeout

    async def prepare(self, claims: list[Any]) -> dict[str, tuple[list[Any], str]]:
        """claim uid -> (devices as ClaimDeviceResult, error), for EVERY claim asked."""
        deadline = time.time() + self.timeout
        results = await asyncio.gather(*(self._bounded(self._prepare_one(c, deadline), deadline) for c in claims),
                                       return_exceptions=True)
        out: dict[str, tuple[list[Any], str]] = {}
        for claim, res in zip(claims, results, strict=True):
            if isinstance(res, BaseException):
                out[claim.uid] = ([], _error(res, f"prepare {claim.namespace}/{claim.name}"))
            else:
                out[claim.uid] = (res, "")
        return out

    async def _prepare_one(self, claim: Any, deadline: float) -> list[Any]:
        view = await self.claims.get(claim.namespace, claim.name, timeout=max(0.1, deadline - time.time()))
        if claim.uid and view.uid != claim.uid:
            raise ValueError(f"ResourceClaim {claim.namespace}/{claim.name} has uid {view.uid}, the kubelet asked "
                             f"for {claim.uid} (deleted and re-created?)")
        reply = await self.bus.request(
            self.bus.subjects.claim_prepare, ClaimPrepareRequest(claim=view, deadline=deadline), ClaimPrepareReply,
            timeout=max(0.1, min(self.request_timeout, deadline - time.time())),
        )
        # In the event loop: no fsync (cdispecs.py says why), so a small file and a rename on the
        # CDI directory's tmpfs, cheaper than a hop to a worker thread.
        self.specs.write(view.uid, reply.response, pod_uid=reply.pod_uid, claim=f"{view.namespace}/{view.name}")
        return reply.devices

    async def unprepare(self, claims: list[Any]) -> dict[str, str]:
        deadline = time.time() + self.timeout
        results = await asyncio.gather(*(self._bounded(self._unprepare_one(c, deadline), deadline) for c in claims),
                                       return_exceptions=True)
        return {c.uid: (_error(r, f"unprepare {c.namespace}/{c.name}") if isinstance(r, BaseException) else "")
                for c, r in zip(claims, results, strict=True)}

    async def _unprepare_one(self, claim: Any, deadline: float) -> None:
        await self.bus.request(
            self.bus.subjects.claim_unprepare, ClaimUnprepareRequest(claim_uid=claim.uid), ClaimUnprepareReply,
            timeout=max(0.1, min(self.request_timeout, deadline - time.time())),
        )
        self.specs.remove(claim.uid)

    @staticmethod
    async def _bounded(work: Awaitable[Any], deadline: float) -> Any:
        try:
            return await asyncio.wait_for(work, max(0.01, deadline - time.time()))
        except TimeoutError:
            raise TimeoutError("no answer within the DRA prepare timeout") from None


def _error(exc: BaseException, what: str) -> str:
    if isinstance(exc, RemoteError):
        return f"{what}: {exc.message}"
    if isinstance(exc, ClaimNotFound):
        return f"{what}: {exc}"
    if isinstance(exc, BusError):
        return f"{what}: the allocator did not answer: {exc}"
    return f"{what}: {exc}"


def _v1_devices(pb: Any, devices: list[Any], *, with_share: bool) -> list[Any]:
    out = []
    for d in devices:
        kw = dict(request_names=d.request_names, pool_name=d.pool_name, device_name=d.device_name,
                  cdi_device_ids=d.cdi_device_ids)
        if with_share and d.share_id:
            kw["share_id"] = d.share_id
        out.append(pb.Device(**kw))
    return out


class _Servicer:
    pb: Any = v1
    with_share = True

    def __init__(self, plugin: DraPlugin) -> None:
        self.plugin = plugin

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        results = await self.plugin.prepare(list(request.claims))
        resp = self.pb.NodePrepareResourcesResponse()
        for uid, (devices, error) in results.items():
            entry = resp.claims[uid]
            if error:
                entry.error = error
            else:
                entry.devices.extend(_v1_devices(self.pb, devices, with_share=self.with_share))
        return resp

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        results = await self.plugin.unprepare(list(request.claims))
        resp = self.pb.NodeUnprepareResourcesResponse()
        for uid, error in results.items():
            resp.claims[uid].error = error
        return resp


class V1Servicer(_Servicer, v1_grpc.DRAPluginServicer):
    pb = v1
    with_share = True


class V1beta1Servicer(_Servicer, v1beta1_grpc.DRAPluginServicer):
    pb = v1beta1
    with_share = False


class HealthServicer(hpb_grpc.DRAResourceHealthServicer):
    """The complete list of DRA-served GPUs on every message, on every change and every 30 s."""

    def __init__(self, catalog: DeviceCatalog, health: DeviceHealth, node: str) -> None:
        self.catalog = catalog
        self.health = health
        self.node = node

    def snapshot(self) -> Any:
        inv = self.catalog.inventory
        now = int(time.time())
        devices = []
        for gpu in inv.gpus if inv else ():
            if gpu.index not in self.catalog.dra_gpus:
                continue
            bad = gpu.uuid in self.health.unhealthy
            devices.append(hpb.DeviceHealth(
                device=hpb.DeviceIdentifier(pool_name=pool_name(self.node), device_name=device_name(gpu.index)),
                health=hpb.UNHEALTHY if bad else hpb.HEALTHY, last_updated_time=now,
                health_check_timeout_seconds=int(HEALTH_RESEND * 3),
                message=f"GPU{gpu.index} {gpu.uuid} " + ("unhealthy" if bad else "healthy"),
            ))
        return hpb.NodeWatchResourcesResponse(devices=devices)

    async def NodeWatchResources(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        while True:
            version = self.catalog.version
            yield self.snapshot()
            async with self.catalog.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self.catalog.changed.wait_for(lambda v=version: self.catalog.version != v), HEALTH_RESEND)


class RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, endpoint: Path) -> None:
        self.endpoint = endpoint
        self.status: reg.RegistrationStatus | None = None
        self.registered = asyncio.Event()

    async def GetInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return reg.PluginInfo(type=PLUGIN_TYPE, name=DRIVER_NAME, endpoint=str(self.endpoint),
                              supported_versions=list(SUPPORTED_VERSIONS))

    async def NotifyRegistrationStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.status = request
        if request.plugin_registered:
            _logger.info("DRA plugin registered with the kubelet", driver=DRIVER_NAME)
            self.registered.set()
        else:
            _logger.error("the kubelet refused the DRA plugin", driver=DRIVER_NAME, error=request.error)
            self.registered.clear()
        return reg.RegistrationStatusResponse()


class DraServers:
    """The DRA service socket (kubelet plugins dir) and the registration socket (plugins_registry).
    The registration socket is created last: the kubelet's watcher dials the endpoint as soon as it
    sees it."""

    def __init__(self, plugin: DraPlugin, catalog: DeviceCatalog, health: DeviceHealth, *, node: str,
                 endpoint: Path, registration: Path) -> None:
        self.endpoint = endpoint
        self.registration_path = registration
        self.registration = RegistrationServicer(endpoint)
        self._make: list[Callable[[grpc.aio.Server], None]] = [
            lambda s: v1_grpc.add_DRAPluginServicer_to_server(V1Servicer(plugin), s),
            lambda s: v1beta1_grpc.add_DRAPluginServicer_to_server(V1beta1Servicer(plugin), s),
            lambda s: hpb_grpc.add_DRAResourceHealthServicer_to_server(HealthServicer(catalog, health, node), s),
        ]
        self._servers: list[tuple[grpc.aio.Server, Path]] = []

    async def start(self) -> None:
        await self._listen(self.endpoint, self._make)
        await self._listen(self.registration_path,
                           [lambda s: reg_grpc.add_RegistrationServicer_to_server(self.registration, s)])

    async def _listen(self, path: Path, adders: list[Callable[[grpc.aio.Server], None]]) -> None:
        check_socket_path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = grpc.aio.server()
        for add in adders:
            add(server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        self._servers.append((server, path))

    async def stop(self) -> None:
        for server, path in reversed(self._servers):  # registration first: the kubelet deregisters
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            await server.stop(grace=0.5)
        self._servers.clear()


async def rebuild_cdi(bus: Bus, specs: CdiSpecs, timeout: float) -> tuple[int, int]:
    """Write the CDI spec of every claim the ledger holds as prepared; remove our other spec files."""
    reply = await bus.request(bus.subjects.state, StateRequest(), StateReply, timeout=timeout)
    prepared = {
        a.alloc_id[len(CLAIM_PREFIX):]: (a.response, a.pod_uid, "")
        for a in reply.snapshot.allocations if a.alloc_id.startswith(CLAIM_PREFIX)
    }
    written, removed = await asyncio.to_thread(specs.rebuild, prepared)
    _logger.info("CDI specs rebuilt from the ledger", written=written, removed=removed, directory=str(specs.directory))
    return written, removed
