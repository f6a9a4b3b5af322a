"""The CDI spec files the DRA driver writes, one per prepared claim (Container Device Interface).

Format: CDI JSON, ``cdiVersion`` 0.6.0 (readers of 0.6 and 0.7 accept it), ``kind`` ``gpuledger.io/claim``.
Each claim's file ``<cdi dir>/gpuledger.io-claim_<claim uid>.json`` holds ONE device named after the
claim UID; its fully qualified CDI ID, ``gpuledger.io/claim=<claim uid>``, is what NodePrepareResources
returns for every device of the claim (a runtime or the simulator's resolver applies it once per
container, however many of the claim's devices the container references). The device's
``containerEdits`` carry what a device-plugin container gets from Allocate: the GPU device nodes and
control devices, ``NVIDIA_VISIBLE_DEVICES`` and the other envs, the driver volume and the pod's
vcuda directory (``vcuda.sock``; the vmanager writes the container's ``vcuda.config`` with the claim's
cores and memory there when it registers) or, in hami-core mode, the HAMi-core envs and mounts.

Edits follow the CDI schema: ``env`` as ``NAME=value`` strings, ``deviceNodes`` {path, hostPath,
permissions}, ``mounts`` {hostPath, containerPath, options}. Pure: encode, decode, name; the service
writes the files atomically.
"""

from __future__ import annotations

import re

import msgspec

from libs.events.schema import ContainerResponse

__all__ = [
    "CDI_KIND",
    "CDI_VERSION",
    "CdiDevice",
    "CdiDeviceNode",
    "CdiEdits",
    "CdiMount",
    "CdiSpec",
    "claim_of_spec_file",
    "decode_spec",
    "device_id",
    "edits_from_response",
    "encode_spec",
    "parse_device_id",
    "spec_file_name",
    "spec_for_claim",
]

CDI_VERSION = "0.6.0"
CDI_VENDOR = "gpuledger.io"
CDI_CLASS = "claim"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
_FILE = re.compile(r"gpuledger\.io-claim_([0-9A-Za-z-]{1,64})\.json")
_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.:-]{0,127}")


class CdiDeviceNode(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    path: str
    hostPath: str = ""  # CDI spells its fields in camelCase
    permissions: str = "rwm"


class CdiMount(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    hostPath: str
    containerPath: str
    options: tuple[str, ...] = ()


class CdiEdits(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    env: tuple[str, ...] = ()
    deviceNodes: tuple[CdiDeviceNode, ...] = ()
    mounts: tuple[CdiMount, ...] = ()


class CdiDevice(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    containerEdits: CdiEdits


class CdiSpec(msgspec.Struct, frozen=True, kw_only=True):
    cdiVersion: str
    kind: str
    devices: tuple[CdiDevice, ...]
    # Annotations CDI allows on a spec; ours say which claim and pod the file is for.
    annotations: dict[str, str] = {}


def spec_file_name(claim_uid: str) -> str:
    if not _NAME.fullmatch(claim_uid):
        raise ValueError(f"{claim_uid!r} is not a claim UID")
    return f"{CDI_VENDOR}-{CDI_CLASS}_{claim_uid}.json"


def claim_of_spec_file(file_name: str) -> str | None:
    """The claim UID a spec file of ours is for; None for any other file."""
    m = _FILE.fullmatch(file_name)
    return m.group(1) if m else None


def device_id(claim_uid: str) -> str:
    """The fully qualified CDI device ID of a claim: ``gpuledger.io/claim=<uid>``."""
    if not _NAME.fullmatch(claim_uid):
        raise ValueError(f"{claim_uid!r} is not a CDI device name")
    return f"{CDI_KIND}={claim_uid}"


def parse_device_id(qualified: str) -> tuple[str, str]:
    """(kind, name) of ``vendor/class=name``; ValueError when it is not qualified."""
    kind, sep, name = qualified.partition("=")
    if not sep or "/" not in kind or not name:
        raise ValueError(f"{qualified!r} is not a qualified CDI device ID (vendor/class=name)")
    return kind, name


def edits_from_response(response: ContainerResponse) -> CdiEdits:
    """What Allocate would have handed the kubelet, as CDI container edits."""
    return CdiEdits(
        env=tuple(f"{k}={v}" for k, v in response.envs.items()),
        deviceNodes=tuple(
            CdiDeviceNode(path=d.container_path, hostPath=d.host_path, permissions=d.permissions)
            for d in response.devices
        ),
        mounts=tuple(
            CdiMount(hostPath=m.host_path, containerPath=m.container_path,
                     options=("ro", "bind") if m.read_only else ("rw", "bind"))
            for m in response.mounts
        ),
    )


def spec_for_claim(claim_uid: str, response: ContainerResponse, *, pod_uid: str = "",
                   claim: str = "") -> CdiSpec:
    annotations = {"gpuledger.io/claim-uid": claim_uid}
    if pod_uid:
        annotations["gpuledger.io/pod-uid"] = pod_uid
    if claim:
        annotations["gpuledger.io/claim"] = claim  # namespace/name
    return CdiSpec(cdiVersion=CDI_VERSION, kind=CDI_KIND, annotations=annotations,
                   devices=(CdiDevice(name=claim_uid, containerEdits=edits_from_response(response)),))


def encode_spec(spec: CdiSpec) -> bytes:
    return msgspec.json.encode(spec)


def decode_spec(data: bytes) -> CdiSpec:
    """A spec file's contents; ValueError when it is not a CDI spec of this shape."""
    try:
        return msgspec.json.decode(data, type=CdiSpec)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a CDI spec: {exc}") from exc
