"""The unix sockets the services listen on: the path limit, telling a socket file from its replacement,
and who is at the other end.

A kubelet restart deletes and recreates sockets; a cleanup can delete ours. Services notice by
comparing a file's identity with the one they recorded. Inode numbers alone are reused quickly after
a delete, so the identity is (inode, ctime).
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

__all__ = ["MAX_SOCKET_PATH", "SocketPathTooLong", "check_socket_path", "file_identity", "peer_credentials"]

MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


class SocketPathTooLong(ValueError):
    pass


def check_socket_path(path: Path) -> None:
    size = len(str(path).encode())
    if size > MAX_SOCKET_PATH:
        raise SocketPathTooLong(
            f"socket path {path} is too long: {size} bytes, unix sockets allow at most {MAX_SOCKET_PATH}; "
            "use a shorter directory"
        )


def file_identity(path: Path) -> tuple[int, int] | None:
    """(inode, ctime) of ``path`` itself (links are not followed), None when it does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected unix socket (``SO_PEERCRED``:
    the kernel's record, taken when the connection was made; pid 0 when it cannot be mapped here)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
