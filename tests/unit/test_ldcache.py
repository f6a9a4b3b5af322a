"""ld.so.cache parsing: glibc's own output (a fixture written by the real ldconfig) and synthetic caches."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.vmanager.ldcache import CacheEntry, LdCacheError, parse_ld_cache, read_ld_cache
from tests.builders.elf import FLAG_ELF_LIBC6, FLAG_I386, FLAG_X8664_LIB64, ld_so_cache

FIXTURE = Path(__file__).parents[1] / "fixtures" / "ld.so.cache"
X64 = FLAG_ELF_LIBC6 | FLAG_X8664_LIB64


def test_cache_written_by_glibc_ldconfig() -> None:
    """tests/fixtures/make_ldcache_fixture.py: glibc 2.36's ldconfig over our compiler-free objects."""
    entries = read_ld_cache(FIXTURE)
    assert sorted((e.name, e.path, e.flags, e.bits) for e in entries) == [
        ("libcuda-control.so", "/opt/nvidia/lib64/libcuda-control.so", X64, 64),
        ("libcuda.so.1", "/opt/nvidia/lib64/libcuda.so.1", X64, 64),
        ("libnvidia-ml.so.1", "/opt/nvidia/lib64/libnvidia-ml.so.1", X64, 64),
        ("libnvidia-ptxjitcompiler.so.1", "/opt/nvidia/lib64/libnvidia-ptxjitcompiler.so.1", X64, 64),
    ]


@pytest.mark.parametrize("old_format", [False, True])
def test_synthetic_cache(old_format: bool) -> None:
    listed = [("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", X64),
              ("libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1", FLAG_ELF_LIBC6 | FLAG_I386),
              ("libx32.so", "/usr/libx32/libx32.so", FLAG_ELF_LIBC6 | 0x0800),
              ("libweird.so", "/odd/libweird.so", FLAG_ELF_LIBC6 | 0x7700),
              ("liba.out.so", "/old/liba.out.so", 0x0000)]
    entries = parse_ld_cache(ld_so_cache(listed, old_format=old_format))
    assert entries == [CacheEntry(name=n, path=p, flags=f) for n, p, f in listed]
    assert [e.bits for e in entries] == [64, 32, 32, None, None]


@pytest.mark.parametrize(("data", "says"), [
    (b"", "not an ld.so.cache"),
    (b"garbage" * 10, "not an ld.so.cache"),
    (b"ld.so-1.7.0\0" + (0).to_bytes(4, "little"), "old-format-only"),
    (b"glibc-ld.so.cache1.1" + bytes(10), "truncated"),
    (ld_so_cache([("a", "/a", X64)])[:60], "too short"),
])
def test_bad_caches_are_refused(data: bytes, says: str) -> None:
    with pytest.raises(LdCacheError, match=says):
        parse_ld_cache(data)


def test_string_outside_the_file_is_refused() -> None:
    data = bytearray(ld_so_cache([("a", "/a", X64)]))
    data[48 + 4:48 + 8] = (10_000).to_bytes(4, "little")  # the name's offset
    with pytest.raises(LdCacheError, match="outside"):
        parse_ld_cache(bytes(data))
