"""hami-core mode on the vmanager's side: the ld.so.preload file and each container's cache directory.

The allocator's response mounts ``<vm>/<pod uid>/_hami/<container>`` read-write at HAMi-core's
directory; it must exist before the container starts, so it is made whenever the pod is prepared
(every grant and every PreStartContainer), and it goes with the pod's directory.

Mode 0777: HAMi-core creates its cache file there as the container's user, which may be any uid.
Only that container mounts it; the pod directory above it stays 0755.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from libs.hami import CACHE_SUBDIR, preload_text
from libs.ledger.state import LedgerState
from libs.logger import get_logger
from services.vmanager.configfiles import write_atomic
from services.vmanager.names import is_container_name

__all__ = ["CacheDirs", "make_cache_dirs", "prepare_node", "write_preload"]

_logger = get_logger("vmanager")


def _mkdir(path: Path, mode: int) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if path.is_symlink() or not path.is_dir():
            raise ValueError(f"{path} exists and is not a directory") from None
    os.chmod(path, mode)  # mkdir's mode is filtered by the umask


def make_cache_dirs(pod_dir: Path, containers: Iterable[str]) -> list[Path]:
    base = pod_dir / CACHE_SUBDIR
    _mkdir(base, 0o755)
    made = []
    for name in sorted(set(containers)):
        if not is_container_name(name):
            raise ValueError(f"{name!r} is not a Kubernetes container name")
        _mkdir(base / name, 0o777)
        made.append(base / name)
    return made


def write_preload(path: Path, mount_dir: str) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, preload_text(mount_dir), mode=0o644)


def prepare_node(preload: Path, mount_dir: str, lock_dir: Path, library: Path) -> None:
    """What every hami-core container mounts from the host, made once at start: the preload file and
    the shared lock directory (sticky and world-writable like /tmp: HAMi-core locks there as any uid)."""
    write_preload(preload, mount_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(lock_dir, 0o1777)
    if not library.is_file():
        _logger.error("HAMi-core's library is missing: containers mounting it will fail to start",
                   hami_library=str(library))


class CacheDirs:
    """PodSockets' prepare hook: one cache directory per container holding an allocation."""

    def __init__(self, state: LedgerState) -> None:
        self.state = state

    def __call__(self, pod_uid: str, pod_dir: Path) -> None:
        claim = self.state.claim_refs.get(pod_uid)
        if claim is not None:  # a claim's directory: its response names the cache after the claim
            make_cache_dirs(pod_dir, [claim.name])
            return
        make_cache_dirs(pod_dir, [a.container for a in self.state.pod_allocations(pod_uid) if a.container])
