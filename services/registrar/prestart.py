"""vcore PreStartContainer: the allocator checks the grant while the vmanager serves its pod's vcuda.sock.

Both are asked at once, each one bus round trip, instead of one after the other through the
allocator. The vmanager is asked for the pod that holds the devices in the log it has folded so far;
its answer counts only for the pod the allocator's check confirms. When the check names another pod
(it corrected the grant with the kubelet's record) or the vmanager found none, the vmanager is asked
again for the checked pod, once it has folded the log as far as the check saw it. The kubelet creates
the container only after this answer, so the pod's socket is always served before it exists.

``AskedAhead`` asks the same thing for each vcore grant a little after its Allocate was answered,
while the kubelet creates the pod's sandbox (60 ms and more), and answers the PreStartContainer that
follows with that verdict: the kubelet no longer waits for two bus round trips before it creates
the container. A verdict answers one PreStart only, and only while it is fresh, no later Allocate
gave any of its devices again, and the socket it names still exists; otherwise the PreStart asks,
as it always did. Neither the check nor the socket changes between the two moments: the kubelet's
record of an admitted container's devices is fixed, and only another Allocate can move them.
"""

from __future__ import annotations

import asyncio
import collections
import os
import stat
import time
from dataclasses import dataclass

import msgspec

from libs.bus.client import Bus
from libs.commands import PrepareReply, PrepareRequest, PreStartReply, PreStartRequest
from libs.errors import BusError, BusTimeout, RemoteError
from libs.runtime import discard

__all__ = ["AHEAD_AFTER_S", "AskedAhead", "PreStart"]

# After the Allocate's answer: the kubelet has recorded the container's vcore and vmemory devices
# by then (its admission takes a few ms), and its sandbox has barely started.
AHEAD_AFTER_S = 0.04
# A verdict older than this answers nothing (a slow image pull, a container restarted later): asked again.
FRESH_FOR_S = 30.0
CHECK_FAILED = 409  # the allocator's "PreStartContainer check failed": it freed the pod's GPUs and failed it
MAX_AHEAD = 1024  # grants whose PreStart never came (a pod that failed admission) are dropped after this


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


@dataclass
class _Verdict:
    task: asyncio.Task[PreStartReply]
    asked_at: float  # monotonic; when the Allocate was answered


class AskedAhead:
    """PreStartContainer verdicts asked ahead of the kubelet (see the module's docstring)."""

    def __init__(self, prestart: PreStart, *, after: float = AHEAD_AFTER_S, fresh_for: float = FRESH_FOR_S,
                 limit: int = MAX_AHEAD) -> None:
        self.prestart = prestart
        self.after = after
        self.fresh_for = fresh_for
        self.limit = limit
        self._verdicts: dict[frozenset[str], _Verdict] = {}  # oldest first
        self._by_device: dict[str, frozenset[str]] = {}
        self.answered: collections.Counter[str] = collections.Counter()  # PreStarts: "ahead" / "asked" (metrics)

    @property
    def timeout(self) -> float:
        return self.prestart.timeout

    def allocated(self, req: PreStartRequest) -> None:
        """A vcore Allocate of these devices was just answered: ask its PreStart's verdict soon."""
        key = frozenset(req.device_ids)
        for device in key:  # the devices now belong to this grant: older verdicts about them are void
            old = self._by_device.get(device)
            if old is not None:
                self._drop(old)
        now = time.monotonic()
        while self._verdicts and (len(self._verdicts) >= self.limit
                                  or now - next(iter(self._verdicts.values())).asked_at > self.fresh_for):
            self._drop(next(iter(self._verdicts)))
        self._verdicts[key] = _Verdict(asyncio.ensure_future(self._ask_later(req)), now)
        for device in key:
            self._by_device[device] = key

    async def _ask_later(self, req: PreStartRequest) -> PreStartReply:
        await asyncio.sleep(self.after)
        return await self.prestart(msgspec.structs.replace(req, ahead=True))

    async def __call__(self, req: PreStartRequest) -> PreStartReply:
        verdict = self._take(frozenset(req.device_ids))
        if verdict is not None:
            try:
                reply = await asyncio.wait_for(verdict, self.timeout)
            except RemoteError as exc:
                if exc.code == CHECK_FAILED:  # the allocator failed the pod already: its answer stands
                    self.answered["ahead"] += 1
                    raise
                reply = None  # no grant found, the vmanager unserved...: ask now, as without it
            except (BusError, TimeoutError, asyncio.CancelledError):
                if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    raise
                reply = None
            if reply is not None and _is_socket(reply.vcuda_socket):
                self.answered["ahead"] += 1
                return reply
        self.answered["asked"] += 1
        return await self.prestart(req)

    def _take(self, key: frozenset[str]) -> asyncio.Task[PreStartReply] | None:
        """The verdict asked ahead for exactly these devices, while it may still answer; it answers once."""
        verdict = self._unlink(key)
        if verdict is None:
            return None
        if time.monotonic() - verdict.asked_at > self.fresh_for or (
                not verdict.task.done() and time.monotonic() - verdict.asked_at < self.after):
            discard(verdict.task)  # too old, or not asked yet: asking now is as quick
            return None
        return verdict.task

    def _drop(self, key: frozenset[str]) -> None:
        verdict = self._unlink(key)
        if verdict is not None:
            discard(verdict.task)

    def _unlink(self, key: frozenset[str]) -> _Verdict | None:
        """The verdict for exactly these devices, no longer kept (None when there is none)."""
        verdict = self._verdicts.pop(key, None)
        if verdict is not None:
            for device in key:
                if self._by_device.get(device) == key:
                    del self._by_device[device]
        return verdict

    def __len__(self) -> int:
        return len(self._verdicts)

    async def close(self) -> None:
        tasks = [v.task for v in self._verdicts.values()]
        self._verdicts.clear()
        self._by_device.clear()
        for task in tasks:
            discard(task)
        await asyncio.gather(*tasks, return_exceptions=True)


def _is_socket(path: str) -> bool:
    """The verdict's vcuda.sock still exists; when it does not (its directory removed by hand, a
    restarted vmanager that has not served it yet), asking has the vmanager serve it again."""
    try:
        return bool(path) and stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False
