"""Bringing the vcuda.config files already written in a pod directory in line with the ledger.

An ``alloc.corrected`` event moves a grant to the container (or pod) that really holds its devices.
A container that registered before the correction has a vcuda.config with the guessed grant's
limits, or holds no grant at all any more. Each file names its container (the ``container_name``
field), whichever entry it sits in (container id or name), so the directory itself says what to fix:

- a container that still holds a grant gets the bytes registration would write now (atomically);
- a container that holds none loses its entry directory (its vcuda.config and pids.config);
- anything else (no vcuda.config, one of another size, a symlink) is left alone.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from libs.ledger.state import LedgerState
from libs.logger import get_logger
from libs.vcuda.config import SIZE, config_for, decode, encode
from services.vmanager.configfiles import CONFIG_NAME, container_dir, write_atomic

__all__ = ["Realigned", "realign_pod_dir", "wanted_configs"]

_logger = get_logger("vmanager")


@dataclass
class Realigned:
    rewritten: list[str] = field(default_factory=list)  # entries whose vcuda.config changed
    removed: list[str] = field(default_factory=list)    # entries of containers holding nothing


def wanted_configs(state: LedgerState, pod_uid: str) -> dict[str, bytes]:
    """Per container name of the pod, the vcuda.config its registration writes now (newest grant wins)."""
    driver = state.inventory.driver_version if state.inventory else ""
    out: dict[str, bytes] = {}
    for alloc in state.pod_allocations(pod_uid):  # oldest first: a later grant of a container overwrites
        try:
            out[alloc.container] = encode(config_for(alloc, container_name=alloc.container, driver_version=driver))
        except ValueError as exc:  # registration refuses it the same way; nothing to rewrite
            _logger.warning("cannot encode vcuda.config", pod_uid=pod_uid, container=alloc.container, error=str(exc))
    return out


def _written_for(path: Path) -> str | None:
    """The container a vcuda.config was written for; None when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(SIZE + 1)
    if len(data) != SIZE:
        return None
    return decode(data).container_name


def realign_pod_dir(pod_dir: Path, wanted: dict[str, bytes]) -> Realigned:
    """Rewrite or remove the pod's vcuda.config files that disagree with ``wanted`` (see above)."""
    done = Realigned()
    try:
        entries = sorted(os.listdir(pod_dir))
    except FileNotFoundError:
        return done
    for entry in entries:
        target = pod_dir / entry
        try:
            if not stat.S_ISDIR(os.lstat(target).st_mode):
                continue  # vcuda.sock, a symlink, a stray file
            container_dir(pod_dir, entry)
            name = _written_for(target / CONFIG_NAME)
            if name is None:
                continue
            if name not in wanted:
                shutil.rmtree(target)
                done.removed.append(entry)
            elif write_atomic(target / CONFIG_NAME, wanted[name], durable=False):
                done.rewritten.append(entry)
        except FileNotFoundError:
            continue  # removed meanwhile (the pod's teardown)
        except ValueError as exc:
            _logger.warning("leaving a container entry alone", path=str(target), error=str(exc))
    return done
