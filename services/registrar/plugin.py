"""The two DevicePlugin servicers: the only code in gpuledger that translates kubelet protos.

vcore Allocate and PreStartContainer are answered by the allocator over NATS (PreStart together
with the vmanager, asked ahead once the Allocate is answered: prestart.py), each within a bounded
time: the kubelet waits forever on Allocate, so a stuck allocator must turn into a clear gRPC error
here, never into a hung node. A vcore grant is answered once the kubelet's pod-resources List, asked
as the Allocate came in, shows its pod being admitted (kubeletlist.py). vmemory needs no placement
of its own (the allocator reads the memory from the pod spec), so, as in gpu-manager, its Allocate
returns one empty response after validation.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
import msgspec

from libs.bus.client import Bus
from libs.commands import AllocateReply, AllocateRequest, PreStartRequest
from libs.config import Settings
from libs.errors import BusError, BusTimeout, RemoteError
from libs.events.schema import ContainerResponse
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from libs.logger import get_logger
from services.registrar.catalog import DeviceCatalog, InvalidDevices
from services.registrar.health import DeviceHealth
from services.registrar.kubeletlist import KubeletLister
from services.registrar.prestart import AskedAhead, PreStart

__all__ = ["DevicePlugin", "to_proto"]

_logger = get_logger("registrar")
_T = TypeVar("_T")

_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def to_proto(resp: ContainerResponse) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=resp.envs,
        mounts=[pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                for m in resp.mounts],
        devices=[pb.DeviceSpec(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
                 for d in resp.devices],
        annotations=resp.annotations,
    )


class DevicePlugin(pb_grpc.DevicePluginServicer):
    def __init__(self, resource: str, catalog: DeviceCatalog, bus: Bus, settings: Settings, *,
                 health: DeviceHealth | None = None, lister: KubeletLister | None = None) -> None:
        self.resource = resource
        self.lister = lister  # the kubelet's List for each vcore Allocate, to check the grant with
        self.catalog = catalog
        self.health = health  # None: every device Healthy
        self.bus = bus
        self.settings = settings
        # (registrar_total, bus_round_trip, check) seconds of each granted vcore Allocate; set by the metrics
        self.on_allocated: Callable[[float, float, float], None] | None = None
        # The kubelet gives PreStartContainer 30 s; answer well inside it.
        self.prestart = (AskedAhead(PreStart(bus, timeout=min(25.0, 2 * settings.request_timeout),
                                             prepare_timeout=settings.request_timeout))
                         if resource == RESOURCE_VCORE else None)
        self.options = pb.DevicePluginOptions(
            pre_start_required=resource == RESOURCE_VCORE, get_preferred_allocation_available=False
        )

    async def close(self) -> None:
        if self.prestart is not None:
            await self.prestart.close()

    @property
    def socket_name(self) -> str:
        return "vcore.sock" if self.resource == RESOURCE_VCORE else "vmemory.sock"

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        return self.options

    async def ListAndWatch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        seen = -1
        while True:
            async with self.catalog.changed:
                await self.catalog.changed.wait_for(lambda seen=seen: self.catalog.version != seen)
                seen = self.catalog.version
                ids = self.catalog.ids(self.resource)
                states = self.health.states(self.resource, ids) if self.health else ["Healthy"] * len(ids)
            unhealthy = sum(s != "Healthy" for s in states)
            _logger.info("advertising", resource=self.resource, devices=len(ids), unhealthy=unhealthy)
            yield pb.ListAndWatchResponse(devices=[pb.Device(ID=i, health=h) for i, h in zip(ids, states, strict=True)])

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        # Not advertised (the IDs carry no meaning); answer sensibly if asked anyway.
        out = []
        for creq in request.container_requests:
            chosen = list(creq.must_include_deviceIDs)
            room = max(0, creq.allocation_size - len(chosen))
            chosen += [d for d in creq.available_deviceIDs if d not in chosen][:room]
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=out)

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        if len(request.container_requests) != 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"expected exactly one container request, got {len(request.container_requests)}")
        received = time.perf_counter()
        ids = list(request.container_requests[0].devices_ids)
        await self._check(ids, context)
        if self.resource == RESOURCE_VMEMORY:
            return pb.AllocateResponse(container_responses=[pb.ContainerAllocateResponse()])
        timeout = self.settings.allocate_timeout
        request_id = uuid.uuid4().hex
        listing = self.lister.begin(request_id) if self.lister is not None else None
        req = AllocateRequest(request_id=request_id, resource=self.resource, device_ids=ids,
                              deadline=time.time() + timeout, check_admission=listing is not None)
        asked = time.perf_counter()
        reply = await self._ask(context, self.bus.subjects.allocate, req, AllocateReply, timeout)
        answered = time.perf_counter()
        if listing is not None:
            reply = await self._checked(context, req, reply, listing)
        checked = time.perf_counter()
        # The rest is bookkeeping: it runs once the response is on its way (grpc starts sending it
        # before this task yields), not before.
        response = pb.AllocateResponse(container_responses=[to_proto(reply.response)])
        marks = (received, asked, answered, checked, time.perf_counter())
        asyncio.get_running_loop().call_soon(self._allocated, req.request_id, reply, ids, marks)
        return response

    def _allocated(self, request_id: str, reply: AllocateReply, ids: list[str],
                   marks: tuple[float, float, float, float, float]) -> None:
        """An Allocate's bookkeeping after its response: its log line, its PreStart verdict asked
        ahead, its times (``marks``: received, asked the allocator, answered, checked, answering)."""
        received, asked, answered, checked, answering = marks
        _logger.info("allocated", request_id=request_id, alloc_id=reply.alloc_id, container=reply.container,
                  pod=f"{reply.namespace}/{reply.pod_name}", pod_uid=reply.pod_uid,
                  allocator_ms=round((answered - asked) * 1000, 2), check_ms=round((checked - answered) * 1000, 2))
        if self.prestart is not None:
            self.prestart.allocated(PreStartRequest(request_id=uuid.uuid4().hex, resource=self.resource,
                                                    device_ids=ids))
        if self.on_allocated is not None:
            self.on_allocated(answering - received, answered - asked, checked - answered)

    async def _checked(self, context: grpc.aio.ServicerContext, req: AllocateRequest, reply: AllocateReply,
                       listing: asyncio.Future[bytes | None]) -> AllocateReply:
        """The grant once the kubelet's List (asked as the request came in) shows its pod being admitted.
        When it does not, the allocator's view of the pods was stale: it is asked again, to take that
        grant back and look on with this List. A List that failed checks nothing."""
        assert self.lister is not None
        if reply.check is None:  # the allocator checked it (or needed no check)
            return reply
        raw = await listing
        if raw is None or self.lister.admits(raw, reply.check) is not False:
            return reply
        _logger.info("the kubelet is not admitting the pod the grant went to: asking again",
                     request_id=req.request_id, pod=f"{reply.namespace}/{reply.pod_name}", alloc_id=reply.alloc_id)
        again = msgspec.structs.replace(req, withdraw=reply.alloc_id, listing=raw)
        return await self._ask(context, self.bus.subjects.allocate, again, AllocateReply,
                               max(0.1, req.deadline - time.time()))

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreStartContainerResponse:
        ids = list(request.devices_ids)
        await self._check(ids, context)
        if self.prestart is not None:
            req = PreStartRequest(request_id=uuid.uuid4().hex, resource=self.resource, device_ids=ids)
            await self._answered(context, self.prestart(req), self.prestart.timeout)
        return pb.PreStartContainerResponse()

    async def _check(self, ids: list[str], context: grpc.aio.ServicerContext) -> None:
        try:
            self.catalog.check(self.resource, ids)
        except InvalidDevices as exc:
            _logger.warning("request refused", resource=self.resource, error=str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _ask(self, context: grpc.aio.ServicerContext, subject: str, req, reply_type, timeout: float):  # type: ignore[no-untyped-def]
        return await self._answered(context, self.bus.request(subject, req, reply_type, timeout=timeout), timeout)

    async def _answered(self, context: grpc.aio.ServicerContext, call: Awaitable[_T], timeout: float) -> _T:
        """What ``call`` (a request to the services) answers, or its failure as the kubelet's gRPC error."""
        try:
            return await call
        except BusTimeout:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the allocator did not answer within {timeout:g}s")
        except RemoteError as exc:
            await context.abort(_GRPC_CODES.get(exc.code, grpc.StatusCode.INTERNAL), exc.message)
        except BusError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach the allocator: {exc}")
        raise AssertionError("unreachable")  # context.abort raises
