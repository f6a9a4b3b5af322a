"""Child processes that die with their parent, and reading an exit status for a log line.

``gpuledger up`` starts every child in its own session (so a terminal's Ctrl-C reaches only the
launcher, which stops them in order). A session of its own also means a ``kill -9`` of the launcher
would leave the children running for good; the Linux parent-death signal (``prctl(PR_SET_PDEATHSIG)``)
makes the kernel SIGKILL each child when the launcher goes, however it goes. SIGKILL, not SIGTERM: it
also ends a child that is frozen (SIGSTOP) at that moment, and every service is built to survive a
SIGKILL.

The child arms the signal itself, in a small Python program that then execs the real command (same
pid; the setting survives the exec): not in a ``preexec_fn``. A ``preexec_fn`` makes Python fork
instead of vfork, and a fork runs gRPC's fork handlers in a process whose gRPC threads are busy (the
node simulator's kubelet beside ``gpuledger up --demo``, the test suite, the benchmarks): about one
child start in ten died of SIGABRT or SIGSEGV before its exec (``Epoll1Poller ... epoll_wait error:
Bad file descriptor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["describe_exit", "process_alive", "start_in_own_session", "with_lifeline"]


# Runs as ``python -I -S -c`` (no site, no user paths: a few milliseconds): argv[1] the parent's
# pid, argv[2:] the command. PR_SET_PDEATHSIG is 1.
_ARM_THEN_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"  # the parent died before the signal was armed
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def with_lifeline(argv: list[str]) -> list[str]:
    """``argv`` started so that it dies with this process (the thread that starts it: start children
    from the thread that lives as long as this process, asyncio's loop thread). Unchanged where
    Linux's prctl is missing."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _ARM_THEN_EXEC, str(os.getpid()), *argv]


async def start_in_own_session(argv: list[str], **kwargs: Any) -> asyncio.subprocess.Process:
    """``argv`` in a session of its own, dying with this process (``with_lifeline``); ``kwargs`` go to
    ``asyncio.create_subprocess_exec`` (its streams, its environment)."""
    return await asyncio.create_subprocess_exec(*with_lifeline(argv), start_new_session=True, **kwargs)


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
