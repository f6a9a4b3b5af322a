"""Reading glibc's /etc/ld.so.cache: which shared libraries the host's dynamic linker knows, and where.

The format (glibc ``sysdeps/generic/dl-cache.h``; gpu-manager-reference.md 6.1), all integers in the
byte order the header's flags give (little-endian when unset):

- optional old table: ``"ld.so-1.7.0"``, pad, uint32 count, count x 12-byte entries; the new table
  follows at the next 8-byte boundary;
- new header (48 bytes): ``"glibc-ld.so.cache"`` ``"1.1"``, uint32 nlibs, uint32 len_strings, uint8
  flags (byte order: 2 little, 3 big), 3 pad, uint32 extension_offset, 3 x uint32 unused;
- nlibs x 24-byte entries: int32 flags, uint32 key (name), uint32 value (path), uint32 osversion,
  uint64 hwcap; ``key``/``value`` are offsets of NUL-terminated strings from the new header's start.

Entry flags: low byte = type (``FLAG_ELF_LIBC6`` = 3, ...), high byte = architecture.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CacheEntry", "LdCacheError", "parse_ld_cache", "read_ld_cache"]

OLD_MAGIC = b"ld.so-1.7.0"
NEW_MAGIC = b"glibc-ld.so.cache1.1"
_NEW_HEADER = 48
_NEW_ENTRY = 24

FLAG_TYPE_MASK = 0x00FF
FLAG_ARCH_MASK = 0xFF00
FLAG_ELF = 0x0001  # any ELF type has this bit (ELF=1, ELF_LIBC5=2... ELF_LIBC6=3)
# Architecture byte -> word size of the library (x86-64, ppc64, s390x, ia64, aarch64, riscv64, ...).
_ARCH_64 = {0x0300, 0x0500, 0x0400, 0x0200, 0x0A00, 0x1000, 0x1100}
_ARCH_32 = {0x0000, 0x0800, 0x0900}  # i386 (no arch byte), x32, arm hard-float


class LdCacheError(ValueError):
    pass


@dataclass(frozen=True)
class CacheEntry:
    name: str   # the soname the linker looks up, e.g. libcuda.so.1
    path: str   # where it lives
    flags: int

    @property
    def bits(self) -> int | None:
        """64 or 32 for an ELF library of a known architecture, None otherwise."""
        if not self.flags & FLAG_ELF:
            return None
        arch = self.flags & FLAG_ARCH_MASK
        return 64 if arch in _ARCH_64 else 32 if arch in _ARCH_32 else None


def _cstring(data: bytes, start: int, offset: int) -> str:
    pos = start + offset
    end = data.find(b"\0", pos)
    if pos >= len(data) or end < 0:
        raise LdCacheError(f"string offset {offset} is outside the cache")
    return data[pos:end].decode("utf-8", "surrogateescape")


def parse_ld_cache(data: bytes) -> list[CacheEntry]:
    start = 0
    if data.startswith(OLD_MAGIC):
        if len(data) < 16:
            raise LdCacheError("truncated old-format header")
        (count,) = struct.unpack_from("<I", data, 12)
        start = (16 + count * 12 + 7) & ~7
        if data[start:start + len(NEW_MAGIC)] != NEW_MAGIC:
            raise LdCacheError("old-format-only cache (libc5 era) is not supported")
    if data[start:start + len(NEW_MAGIC)] != NEW_MAGIC:
        raise LdCacheError("not an ld.so.cache (no glibc-ld.so.cache1.1 header)")
    if len(data) < start + _NEW_HEADER:
        raise LdCacheError("truncated header")
    order = ">" if data[start + 28] == 3 else "<"
    nlibs, _strings = struct.unpack_from(order + "II", data, start + 20)
    if start + _NEW_HEADER + nlibs * _NEW_ENTRY > len(data):
        raise LdCacheError(f"header says {nlibs} entries; the file is too short for them")
    entries = []
    for i in range(nlibs):
        flags, key, value, _os, _hwcap = struct.unpack_from(order + "iIIIQ", data, start + _NEW_HEADER + i * _NEW_ENTRY)
        entries.append(CacheEntry(name=_cstring(data, start, key), path=_cstring(data, start, value), flags=flags))
    return entries


def read_ld_cache(path: Path) -> list[CacheEntry]:
    return parse_ld_cache(path.read_bytes())
