"""Child processes that die with their parent, and reading an exit status for a log line.

``gpuledger up`` starts every child in its own session (so a terminal's Ctrl-C reaches only the
launcher, which stops them in order). A session of its own also means a ``kill -9`` of the launcher
would leave the children running for good; the Linux parent-death signal (``prctl(PR_SET_PDEATHSIG)``,
set in the child between fork and exec) makes the kernel SIGKILL each child when the launcher goes,
however it goes. SIGKILL, not SIGTERM: it also ends a child that is frozen (SIGSTOP) at that moment,
and every service is built to survive a SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["describe_exit", "die_with_parent", "process_alive"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that arms the parent-death signal; None where Linux's prctl is missing.

    The signal fires when the *thread* that forked exits: fork from the thread that lives as long as
    the launcher (asyncio's loop thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def describe_exit(returncode: int | None) -> str:
    """``exit code 3`` or ``signal SIGKILL``: the cause of an exit, for a log line or a status file."""
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (someone else's process counts; a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purpose (its parent has not reaped it yet).
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True
