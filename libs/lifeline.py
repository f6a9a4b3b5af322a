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
import os
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["command_line", "describe_exit", "parent_pid", "process_alive", "start_in_own_session", "with_lifeline"]


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
    stat = _stat_after_name(pid)
    return not stat or stat[0] != "Z"


def parent_pid(pid: int) -> int:
    """``pid``'s parent, 0 when ``pid`` is gone."""
    stat = _stat_after_name(pid)
    return int(stat[1]) if stat else 0


def command_line(pid: int) -> list[str]:
    """``pid``'s argv, [] when it is gone (or a kernel thread)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _stat_after_name(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after ``pid (comm)`` (state, ppid, ...), [] when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []
