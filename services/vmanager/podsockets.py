"""One vcuda.sock per pod, at ``<vm_root>/<pod_uid>/vcuda.sock``; started once, stopped once.

Each pod's socket is a PeerGate (peergate.py: SO_PEERCRED + cgroup check), which answers the calls of
the callers it checked itself (grpcwire.py): ``methods`` says what each caller may call.

gpu-manager starts a new server on every PreStartContainer and leaves the previous one running on an
unlinked socket (gpu-manager-reference.md 5.2). Here ``ensure`` is idempotent: a pod has at most one
server, restarted only when its socket file disappeared. All changes go through one lock, and a pod
is only (re)started while the folded log says it still holds an allocation, so a prepare racing a
release can never leave a server behind.

The pod directory is bind-mounted into the pod's containers at /etc/vcuda. It is created once and
never recreated for a live pod (a new directory would be invisible behind the existing mounts). It
holds a spare container directory for the next container's first registration (``.spare``,
configfiles.py), made when the pod is first served and again each time a registration takes it.

A prepared DRA claim has a directory of its own, ``<vm_root>/<claim uid>``: its CDI spec mounts it in
every container of every pod that uses the claim (a CDI device is per claim, not per pod). Its gate
(``admit_for`` gives it) identifies each caller as its own pod and admits it only when that pod uses
the claim, so the peer-credential check holds for each pod sharing the claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from libs.grpcwire import Unary
from libs.logger import get_logger
from libs.unixsock import check_socket_path, file_identity
from services.vmanager.cleanup import remove_pod_dir
from services.vmanager.configfiles import has_spare, make_spare
from services.vmanager.names import is_pod_uid
from services.vmanager.peergate import Admission, Caller, Callers, PeerGate

__all__ = ["SOCKET_NAME", "PodGone", "PodPaths", "PodSockets"]

SOCKET_NAME = "vcuda.sock"
RESPARE_AFTER_S = 0.2

_logger = get_logger("vmanager")



class PodGone(LookupError):
    """The pod no longer holds any allocation: nothing to serve."""


@dataclass(frozen=True)
class PodPaths:
    directory: Path
    socket: Path


@dataclass
class _Running:
    server: PeerGate
    identity: tuple[int, int] | None  # of the socket file we listen on


class PodSockets:
    def __init__(
        self,
        vm_root: Path,
        methods: Callable[[Caller], dict[str, Unary]],
        holds_allocation: Callable[[str], bool],
        *,
        callers: Callers,
        proc_root: Path,
        on_prepare: Callable[[str, Path], None] | None = None,
        admit_for: Callable[[str], Admission | None] | None = None,
        on_served: Callable[[str], None] | None = None,
        on_unserved: Callable[[str], None] | None = None,
    ) -> None:
        self.vm_root = vm_root
        self.methods = methods  # what a checked caller may call on its pod's socket
        self.holds_allocation = holds_allocation
        self.callers = callers
        self.proc_root = proc_root
        self.on_prepare = on_prepare  # more per-pod files (hami-core cache directories), every time
        self.admit_for = admit_for  # a claim directory's admission of pods (None for a pod's own)
        # a pod's own socket started / stopped (namesahead.py watches its cgroup meanwhile)
        self.on_served, self.on_unserved = on_served, on_unserved
        self.servers: dict[str, _Running] = {}
        self._lock = asyncio.Lock()
        self._spares: set[asyncio.Task[None]] = set()  # respare_soon's

    def paths(self, pod_uid: str) -> PodPaths:
        if not is_pod_uid(pod_uid):
            raise ValueError(f"pod uid {pod_uid!r} is not a UUID")
        directory = self.vm_root / pod_uid
        return PodPaths(directory=directory, socket=directory / SOCKET_NAME)

    async def ensure(self, pod_uid: str) -> PodPaths:
        """The pod's directory and a listening socket, started now unless already running."""
        paths = self.paths(pod_uid)
        check_socket_path(paths.socket)
        async with self._lock:
            if not self.holds_allocation(pod_uid):
                raise PodGone(f"pod {pod_uid} holds no GPU allocation")
            running = self.servers.get(pod_uid)
            if running is not None and (running.identity is None
                                        or file_identity(paths.socket) != running.identity):
                _logger.warning("vcuda.sock vanished; restarting its server",
                             pod_uid=pod_uid, socket=str(paths.socket))
                await self._stop(pod_uid)
                running = None
            if running is None:
                await self._start(pod_uid, paths)
            if self.on_prepare is not None:
                self.on_prepare(pod_uid, paths.directory)
        return paths

    async def _start(self, pod_uid: str, paths: PodPaths) -> None:
        if paths.directory.is_symlink():
            raise ValueError(f"{paths.directory} is a symlink; refusing to serve a pod through it")
        paths.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(paths.directory, 0o755)
        with contextlib.suppress(FileNotFoundError):
            paths.socket.unlink()  # left by a previous run: nobody listens on it
        admit = self.admit_for(pod_uid) if self.admit_for is not None else None
        gate = PeerGate(pod_uid, paths.socket, self.methods, self.callers, self.proc_root, admit=admit)
        try:
            await gate.start()
        except BaseException:
            await gate.close()
            raise
        self.servers[pod_uid] = _Running(server=gate, identity=file_identity(paths.socket))
        _logger.info("serving vcuda.sock", pod_uid=pod_uid, socket=str(paths.socket))
        if admit is None and self.on_served is not None:
            self.on_served(pod_uid)
        await self._make_spare(paths.directory)

    def respare_soon(self, pod_uid: str) -> None:
        """A registration took the pod's spare container directory: make the next one in the
        background, a little later (not while the container that took it does its first work on the
        same disk), under the lock (a teardown never meets a spare being made)."""
        task = asyncio.ensure_future(self._respare(pod_uid))
        self._spares.add(task)
        task.add_done_callback(self._spares.discard)

    async def _respare(self, pod_uid: str) -> None:
        await asyncio.sleep(RESPARE_AFTER_S)
        async with self._lock:
            if pod_uid in self.servers:
                await self._make_spare(self.paths(pod_uid).directory)

    async def _make_spare(self, directory: Path) -> None:
        """A container's first registration takes it instead of making a directory and two files
        (configfiles.py: ``make_spare``); without one, it makes them."""
        if has_spare(directory):
            return
        try:
            await asyncio.to_thread(make_spare, directory)
        except (OSError, ValueError) as exc:
            _logger.warning("no spare container directory: the next registration makes its own",
                            directory=str(directory), error=str(exc))

    async def _stop(self, pod_uid: str) -> None:
        running = self.servers.pop(pod_uid, None)
        if running is not None:
            if self.on_unserved is not None:
                self.on_unserved(pod_uid)
            await running.server.close()

    async def teardown(self, pod_uid: str, *, unless_held: bool = False) -> bool:
        """Stop the pod's server and delete its directory (the pod holds nothing any more).

        ``unless_held``: do nothing when the pod holds an allocation again by now, checked under the
        same lock as ``ensure`` (a correction that emptied the pod may be followed by one filling it).
        """
        async with self._lock:
            if unless_held and self.holds_allocation(pod_uid):
                return False
            await self._stop(pod_uid)
            if await asyncio.to_thread(remove_pod_dir, self.vm_root, pod_uid):
                _logger.info("removed pod directory", pod_uid=pod_uid)
            return True

    async def retain(self, live: set[str]) -> None:
        """Tear down every running server whose pod is not in ``live``."""
        for pod_uid in [p for p in self.servers if p not in live]:
            await self.teardown(pod_uid)

    async def close(self, timeout: float = 5.0) -> None:
        """Stop every server; directories stay (the pods' containers still mount them). A prepare that
        still holds the lock gets ``timeout`` seconds to finish; the stop goes on without it after that."""
        held = False
        for task in list(self._spares):
            task.cancel()
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout)
            held = True
        except TimeoutError:
            _logger.error("vcuda.sock servers stopped while a prepare still held them", timeout=timeout)
        try:
            servers, self.servers = self.servers, {}
            await asyncio.gather(*(r.server.close() for r in servers.values()))
        finally:
            if held:
                self._lock.release()
