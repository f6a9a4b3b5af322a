"""RegisterVDevice: a container's process asks for its limits, the vmanager writes its two files.

The only vmanager module that speaks the vcuda proto. Every call arrives through a PeerGate
(peergate.py), which already checked that the calling process is in that pod's cgroup (or, on a shared
claim's socket, in a pod that uses the claim); the request can only ever write under the socket's
directory:

- ``pod_uid`` must be the caller's pod;
- exactly one of ``container_id`` (current library) or ``container_name`` (legacy), each checked
  against the form runtimes / Kubernetes produce; an id must be the caller's own container when
  its cgroup names one;
- the container (by name, or by id via the CRI runtime or the watchdog's pod status) must hold an
  allocation in the folded log; its limits become ``<pod dir>/<id or name>/vcuda.config``;
- ``<pod dir>/<id or name>/pids.config``: the container's host pids from its cgroup (libs/cgroups.py),
  rewritten on every registration (each new CUDA process registers), written before vcuda.config.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, NamedTuple

from google.protobuf.message import DecodeError

from libs.cgroups import encode_pids, find_container_cgroup, read_pids
from libs.grpcwire import CallFailed, Status, Unary
from libs.ledger.state import CLAIM_PREFIX, Allocation, LedgerState, claim_alloc_id
from libs.logger import get_logger
from libs.vcuda import api_pb2 as pb
from libs.vcuda.config import config_for, encode
from services.vmanager.configfiles import CONFIG_NAME, PIDS_NAME, has_spare, take_spare, write_container_files
from services.vmanager.containers import ContainerNames, ContainerRef, ContainerUnknown, WatchdogUnavailable
from services.vmanager.names import is_container_id, is_container_name, is_pod_uid
from services.vmanager.peergate import Caller

if TYPE_CHECKING:
    from services.vmanager.namesahead import NamesAhead

__all__ = ["REGISTER_PATH", "Bound", "RegisterError", "VDeviceRegistrations", "VcudaMethods"]

_logger = get_logger("vmanager")

_SERVICE = pb.DESCRIPTOR.services_by_name["VCUDAService"]
REGISTER_PATH = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['RegisterVDevice'].name}"
_EMPTY_RESPONSE = pb.VDeviceResponse().SerializeToString()

# Keep a little of the caller's deadline to write the file and answer.
_DEADLINE_MARGIN = 0.5


class Bound(NamedTuple):
    entry: str  # the directory written under the pod's: the container id, or the legacy name
    name: str  # the Kubernetes container name
    changed: bool  # vcuda.config was (re)written
    pids: int  # pids in pids.config
    via: str  # who named the container: runtime, watchdog, or the request itself (legacy)


class RegisterError(CallFailed):
    """A registration refused: its gRPC status and the message the caller reads."""


def _invalid(message: str) -> RegisterError:
    return RegisterError(Status.INVALID_ARGUMENT, message)


class VDeviceRegistrations:
    """Container registrations of virtual devices: each checked against the caller and the folded log,
    then written as the container's vcuda.config and pids.config."""

    def __init__(
        self, state: LedgerState, names: ContainerNames, *, lookup_patience: float, cgroup_root: Path,
        ahead: NamesAhead | None = None,
    ) -> None:
        self.state = state
        self.names = names
        self.lookup_patience = lookup_patience
        self.cgroup_root = cgroup_root
        # Names asked of the runtime as containers' cgroups appear (namesahead.py), when it runs.
        self.ahead = ahead
        # Told the directory whose spare a registration took (PodSockets.respare_soon makes the next).
        self.on_spare_taken: Callable[[str], None] | None = None

    def allocation_of(self, pod_uid: str, container: str, *, claim_uid: str = "") -> Allocation | None:
        """The grant whose limits the container gets: through a claim's directory (``claim_uid``) the
        claim's, for any container of a pod the gate admitted; else the pod's own."""
        if claim_uid:
            return self.state.allocations.get(claim_alloc_id(claim_uid))
        held = [a for a in self.state.pod_allocations(pod_uid) if a.container == container]
        if not held:
            # A DRA claim's grant names no container: every container of the pod that references
            # the claim (its CDI device mounts this pod's vcuda directory) gets the claim's limits.
            held = [a for a in self.state.pod_allocations(pod_uid) if a.alloc_id.startswith(CLAIM_PREFIX)]
        return held[-1] if held else None  # the newest grant wins

    async def register(
        self, caller: Caller, pod_dir: Path, req: pb.VDeviceRequest, *, time_left: float | None = None
    ) -> Bound:
        """What was written, or RegisterError."""
        pod_uid = caller.pod_uid
        own_id = caller.owner.container_id if caller.owner else None
        if not is_pod_uid(req.pod_uid):
            raise _invalid(f"pod_uid {req.pod_uid[:64]!r} is not a pod UID")
        if req.pod_uid != pod_uid:
            raise _invalid(f"this vcuda.sock serves pod {pod_uid}, the request names pod {req.pod_uid}")
        if req.container_id and req.container_name:
            raise _invalid("give exactly one of container_id and container_name, not both")
        if req.container_name:
            if not is_container_name(req.container_name):
                raise _invalid(
                    f"container_name {req.container_name[:80]!r} is not a Kubernetes container name"
                )
            entry = name = req.container_name
            ref = ContainerRef(name=name, qos_class="", via="request")
            container_id = own_id  # the legacy library does not say; its caller's cgroup does
        elif req.container_id:
            if not is_container_id(req.container_id):
                raise _invalid(f"container_id {req.container_id[:140]!r} is not a container id")
            if own_id is not None and own_id != req.container_id:
                raise RegisterError(Status.PERMISSION_DENIED, (
                    f"caller pid {caller.pid} is container {own_id}; it may not register container "
                    f"{req.container_id}"))
            entry = container_id = req.container_id
            # caller.ahead: the runtime's answer for the caller's own container (``look_ahead``), which
            # is this one when there is an answer: an id other than its own was refused just above.
            ref = await self._name_of(pod_uid, entry, time_left, caller.ahead)
            name = ref.name
        else:
            raise _invalid("give exactly one of container_id and container_name; both are empty")

        claim_uid = caller.served if caller.served and caller.served != pod_uid else ""
        alloc = self.allocation_of(pod_uid, name, claim_uid=claim_uid)
        if alloc is None:
            raise RegisterError(
                Status.NOT_FOUND, f"no GPU allocation for container {name} of pod {pod_uid}"
            )
        driver = self.state.inventory.driver_version if self.state.inventory else ""
        try:
            data = encode(config_for(alloc, container_name=name, driver_version=driver))
        except ValueError as exc:
            raise RegisterError(Status.INTERNAL, f"cannot encode vcuda.config: {exc}") from exc
        strict = bool(req.container_id)
        try:
            done = self._write_first(caller, container_id, ref.qos_class, pod_dir, entry, data, strict=strict)
            if done is None:
                # One trip to a worker thread for all of it (the cgroup read and the two small writes):
                # each hand-off costs the registering container a loop turn or two on a busy node.
                done = await asyncio.to_thread(self._write_files, caller, container_id, ref.qos_class,
                                               pod_dir, entry, data, strict=strict)
            written, pids = done
        except ValueError as exc:
            raise _invalid(str(exc)) from exc
        except FileNotFoundError as exc:
            message = f"pod {pod_uid} is no longer served: {exc}"
            raise RegisterError(Status.NOT_FOUND, message) from exc
        except OSError as exc:
            message = f"cannot write vcuda.config for {entry}: {exc}"
            raise RegisterError(Status.INTERNAL, message) from exc
        return Bound(entry, name, written[CONFIG_NAME], pids, ref.via)

    def _write_first(self, caller: Caller, container_id: str | None, qos: str, pod_dir: Path, entry: str,
                     config: bytes, *, strict: bool) -> tuple[dict[str, bool], int] | None:
        """A container's first registration, written into the pod's spare directory (configfiles.py):
        one rename and two writes into files that exist, quick enough for the loop. None when the pod
        has no spare or the container's directory exists (``_write_files`` then)."""
        if not has_spare(pod_dir) or os.path.lexists(pod_dir / entry):
            return None
        pids = self._pids(caller, container_id, qos)  # the cgroup's files: memory, not the disk
        files = self._files(caller, container_id, pids, entry, config, strict=strict)
        staged = take_spare(pod_dir, entry)
        if staged is None:
            return None
        try:
            written = staged.commit(files)
        finally:
            staged.discard()
        if self.on_spare_taken is not None:
            self.on_spare_taken(pod_dir.name)
        return written, len(pids)

    def _write_files(self, caller: Caller, container_id: str | None, qos: str, pod_dir: Path, entry: str,
                     config: bytes, *, strict: bool) -> tuple[dict[str, bool], int]:
        """pids.config (when the container's cgroup is found) then vcuda.config; what changed, and how
        many pids."""
        pids = self._pids(caller, container_id, qos)
        files = self._files(caller, container_id, pids, entry, config, strict=strict)
        return write_container_files(pod_dir, entry, files), len(pids)

    def _files(self, caller: Caller, container_id: str | None, pids: list[int], entry: str, config: bytes, *,
               strict: bool) -> dict[str, bytes]:
        """The files to write, in order. ``strict`` (the caller named its container id): no pids is an error."""
        files = {}
        if pids:
            files[PIDS_NAME] = encode_pids(pids)
        elif strict:
            raise RegisterError(Status.FAILED_PRECONDITION, (
                f"no processes found for container {container_id} of pod {caller.pod_uid} under "
                f"{self.cgroup_root} (cgroup v1/v2, cgroupfs/systemd, docker/containerd/CRI-O layouts tried)"))
        else:  # legacy name variant: that library reads /etc/vcuda//pids.config, which nobody writes
            _logger.warning("pids.config not written: the caller's container is unknown",
                         pod_uid=caller.pod_uid, container=entry)
        files[CONFIG_NAME] = config
        return files

    def _pids(self, caller: Caller, container_id: str | None, qos: str) -> list[int]:
        if container_id is None:
            return []
        likely = []
        # Where the caller itself lives: its container's cgroup, whose name gave the container id
        # (only a plain absolute path, as seen from the host's cgroup namespace).
        if caller.owner and caller.owner.container_id == container_id and caller.owner.path.startswith("/"):
            rel = PurePosixPath(caller.owner.path.lstrip("/"))
            if ".." not in rel.parts:
                likely.append(rel)
        try:
            found = find_container_cgroup(self.cgroup_root, caller.pod_uid, container_id, qos, likely=likely)
            return read_pids(found) if found else []
        except OSError as exc:
            _logger.warning("cannot read the container's cgroup", container_id=container_id, error=str(exc))
            return []

    def look_ahead(self, caller: Caller) -> asyncio.Future[ContainerRef | None] | None:
        """Ask the runtime for the name of the caller's own container before its request arrives (the
        caller may register no other container: ``register``); one local call, no retries."""
        runtime = self.names.runtime
        if runtime is None or caller.refusal is not None or caller.owner is None or not caller.owner.container_id:
            return None
        wait = self.lookup_patience / 2
        if self.ahead is not None:  # asked when the container's cgroup appeared (namesahead.py)
            known = self.ahead.answer_for(caller.pod_uid, caller.owner.container_id, timeout=wait)
            if known is not None:
                return known
        return asyncio.ensure_future(runtime.lookup(caller.pod_uid, caller.owner.container_id, timeout=wait))

    async def _name_of(self, pod_uid: str, container_id: str, time_left: float | None,
                       ahead: asyncio.Future[ContainerRef | None] | None) -> ContainerRef:
        patience = self.lookup_patience
        if time_left is not None:
            patience = min(patience, time_left - _DEADLINE_MARGIN)
        try:
            return await self.names.lookup(pod_uid, container_id, patience=patience, runtime_answer=ahead)
        except ContainerUnknown as exc:
            raise RegisterError(Status.NOT_FOUND, str(exc)) from exc
        except WatchdogUnavailable as exc:
            raise RegisterError(Status.UNAVAILABLE, str(exc)) from exc


