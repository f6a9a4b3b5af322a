"""Driver volumes: the host's NVIDIA binaries and libraries mirrored into ``<vdriver>/origin`` and ``/nvidia``.

Allocate responses mount one of them at /usr/local/nvidia (``LD_LIBRARY_PATH=/usr/local/nvidia/lib64``):
``origin`` (pristine) for whole GPUs, ``nvidia`` for fractional ones, where the CUDA driver and NVML
sonames are gpu-manager's interception library (gpu-manager-reference.md 5.7, 6.1):

- libraries are found through the host's ld.so.cache (ldcache.py): every ELF entry whose name starts
  with one of the prefixes below, resolved through symlinks -> ``lib64/`` (64-bit) or ``lib/`` (32-bit);
- binaries are searched in the configured directories -> ``bin/``;
- each file is hard-linked (a copy, keeping mode and mtime, across file systems); its DT_SONAME
  (read with pyelftools) gets relative links ``<soname> -> file`` and ``<soname without the
  version> -> file`` (``libcuda.so.1``, ``libcuda.so``); ``libGLX_nvidia*`` also ``libGLX_indirect.so.0``;
- in share mode, in ``nvidia/lib64``, ``libcuda.so.1``, ``libcuda.so``, ``libnvidia-ml.so.1`` and
  ``libnvidia-ml.so`` are the interception library itself; the versioned real files stay (the
  library ``dlopen``s ``libcuda.so.<version>``). In ``nvidia/lib`` (32-bit) those names are left out:
  the 64-bit interception library cannot serve 32-bit programs, and the real one would be unlimited.
  Without an interception library the share volume has no CUDA driver names at all (fail closed).

The build is idempotent and in place: files already right are left alone, changed ones replaced
atomically, stale ones removed, so containers that already mount a volume keep a consistent view.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from libs.config import Settings
from libs.logger import get_logger
from services.vmanager.ldcache import CacheEntry, LdCacheError, read_ld_cache

__all__ = ["VolumeReport", "build_from_settings", "build_volumes", "plan_libraries", "soname_of"]

_logger = get_logger("vmanager")

BINARIES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server", "nvidia-debugdump", "nvidia-persistenced",
            "nvidia-smi")
SHARE_BINARIES = ("gpu-client",)  # the in-container client the interception library executes
LIBRARY_PREFIXES = (
    "libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so", "libnvidia-fatbinaryloader.so",
    "libnvidia-opencl.so", "libnvidia-compiler.so", "libnvidia-nvvm.so", "libnvidia-allocator.so",
    "libnvidia-cfg.so", "libnvcuvid.so", "libnvidia-encode.so", "libnvidia-opticalflow.so",
    "libnvidia-fbc.so", "libnvidia-ifr.so", "libvdpau_nvidia.so", "libGLX_nvidia.so", "libEGL_nvidia.so",
    "libGLESv2_nvidia.so", "libGLESv1_CM_nvidia.so", "libnvidia-eglcore.so", "libnvidia-egl-wayland.so",
    "libnvidia-glcore.so", "libnvidia-tls.so", "libnvidia-glsi.so", "libnvidia-glvkspirv.so",
    "libnvidia-rtcore.so", "libnvoptix.so",
)
CONTROL_PREFIX = "libcuda-control.so"
SHARE_EXTRA_PREFIXES = (CONTROL_PREFIX, "libnvidia-gpucomp.so")
HOOKED = ("libcuda.so", "libnvidia-ml.so")  # whose sonames the interception library takes over
HOOKED_NAMES = ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so")
_VERSION_TAIL = re.compile(r"(\.[0-9]+)+$")


def soname_of(path: Path) -> str | None:
    """DT_SONAME of a shared object (from PT_DYNAMIC, as the loader reads it, else .dynamic)."""
    # pyelftools (with the pdb it imports, about 2.6 MB resident) only where a driver library is read:
    # a node without NVIDIA libraries, or with driver volumes off, never loads it.
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            for seg in elf.iter_segments():
                if seg["p_type"] == "PT_DYNAMIC":
                    for tag in seg.iter_tags("DT_SONAME"):
                        return str(tag.soname)
            section = elf.get_section_by_name(".dynamic")
            if section is not None:
                for tag in section.iter_tags("DT_SONAME"):  # type: ignore[attr-defined]
                    return str(tag.soname)
    except (ELFError, OSError, ValueError, KeyError) as exc:
        _logger.warning("cannot read a library's soname", path=str(path), error=str(exc))
    return None


def plan_libraries(entries: Iterable[CacheEntry], prefixes: Sequence[str]) -> dict[str, Path]:
    """``lib64/<file>`` / ``lib/<file>`` -> the real file, for the cache entries with those prefixes."""
    out: dict[str, Path] = {}
    for entry in entries:
        bits = entry.bits
        if bits is None or not entry.name.startswith(tuple(prefixes)):
            continue
        real = Path(os.path.realpath(entry.path))
        if not real.is_file():
            continue
        out.setdefault(f"{'lib64' if bits == 64 else 'lib'}/{real.name}", real)
    return out


def plan_binaries(names: Sequence[str], search: Sequence[Path]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for name in names:
        for directory in search:
            candidate = directory / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                out[f"bin/{name}"] = Path(os.path.realpath(candidate))
                break
    return out


def _unversioned(soname: str) -> str:
    return _VERSION_TAIL.sub("", soname)


def _same(dst: Path, src: Path) -> bool:
    try:
        if dst.is_symlink():
            return False
        if os.path.samefile(dst, src):
            return True
        a, b = os.stat(dst), os.stat(src)
        return a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns and a.st_mode == b.st_mode
    except OSError:
        return False


def _place_file(dst: Path, src: Path) -> bool:
    if _same(dst, src):
        return False
    tmp = dst.with_name(f".{dst.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.link(src, tmp)
    except OSError:  # another file system, or links not allowed: a copy keeping mode and mtime
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)
    return True


def _place_link(dst: Path, target: str) -> bool:
    if dst.is_symlink() and os.readlink(dst) == target:
        return False
    tmp = dst.with_name(f".{dst.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, dst)
    return True


@dataclass
class VolumeReport:
    name: str
    files: int = 0
    links: int = 0
    changed: int = 0
    removed: int = 0
    hooked: list[str] = field(default_factory=list)


def _sync_volume(root: Path, files: dict[str, Path], links: dict[str, str], report: VolumeReport) -> None:
    for sub in ("bin", "lib", "lib64"):
        (root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(root / sub, 0o755)
    wanted = set(files) | set(links)
    for rel, src in sorted(files.items()):
        report.changed += _place_file(root / rel, src)
    for rel, target in sorted(links.items()):
        report.changed += _place_link(root / rel, target)
    for sub in ("bin", "lib", "lib64"):
        for name in sorted(os.listdir(root / sub)):
            if f"{sub}/{name}" not in wanted:
                path = root / sub / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
                report.removed += 1
    report.files, report.links = len(files), len(links)


def _volume(
    root: Path, name: str, files: dict[str, Path], *, control: Path | None, hook: bool
) -> VolumeReport:
    report = VolumeReport(name=name)
    links: dict[str, str] = {}
    for rel, src in files.items():
        sub, filename = rel.split("/", 1)
        if sub == "bin":
            continue
        soname = soname_of(src)
        names = set()
        if soname and soname != filename:
            names.add(soname)
        if soname and _unversioned(soname) != filename:
            names.add(_unversioned(soname))
        if filename.startswith("libGLX_nvidia"):
            names.add("libGLX_indirect.so.0")
        for n in names:
            links.setdefault(f"{sub}/{n}", filename)
    files = dict(files)
    if hook:
        for rel in [r for r in links if r.split("/", 1)[1].startswith(HOOKED)]:
            del links[rel]
        if control is not None:
            for name in HOOKED_NAMES:
                files[f"lib64/{name}"] = control  # the interception library under the driver's names
                report.hooked.append(f"lib64/{name}")
    _sync_volume(root, files, links, report)
    return report


def build_volumes(
    vdriver_root: Path, *, ld_cache: Path, bin_dirs: Sequence[Path], share_mode: bool,
    control_library: Path | None = None,
) -> list[VolumeReport]:
    """Build (or bring up to date) ``<vdriver_root>/origin`` and ``<vdriver_root>/nvidia``."""
    entries = read_ld_cache(ld_cache)
    origin_files = {**plan_binaries(BINARIES, bin_dirs), **plan_libraries(entries, LIBRARY_PREFIXES)}
    share_files = {**plan_binaries(BINARIES + SHARE_BINARIES, bin_dirs),
                   **plan_libraries(entries, LIBRARY_PREFIXES + SHARE_EXTRA_PREFIXES)}
    control = control_library
    if control is None:
        control = next((src for rel, src in share_files.items()
                        if rel.startswith("lib64/") and src.name.startswith(CONTROL_PREFIX)), None)
    elif not control.is_file():
        raise FileNotFoundError(f"the interception library {control} does not exist")
    if control is not None:
        share_files[f"lib64/{CONTROL_PREFIX}"] = Path(os.path.realpath(control))
    vdriver_root.mkdir(parents=True, exist_ok=True)
    reports = [
        _volume(vdriver_root / "origin", "origin", origin_files, control=None, hook=False),
        _volume(vdriver_root / "nvidia", "nvidia", share_files, control=control, hook=share_mode),
    ]
    if share_mode and control is None:
        _logger.error("no libcuda-control.so found: the share volume has no CUDA driver, so fractional "
                   "containers fail to load CUDA instead of running unlimited",
                   ld_cache=str(ld_cache))
    return reports


def build_from_settings(settings: Settings) -> list[VolumeReport] | None:
    """The vmanager's start-up build; a host without a readable cache or NVIDIA libraries is logged,
    not fatal (fake GPUs, or a node being set up): the volumes are then built on the next start."""
    ld_cache = Path(settings.ld_cache)
    if not ld_cache.is_file():
        _logger.warning("no ld.so.cache: driver volumes not built", ld_cache=str(ld_cache))
        return None
    control = Path(settings.vcuda_control_library) if settings.vcuda_control_library else None
    try:
        reports = build_volumes(
            settings.vdriver_root, ld_cache=ld_cache,
            bin_dirs=[Path(d) for d in settings.driver_bin_dirs.split(":") if d],
            share_mode=settings.share_mode, control_library=control,
        )
    except (OSError, LdCacheError) as exc:
        _logger.error("cannot build the driver volumes", vdriver=str(settings.vdriver_root), error=str(exc))
        return None
    for r in reports:
        _logger.info("driver volume ready", volume=r.name, files=r.files, links=r.links, changed=r.changed,
                  removed=r.removed, hooked=r.hooked)
    return reports
