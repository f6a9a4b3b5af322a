"""Events, pods and helpers for the vmanager tests (realistic shapes, fixed node "node-a").

Also the vcuda.config the C struct expects, built by hand (``golden_config``), and the running parts
the fixtures in conftest.py hand out: the ledger with its relay, a fake watchdog, a running vmanager.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import msgspec

from libs.bus import Bus, Relay
from libs.commands import PodsReply, PodsRequest, PrepareReply, PrepareRequest
from libs.config import Settings
from libs.cri.v1 import api_pb2 as cri
from libs.cri.v1 import api_pb2_grpc as cri_grpc
from libs.events.schema import (
    AllocationGranted,
    AllocationReleased,
    ContainerResponse,
    Event,
    GpuInfo,
    GpuShare,
    InventoryRecorded,
    MountSpec,
)
from libs.kube.pods import Pod
from libs.store import EventLog
from libs.vcuda import api_pb2 as pb
from libs.vcuda import api_pb2_grpc as pb_grpc
from libs.vcuda import register_vdevice
from services.vmanager.app import VmanagerService, service
from tests.builders.cgroups import enter_container

NODE = "node-a"
GIB = 1 << 30
BLOCK = 256 << 20
DRIVER = "550.54.15"
GPUS = (
    GpuInfo(index=0, minor=0, uuid="GPU-5e1b0a8c-3a6f-4f8e-9c1d-0a1b2c3d4e5f", pci_bus_id="00000000:17:00.0",
            memory=80 * GIB, name="NVIDIA A100-SXM4-80GB"),
    GpuInfo(index=1, minor=1, uuid="GPU-7f2c1b9d-4b70-4a9f-8d2e-1b2c3d4e5f60", pci_bus_id="00000000:31:00.0",
            memory=80 * GIB, name="NVIDIA A100-SXM4-80GB"),
)


def new_pod_uid() -> str:
    return str(uuid.uuid4())


def new_container_id() -> str:
    return uuid.uuid4().hex + uuid.uuid4().hex  # 64 hex, as containerd


def inventory(driver: str = DRIVER) -> InventoryRecorded:
    return InventoryRecorded(node=NODE, backend="fake", driver_version=driver, gpus=GPUS,
                             links=(("X", "NV12"), ("NV12", "X")))


def granted(
    pod_uid: str,
    container: str,
    *,
    cores: int = 30,
    memory: int = 4 * BLOCK,
    core_limit: int | None = None,
    index: int = 0,
    init: bool = False,
) -> AllocationGranted:
    shares, left, gpu = [], cores, 0
    while left > 0:
        part = min(left, 100)
        shares.append(GpuShare(index=gpu, uuid=GPUS[gpu].uuid, minor=gpu, cores=part,
                               memory=memory if cores < 100 else GPUS[gpu].memory))
        left -= part
        gpu += 1
    return AllocationGranted(
        alloc_id=uuid.uuid4().hex,
        request_id=uuid.uuid4().hex,
        pod_uid=pod_uid,
        namespace="ml",
        pod_name="train-0",
        container=container,
        container_index=index,
        init_container=init,
        cores=cores,
        memory=memory,
        device_ids=tuple(f"tencent.com/vcuda-core-{i}" for i in range(cores)),
        shares=tuple(shares),
        core_limit=core_limit,
        response=ContainerResponse(
            mounts=(MountSpec(container_path="/etc/vcuda", host_path=f"/var/lib/gpuledger/vm/{pod_uid}"),),
            annotations={"tencent.com/vcuda-core": str(cores), "tencent.com/vcuda-memory": str(memory)},
        ),
    )


def released(grant: AllocationGranted, reason: str = "deleted") -> AllocationReleased:
    return AllocationReleased(alloc_id=grant.alloc_id, pod_uid=grant.pod_uid, container=grant.container,
                              reason=reason)


def pod(uid: str, containers: dict[str, str], init: dict[str, str] | None = None, qos: str = "Burstable") -> Pod:
    """A Pod as the API server returns it; ``containers``/``init``: name -> containerd id."""

    def spec(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "image": "nvcr.io/nvidia/pytorch:24.01-py3",
            "command": ["python", "train.py"],
            "resources": {
                "limits": {"tencent.com/vcuda-core": "30", "tencent.com/vcuda-memory": "4"},
                "requests": {"tencent.com/vcuda-core": "30", "tencent.com/vcuda-memory": "4"},
            },
            "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
            "terminationMessagePath": "/dev/termination-log",
            "imagePullPolicy": "IfNotPresent",
        }

    def status(name: str, cid: str, running: bool) -> dict[str, Any]:
        state = ({"running": {"startedAt": "2024-05-01T10:00:05Z"}} if running else
                 {"terminated": {"exitCode": 0, "reason": "Completed", "containerID": f"containerd://{cid}"}})
        return {
            "name": name,
            "containerID": f"containerd://{cid}",
            "image": "nvcr.io/nvidia/pytorch:24.01-py3",
            "imageID": "nvcr.io/nvidia/pytorch@sha256:" + "ab" * 32,
            "ready": running,
            "restartCount": 0,
            "started": running,
            "state": state,
            "lastState": {},
        }

    init = init or {}
    doc = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-0",
            "namespace": "ml",
            "uid": uid,
            "resourceVersion": "184467",
            "creationTimestamp": "2024-05-01T10:00:00Z",
            "labels": {"app": "train"},
            "annotations": {"tencent.com/predicate-time": "1714557600000000000"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "train",
                                 "uid": str(uuid.uuid4()), "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            "nodeName": NODE,
            "schedulerName": "default-scheduler",
            "restartPolicy": "Always",
            "initContainers": [spec(n) for n in init],
            "containers": [spec(n) for n in containers],
        },
        "status": {
            "phase": "Running",
            "qosClass": qos,
            "hostIP": "10.0.0.5",
            "podIP": "10.244.1.7",
            "startTime": "2024-05-01T10:00:01Z",
            "initContainerStatuses": [status(n, c, False) for n, c in init.items()],
            "containerStatuses": [status(n, c, True) for n, c in containers.items()],
        },
    }
    return msgspec.json.decode(json.dumps(doc), type=Pod)


def tree(root: Path) -> dict[str, tuple[str, int]]:
    """Every path under ``root`` (symlinks not followed) with its kind and permission bits."""
    out: dict[str, tuple[str, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            kind = ("link" if path.is_symlink() else "dir" if path.is_dir()
                    else "sock" if path.is_socket() else "file")
            out[str(path.relative_to(root))] = (kind, st.st_mode & 0o7777)
    return out


async def raw_register(socket: Path | str, **fields: str) -> tuple[grpc.StatusCode, str]:
    """RegisterVDevice with any fields (the client refuses some combinations before sending)."""
    # A connection of its own: the vmanager judges the caller once per connection.
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(f"unix://{socket}", options=options) as channel:
        try:
            await pb_grpc.VCUDAServiceStub(channel).RegisterVDevice(pb.VDeviceRequest(**fields), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


_NAMED: dict[tuple[str, str], str] = {}


def caller_container(pod_uid: str, container_id: str = "", container_name: str = "") -> str:
    """The container id the calling process has: the one it registers, or a fixed one per name."""
    return container_id or _NAMED.setdefault((pod_uid, container_name), new_container_id())


async def register(sock: Path | str, *, pod_uid: str, container_id: str = "", container_name: str = "",
                   **kwargs: Any) -> list[int]:
    """RegisterVDevice as a process of that container of the socket's pod would make it.

    The vmanager checks the caller through Settings.proc_root / cgroup_root, which the fixtures put
    beside the vm root (``<workdir>/{vm,proc,cgroup}``). Returns the container's pids.
    """
    sock = Path(sock)
    owner = sock.parent.name  # <workdir>/vm/<pod uid>/vcuda.sock: the caller is in the socket's pod
    pids = enter_container(sock.parents[2], owner, caller_container(owner, container_id, container_name))
    await register_vdevice(str(sock), pod_uid=pod_uid, container_id=container_id,
                           container_name=container_name, **kwargs)
    return pids


# -- vcuda.config built by hand ----------------------------------------------------------------------------

GOLDEN_CONFIG_SIZE = 8240


def golden_config(
    *,
    pod_uid: str,
    limit: int,
    container_name: str,
    gpu_memory: int,
    utilization: int,
    hard_limit: int,
    driver_major: int,
    driver_minor: int,
    enable: int,
    bus_id: str = "",
) -> bytes:
    """vcuda.config built by hand, field by field at the offsets of gpu-manager-reference.md 5.4.

    Deliberately independent of libs.vcuda.config (no struct format): the two must agree byte for byte.
    """
    buf = bytearray(GOLDEN_CONFIG_SIZE)  # every byte not written below is zero: padding and NUL terminators

    def text(offset: int, value: str) -> None:
        raw = value.encode()
        buf[offset : offset + len(raw)] = raw

    def number(offset: int, value: int, size: int = 4, signed: bool = True) -> None:
        buf[offset : offset + size] = value.to_bytes(size, "little", signed=signed)

    text(0x0000, pod_uid)                      # char pod_uid[48]
    number(0x0030, limit)                      # int limit
    text(0x1000, container_name)               # char container_name[4096] after occupied[4044]
    text(0x2000, bus_id)                       # char bus_id[16]
    number(0x2010, gpu_memory, 8, signed=False)  # uint64 gpu_memory
    number(0x2018, utilization)                # int utilization
    number(0x201C, hard_limit)                 # int hard_limit
    number(0x2020, driver_major)               # version_t.major
    number(0x2024, driver_minor)               # version_t.minor
    number(0x2028, enable)                     # int enable; 4 bytes of tail padding follow
    assert len(buf) == GOLDEN_CONFIG_SIZE
    return bytes(buf)


# -- the running parts: short dirs, the ledger and a fake watchdog the fixtures build, the vmanager ------

def short_tmp(prefix: str = "vm") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class Ledger:
    """The allocation log as the allocator would write it, published by a running relay."""

    def __init__(self, event_log: EventLog, relay: Relay) -> None:
        self.log = event_log
        self.relay = relay

    async def append(self, *events: Event) -> int:
        stored = await self.log.append(list(events))
        await self.relay.wait_published(stored[-1].seq, 5)
        return stored[-1].seq


class FakeWatchdog:
    """Answers ``watchdog.pods`` the way the watchdog does: from its view of the node's pods."""

    def __init__(self) -> None:
        self.pods: dict[str, Pod] = {}
        self.calls: list[PodsRequest] = []

    def add(self, pod: Pod) -> None:
        self.pods[pod.uid] = pod

    async def handle(self, req: PodsRequest) -> PodsReply:
        self.calls.append(req)
        return PodsReply(pods=[p for uid, p in self.pods.items() if not req.uid or uid == req.uid])


