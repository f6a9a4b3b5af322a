"""RegisterVDevice: a container's process asks for its limits, the vmanager writes its vcuda.config.

The only vmanager module that speaks the vcuda proto. Each pod's server gets its own servicer bound
to that pod, so a request can only ever write under that pod's directory:

- ``pod_uid`` must be the socket's pod;
- exactly one of ``container_id`` (current library) or ``container_name`` (legacy), each checked
  against the form runtimes / Kubernetes produce;
- the container (by name, or by id via the watchdog's pod status) must hold an allocation in the
  folded log; its limits become ``<pod dir>/<id or name>/vcuda.config``.

pids.config (section 5.5) is not written here: pid discovery from cgroups is a separate piece.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from libs.ledger.state import Allocation, LedgerState
from libs.log import get_logger
from libs.vcuda import api_pb2 as pb
from libs.vcuda import api_pb2_grpc as pb_grpc
from libs.vcuda.config import config_for, encode
from services.vmanager.configfiles import write_container_config
from services.vmanager.containers import ContainerNames, ContainerUnknown, WatchdogUnavailable
from services.vmanager.names import is_container_id, is_container_name, is_pod_uid

__all__ = ["RegisterError", "Registrar", "VcudaServicer"]

_log = get_logger("vmanager")

# Keep a little of the caller's deadline to write the file and answer.
_DEADLINE_MARGIN = 0.5


class RegisterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> RegisterError:
    return RegisterError(grpc.StatusCode.INVALID_ARGUMENT, message)


class Registrar:
    def __init__(self, state: LedgerState, names: ContainerNames, *, lookup_patience: float) -> None:
        self.state = state
        self.names = names
        self.lookup_patience = lookup_patience

    def allocation_of(self, pod_uid: str, container: str) -> Allocation | None:
        held = [a for a in self.state.pod_allocations(pod_uid) if a.container == container]
        return held[-1] if held else None  # the newest grant wins

    async def register(
        self, pod_uid: str, pod_dir: Path, req: pb.VDeviceRequest, *, time_left: float | None = None
    ) -> tuple[str, str, bool]:
        """(entry written, container name, changed) or RegisterError."""
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
        elif req.container_id:
            if not is_container_id(req.container_id):
                raise _invalid(f"container_id {req.container_id[:140]!r} is not a container id")
            entry = req.container_id
            name = await self._name_of(pod_uid, entry, time_left)
        else:
            raise _invalid("give exactly one of container_id and container_name; both are empty")

        alloc = self.allocation_of(pod_uid, name)
        if alloc is None:
            raise RegisterError(
                grpc.StatusCode.NOT_FOUND, f"no GPU allocation for container {name} of pod {pod_uid}"
            )
        driver = self.state.inventory.driver_version if self.state.inventory else ""
        try:
            data = encode(config_for(alloc, container_name=name, driver_version=driver))
        except ValueError as exc:
            raise RegisterError(grpc.StatusCode.INTERNAL, f"cannot encode vcuda.config: {exc}") from exc
        try:
            changed = await asyncio.to_thread(write_container_config, pod_dir, entry, data)
        except ValueError as exc:
            raise _invalid(str(exc)) from exc
        except FileNotFoundError as exc:
            message = f"pod {pod_uid} is no longer served: {exc}"
            raise RegisterError(grpc.StatusCode.NOT_FOUND, message) from exc
        except OSError as exc:
            message = f"cannot write vcuda.config for {entry}: {exc}"
            raise RegisterError(grpc.StatusCode.INTERNAL, message) from exc
        return entry, name, changed

    async def _name_of(self, pod_uid: str, container_id: str, time_left: float | None) -> str:
        patience = self.lookup_patience
        if time_left is not None:
            patience = min(patience, time_left - _DEADLINE_MARGIN)
        try:
            return await self.names.lookup(pod_uid, container_id, patience=patience)
        except ContainerUnknown as exc:
            raise RegisterError(grpc.StatusCode.NOT_FOUND, str(exc)) from exc
        except WatchdogUnavailable as exc:
            raise RegisterError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc


class VcudaServicer(pb_grpc.VCUDAServiceServicer):
    """The servicer behind one pod's vcuda.sock."""

    def __init__(self, registrar: Registrar, pod_uid: str, pod_dir: Path) -> None:
        self.registrar = registrar
        self.pod_uid = pod_uid
        self.pod_dir = pod_dir

    async def RegisterVDevice(
        self, request: pb.VDeviceRequest, context: grpc.aio.ServicerContext
    ) -> pb.VDeviceResponse:
        try:
            entry, name, changed = await self.registrar.register(
                self.pod_uid, self.pod_dir, request, time_left=context.time_remaining()
            )
        except RegisterError as exc:
            _log.warning("registration refused", pod_uid=self.pod_uid, code=exc.code.name, error=exc.message)
            await context.abort(exc.code, exc.message)
            raise AssertionError("unreachable") from exc  # context.abort raises
        _log.info("container bound", pod_uid=self.pod_uid, container=name, entry=entry, written=changed)
        return pb.VDeviceResponse()
