"""vcuda.config built by hand, field by field at the offsets of gpu-manager-reference.md 5.4.

Deliberately independent of libs.vcuda.config (no struct format): the two must agree byte for byte.
"""

from __future__ import annotations

SIZE = 8240


def golden_config(
    *,
    pod_uid: str,
    limit: int,
    container_name: str,
    gpu_memory: int,
    utilization: int,
    hard_limit: int,
    driver_major: int,
    driver_minor: int,
    enable: int,
    bus_id: str = "",
) -> bytes:
    buf = bytearray(SIZE)  # every byte not written below is zero: padding and NUL terminators

    def text(offset: int, value: str) -> None:
        raw = value.encode()
        buf[offset : offset + len(raw)] = raw

    def number(offset: int, value: int, size: int = 4, signed: bool = True) -> None:
        buf[offset : offset + size] = value.to_bytes(size, "little", signed=signed)

    text(0x0000, pod_uid)                      # char pod_uid[48]
    number(0x0030, limit)                      # int limit
    text(0x1000, container_name)               # char container_name[4096] after occupied[4044]
    text(0x2000, bus_id)                       # char bus_id[16]
    number(0x2010, gpu_memory, 8, signed=False)  # uint64 gpu_memory
    number(0x2018, utilization)                # int utilization
    number(0x201C, hard_limit)                 # int hard_limit
    number(0x2020, driver_major)               # version_t.major
    number(0x2024, driver_minor)               # version_t.minor
    number(0x2028, enable)                     # int enable; 4 bytes of tail padding follow
    assert len(buf) == SIZE
    return bytes(buf)
