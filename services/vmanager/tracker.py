"""The allocation log as the vmanager follows it, and what each fold means for the pods' sockets.

The log (through JetStream) is the only source of truth: no kubelet checkpoint, no SQLite file.
Events are folded from seq 0 into a ``LedgerState``. Until the follower has caught up with the
stream's last seq at start, nothing reacts (a long history would start and stop servers for pods
long gone); at that point one reconciliation runs:

- running servers of pods without allocations are stopped, their directories removed;
- ``<vm_root>/<uuid>`` directories of pods without allocations are removed (only when the log has any
  event at all: an empty or missing stream proves nothing about the pods whose directories exist);
- other entries of the vm root are left alone (one warning each);
- every pod holding allocations gets its server back (recovery after a vmanager restart).

After that, a grant prepares its pod at once (the socket exists before PreStartContainer) and the
release of a pod's last allocation stops its server and removes its directory. A prepared DRA claim
is served in a directory of its own (``<vm_root>/<claim uid>``, what its CDI spec mounts in every pod
that uses it), made at ``claim.prepared`` and removed at ``claim.unprepared``.

An ``alloc.corrected`` (the allocator learnt from the kubelet that a grant belongs to another pod or
container) prepares the pod that now holds it, rewrites or removes the vcuda.config files written
for the guessed owner (realign.py), and tears down the previous pod when it is left holding nothing.
That teardown waits ``settle`` seconds and happens only if the pod still holds nothing then: the
allocator appends a swap of two grants as two events, and between them the first pod holds nothing
for an instant; removing its directory then would break the mount of a directory that is needed
again. The catch-up reconciliation realigns every live pod too (corrections made while the vmanager
was down).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.js.errors import NotFoundError

from libs.bus.client import Bus
from libs.bus.follow import LogFollower
from libs.events.codec import StoredEvent
from libs.events.schema import (
    AllocationCorrected,
    AllocationGranted,
    AllocationReleased,
    ClaimPrepared,
    ClaimUnprepared,
    ContainerResponse,
)
from libs.ledger.state import CLAIM_PREFIX, LedgerState
from libs.logger import get_logger
from libs.placement.responses import VCUDA_MOUNTPOINT
from services.vmanager.cleanup import scan_vm_root
from services.vmanager.podsockets import PodGone, PodSockets
from services.vmanager.realign import realign_pod_dir, wanted_configs

__all__ = ["AllocationTracker", "claim_directory", "stream_last_seq"]

_logger = get_logger("vmanager")


def claim_directory(claim_uid: str, response: ContainerResponse) -> str:
    """The vm-root directory a claim's containers mount at /etc/vcuda: the claim's own, or, for a claim
    prepared by an earlier version, its first pod's (what its response, and so its CDI spec, says)."""
    for mount in response.mounts:
        if mount.container_path == VCUDA_MOUNTPOINT:
            return Path(mount.host_path).name
    return claim_uid  # hami-core delivery: the cache directories live in the claim's directory


async def stream_last_seq(bus: Bus) -> int:
    """The stream's last seq now; 0 when the stream does not exist yet (nothing to catch up)."""
    try:
        return (await bus.js.stream_info(bus.subjects.stream)).state.last_seq
    except NotFoundError:
        return 0


