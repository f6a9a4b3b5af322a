"""Small shared objects and ld.so.cache files written byte by byte, so tests need no compiler.

``shared_object`` writes a minimal ELF64 ET_DYN file: a PT_LOAD over the whole file, a PT_DYNAMIC
with DT_SONAME / DT_STRTAB / DT_STRSZ, and section headers (.dynstr, .dynamic, .shstrtab). That is
all glibc's ldconfig and pyelftools read to learn a soname (checked: tests/fixtures/ld.so.cache is
written by the real ldconfig from such files, see make_ldcache_fixture.py).

``ld_so_cache`` writes glibc's cache format ("glibc-ld.so.cache1.1", optionally behind the old
"ld.so-1.7.0" table), from the layout in glibc's sysdeps/generic/dl-cache.h as documented in
ldconfig(8) and gpu-manager-reference.md 6.1.
"""

from __future__ import annotations

import struct
from pathlib import Path

EM_X86_64 = 62
FLAG_ELF_LIBC6 = 0x0003
FLAG_X8664_LIB64 = 0x0300
FLAG_I386 = 0x0000
FLAG_AARCH64_LIB64 = 0x0A00
FLAG_ARM_LIBHF = 0x0900


def shared_object(path: Path, soname: str | None, *, payload: bytes = b"", machine: int = EM_X86_64) -> Path:
    dynstr = b"\0" + (soname.encode() + b"\0" if soname else b"")
    ph_off, ph_num, ph_size = 64, 2, 56
    dynstr_off = ph_off + ph_num * ph_size
    dyn_off = (dynstr_off + len(dynstr) + 7) & ~7
    dyn = b""
    if soname:
        dyn += struct.pack("<qQ", 14, 1)  # DT_SONAME -> offset 1 in .dynstr
    dyn += struct.pack("<qQ", 5, dynstr_off) + struct.pack("<qQ", 10, len(dynstr)) + struct.pack("<qQ", 0, 0)
    shstr = b"\0.dynstr\0.dynamic\0.shstrtab\0"
    shstr_off = dyn_off + len(dyn)
    data_off = shstr_off + len(shstr)
    sh_off = (data_off + len(payload) + 7) & ~7
    total = sh_off + 4 * 64

    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header += struct.pack("<HHIQQQIHHHHHH", 3, machine, 1, 0, ph_off, sh_off, 0, 64, ph_size, ph_num, 64, 4, 3)
    phdrs = struct.pack("<IIQQQQQQ", 1, 4, 0, 0, 0, total, total, 0x1000)  # PT_LOAD, whole file at 0
    phdrs += struct.pack("<IIQQQQQQ", 2, 6, dyn_off, dyn_off, dyn_off, len(dyn), len(dyn), 8)  # PT_DYNAMIC

    def shdr(name: int, typ: int, flags: int, off: int, size: int, link: int, align: int, entsize: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, typ, flags, off if flags else 0, off, size, link, 0, align, entsize)

    shdrs = bytes(64)
    shdrs += shdr(1, 3, 2, dynstr_off, len(dynstr), 0, 1, 0)    # .dynstr  SHT_STRTAB, ALLOC
    shdrs += shdr(9, 6, 3, dyn_off, len(dyn), 1, 8, 16)         # .dynamic SHT_DYNAMIC, WRITE|ALLOC
    shdrs += shdr(18, 3, 0, shstr_off, len(shstr), 0, 1, 0)     # .shstrtab
    out = bytearray(total)
    out[0:64] = header
    out[ph_off:ph_off + len(phdrs)] = phdrs
    out[dynstr_off:dynstr_off + len(dynstr)] = dynstr
    out[dyn_off:dyn_off + len(dyn)] = dyn
    out[shstr_off:shstr_off + len(shstr)] = shstr
    out[data_off:data_off + len(payload)] = payload
    out[sh_off:] = shdrs
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(out))
    return path


def ld_so_cache(entries: list[tuple[str, str, int]], *, old_format: bool = False) -> bytes:
    """A cache listing (name, path, flags) entries, as ldconfig writes them (names sorted by ldconfig's
    order is not needed by readers that scan every entry)."""
    strings = bytearray()
    offsets: list[tuple[int, int]] = []
    header_size = 48
    entries_size = 24 * len(entries)
    base = header_size + entries_size  # string offsets count from the new header's start
    for name, path, _flags in entries:
        k = base + len(strings)
        strings += name.encode() + b"\0"
        v = base + len(strings)
        strings += path.encode() + b"\0"
        offsets.append((k, v))
    new = b"glibc-ld.so.cache" + b"1.1"
    new += struct.pack("<IIB3xI12x", len(entries), len(strings), 2, 0)  # flags 2: little-endian
    assert len(new) == header_size
    for (_name, _path, flags), (k, v) in zip(entries, offsets, strict=True):
        new += struct.pack("<iIIIQ", flags, k, v, 0, 0)
    new += bytes(strings)
    if not old_format:
        return new
    old = b"ld.so-1.7.0" + b"\0" + struct.pack("<I", len(entries))
    old += b"".join(struct.pack("<iII", 1, 0, 0) for _ in entries)  # libc5-style entries: never read
    pad = (-len(old)) % 8
    return old + bytes(pad) + new
