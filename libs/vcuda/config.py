"""vcuda.config: the 8240-byte ``resource_data_t`` the in-container CUDA library reads (pure codec, no I/O).

The layout is vcuda-controller's C struct (``packed, aligned(8)``, x86_64, little-endian), see
gpu-manager-reference.md section 5.4. The library refuses any file whose ``read()`` is not exactly
8240 bytes, so the format below is asserted at import: a wrong edit fails loudly, not in a container.

    offset  size  field
         0    48  pod_uid          char[48], NUL-terminated
        48     4  limit            int32   soft-limit target (vcuda-core-limit), 0 = none
        52  4044  (occupied)       zero
      4096  4096  container_name   char[4096], NUL-terminated
      8192    16  bus_id           char[16], NUL-terminated
      8208     8  gpu_memory       uint64  bytes
      8216     4  utilization      int32   vcuda-core units
      8220     4  hard_limit       int32   1 = hard, 0 = soft (core-limit annotation present)
      8224     8  driver_version   int32 major, int32 minor
      8232     4  enable           int32   0 = no limits at all (a whole GPU or more)
      8236     4  (tail padding)   zero
"""

from __future__ import annotations

import re
import struct

import msgspec

from libs.ledger.state import Allocation

__all__ = ["SIZE", "VcudaConfig", "config_for", "decode", "encode", "parse_driver_version"]

SIZE = 8240

POD_UID_LEN = 48
CONTAINER_NAME_LEN = 4096  # FILENAME_MAX
BUS_ID_LEN = 16            # NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE

# '<': little-endian, no implicit alignment: every byte of the C struct is spelled out here.
_FORMAT = struct.Struct(
    "<"
    f"{POD_UID_LEN}s"         # 0     pod_uid
    "i"                       # 48    limit
    "4044x"                   # 52    occupied
    f"{CONTAINER_NAME_LEN}s"  # 4096  container_name
    f"{BUS_ID_LEN}s"          # 8192  bus_id
    "Q"                       # 8208  gpu_memory
    "i"                       # 8216  utilization
    "i"                       # 8220  hard_limit
    "i"                       # 8224  driver_version.major
    "i"                       # 8228  driver_version.minor
    "i"                       # 8232  enable
    "4x"                      # 8236  tail padding to the 8-byte alignment
)
assert _FORMAT.size == SIZE, f"vcuda.config format is {_FORMAT.size} bytes, the library reads {SIZE}"

_INT32 = (-(2**31), 2**31 - 1)
_UINT64 = (0, 2**64 - 1)
_DRIVER = re.compile(r"\s*(\d+)\.(\d+)(?:\.\d+)*\s*")


class VcudaConfig(msgspec.Struct, frozen=True, kw_only=True):
    pod_uid: str
    limit: int
    container_name: str
    bus_id: str = ""
    gpu_memory: int  # bytes
    utilization: int
    hard_limit: int
    driver_major: int
    driver_minor: int
    enable: int


def _cstring(field: str, value: str, size: int) -> bytes:
    raw = value.encode()
    if b"\0" in raw:
        raise ValueError(f"vcuda.config {field} must not contain NUL bytes: {value!r}")
    if len(raw) >= size:  # room for the terminating NUL
        raise ValueError(f"vcuda.config {field} is {len(raw)} bytes, at most {size - 1} fit: {value[:64]!r}")
    return raw


def _int(field: str, value: int, bounds: tuple[int, int]) -> int:
    low, high = bounds
    if not low <= value <= high:
        raise ValueError(f"vcuda.config {field}={value} is outside {low}..{high}")
    return value


def encode(cfg: VcudaConfig) -> bytes:
    """The exact 8240 bytes of the file; ValueError when a value does not fit its C field."""
    return _FORMAT.pack(
        _cstring("pod_uid", cfg.pod_uid, POD_UID_LEN),
        _int("limit", cfg.limit, _INT32),
        _cstring("container_name", cfg.container_name, CONTAINER_NAME_LEN),
        _cstring("bus_id", cfg.bus_id, BUS_ID_LEN),
        _int("gpu_memory", cfg.gpu_memory, _UINT64),
        _int("utilization", cfg.utilization, _INT32),
        _int("hard_limit", cfg.hard_limit, _INT32),
        _int("driver_major", cfg.driver_major, _INT32),
        _int("driver_minor", cfg.driver_minor, _INT32),
        _int("enable", cfg.enable, _INT32),
    )


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode()


def decode(data: bytes) -> VcudaConfig:
    if len(data) != SIZE:
        raise ValueError(f"vcuda.config must be exactly {SIZE} bytes, got {len(data)}")
    pod_uid, limit, name, bus_id, memory, utilization, hard, major, minor, enable = _FORMAT.unpack(data)
    return VcudaConfig(
        pod_uid=_text(pod_uid),
        limit=limit,
        container_name=_text(name),
        bus_id=_text(bus_id),
        gpu_memory=memory,
        utilization=utilization,
        hard_limit=hard,
        driver_major=major,
        driver_minor=minor,
        enable=enable,
    )


def parse_driver_version(version: str) -> tuple[int, int]:
    """``"550.54.15"`` -> ``(550, 54)``; anything else -> ``(0, 0)`` (the library never reads it)."""
    m = _DRIVER.fullmatch(version or "")
    if not m:
        return 0, 0
    major, minor = int(m.group(1)), int(m.group(2))
    if major > _INT32[1] or minor > _INT32[1]:
        return 0, 0
    return major, minor


def config_for(alloc: Allocation, *, container_name: str, driver_version: str) -> VcudaConfig:
    """What gpu-manager writes for one container's allocation (section 5.4, "Written by manager")."""
    soft = alloc.core_limit is not None
    major, minor = parse_driver_version(driver_version)
    return VcudaConfig(
        pod_uid=alloc.pod_uid,
        limit=min(max(alloc.core_limit, 0), 100) if alloc.core_limit is not None else 0,
        container_name=container_name,
        gpu_memory=alloc.memory,
        utilization=alloc.cores,
        hard_limit=0 if soft else 1,
        driver_major=major,
        driver_minor=minor,
        enable=0 if alloc.cores >= 100 else 1,
    )
