"""Driver volumes from a synthetic host: an NVIDIA driver install laid out as the installer does, its
ld.so.cache, and shared objects with real DT_SONAMEs (tests/builders/elf.py, no compiler)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libs.config import Settings
from services.vmanager.volumes import build_volumes, soname_of
from tests.builders.elf import FLAG_ELF_LIBC6, FLAG_I386, FLAG_X8664_LIB64, ld_so_cache, shared_object
from tests.vmanager.helpers import running_vmanager

VER = "550.54.15"
X64 = FLAG_ELF_LIBC6 | FLAG_X8664_LIB64
X32 = FLAG_ELF_LIBC6 | FLAG_I386


class Host:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.lib64 = root / "usr/lib/x86_64-linux-gnu"
        self.lib32 = root / "usr/lib/i386-linux-gnu"
        self.bin = root / "usr/bin"
        self.cache = root / "etc/ld.so.cache"
        self.entries: list[tuple[str, str, int]] = []

    def library(self, directory: Path, filename: str, soname: str, flags: int, *, dev_link: bool = True) -> Path:
        """The installer's file plus ldconfig's soname link (and the -dev unversioned link)."""
        path = shared_object(directory / filename, soname, payload=filename.encode())
        if soname != filename:
            (directory / soname).symlink_to(filename)
            self.entries.append((soname, str(directory / soname), flags))
        else:
            self.entries.append((soname, str(path), flags))
        unversioned = soname.split(".so")[0] + ".so"
        if dev_link and unversioned != soname:
            (directory / unversioned).symlink_to(soname)
            self.entries.append((unversioned, str(directory / unversioned), flags))
        return path

    def binary(self, name: str, executable: bool = True) -> Path:
        self.bin.mkdir(parents=True, exist_ok=True)
        path = self.bin / name
        path.write_text(f"#!/bin/sh\necho {name}\n")
        path.chmod(0o755 if executable else 0o644)
        return path

    def write_cache(self) -> Path:
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        self.cache.write_bytes(ld_so_cache(self.entries, old_format=True))
        return self.cache


@pytest.fixture
def host(workdir: Path) -> Host:
    h = Host(workdir / "host")
    h.library(h.lib64, f"libcuda.so.{VER}", "libcuda.so.1", X64)
    h.library(h.lib64, f"libnvidia-ml.so.{VER}", "libnvidia-ml.so.1", X64)
    h.library(h.lib64, f"libnvidia-ptxjitcompiler.so.{VER}", "libnvidia-ptxjitcompiler.so.1", X64, dev_link=False)
    h.library(h.lib64, f"libGLX_nvidia.so.{VER}", "libGLX_nvidia.so.0", X64, dev_link=False)
    h.library(h.lib64, "libcuda-control.so", "libcuda-control.so", X64)
    h.library(h.lib64, "libz.so.1.2.13", "libz.so.1", X64)  # not NVIDIA's: never mirrored
    h.library(h.lib32, f"libcuda.so.{VER}", "libcuda.so.1", X32)
    h.binary("nvidia-smi")
    h.binary("gpu-client")
    h.binary("nvidia-debugdump", executable=False)  # not executable: not a binary to mirror
    h.write_cache()
    return h


def listing(root: Path) -> dict[str, str]:
    """Every entry: 'file' or '-> target'."""
    out = {}
    for sub in sorted(os.listdir(root)):
        for name in sorted(os.listdir(root / sub)):
            p = root / sub / name
            out[f"{sub}/{name}"] = f"-> {os.readlink(p)}" if p.is_symlink() else "file"
    return out


def same(a: Path, b: Path) -> bool:
    return os.stat(a).st_ino == os.stat(b).st_ino


def test_sonames_are_read_with_pyelftools(host: Host) -> None:
    assert soname_of(host.lib64 / f"libcuda.so.{VER}") == "libcuda.so.1"
    assert soname_of(host.bin / "nvidia-smi") is None  # not an ELF file


def test_share_and_origin_volumes(workdir: Path, host: Host) -> None:
    vdriver = workdir / "vdriver"
    reports = build_volumes(vdriver, ld_cache=host.cache, bin_dirs=[host.root / "nope", host.bin], share_mode=True)
    assert listing(vdriver / "origin") == {
        "bin/nvidia-smi": "file",
        "lib/libcuda.so": f"-> libcuda.so.{VER}",
        "lib/libcuda.so.1": f"-> libcuda.so.{VER}",
        f"lib/libcuda.so.{VER}": "file",
        "lib64/libGLX_indirect.so.0": f"-> libGLX_nvidia.so.{VER}",
        "lib64/libGLX_nvidia.so": f"-> libGLX_nvidia.so.{VER}",
        "lib64/libGLX_nvidia.so.0": f"-> libGLX_nvidia.so.{VER}",
        f"lib64/libGLX_nvidia.so.{VER}": "file",
        "lib64/libcuda.so": f"-> libcuda.so.{VER}",
        "lib64/libcuda.so.1": f"-> libcuda.so.{VER}",
        f"lib64/libcuda.so.{VER}": "file",
        "lib64/libnvidia-ml.so": f"-> libnvidia-ml.so.{VER}",
        "lib64/libnvidia-ml.so.1": f"-> libnvidia-ml.so.{VER}",
        f"lib64/libnvidia-ml.so.{VER}": "file",
        "lib64/libnvidia-ptxjitcompiler.so": f"-> libnvidia-ptxjitcompiler.so.{VER}",
        "lib64/libnvidia-ptxjitcompiler.so.1": f"-> libnvidia-ptxjitcompiler.so.{VER}",
        f"lib64/libnvidia-ptxjitcompiler.so.{VER}": "file",
    }
    nvidia = listing(vdriver / "nvidia")
    assert nvidia == {
        **{k: v for k, v in listing(vdriver / "origin").items()
           if not k.startswith(("lib/libcuda.so", "lib64/libcuda.so", "lib64/libnvidia-ml.so"))},
        "bin/gpu-client": "file",
        f"lib/libcuda.so.{VER}": "file",  # 32-bit: only the real file, no name a program loads by
        "lib64/libcuda-control.so": "file",
        "lib64/libcuda.so": "file", "lib64/libcuda.so.1": "file", f"lib64/libcuda.so.{VER}": "file",
        "lib64/libnvidia-ml.so": "file", "lib64/libnvidia-ml.so.1": "file", f"lib64/libnvidia-ml.so.{VER}": "file",
    }
    control = host.lib64 / "libcuda-control.so"
    lib64 = vdriver / "nvidia" / "lib64"
    for name in ("libcuda.so", "libcuda.so.1", "libnvidia-ml.so", "libnvidia-ml.so.1", "libcuda-control.so"):
        assert same(lib64 / name, control), name  # hard links of the interception library
    assert same(lib64 / f"libcuda.so.{VER}", host.lib64 / f"libcuda.so.{VER}")  # the real one, for dlopen
    assert same(vdriver / "origin" / "lib64" / "libcuda.so.1", host.lib64 / f"libcuda.so.{VER}")
    assert [r.hooked for r in reports] == [[], ["lib64/libcuda.so.1", "lib64/libcuda.so", "lib64/libnvidia-ml.so.1",
                                                "lib64/libnvidia-ml.so"]]


def test_idempotent_in_place_and_stale_entries_go(workdir: Path, host: Host) -> None:
    vdriver = workdir / "vdriver"
    kw = {"ld_cache": host.cache, "bin_dirs": [host.bin], "share_mode": True}
    build_volumes(vdriver, **kw)  # type: ignore[arg-type]
    before = {p: os.lstat(p).st_ino for p in vdriver.rglob("*")}
    again = build_volumes(vdriver, **kw)  # type: ignore[arg-type]
    assert [(r.changed, r.removed) for r in again] == [(0, 0), (0, 0)]
    assert {p: os.lstat(p).st_ino for p in vdriver.rglob("*")} == before

    (vdriver / "origin" / "lib64" / "libold.so.1").write_text("left over")
    (host.lib64 / "libnvidia-ml.so.1").unlink()  # the driver was upgraded: ml moved
    host.entries = [e for e in host.entries if not e[0].startswith("libnvidia-ml")]
    host.write_cache()
    reports = build_volumes(vdriver, **kw)  # type: ignore[arg-type]
    origin = listing(vdriver / "origin")
    assert "lib64/libold.so.1" not in origin and not any("libnvidia-ml" in k for k in origin)
    assert reports[0].removed == 4  # libold + ml's file and its two links
    assert not list(vdriver.rglob(".*.tmp"))


def test_without_share_mode_nothing_is_hooked(workdir: Path, host: Host) -> None:
    vdriver = workdir / "vdriver"
    build_volumes(vdriver, ld_cache=host.cache, bin_dirs=[host.bin], share_mode=False)
    assert os.readlink(vdriver / "nvidia" / "lib64" / "libcuda.so.1") == f"libcuda.so.{VER}"


def test_share_volume_fails_closed_without_the_interception_library(workdir: Path, host: Host) -> None:
    host.entries = [e for e in host.entries if not e[0].startswith("libcuda-control")]
    host.write_cache()
    vdriver = workdir / "vdriver"
    build_volumes(vdriver, ld_cache=host.cache, bin_dirs=[host.bin], share_mode=True)
    names = os.listdir(vdriver / "nvidia" / "lib64")
    assert "libcuda.so.1" not in names and "libcuda.so" not in names and "libnvidia-ml.so.1" not in names
    assert os.path.exists(vdriver / "origin" / "lib64" / "libcuda.so.1")


def test_configured_interception_library(workdir: Path, host: Host) -> None:
    mine = shared_object(workdir / "opt" / "libcuda-control.so", "libcuda-control.so", payload=b"v2")
    vdriver = workdir / "vdriver"
    build_volumes(vdriver, ld_cache=host.cache, bin_dirs=[host.bin], share_mode=True, control_library=mine)
    assert same(vdriver / "nvidia" / "lib64" / "libcuda.so.1", mine)
    with pytest.raises(FileNotFoundError):
        build_volumes(vdriver, ld_cache=host.cache, bin_dirs=[], share_mode=True,
                      control_library=workdir / "missing.so")


async def test_vmanager_builds_them_at_start(settings: Settings, workdir: Path, host: Host, ledger: object) -> None:
    s = settings.replace(driver_volumes=True, ld_cache=str(host.cache), driver_bin_dirs=str(host.bin),
                         vdriver_dir=str(workdir / "vd"))
    async with running_vmanager(s):
        assert same(workdir / "vd" / "nvidia" / "lib64" / "libcuda.so.1", host.lib64 / "libcuda-control.so")
        assert (workdir / "vd" / "origin" / "bin" / "nvidia-smi").is_file()
    # A missing cache is logged, not fatal.
    async with running_vmanager(s.replace(ld_cache=str(workdir / "none"))):
        pass