@contextlib.asynccontextmanager
async def running_vmanager(settings: Settings) -> AsyncIterator[VmanagerService]:
    async with service(settings) as svc:
        await asyncio.wait_for(svc.tracker.caught_up.wait(), 10)
        yield svc


async def folded(svc: VmanagerService, seq: int) -> None:
    await svc.tracker.follower.wait_for(seq, 5)


async def prepared(ledger: Ledger, bus: Bus, uid: str, *grants: object) -> Path:
    seq = await ledger.append(inventory(), *grants)  # type: ignore[arg-type]
    reply = await bus.request(bus.subjects.prepare, PrepareRequest(pod_uid=uid, alloc_seq=seq), PrepareReply,
                              timeout=5)
    return Path(reply.socket)


def with_runtime(settings: Settings, socket: Path, *, scheme: bool = False) -> Settings:
    """``settings`` with the CRI runtime at ``socket`` (``unix://`` in front with ``scheme``)."""
    return settings.replace(container_runtime_endpoint=f"unix://{socket}" if scheme else str(socket))


class FakeRuntime(cri_grpc.RuntimeServiceServicer):
    """A CRI runtime's ``ContainerStatus`` on a real unix socket, answering for the containers added
    (labelled as the kubelet labels them); ``delay`` makes it slow, ``labelled=False`` a runtime that
    was not driven by a kubelet."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.containers: dict[str, tuple[str, str]] = {}  # id -> (container name, pod uid)
        self.calls: list[str] = []
        self.delay = 0.0
        self.labelled = True
        self._server: grpc.aio.Server | None = None

    def add(self, container_id: str, name: str, pod_uid: str) -> None:
        self.containers[container_id] = (name, pod_uid)

    async def start(self) -> None:
        self._server = grpc.aio.server()
        cri_grpc.add_RuntimeServiceServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)

    async def ContainerStatus(self, request: cri.ContainerStatusRequest,
                              context: grpc.aio.ServicerContext) -> cri.ContainerStatusResponse:
        self.calls.append(request.container_id)
        await asyncio.sleep(self.delay)
        found = self.containers.get(request.container_id)
        if found is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"an error occurred when try to find container "
                                                           f"{request.container_id!r}: not found")
        name, pod_uid = found  # type: ignore[misc]
        labels = {"io.kubernetes.container.name": name, "io.kubernetes.pod.uid": pod_uid,
                  "io.kubernetes.pod.name": "train-0", "io.kubernetes.pod.namespace": "ml"}
        return cri.ContainerStatusResponse(status=cri.ContainerStatus(
            id=request.container_id, metadata=cri.ContainerMetadata(name=name if self.labelled else ""),
            state=cri.CONTAINER_RUNNING, labels=labels if self.labelled else {}))