class AllocationTracker:
    def __init__(self, bus: Bus, state: LedgerState, sockets: PodSockets, vm_root: Path, *,
                 settle: float = 0.5) -> None:
        self.bus = bus
        self.state = state
        self.sockets = sockets
        self.vm_root = vm_root
        self.settle = settle  # seconds before a pod emptied by a correction is torn down
        self.follower = LogFollower(bus, self._on_event, after_seq=0)
        self.caught_up = asyncio.Event()
        self.target = 0
        self._warned: set[str] = set()
        self._settling: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        self.target = await stream_last_seq(self.bus)
        _logger.info("following the allocation log", catch_up_to=self.target)
        if self.target == 0:
            await self._reconcile()
        try:
            await self.follower.run()
        finally:
            for task in list(self._settling):
                task.cancel()

    async def _on_event(self, stored: StoredEvent) -> None:
        self.state.apply(stored)
        if not self.caught_up.is_set():
            if stored.seq >= self.target:
                await self._reconcile()
            return
        ev = stored.event
        if isinstance(ev, ClaimPrepared):
            await self._prepare(claim_directory(ev.claim_uid, ev.response))  # what its CDI spec mounts
        elif isinstance(ev, AllocationGranted):
            await self._prepare(ev.pod_uid)
        elif isinstance(ev, AllocationReleased):
            if isinstance(ev, ClaimUnprepared):
                await self._teardown(ev.claim_uid)
            if not self.state.holds(ev.pod_uid):
                await self._teardown(ev.pod_uid)
        elif isinstance(ev, AllocationCorrected):
            await self._follow_correction(ev)

    async def _follow_correction(self, ev: AllocationCorrected) -> None:
        await self._prepare(ev.pod_uid)
        await self._realign(ev.pod_uid)
        previous = ev.previous_pod_uid
        if previous == ev.pod_uid:
            return
        if self.state.holds(previous):
            await self._realign(previous)
        else:
            task = asyncio.create_task(self._teardown_when_settled(previous), name=f"settle-{previous}")
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _teardown_when_settled(self, pod_uid: str) -> None:
        await asyncio.sleep(self.settle)
        try:
            if await self.sockets.teardown(pod_uid, unless_held=True):
                _logger.info("pod left without grants by a correction: directory removed", pod_uid=pod_uid)
        except (OSError, ValueError) as exc:
            _logger.error("cannot remove pod directory", pod_uid=pod_uid, error=str(exc))

    async def _realign(self, pod_uid: str) -> None:
        """Rewrite or remove the pod's vcuda.config files that disagree with the ledger."""
        try:
            pod_dir = self.sockets.paths(pod_uid).directory
            done = await asyncio.to_thread(realign_pod_dir, pod_dir, wanted_configs(self.state, pod_uid))
        except (OSError, ValueError) as exc:
            _logger.error("cannot realign vcuda.config files", pod_uid=pod_uid, error=str(exc))
            return
        if done.rewritten or done.removed:
            _logger.info("vcuda.config files follow the corrected grants", pod_uid=pod_uid,
                      rewritten=done.rewritten, removed=done.removed)

    async def _reconcile(self) -> None:
        # Pods served in their own directory (device-plugin grants), and prepared claims in theirs (a
        # claim prepared by an earlier version mounts its first pod's directory: that pod's, kept).
        pods = {a.pod_uid for a in self.state.allocations.values() if not a.alloc_id.startswith(CLAIM_PREFIX)}
        claim_dirs = {claim_directory(uid, a.response) for uid, a in self.state.claims().items()}
        pods |= {a.pod_uid for a in self.state.claims().values() if a.pod_uid in claim_dirs}
        live = pods | claim_dirs
        await self.sockets.retain(live)
        pod_dirs, others = await asyncio.to_thread(scan_vm_root, self.vm_root)
        for name in sorted(others - self._warned):
            _logger.warning("leaving an entry of the vm directory alone: not named like a pod UID",
                         path=str(self.vm_root / name))
        self._warned |= others
        if self.state.seq > 0:
            for pod_uid in sorted(pod_dirs - live):
                await self._teardown(pod_uid)
        for key in sorted(live):
            await self._prepare(key)
            if key in pods:
                await self._realign(key)
        _logger.info("caught up with the allocation log", seq=self.state.seq, pods=len(pods),
                  claims=len(live - pods),
                  removed=len(pod_dirs - live) if self.state.seq > 0 else 0)
        self.caught_up.set()

    # A failure here concerns one pod: log it and keep following (PreStartContainer will report it).
    async def _prepare(self, pod_uid: str) -> None:
        try:
            await self.sockets.ensure(pod_uid)
        except PodGone:
            pass
        except (OSError, ValueError, RuntimeError) as exc:
            _logger.error("cannot serve vcuda.sock", pod_uid=pod_uid, error=str(exc))

    async def _teardown(self, pod_uid: str) -> None:
        try:
            await self.sockets.teardown(pod_uid)
        except (OSError, ValueError) as exc:
            _logger.error("cannot remove pod directory", pod_uid=pod_uid, error=str(exc))
