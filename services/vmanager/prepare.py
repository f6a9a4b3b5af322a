"""``vmanager.prepare`` (PrepareRequest -> PrepareReply): PreStartContainer asks for a pod's vcuda.sock.

The pod is named, with the seq of the grant to wait for; or the registrar names a grant's vcore
devices while the allocator is still checking that grant, and the pod that holds them in the log
folded so far is served (the registrar compares it with the allocator's answer)."""

from __future__ import annotations

from libs.commands import PrepareReply, PrepareRequest
from libs.errors import ServiceError
from libs.unixsock import SocketPathTooLong
from services.vmanager.names import is_pod_uid
from services.vmanager.podsockets import PodGone, PodSockets
from services.vmanager.tracker import AllocationTracker

__all__ = ["Prepare"]

# More vcore devices than any node has (100 per GPU): refused before a lookup.
_MAX_DEVICES = 100 * 64


class Prepare:
    def __init__(self, tracker: AllocationTracker, sockets: PodSockets, *, timeout: float) -> None:
        self.tracker = tracker
        self.sockets = sockets
        self.timeout = timeout

    async def __call__(self, req: PrepareRequest) -> PrepareReply:
        if req.device_ids and not req.pod_uid:
            return await self._serve(self._holder(req.device_ids))
        if not is_pod_uid(req.pod_uid):
            # Checked first: the uid becomes a directory name.
            raise ServiceError(400, f"pod uid {req.pod_uid[:64]!r} is not a UUID")
        follower = self.tracker.follower
        try:
            await follower.wait_for(req.alloc_seq, self.timeout)
        except TimeoutError:
            raise ServiceError(504, (
                f"the vmanager has followed the allocation log to seq {follower.last_seq}, not yet to "
                f"{req.alloc_seq}, after {self.timeout:g}s"
            )) from None
        return await self._serve(req.pod_uid)

    def _holder(self, device_ids: list[str]) -> str:
        """The pod whose grant holds exactly these devices in the log folded so far."""
        if len(device_ids) > _MAX_DEVICES:
            raise ServiceError(400, f"{len(device_ids)} device IDs; a grant holds at most {_MAX_DEVICES}")
        alloc = self.tracker.state.find_by_devices(device_ids)
        if alloc is None:
            raise ServiceError(404, (
                f"no grant holds these {len(device_ids)} devices in the log folded so far "
                f"(seq {self.tracker.follower.last_seq})"))
        return alloc.pod_uid

    async def _serve(self, pod_uid: str) -> PrepareReply:
        try:
            paths = await self.sockets.ensure(pod_uid)  # 404 when the pod holds no allocation
        except PodGone as exc:
            raise ServiceError(404, f"{exc} (log seq {self.tracker.follower.last_seq})") from exc
        except SocketPathTooLong as exc:
            raise ServiceError(500, str(exc)) from exc
        except (OSError, ValueError, RuntimeError) as exc:
            raise ServiceError(500, f"cannot serve vcuda.sock for pod {pod_uid}: {exc}") from exc
        return PrepareReply(directory=str(paths.directory), socket=str(paths.socket), pod_uid=pod_uid)
