"""The allocation state, folded from the log: who holds which GPU share, since when.

The same fold serves the allocator (authoritative, rebuilt at start), the vmanager (which pods and
containers have limits to deliver), the CLI's ``replay`` (state as of a time) and the tests (replayed
state equals live state). It is pure: events in, state out, no I/O.
"""

from __future__ import annotations

import msgspec

from libs.events.codec import StoredEvent
from libs.events.schema import (
    AllocationCorrected,
    AllocationGranted,
    AllocationRefused,
    AllocationReleased,
    ClaimPrepared,
    ClaimUnprepared,
    ContainerResponse,
    GpuHealthChanged,
    GpuModeChanged,
    GpuShare,
    InventoryRecorded,
)
from libs.ledger.rules import health_reason, move_to_real_owner, takes_over

__all__ = ["CLAIM_PREFIX", "MODE_DEVICE_PLUGIN", "MODE_DRA", "Allocation", "GpuUsage", "LedgerSnapshot",
           "LedgerState", "PreparedClaim", "claim_alloc_id"]

CLAIM_PREFIX = "claim:"           # alloc_id of a prepared DRA claim: claim:<claim uid>
MODE_DEVICE_PLUGIN = "device-plugin"
MODE_DRA = "dra"


def claim_alloc_id(claim_uid: str) -> str:
    return CLAIM_PREFIX + claim_uid


class Allocation(msgspec.Struct, gc=False, kw_only=True):
    alloc_id: str
    request_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    container_index: int
    init_container: bool
    cores: int
    memory: int
    device_ids: tuple[str, ...]
    shares: tuple[GpuShare, ...]
    core_limit: int | None
    response: ContainerResponse
    granted_seq: int
    granted_at: int
    # False once a later container of the same pod reuses this init container's kubelet devices
    # (the kubelet hands an init container's devices on; they are held once, not twice).
    charged: bool = True
    corrected_seq: int = 0  # seq of the last alloc.corrected, 0 when the guess at Allocate stood

    @classmethod
    def from_event(cls, ev: AllocationGranted, seq: int, at: int) -> Allocation:
        if type(ev) is AllocationGranted:  # every grant's fold (replay too): its fields are exactly these
            return cls(**msgspec.structs.asdict(ev), granted_seq=seq, granted_at=at)
        fields = {f: getattr(ev, f) for f in _GRANT_FIELDS}  # a subtype (alloc.imported) may carry more
        return cls(**fields, granted_seq=seq, granted_at=at)


_GRANT_FIELDS = AllocationGranted.__struct_fields__


class GpuUsage(msgspec.Struct, kw_only=True):
    index: int
    uuid: str
    minor: int
    memory_total: int
    cores_used: int = 0
    memory_used: int = 0
    alloc_ids: list[str] = msgspec.field(default_factory=list)
    healthy: bool = True        # folded from gpu.health events
    health_reason: str = ""     # why it is unhealthy (empty when healthy)
    mode: str = MODE_DEVICE_PLUGIN  # folded from gpu.mode events: which kubelet API serves the GPU

    @property
    def cores_free(self) -> int:
        return max(0, 100 - self.cores_used)

    @property
    def memory_free(self) -> int:
        return max(0, self.memory_total - self.memory_used)

    @property
    def idle(self) -> bool:
        return not self.alloc_ids


class LedgerSnapshot(msgspec.Struct, kw_only=True):
    """A canonical, comparable view of the state (also what ``gpuledger replay --json`` prints)."""

    seq: int
    time: int
    node: str
    gpus: list[GpuUsage]
    allocations: list[Allocation]


class PreparedClaim(msgspec.Struct, frozen=True, kw_only=True):
    """A prepared DRA claim and the ResourceClaim it came from (what the watchdog reads to reconcile it)."""

    uid: str
    namespace: str
    name: str
    reserved_pods: tuple[str, ...]  # status.reservedFor at prepare time


