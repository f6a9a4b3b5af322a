"""The kubelet's device-manager checkpoint, ``kubelet_internal_checkpoint``, read as a record of which
container the kubelet gave which device IDs (kubelet-device-plugin.md 2.9).

The kubelet rewrites the whole file after each container's Allocates (every resource of it) and
replaces it by a rename, so a reader sees one write or the next, never half of one. gpu-manager reads
it at PreStartContainer to learn the pod and container behind a request's device IDs. Three layouts
(gpu-manager-reference.md 4.4): ``{"Data": {"PodDeviceEntries": [...]}}`` with ``DeviceIDs`` per
NUMA node (Kubernetes >= 1.20) or as a flat list, and the legacy top-level ``PodDeviceEntries``.
Only the entries' names and IDs are decoded: each ``AllocResp`` (base64 protobuf) and the registered
devices are skipped. The checksum is not checked (it hashes a Go-specific dump of the data): the
file is the kubelet's own, replaced whole.
"""

from __future__ import annotations

import msgspec

__all__ = ["CHECKPOINT_FILE", "MAX_CHECKPOINT_BYTES", "CheckpointEntry", "CheckpointUnreadable", "checkpoint_entries"]

CHECKPOINT_FILE = "kubelet_internal_checkpoint"
# Far beyond any node's (an entry is a few hundred bytes plus its response): a bigger file is not read.
MAX_CHECKPOINT_BYTES = 64 * 1024 * 1024


class CheckpointUnreadable(ValueError):
    """The bytes are not a kubelet device-manager checkpoint in any known layout."""


class CheckpointEntry(msgspec.Struct, frozen=True):
    pod_uid: str
    container: str
    resource: str
    device_ids: tuple[str, ...]  # every NUMA node's, in the file's order


class _Entry(msgspec.Struct):
    PodUID: str = ""
    ContainerName: str = ""
    ResourceName: str = ""
    DeviceIDs: dict[str, list[str]] | list[str] | None = None


class _Data(msgspec.Struct):
    PodDeviceEntries: list[_Entry] | None = None


class _File(msgspec.Struct):
    Data: _Data | None = None
    PodDeviceEntries: list[_Entry] | None = None  # the legacy layout, without ``Data``


_decoder = msgspec.json.Decoder(_File)


def checkpoint_entries(raw: bytes) -> list[CheckpointEntry] | None:
    """The file's entries; None when it names none (``PodDeviceEntries`` absent, or null as the
    kubelet writes an empty list). CheckpointUnreadable when it is not such a file."""
    try:
        decoded = _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointUnreadable(str(exc)) from exc
    entries = decoded.Data.PodDeviceEntries if decoded.Data is not None else decoded.PodDeviceEntries
    if entries is None:
        return None
    return [CheckpointEntry(pod_uid=e.PodUID, container=e.ContainerName, resource=e.ResourceName,
                            device_ids=_flat(e.DeviceIDs)) for e in entries]


def _flat(ids: dict[str, list[str]] | list[str] | None) -> tuple[str, ...]:
    if ids is None:
        return ()
    if isinstance(ids, dict):
        return tuple(i for per_node in ids.values() for i in per_node)
    return tuple(ids)
