"""HAMi-core's host-side layout, shared by the allocator (which mounts it) and the vmanager (which makes it)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CACHE_SUBDIR", "LIBRARY_NAME", "cache_dir", "preload_text"]

CACHE_SUBDIR = "_hami"  # never a container id nor a container name: no clash with vcuda entries
LIBRARY_NAME = "libvgpu.so"


def cache_dir(vm_root: Path, pod_uid: str, container: str) -> Path:
    """The per-container directory holding HAMi-core's shared-region cache file."""
    return vm_root / pod_uid / CACHE_SUBDIR / container


def preload_text(mount_dir: str) -> bytes:
    """/etc/ld.so.preload for the container: the library, by its path inside the container."""
    return f"{mount_dir.rstrip('/')}/{LIBRARY_NAME}\n".encode()