class LedgerState:
    def __init__(self) -> None:
        self.seq = 0
        self.time = 0
        self.inventory: InventoryRecorded | None = None
        self.allocations: dict[str, Allocation] = {}
        self.gpus: dict[int, GpuUsage] = {}
        self.refusals = 0
        self.releases = 0
        self.health: dict[str, GpuHealthChanged] = {}  # by GPU uuid: the last health transition
        self.modes: dict[str, str] = {}  # by GPU uuid: dra | device-plugin (absent: device-plugin)
        # DRA claims unprepared and not prepared again since: claim uid -> the pods it was reserved for
        # (a prepare of one of them for no new pod is a stale retry; see ``stale_prepare``)
        self.unprepared: dict[str, tuple[str, ...]] = {}
        self.claim_pods: dict[str, tuple[str, ...]] = {}  # prepared claim uid -> its reservedFor pods
        self.claim_refs: dict[str, PreparedClaim] = {}    # prepared claim uid -> its ResourceClaim

    # --- folding ---
    def apply(self, stored: StoredEvent) -> None:
        if stored.seq <= self.seq:
            return  # already folded (at-least-once delivery is fine)
        if stored.seq != self.seq + 1:
            raise ValueError(f"gap in the event stream: at seq {self.seq}, got {stored.seq}")
        ev = stored.event
        if isinstance(ev, AllocationGranted):
            alloc = Allocation.from_event(ev, stored.seq, stored.recorded_at)
            self._absorb_reused(alloc)
            self.allocations[alloc.alloc_id] = alloc
            self._charge(alloc, +1)
        elif isinstance(ev, AllocationReleased):
            released = self.allocations.pop(ev.alloc_id, None)
            if released is not None:
                self.releases += 1
                if released.charged:
                    self._charge(released, -1)
        elif isinstance(ev, AllocationCorrected):
            self._correct(ev, stored.seq)
        elif isinstance(ev, InventoryRecorded):
            self.inventory = ev
            self._rebuild_usage()
        elif isinstance(ev, AllocationRefused):
            self.refusals += 1
        elif isinstance(ev, GpuHealthChanged):
            self.health[ev.uuid] = ev
            self._apply_health()
        elif isinstance(ev, GpuModeChanged):
            self.modes[ev.uuid] = ev.mode
            self._apply_health()
        if isinstance(ev, ClaimPrepared):
            self.unprepared.pop(ev.claim_uid, None)
            self.claim_pods[ev.claim_uid] = ev.reserved_pods
            self.claim_refs[ev.claim_uid] = PreparedClaim(uid=ev.claim_uid, namespace=ev.claim_namespace,
                                                          name=ev.claim_name, reserved_pods=ev.reserved_pods)
        elif isinstance(ev, ClaimUnprepared):
            self.unprepared[ev.claim_uid] = ev.reserved_pods
            self.claim_pods.pop(ev.claim_uid, None)
            self.claim_refs.pop(ev.claim_uid, None)
        self.seq = stored.seq
        self.time = stored.recorded_at

    def _absorb_reused(self, alloc: Allocation) -> None:
        """An app container whose kubelet device IDs include an init container's of the same pod
        takes over that init container's hold (``rules.takes_over``): the init container has run to
        completion by the time the app container starts, so the GPUs are charged once, for the later
        container."""
        if alloc.init_container:
            return
        ids = set(alloc.device_ids)
        for other in self.reused_by(alloc.pod_uid, ids):
            self._charge(other, -1)
            other.charged = False

    def reused_by(self, pod_uid: str, device_ids: set[str]) -> list[Allocation]:
        """The pod's charged init-container allocations sharing kubelet device IDs with these."""
        return [
            a for a in self.allocations.values()
            if a.pod_uid == pod_uid and a.init_container and a.charged and takes_over(device_ids, a.device_ids)
        ]

    def _correct(self, ev: AllocationCorrected, seq: int) -> None:
        old = self.allocations.get(ev.alloc_id)
        if old is None:
            return  # released meanwhile; nothing to move
        if old.charged:
            self._charge(old, -1)
        # The real owner and its limits move (``rules.CORRECTION_MOVES``); cores, device IDs, charged stay.
        new = msgspec.structs.replace(move_to_real_owner(old, ev), corrected_seq=seq)
        self.allocations[ev.alloc_id] = new
        if new.charged:
            self._charge(new, +1)

    def _charge(self, alloc: Allocation, sign: int) -> None:
        for share in alloc.shares:
            gpu = self.gpus.get(share.index)
            if gpu is None:
                continue  # a GPU that left the inventory; the allocation itself is still recorded
            gpu.cores_used += sign * share.cores
            gpu.memory_used += sign * share.memory
            if sign > 0:
                gpu.alloc_ids.append(alloc.alloc_id)
            elif alloc.alloc_id in gpu.alloc_ids:
                gpu.alloc_ids.remove(alloc.alloc_id)

    def _rebuild_usage(self) -> None:
        assert self.inventory is not None
        self.gpus = {
            g.index: GpuUsage(index=g.index, uuid=g.uuid, minor=g.minor, memory_total=g.memory)
            for g in self.inventory.gpus
        }
        for alloc in sorted(self.allocations.values(), key=lambda a: a.granted_seq):
            if alloc.charged:
                self._charge(alloc, +1)
        self._apply_health()

    def _apply_health(self) -> None:
        # By uuid, not index: a GPU that moved to another index after a reboot keeps its health.
        for gpu in self.gpus.values():
            ev = self.health.get(gpu.uuid)
            gpu.healthy = ev is None or ev.healthy
            gpu.health_reason = health_reason(ev)
            gpu.mode = self.modes.get(gpu.uuid, MODE_DEVICE_PLUGIN)

    # --- queries ---
    def claims(self) -> dict[str, Allocation]:
        """The prepared DRA claims by claim UID."""
        return {a.alloc_id[len(CLAIM_PREFIX):]: a for a in self.allocations.values()
                if a.alloc_id.startswith(CLAIM_PREFIX)}

    def prepared_claims(self) -> list[PreparedClaim]:
        """The prepared claims with their ResourceClaims' names, by claim UID (a claim whose grant an
        older watchdog released as an ``alloc.released`` is not prepared any more)."""
        return [ref for uid, ref in sorted(self.claim_refs.items()) if claim_alloc_id(uid) in self.allocations]

    def stale_prepare(self, claim_uid: str, reserved_pods: tuple[str, ...]) -> bool:
        """A prepare of an unprepared claim that names no pod beyond those it was unprepared for: a
        retry that lost the race with its unprepare (a claim reused by a NEW pod may be prepared again)."""
        before = self.unprepared.get(claim_uid)
        return before is not None and set(reserved_pods) <= set(before)

    def gpus_in_mode(self, mode: str) -> list[GpuUsage]:
        return [g for _, g in sorted(self.gpus.items()) if g.mode == mode]

    def pod_allocations(self, pod_uid: str) -> list[Allocation]:
        return sorted(
            (a for a in self.allocations.values() if a.pod_uid == pod_uid), key=lambda a: a.granted_seq
        )

    def pods(self) -> set[str]:
        return {a.pod_uid for a in self.allocations.values()}

    def holds(self, pod_uid: str) -> bool:
        """Whether the pod holds any allocation."""
        return any(a.pod_uid == pod_uid for a in self.allocations.values())

    def find_by_devices(self, device_ids: list[str] | tuple[str, ...]) -> Allocation | None:
        """The newest allocation that holds exactly these kubelet device IDs."""
        wanted = frozenset(device_ids)
        size = len(wanted)
        best: Allocation | None = None
        for alloc in self.allocations.values():
            ids = alloc.device_ids
            # Most grants differ at once: fewer IDs, or their first is not wanted (no set built for them;
            # a PreStart asks this of every grant on the node, two or three times).
            if len(ids) < size or (ids and ids[0] not in wanted):
                continue
            if frozenset(ids) == wanted and (best is None or alloc.granted_seq > best.granted_seq):
                best = alloc
        return best

    def snapshot(self) -> LedgerSnapshot:
        return LedgerSnapshot(
            seq=self.seq,
            time=self.time,
            node=self.inventory.node if self.inventory else "",
            gpus=[msgspec.structs.replace(g, alloc_ids=sorted(g.alloc_ids)) for _, g in sorted(self.gpus.items())],
            allocations=sorted(self.allocations.values(), key=lambda a: a.granted_seq),
        )
