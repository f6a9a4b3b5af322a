"""One real-runtime run per host at a time.

Runs on one host share what lies outside their temp dirs: ``/dev/nvidiactl`` and ``/dev/nvidia-uvm``
(made by the first run that needs them, and removed by it), the kubepods cgroup trees and
``/run/containerd``. Each run removes what it made, so a second run beside a first breaks both: its
pods fail with ``lstat /dev/nvidiactl: no such file or directory`` once the first run ends, and the
first reports the second's cgroups as leftovers. So the fake GPUs and containerd are made only under
this lock; a second run is refused at once, naming the holder.

The lock is a name in the abstract unix-socket namespace: nothing is left on disk, and the kernel frees
it when its holder dies, however it dies. A run is a process tree: takes nest within a process (the
fake GPUs, then containerd inside them), and a descendant of the holder is part of its run
(``gpuledger up --demo`` makes the fake GPUs and its simulator child starts containerd).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator

from libs.lifeline import command_line, parent_pid
from libs.unixsock import peer_credentials

__all__ = ["LOCK_NAME", "RuntimeBusy", "holder_pid", "holding", "release", "take"]

LOCK_NAME = "gpuledger-real-runtime"


class RuntimeBusy(RuntimeError):
    """Another process holds the host's real runtime."""


# name -> (its socket, or None under an ancestor's; how many takes)
_held: dict[str, tuple[socket.socket | None, int]] = {}


def _address(name: str) -> bytes:
    return b"\0" + name.encode()


def holder_pid(name: str = LOCK_NAME) -> int | None:
    """The pid of the process holding ``name``, None when nobody does (or it cannot be learned)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(_address(name))
        pid = peer_credentials(probe)[0]
    except OSError:
        return None
    finally:
        probe.close()
    return pid or None


def _is_ancestor(pid: int) -> bool:
    here = os.getppid()
    for _ in range(64):
        if here == pid:
            return True
        if here <= 1:
            return False
        here = parent_pid(here)
    return False


def _describe(pid: int | None) -> str:
    if pid is None:
        return "another process"
    cmd = " ".join(command_line(pid))
    return f"pid {pid}" + (f" ({cmd[:200]})" if cmd else "")


def take(name: str = LOCK_NAME) -> None:
    """Hold the host's real runtime (again, if this process already does); RuntimeBusy when another
    process holds it."""
    if name in _held:
        sock, depth = _held[name]
        _held[name] = (sock, depth + 1)
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_address(name))
        sock.listen(64)  # answers the question of who holds it (``holder_pid``)
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        holder = holder_pid(name)
        if holder is not None and _is_ancestor(holder):
            _held[name] = (None, 1)  # our run's: the ancestor lets go of the host, we only count
            return
        raise RuntimeBusy(
            f"another real-runtime run holds this host ({_describe(holder)}): runs share /dev/nvidiactl, "
            "the kubepods cgroups and /run/containerd, and each removes what it made; run one at a time"
        ) from None
    _held[name] = (sock, 1)  # Python's sockets are not inherited: a child cannot keep the host


def release(name: str = LOCK_NAME) -> None:
    """Let go of one ``take``; the host is free once every take of this process is let go."""
    if name not in _held:
        return
    sock, depth = _held[name]
    if depth > 1:
        _held[name] = (sock, depth - 1)
        return
    del _held[name]
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()


@contextlib.contextmanager
def holding(name: str = LOCK_NAME) -> Iterator[None]:
    take(name)
    try:
        yield
    finally:
        release(name)
