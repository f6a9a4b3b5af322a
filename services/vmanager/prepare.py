"""``vmanager.prepare`` (PrepareRequest -> PrepareReply): PreStartContainer asks for a pod's vcuda.sock."""

from __future__ import annotations

from libs.commands import PrepareReply, PrepareRequest
from libs.errors import ServiceError
from libs.unixsock import SocketPathTooLong
from services.vmanager.names import is_pod_uid
from services.vmanager.podsockets import PodGone, PodSockets
from services.vmanager.tracker import AllocationTracker

__all__ = ["Prepare"]


class Prepare:
    def __init__(self, tracker: AllocationTracker, sockets: PodSockets, *, timeout: float) -> None:
        self.tracker = tracker
        self.sockets = sockets
        self.timeout = timeout

    async def __call__(self, req: PrepareRequest) -> PrepareReply:
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
        try:
            paths = await self.sockets.ensure(req.pod_uid)  # 404 when the pod holds no allocation
        except PodGone as exc:
            raise ServiceError(404, f"{exc} (log seq {follower.last_seq})") from exc
        except SocketPathTooLong as exc:
            raise ServiceError(500, str(exc)) from exc
        except (OSError, ValueError, RuntimeError) as exc:
            raise ServiceError(500, f"cannot serve vcuda.sock for pod {req.pod_uid}: {exc}") from exc
        return PrepareReply(directory=str(paths.directory), socket=str(paths.socket))
