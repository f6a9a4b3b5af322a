"""Writing a container's vcuda.config: inside its pod directory only, atomically, only when it changed.

The CUDA library reads the file with one ``read()`` at any moment, so a reader must see either the
old bytes or the new ones: write a temporary file next to it, then ``os.replace``. A container's
vcuda.config and pids.config are not fsynced: they are derived from the log and rewritten by every
registration, which the library makes before it reads them, and a host crash that could lose them
also ends every process that read them (their restarted containers register again). Files read
without a registration first (HAMi's ld.so.preload) are written durably (``durable=True``).

A container's first registration makes a directory and two files: on some filesystems three new
inodes are most of what the registration costs (about 0.2 ms each on ext4 here, more while the
runtime starts containers). So each pod directory holds a spare one, made ahead (``make_spare``),
which that registration takes by one rename (``take_spare``) and fills.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CONFIG_NAME", "PIDS_NAME", "SPARE_NAME", "StagedFiles", "container_dir", "has_spare", "make_spare",
           "take_spare", "write_atomic", "write_container_config", "write_container_files"]

CONFIG_NAME = "vcuda.config"
PIDS_NAME = "pids.config"


def _child(pod_dir: Path, entry: str) -> Path:
    """``<pod_dir>/<entry>``, refused unless ``entry`` is a plain name."""
    target = pod_dir / entry
    # Defence in depth: callers validated ``entry`` already; re-check the path they would write to.
    if target.name != entry or target.parent != pod_dir or entry in ("", ".", ".."):
        raise ValueError(f"{entry!r} is not a plain directory name")
    return target


def container_dir(pod_dir: Path, entry: str) -> Path:
    """``<pod_dir>/<entry>``, refused unless it is (and resolves to) a direct child of ``pod_dir``."""
    target = _child(pod_dir, entry)
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
    _check_names(files)
    target = _make_container_dir(pod_dir, entry)
    return {name: write_atomic(target / name, data, durable=False) for name, data in files.items()}


class StagedFiles:
    """A container directory with one empty temporary file per name in it, made before they are needed
    (``make_spare``, ``take_spare``): on some filesystems a new inode is most of what writing the files
    costs. ``commit`` writes each file into its temporary and renames it into place (atomic, as
    ``write_atomic``); ``discard`` removes what was not used, and the directory when nothing was
    committed into it."""

    def __init__(self, directory: Path, temps: dict[str, Path]) -> None:
        self.directory = directory
        self._temps = temps
        self._committed = False

    def commit(self, files: dict[str, bytes]) -> dict[str, bool]:
        """Write each file (each one staged), in order; all of them are new."""
        missing = set(files) - set(self._temps)
        if missing:
            raise ValueError(f"no staged file for {sorted(missing)}")
        for name, data in files.items():
            tmp = self._temps.pop(name)
            fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)  # made readable by all (make_spare)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, self.directory / name)
            self._committed = True
        return dict.fromkeys(files, True)

    def discard(self) -> None:
        for tmp in self._temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._temps.clear()
        if not self._committed:
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)


# In a pod's directory: a container directory made ahead, with its two files, for the next first
# registration (a new container, or a restarted one: a new id) to take by one rename.
SPARE_NAME = ".spare"
_SPARE_FILES = (PIDS_NAME, CONFIG_NAME)


def _temp_name(name: str) -> str:
    return f".{name}.tmp"


def has_spare(pod_dir: Path) -> bool:
    return os.path.lexists(pod_dir / SPARE_NAME)


def make_spare(pod_dir: Path) -> bool:
    """Make the pod's spare container directory, unless it has one; whether one was made. It is
    built under a name of its own and renamed into place whole, so a taker never sees half of it.
    FileNotFoundError when the pod's directory is gone."""
    if has_spare(pod_dir):
        return False
    building = Path(tempfile.mkdtemp(prefix=f"{SPARE_NAME}.", dir=pod_dir))
    try:
        os.chmod(building, 0o755)
        for name in _SPARE_FILES:
            fd = os.open(building / _temp_name(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fchmod(fd, 0o644)  # readable by the container's user, whoever it is (not the umask's)
            finally:
                os.close(fd)
        os.rename(building, pod_dir / SPARE_NAME)  # fails when a spare (never empty) appeared meanwhile
    except OSError:
        shutil.rmtree(building, ignore_errors=True)
        if has_spare(pod_dir):
            return False
        raise
    return True


def take_spare(pod_dir: Path, entry: str) -> StagedFiles | None:
    """``<pod_dir>/<entry>`` made from the pod's spare, ready for ``commit``; None when there is no
    spare or ``entry`` is there already (not a first registration: ``write_container_files``)."""
    # No realpath here (four of them were a third of a first registration's file work): a plain name
    # that the spare, a real directory, was renamed to is a directory inside ``pod_dir`` (a rename
    # onto a symlink or a file fails), which the lstat below confirms.
    target = _child(pod_dir, entry)
    if os.path.lexists(target):
        return None
    try:
        os.rename(pod_dir / SPARE_NAME, target)
    except OSError:  # no spare; or a writer made ``entry`` meanwhile, and wrote into it
        return None
    if not stat.S_ISDIR(os.lstat(target).st_mode):  # nothing is written or removed through it
        raise ValueError(f"{target} is not a directory")
    return StagedFiles(target, {name: target / _temp_name(name) for name in _SPARE_FILES})


def _check_names(names: Iterable[str]) -> None:
    if any(name not in (CONFIG_NAME, PIDS_NAME) for name in names):
        raise ValueError(f"unexpected container file names {sorted(names)}")


def _make_container_dir(pod_dir: Path, entry: str) -> Path:
    """``<pod_dir>/<entry>``, made when missing, a directory inside ``pod_dir``."""
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
    return target


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
