"""`kubelet_internal_checkpoint`: the file the device manager rewrites after every change (spec 2.9).

Plugins such as gpu-manager read it to find which pod a PreStartContainer is for, so the layout is
upstream's exactly: Go field names, DeviceIDs keyed by NUMA node as decimal strings, AllocResp as
base64 of the protobuf `ContainerAllocateResponse`.

The `Checksum` is NOT the kubelet's (that one hashes a Go-specific dump of the data); ours is
CRC-32 over the canonical JSON of `Data` (zlib's, in C: a byte loop in Python cost ~2 ms per write,
on every pod's admission path, where the real kubelet's Go code spends well under a millisecond). A
real kubelet would call our file corrupt, and we ignore the checksum when reading, so we can also
read files a real kubelet wrote.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.kubelet.checkpoint import CHECKPOINT_FILE  # the file's name, as the services read it
from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp

__all__ = ["CHECKPOINT_FILE", "Checkpoint", "CheckpointError", "CheckpointRow", "read_checkpoint",
           "write_checkpoint"]


class CheckpointError(ValueError):
    """The file exists but cannot be used; the kubelet then starts with empty state."""


@dataclass
class CheckpointRow:
    pod_uid: str
    container: str
    resource: str
    devices_per_numa: dict[int, list[str]]
    response: dp.ContainerAllocateResponse


@dataclass
class Checkpoint:
    rows: list[CheckpointRow]
    registered: dict[str, list[str]]  # resource -> healthy IDs at write time (only keys are used)


def encode_checkpoint(cp: Checkpoint) -> bytes:
    entries = [
        {
            "PodUID": row.pod_uid,
            "ContainerName": row.container,
            "ResourceName": row.resource,
            "DeviceIDs": {str(node): ids for node, ids in row.devices_per_numa.items()},
            "AllocResp": base64.b64encode(row.response.SerializeToString()).decode(),
        }
        for row in cp.rows
    ]
    data = {"PodDeviceEntries": entries or None, "RegisteredDevices": cp.registered}
    # Encoded once: the checksummed text is the file's Data as it stands (hundreds of registered IDs,
    # written at every Allocate, made encoding twice half of the emulated kubelet's checkpoint time).
    encoded = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return b'{"Data":' + encoded + b',"Checksum":' + str(zlib.crc32(encoded)).encode() + b"}"


def write_checkpoint(directory: Path, cp: Checkpoint) -> None:
    """Replace the file atomically, so a plugin reading it never sees half a write."""
    payload = encode_checkpoint(cp)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        os.replace(tmp, directory / CHECKPOINT_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def decode_checkpoint(raw: bytes) -> Checkpoint:
    try:
        doc: Any = json.loads(raw)
        data = doc["Data"]
        rows = []
        for entry in data.get("PodDeviceEntries") or []:
            per_numa = entry["DeviceIDs"]
            if not isinstance(per_numa, dict):
                # Pre-1.20 flat lists: the current kubelet cannot parse them either.
                raise CheckpointError("DeviceIDs is not a per-NUMA map")
            response = dp.ContainerAllocateResponse()
            response.ParseFromString(base64.b64decode(entry.get("AllocResp") or ""))
            rows.append(
                CheckpointRow(
                    pod_uid=entry["PodUID"],
                    container=entry["ContainerName"],
                    resource=entry["ResourceName"],
                    devices_per_numa={int(node): list(ids or []) for node, ids in per_numa.items()},
                    response=response,
                )
            )
        registered = {name: list(ids or []) for name, ids in (data.get("RegisteredDevices") or {}).items()}
    except CheckpointError:
        raise
    except Exception as err:  # any malformed content means "corrupt checkpoint"
        raise CheckpointError(f"corrupt checkpoint: {err}") from err
    return Checkpoint(rows=rows, registered=registered)


def read_checkpoint(directory: Path) -> Checkpoint | None:
    """None when there is no file (not an error); CheckpointError when it is unusable."""
    path = directory / CHECKPOINT_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    return decode_checkpoint(raw)
