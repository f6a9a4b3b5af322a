"""Migration from gpu-manager: its ``gpumanager_internal_checkpoint`` becomes the log's genesis.

The checkpoint (gpu-manager-reference.md 4.4) is JSON with Go field names,
``{"PodGPUMapping": {"<pod uid>": {"<container>": {"Devices": ["/dev/nvidia0"], "Cores": 200,
"Memory": <bytes>}}}}``, and holds nothing else: no GPU UUIDs, no pod names, no responses.

Each container becomes one ``alloc.imported`` event (a grant with its origin). Devices are matched to
this node's GPUs by minor number; whole-GPU containers (Cores >= 100) hold each of their GPUs fully,
as the allocator's own whole-GPU grants do; a share holds Cores and Memory of its one GPU. The response
is the one gpu-manager would have built. Everything is checked before anything is written, and all
events go in one append, so an import is all or nothing; its command id is the file's hash, so
running it twice imports once.

It writes only into a log that holds no allocation yet (empty, or only the GPU inventory), and never
while the allocator runs (the log's writer lock): anything else could contradict recorded history.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec

from libs.config import Settings
from libs.errors import GpuledgerError, StoreError
from libs.events.codec import StoredEvent
from libs.events.schema import AllocationImported, GpuInfo, GpuShare, InventoryRecorded
from libs.kube.pods import RESOURCE_VCORE
from libs.kubelet.checkpoint import CheckpointUnreadable, checkpoint_entries
from libs.placement.recorded import ResponseSettings
from libs.placement.responses import build_response
from libs.store import EventLog

__all__ = ["CheckpointError", "ImportResult", "import_checkpoint", "plan_import"]

_DEVICE = re.compile(r"^/dev/nvidia(\d+)$")


class CheckpointError(GpuledgerError):
    pass


class _Container(msgspec.Struct):
    Devices: list[str]
    Cores: int
    Memory: int = 0


class _Checkpoint(msgspec.Struct):
    PodGPUMapping: dict[str, dict[str, _Container]] = {}


@dataclass
class ImportResult:
    stored: list[StoredEvent]
    already: bool                # the same file had been imported before: nothing was written
    allocations: int
    pods: int


def _read(path: Path) -> _Checkpoint:
    try:
        return msgspec.json.decode(path.read_bytes(), type=_Checkpoint)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"{path} is not a gpu-manager checkpoint: {exc}") from exc


def kubelet_device_ids(path: Path) -> dict[tuple[str, str], tuple[str, ...]]:
    """(pod uid, container) -> the vcore device IDs the kubelet gave it, from kubelet_internal_checkpoint
    in any of its layouts (libs/kubelet/checkpoint.py)."""
    try:
        entries = checkpoint_entries(path.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except CheckpointUnreadable as exc:
        raise CheckpointError(f"{path} is not a kubelet checkpoint: {exc}") from exc
    if entries is None:
        raise CheckpointError(f"{path} is not a kubelet checkpoint: no PodDeviceEntries")
    return {(e.pod_uid, e.container): e.device_ids for e in entries if e.resource == RESOURCE_VCORE}


def plan_import(path: Path, gpus: tuple[GpuInfo, ...], settings: Settings,
                device_ids: dict[tuple[str, str], tuple[str, ...]] | None = None) -> list[AllocationImported]:
    """The events for ``path`` on a node with ``gpus``; raises CheckpointError naming what is wrong.

    ``device_ids`` (from the kubelet's checkpoint) lets PreStartContainer find an imported allocation
    when the kubelet restarts one of its containers; without it they stay empty.
    """
    checkpoint = _read(path)
    by_minor = {g.minor: g for g in gpus}
    used: dict[int, list[int]] = {g.index: [0, 0] for g in gpus}  # index -> [cores, memory]
    events: list[AllocationImported] = []
    for pod_uid in sorted(checkpoint.PodGPUMapping):
        for name in sorted(checkpoint.PodGPUMapping[pod_uid]):
            entry = checkpoint.PodGPUMapping[pod_uid][name]
            where = f"pod {pod_uid} container {name!r}"
            shares = _shares(entry, by_minor, where)
            ids = (device_ids or {}).get((pod_uid, name), ())
            if ids and len(ids) != entry.Cores:
                raise CheckpointError(f"{where}: the kubelet's checkpoint gives it {len(ids)} {RESOURCE_VCORE} "
                                      f"IDs but gpu-manager's {entry.Cores} cores")
            for share in shares:
                used[share.index][0] += share.cores
                used[share.index][1] += share.memory
            events.append(AllocationImported(
                alloc_id=uuid.uuid4().hex, request_id=f"import:{pod_uid}/{name}", pod_uid=pod_uid,
                namespace="", pod_name="", container=name, container_index=-1, cores=entry.Cores,
                memory=entry.Memory, device_ids=ids, shares=shares, source=str(path),
                response=build_response(shares=shares, cores=entry.Cores, memory=entry.Memory, pod_uid=pod_uid,
                                        vm_root=settings.vm_root, vdriver_root=settings.vdriver_root),
            ))
    for g in gpus:
        cores, memory = used[g.index]
        if cores > 100 or memory > g.memory:
            raise CheckpointError(f"{path} gives GPU{g.index} (minor {g.minor}) {cores} cores and {memory} bytes: "
                                  f"more than it has (100 cores, {g.memory} bytes)")
    return events


def _shares(entry: _Container, by_minor: dict[int, GpuInfo], where: str) -> tuple[GpuShare, ...]:
    if not entry.Devices:
        raise CheckpointError(f"{where} holds no device")
    found: list[GpuInfo] = []
    for dev in entry.Devices:
        m = _DEVICE.match(dev)
        if not m:
            raise CheckpointError(f"{where}: {dev!r} is not an NVIDIA device node (/dev/nvidia<minor>)")
        gpu = by_minor.get(int(m.group(1)))
        if gpu is None:
            raise CheckpointError(f"{where}: {dev} is not a GPU of this node (minors {sorted(by_minor)})")
        found.append(gpu)
    if entry.Cores <= 0 or entry.Memory < 0:
        raise CheckpointError(f"{where}: Cores {entry.Cores} and Memory {entry.Memory} are not a valid request")
    if entry.Cores >= 100:
        if entry.Cores != 100 * len(found):
            raise CheckpointError(f"{where}: {entry.Cores} cores on {len(found)} whole GPUs")
        return tuple(GpuShare(index=g.index, uuid=g.uuid, minor=g.minor, cores=100, memory=g.memory) for g in found)
    if len(found) != 1:
        raise CheckpointError(f"{where}: a share of {entry.Cores} cores cannot span {len(found)} GPUs")
    g = found[0]
    return (GpuShare(index=g.index, uuid=g.uuid, minor=g.minor, cores=entry.Cores, memory=entry.Memory),)


async def import_checkpoint(path: Path, settings: Settings, inventory: InventoryRecorded,
                            kubelet_checkpoint: Path | None = None) -> ImportResult:
    """Append the checkpoint's allocations (and, into an empty log, the inventory first)."""
    device_ids = kubelet_device_ids(kubelet_checkpoint) if kubelet_checkpoint is not None else None
    command_id = "import:" + hashlib.sha256(path.read_bytes()).hexdigest()[:32]
    recorded = ResponseSettings.of(settings.vm_root, settings.vdriver_root)  # what plan_import builds with
    # Takes the writer lock: refuses while the allocator runs.
    event_log = await EventLog.open(settings.log_path, response_settings=recorded)
    try:
        earlier = await event_log.queries.by_command(command_id)
        if earlier:
            return ImportResult(stored=earlier, already=True, allocations=len(earlier), pods=len(
                {e.event.pod_uid for e in earlier if isinstance(e.event, AllocationImported)}))
        recorded = await _recorded_inventory(event_log)
        gpus = recorded.gpus if recorded is not None else inventory.gpus
        events = plan_import(path, gpus, settings, device_ids)
        if recorded is None:
            await event_log.append([inventory])
        stored = await event_log.append(events, command_id=command_id) if events else []
        return ImportResult(stored=stored, already=False, allocations=len(events),
                            pods=len({e.pod_uid for e in events}))
    finally:
        await event_log.close()


async def _recorded_inventory(event_log: EventLog) -> InventoryRecorded | None:
    """The last inventory, after checking that the log holds nothing but inventories."""
    recorded: InventoryRecorded | None = None
    after = 0
    while batch := await event_log.read_after(after, 512):
        for stored in batch:
            if not isinstance(stored.event, InventoryRecorded):
                raise StoreError(
                    f"{event_log.path} already holds allocation history (seq {stored.seq} is {stored.type}): importing "
                    "a checkpoint now could contradict it. Import into a fresh --state-dir before the first start.")
            recorded = stored.event
        after = batch[-1].seq
    return recorded
