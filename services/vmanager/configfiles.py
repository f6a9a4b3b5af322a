"""Writing a container's vcuda.config: inside its pod directory only, atomically, only when it changed.

The CUDA library reads the file with one ``read()`` at any moment, so a reader must see either the
old bytes or the new ones: write a temporary file next to it, then ``os.replace``. A container's
vcuda.config and pids.config are not fsynced: they are derived from the log and rewritten by every
registration, which the library makes before it reads them, and a host crash that could lose them
also ends every process that read them (their restarted containers register again). Files read
without a registration first (HAMi's ld.so.preload) are written durably (``durable=True``).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["CONFIG_NAME", "PIDS_NAME", "container_dir", "write_atomic", "write_container_config",
           "write_container_files"]

CONFIG_NAME = "vcuda.config"
PIDS_NAME = "pids.config"


def container_dir(pod_dir: Path, entry: str) -> Path:
    """``<pod_dir>/<entry>``, refused unless it is (and resolves to) a direct child of ``pod_dir``."""
    target = pod_dir / entry
    # Defence in depth: callers validated ``entry`` already; re-check the path they would write to.
    if target.name != entry or target.parent != pod_dir or entry in ("", ".", ".."):
        raise ValueError(f"{entry!r} is not a plain directory name")
    if Path(os.path.realpath(target)).parent != Path(os.path.realpath(pod_dir)):
        raise ValueError(f"{target} does not resolve to a directory inside {pod_dir}")
    return target


def write_container_config(pod_dir: Path, entry: str, data: bytes) -> bool:
    """Write ``<pod_dir>/<entry>/vcuda.config``; False when it already held exactly ``data``."""
    return write_container_files(pod_dir, entry, {CONFIG_NAME: data})[CONFIG_NAME]


def write_container_files(pod_dir: Path, entry: str, files: dict[str, bytes]) -> dict[str, bool]:
    """Write each ``<pod_dir>/<entry>/<name>`` in order; per name, whether it changed.

    The pod directory must exist (it is created with the pod's socket): a container directory is
    never created for a pod that is not being served.
    """
    if any(name not in (CONFIG_NAME, PIDS_NAME) for name in files):
        raise ValueError(f"unexpected container file names {sorted(files)}")
    target = container_dir(pod_dir, entry)
    try:
        os.mkdir(target, 0o755)
        os.chmod(target, 0o755)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        pass
    info = os.lstat(target)
    if not stat.S_ISDIR(info.st_mode):  # a symlink or a file where the directory should be
        raise ValueError(f"{target} exists and is not a directory")
    container_dir(pod_dir, entry)  # still inside, now that it exists
    return {name: write_atomic(target / name, data, durable=False) for name, data in files.items()}


def _current(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, OSError):
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> bool:
    """Replace ``path`` with ``data`` atomically; skip (False) when the bytes are already there.
    ``durable``: fsync the file and the directory, so that the new bytes survive a host crash."""
    if _current(path) == data:
        return False
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)  # readable by the container's user, whoever it is
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if not durable:
        return True
    # The rename itself must survive a crash too.
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return True
