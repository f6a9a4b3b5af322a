"""The unix sockets the services listen on: the path limit, and telling a socket file from its replacement.

A kubelet restart deletes and recreates sockets; a cleanup can delete ours. Services notice by
comparing a file's identity with the one they recorded. Inode numbers alone are reused quickly after
a delete, so the identity is (inode, ctime).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["MAX_SOCKET_PATH", "SocketPathTooLong", "check_socket_path", "file_identity"]

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
