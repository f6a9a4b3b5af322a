"""Removing pod directories under the vm root: only ever ``<vm_root>/<pod uid>``, nothing else.

Entries that are not named like a pod UID (an operator's file, ``lost+found``) are never touched.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from services.vmanager.names import is_pod_uid

__all__ = ["remove_pod_dir", "scan_vm_root"]


def scan_vm_root(vm_root: Path) -> tuple[set[str], set[str]]:
    """(names that are pod UIDs, other names) of the entries directly under ``vm_root``."""
    try:
        names = os.listdir(vm_root)
    except FileNotFoundError:
        return set(), set()
    pods = {n for n in names if is_pod_uid(n)}
    return pods, set(names) - pods


def remove_pod_dir(vm_root: Path, pod_uid: str) -> bool:
    """Delete ``<vm_root>/<pod_uid>`` and everything in it; False when it was not there."""
    if not is_pod_uid(pod_uid):
        raise ValueError(f"refusing to remove {pod_uid!r}: not a pod UID")
    path = vm_root / pod_uid
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path)  # does not follow symlinks found inside
    else:
        os.unlink(path)  # a symlink (never followed) or a stray file
    return True