class VcudaMethods:
    """What each pod's vcuda.sock serves, to the caller its gate checked (peergate.py)."""

    def __init__(self, registrations: VDeviceRegistrations, vm_root: Path) -> None:
        self.registrations = registrations
        self.vm_root = vm_root

    def for_caller(self, caller: Caller) -> dict[str, Unary]:
        async def register_vdevice(message: bytes, time_left: float | None) -> bytes:
            return await self.register_vdevice(caller, message, time_left)

        return {REGISTER_PATH: register_vdevice}

    async def register_vdevice(self, caller: Caller, message: bytes, time_left: float | None) -> bytes:
        try:
            if caller.refusal is not None:
                raise RegisterError(Status.PERMISSION_DENIED, caller.refusal)
            try:
                request = pb.VDeviceRequest.FromString(message)
            except DecodeError as exc:
                raise _invalid(f"the request is not a VDeviceRequest: {exc}") from exc
            bound = await self.registrations.register(
                caller, self.vm_root / caller.directory_name, request, time_left=time_left)
        except RegisterError as exc:
            _logger.warning("registration refused", pod_uid=caller.pod_uid, pid=caller.pid, code=exc.code.name,
                            error=exc.message)
            raise
        # Logged on the loop's next turn, once the reply is written: the container waits for it.
        asyncio.get_running_loop().call_soon(functools.partial(
            _logger.info, "container bound", pod_uid=caller.pod_uid, container=bound.name, entry=bound.entry,
            written=bound.changed, pids=bound.pids, via=bound.via))
        return _EMPTY_RESPONSE
