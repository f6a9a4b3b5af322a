"""vcore PreStartContainer: the allocator checks the grant while the vmanager serves its pod's vcuda.sock.

Both are asked at once, each one bus round trip, instead of one after the other through the
allocator. The vmanager is asked for the pod that holds the devices in the log it has folded so far;
its answer counts only for the pod the allocator's check confirms. When the check names another pod
(it corrected the grant with the kubelet's record) or the vmanager found none, the vmanager is asked
again for the checked pod, once it has folded the log as far as the check saw it. The kubelet creates
the container only after this answer, so the pod's socket is always served before it exists.
"""

from __future__ import annotations

import asyncio

import msgspec

from libs.bus.client import Bus
from libs.commands import PrepareReply, PrepareRequest, PreStartReply, PreStartRequest
from libs.errors import BusError, BusTimeout, RemoteError
from libs.runtime import discard

__all__ = ["PreStart"]


class PreStart:
    def __init__(self, bus: Bus, *, timeout: float, prepare_timeout: float) -> None:
        self.bus = bus
        self.timeout = timeout  # the allocator's check
        self.prepare_timeout = prepare_timeout  # each request to the vmanager

    async def __call__(self, req: PreStartRequest) -> PreStartReply:
        """The checked grant, its pod's socket served; BusError (RemoteError 503 when the vmanager
        could not serve the socket) otherwise."""
        subjects = self.bus.subjects
        ahead = asyncio.ensure_future(self._prepare(PrepareRequest(device_ids=req.device_ids)))
        try:
            reply = await self.bus.request(subjects.prestart, req, PreStartReply, timeout=self.timeout)
        except BaseException:
            discard(ahead)
            raise
        try:
            prepared = await ahead
        except BusTimeout as exc:  # the vmanager is not answering: asking again would wait as long
            raise self._unserved(reply.pod_uid, exc) from exc
        except BusError:
            prepared = None
        if prepared is None or prepared.pod_uid != reply.pod_uid:
            try:
                prepared = await self._prepare(PrepareRequest(pod_uid=reply.pod_uid, alloc_seq=reply.seq))
            except BusError as exc:
                raise self._unserved(reply.pod_uid, exc) from exc
        return msgspec.structs.replace(reply, vcuda_socket=prepared.socket)

    async def _prepare(self, req: PrepareRequest) -> PrepareReply:
        return await self.bus.request(self.bus.subjects.prepare, req, PrepareReply, timeout=self.prepare_timeout)

    def _unserved(self, pod_uid: str, exc: BusError) -> RemoteError:
        # gpu-manager's text for the same failure, as the allocator answered it before.
        reason = exc.message if isinstance(exc, RemoteError) else str(exc)
        return RemoteError(self.bus.subjects.prepare, 503, f"failed to setup VCuda for pod {pod_uid}: {reason}")
