"""Who is calling a pod's vcuda.sock: SO_PEERCRED, then the caller's cgroup must be one of that pod's.

gRPC's Python server does not expose the peer's credentials on a unix socket (``context.peer()`` is
``"unix:"``, the auth context has no pid), so each pod's vcuda.sock is a small asyncio listener:

1. accept, read ``SO_PEERCRED`` (pid, uid, gid; the kernel's record of the connecting process);
2. read ``<proc_root>/<pid>/cgroup`` and find the pod (and container) it names (libs/cgroups.py);
3. answer the connection's gRPC calls in the same task (grpcwire.py), each told the verdict.

A refused caller gets a clear PERMISSION_DENIED instead of a dropped connection, and the refusal is
logged once with the caller's pid and cgroup. No other socket leads to the calls: there is no
private server to reach around the gate.

The pid is meaningful only in the vmanager's pid namespace: the vmanager runs with hostPID (as
gpu-manager does); a caller whose pid the kernel cannot map (pid 0) is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from libs.cgroups import AmbiguousCgroup, CgroupOwner, owner_of_process
from libs.grpcwire import Unary, serve_unary
from libs.logger import get_logger
from libs.runtime import discard
from libs.unixsock import peer_credentials

__all__ = ["SOCKET_MODE", "Admission", "Caller", "Callers", "PeerGate", "check_caller"]

# A claim socket's question about a caller's pod: None when the pod uses the claim, else why not.
Admission = Callable[[str], Awaitable[str | None]]

_logger = get_logger("vmanager")

# Connecting to a unix socket needs write permission on it; containers run as any uid. Who may
# actually talk is decided by the cgroup check, not by the mode.
SOCKET_MODE = 0o666
MAX_MESSAGE = 64 * 1024  # a VDeviceRequest is a few hundred bytes


@dataclass(frozen=True)
class Caller:
    pod_uid: str  # the caller's pod (a pod's socket admits only that pod)
    pid: int
    uid: int
    owner: CgroupOwner | None
    refusal: str | None = None
    served: str = ""  # the directory whose socket was called: the pod's, or a shared claim's
    # What ``Callers``' look-ahead started for this connection (it lasts as long as the connection).
    ahead: asyncio.Future[Any] | None = field(default=None, compare=False, repr=False)

    @property
    def directory_name(self) -> str:
        return self.served or self.pod_uid


class Callers:
    """The verdicts of the connections open now, and what is looked up ahead for each.

    ``look_ahead`` may start work for a caller as soon as the gate has checked it, so that it runs
    while the caller's request is still on its way; it lasts as long as the connection."""

    def __init__(self, look_ahead: Callable[[Caller], asyncio.Future[Any] | None] | None = None) -> None:
        self._open: dict[int, Caller] = {}
        self._look_ahead = look_ahead

    def admitted(self, caller: Caller) -> Caller:
        """The caller, with what was started ahead for it; ``done`` when its connection closes."""
        started = self._look_ahead(caller) if self._look_ahead is not None else None
        caller = caller if started is None else replace(caller, ahead=started)
        self._open[id(caller)] = caller
        return caller

    def done(self, caller: Caller) -> None:
        if self._open.pop(id(caller), None) is not None and caller.ahead is not None:
            discard(caller.ahead)

    def __len__(self) -> int:
        return len(self._open)


def check_caller(proc_root: Path, pod_uid: str, pid: int, uid: int, *, any_pod: bool = False) -> Caller:
    """The caller of ``pod_uid``'s socket, refused unless its cgroup is that pod's. ``any_pod``: the
    socket of a claim's directory (``pod_uid`` names the claim), where any pod's process is identified
    as its own pod and the gate then asks whether that pod uses the claim."""
    def refuse(why: str, owner: CgroupOwner | None = None) -> Caller:
        return Caller(pod_uid=pod_uid, pid=pid, uid=uid, owner=owner, refusal=why, served=pod_uid)

    if pid <= 0:
        return refuse("the caller's pid is not visible here (run the vmanager with the host's pid namespace)")
    try:
        owner = owner_of_process(proc_root, pid)
    except FileNotFoundError:
        return refuse(f"caller pid {pid} has no {proc_root}/{pid}/cgroup (process gone?)")
    except (AmbiguousCgroup, OSError, UnicodeDecodeError) as exc:
        return refuse(f"caller pid {pid}: {exc}")
    if any_pod and owner.pod_uid:
        return Caller(pod_uid=owner.pod_uid, pid=pid, uid=uid, owner=owner, served=pod_uid)
    if owner.pod_uid != pod_uid:
        where = f"pod {owner.pod_uid}" if owner.pod_uid else "no pod"
        serves = f"claim {pod_uid}" if any_pod else f"pod {pod_uid}"
        return refuse(f"caller pid {pid} is in {where} (cgroup {owner.path!r}); this socket serves {serves}",
                      owner)
    return Caller(pod_uid=pod_uid, pid=pid, uid=uid, owner=owner, served=pod_uid)


class PeerGate:
    """One pod's vcuda.sock: checks every connection, then answers its calls (``methods``, told the
    verdict: they refuse a refused caller)."""

    def __init__(self, pod_uid: str, path: Path, methods: Callable[[Caller], dict[str, Unary]], callers: Callers,
                 proc_root: Path, admit: Admission | None = None) -> None:
        self.pod_uid = pod_uid
        self.admit = admit  # a shared claim's directory: which pods may call (None: only pod_uid)
        self.path = path
        self.methods = methods
        self.callers = callers
        self.proc_root = proc_root
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accepted, path=str(self.path), backlog=64)
        os.chmod(self.path, SOCKET_MODE)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            pass  # close() ends open connections; asyncio would report the cancelled callback as an error
        finally:
            self._tasks.discard(task)
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid, _gid = peer_credentials(writer.get_extra_info("socket"))
        # On the loop: one small procfs read (memory, never the disk), cheaper than a thread hand-off.
        caller = check_caller(self.proc_root, self.pod_uid, pid, uid, any_pod=self.admit is not None)
        if self.admit is not None and caller.refusal is None:
            refusal = await self.admit(caller.pod_uid)
            if refusal:
                caller = replace(caller, refusal=f"caller pid {pid} is in pod {caller.pod_uid}: {refusal}")
        if caller.refusal:
            _logger.warning("vcuda.sock caller refused", pod_uid=self.pod_uid, pid=pid, uid=uid, reason=caller.refusal)
        caller = self.callers.admitted(caller)
        try:
            await serve_unary(reader, writer, self.methods(caller), limit=MAX_MESSAGE)
        except (ConnectionError, OSError):
            pass  # the caller went away
        finally:
            self.callers.done(caller)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
