"""The kubelet's container-runtime half, over CRI: one pod sandbox per pod, its containers created
with exactly the device plugins' merged Allocate/PreStartContainer results plus the kubelet's own
defaults, and the pod torn down (cgroups included) when it goes.

What the kubelet (``kuberuntime``) sends, reproduced here:

* ``RunPodSandbox``: pod metadata, ``io.kubernetes.pod.*`` labels, the pod's annotations, a log
  directory ``<logs>/<ns>_<name>_<uid>``, the cgroup parent of the pod's QoS class (cgroupfs driver:
  ``/kubepods/besteffort/pod<uid>``, ``/kubepods/burstable/pod<uid>``, ``/kubepods/pod<uid>``),
  host network (no CNI here; ``hostname`` stays empty then, as the kubelet leaves it), a pid namespace
  per container, the pod's ipc namespace, seccomp ``RuntimeDefault``.
* ``CreateContainer``: the device specs, mounts (read-only where the response says so), envs and
  annotations of the merged responses, CDI device names, then the pod spec's hostPath volumes, the
  container's command, args and env values; ``io.kubernetes.container.name`` and pod labels;
  ``<name>/<attempt>.log``; cpu shares and oom_score_adj of the QoS class; the kubelet's masked and
  read-only ``/proc`` and ``/sys`` paths; seccomp ``RuntimeDefault``.
* Deletion: ``StopContainer`` (the pod's grace, capped), ``RemoveContainer``, ``StopPodSandbox``,
  ``RemovePodSandbox``, then ``rmdir`` of the pod cgroup in every hierarchy (runc removes only the
  containers' own cgroups; the kubelet's pod-cgroup cleanup removes the rest).

Images: a container whose image is one we built (``localhost/gpuledger/...``) runs it; any other name
(``cuda``, ``nvidia/cuda:12``) runs the test busybox image instead, with its command if the pod gives
one, else a shell that waits for SIGTERM. Nothing is ever pulled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ..logger import logger
from ..podspec import pod_key, pod_uid
from .cri import CriClient, cri
from .images import BUSYBOX_IMAGE
from .leftovers import Leftovers, cgroup_mounts

__all__ = ["MASKED_PATHS", "READONLY_PATHS", "WAIT_FOR_TERM", "ContainerCreateError", "PodRuntime"]

# The kubelet's defaults (securitycontext DefaultProcMountType): masked and read-only paths.
MASKED_PATHS = (
    "/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
# PID 1 of a pid namespace ignores SIGTERM unless it handles it: without the trap a stop waits out
# the whole grace period.
WAIT_FOR_TERM = "trap 'exit 0' TERM; sleep 2147483647 & wait"
LOCAL_IMAGE_PREFIX = "localhost/gpuledger/"
MAX_STOP_GRACE = 10

_logger = logger("runtime")


class ContainerCreateError(Exception):
    """CreateContainer or StartContainer failed: the kubelet's CreateContainerError / RunContainerError."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _Pod:
    uid: str
    sandbox_id: str
    config: cri.PodSandboxConfig
    cgroup_parent: str
    containers: dict[str, str] = field(default_factory=dict)  # name -> container id
    attempts: dict[str, int] = field(default_factory=dict)


def cgroup_parent(pod: dict[str, Any]) -> str:
    qos = ((pod.get("status") or {}).get("qosClass") or "BestEffort").lower()
    uid = pod_uid(pod)
    return f"/kubepods/pod{uid}" if qos == "guaranteed" else f"/kubepods/{qos}/pod{uid}"


def _milli_cpu(raw: Any) -> int:
    text = str(raw or "0")
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def _resources(pod: dict[str, Any], container: dict[str, Any]) -> cri.LinuxContainerResources:
    """cpu shares and oom_score_adj as the kubelet computes them for the pod's QoS class."""
    qos = (pod.get("status") or {}).get("qosClass") or "BestEffort"
    requests = (container.get("resources") or {}).get("requests") or {}
    shares = max(2, _milli_cpu(requests.get("cpu")) * 1024 // 1000)
    oom = {"Guaranteed": -997, "BestEffort": 1000}.get(qos, 999)
    return cri.LinuxContainerResources(cpu_shares=shares, oom_score_adj=oom)


class PodRuntime:
    def __init__(self, client: CriClient, leftovers: Leftovers, log_dir: Path) -> None:
        self.client = client
        self.leftovers = leftovers
        self.log_dir = Path(log_dir)
        self._pods: dict[str, _Pod] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def container_id(self, uid: str, name: str) -> str | None:
        pod = self._pods.get(uid)
        return pod.containers.get(name) if pod else None

    def sandbox_id(self, uid: str) -> str | None:
        pod = self._pods.get(uid)
        return pod.sandbox_id if pod else None

    # -- sandbox -------------------------------------------------------------------------------

    def sandbox_config(self, pod: dict[str, Any]) -> cri.PodSandboxConfig:
        ns, name = pod_key(pod)
        uid = pod_uid(pod)
        meta = pod.get("metadata") or {}
        labels = {**(meta.get("labels") or {}), "io.kubernetes.pod.name": name,
                  "io.kubernetes.pod.namespace": ns, "io.kubernetes.pod.uid": uid}
        namespaces = cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD)
        return cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace=ns, attempt=0),
            hostname="",  # host network: containerd drops the UTS namespace and runc refuses a hostname
            log_directory=str(self.log_dir / f"{ns}_{name}_{uid}"),
            labels=labels,
            annotations=dict(meta.get("annotations") or {}),
            linux=cri.LinuxPodSandboxConfig(
                cgroup_parent=cgroup_parent(pod),
                security_context=cri.LinuxSandboxSecurityContext(
                    namespace_options=namespaces,
                    seccomp=cri.SecurityProfile(profile_type=cri.SecurityProfile.RuntimeDefault)),
            ),
        )

    async def ensure_sandbox(self, pod: dict[str, Any]) -> None:
        """The pod's sandbox, made the first time (RunPodSandbox): the kubelet's SyncPod creates it
        before it builds any container's run options (PreStartContainer among them). Raises
        ContainerCreateError (CreatePodSandboxError) when the runtime refuses."""
        async with self._locks.setdefault(pod_uid(pod), asyncio.Lock()):
            await self._sandbox(pod)

    async def _sandbox(self, pod: dict[str, Any]) -> _Pod:
        uid = pod_uid(pod)
        if uid in self._pods:
            return self._pods[uid]
        config = self.sandbox_config(pod)
        self.leftovers.add_cgroup_parent(config.linux.cgroup_parent)  # written down before runc makes it
        Path(config.log_directory).mkdir(parents=True, exist_ok=True)
        try:
            sandbox_id = await self.client.run_pod_sandbox(config)
        except grpc.aio.AioRpcError as err:
            raise ContainerCreateError("CreatePodSandboxError", f"RunPodSandbox: {err.details()}") from err
        self._pods[uid] = _Pod(uid, sandbox_id, config, config.linux.cgroup_parent)
        _logger.info("pod sandbox running", pod=uid, sandbox=sandbox_id[:13])
        return self._pods[uid]

    # -- containers ----------------------------------------------------------------------------

    def container_config(self, pod: dict[str, Any], container: dict[str, Any], opts: dict[str, Any],
                         attempt: int) -> cri.ContainerConfig:
        ns, name = pod_key(pod)
        image = str(container.get("image") or "")
        local = image.startswith(LOCAL_IMAGE_PREFIX)
        command = list(container.get("command") or [])
        args = list(container.get("args") or [])
        if not local and not command and not args:
            command = ["/bin/sh", "-c", WAIT_FOR_TERM]
        envs = [cri.KeyValue(key=k, value=v) for k, v in opts["envs"].items()]
        envs += [cri.KeyValue(key=e["name"], value=str(e.get("value", "")))
                 for e in container.get("env") or [] if "valueFrom" not in e]
        mounts = [cri.Mount(container_path=m["container_path"], host_path=m["host_path"], readonly=m["read_only"])
                  for m in opts["mounts"]]
        mounts += self._volume_mounts(pod, container)
        devices = [cri.Device(container_path=d["container_path"], host_path=d["host_path"],
                              permissions=d["permissions"]) for d in opts["devices"]]
        security = cri.LinuxContainerSecurityContext(
            namespace_options=cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD),
            masked_paths=list(MASKED_PATHS), readonly_paths=list(READONLY_PATHS),
            seccomp=cri.SecurityProfile(profile_type=cri.SecurityProfile.RuntimeDefault),
        )
        run_as = ((container.get("securityContext") or {}).get("runAsUser"))
        if run_as is not None:
            security.run_as_user.value = int(run_as)
        return cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=container["name"], attempt=attempt),
            image=cri.ImageSpec(image=image if local else BUSYBOX_IMAGE),
            command=command, args=args, working_dir=str(container.get("workingDir") or ""),
            envs=envs, mounts=mounts, devices=devices,
            labels={"io.kubernetes.container.name": container["name"], "io.kubernetes.pod.name": name,
                    "io.kubernetes.pod.namespace": ns, "io.kubernetes.pod.uid": pod_uid(pod)},
            annotations={**opts["annotations"], "io.kubernetes.container.restartCount": str(attempt)},
            log_path=f"{container['name']}/{attempt}.log",
            linux=cri.LinuxContainerConfig(resources=_resources(pod, container), security_context=security),
            # Resolved into devices, mounts and envs by the kubelet when it has a CDI dir (containerd 1.6
            # has no CDI support); otherwise passed on for a runtime that resolves them itself.
            CDI_devices=[] if opts.get("cdi_resolved") else [cri.CDIDevice(name=n) for n in opts["cdi_devices"]],
        )

    @staticmethod
    def _volume_mounts(pod: dict[str, Any], container: dict[str, Any]) -> list[cri.Mount]:
        """The container's volumeMounts of hostPath volumes (the only volume kind emulated)."""
        volumes = {v.get("name"): v for v in (pod.get("spec") or {}).get("volumes") or []}
        mounts = []
        for vm in container.get("volumeMounts") or []:
            host = (volumes.get(vm.get("name")) or {}).get("hostPath") or {}
            if host.get("path"):
                mounts.append(cri.Mount(container_path=vm["mountPath"], host_path=host["path"],
                                        readonly=bool(vm.get("readOnly"))))
        return mounts

    async def start_container(self, pod: dict[str, Any], container: dict[str, Any], opts: dict[str, Any]) -> str:
        """Sandbox (first time), CreateContainer, StartContainer; the container id.
        Raises ContainerCreateError with the kubelet's reason when the runtime refuses."""
        uid = pod_uid(pod)
        async with self._locks.setdefault(uid, asyncio.Lock()):
            entry = await self._sandbox(pod)
            name = container["name"]
            attempt = entry.attempts.get(name, -1) + 1
            entry.attempts[name] = attempt
            config = self.container_config(pod, container, opts, attempt)
            try:
                cid = await self.client.create_container(entry.sandbox_id, config, entry.config)
            except grpc.aio.AioRpcError as err:
                raise ContainerCreateError("CreateContainerError", err.details() or str(err.code())) from err
            entry.containers[name] = cid
            try:
                await self.client.start_container(cid)
            except grpc.aio.AioRpcError as err:
                raise ContainerCreateError("RunContainerError", err.details() or str(err.code())) from err
        _logger.info("container started", pod=uid, container=name, id=cid[:13])
        return cid

    async def wait_exited(self, cid: str, timeout: float) -> int:
        """Wait until the container has exited (an init container); its exit code."""
        async with asyncio.timeout(timeout):
            while True:
                status = (await self.client.container_status(cid)).status
                if status.state == cri.CONTAINER_EXITED:
                    return status.exit_code
                await asyncio.sleep(0.05)

    # -- teardown ------------------------------------------------------------------------------

    async def remove_pod(self, uid: str, grace: int = MAX_STOP_GRACE) -> None:
        """Stop and remove the pod's containers and sandbox, then its cgroups. Idempotent."""
        async with self._locks.setdefault(uid, asyncio.Lock()):
            entry = self._pods.pop(uid, None)
            if entry is None:
                return
            grace = max(0, min(grace, MAX_STOP_GRACE))
            stops = [self._stop_container(cid, grace) for cid in entry.containers.values()]
            await asyncio.gather(*stops)
            for call in (self.client.stop_pod_sandbox, self.client.remove_pod_sandbox):
                try:
                    await call(entry.sandbox_id)
                except grpc.aio.AioRpcError as err:
                    _logger.warning("sandbox teardown failed", pod=uid, error=err.details())
            left = await asyncio.to_thread(remove_pod_cgroups, entry.cgroup_parent)
            if not left:  # what remains stays named, for the end of the run (or the reaper) to remove
                self.leftovers.drop_cgroup_parent(entry.cgroup_parent)
        self._locks.pop(uid, None)
        _logger.info("pod removed from the runtime", pod=uid)

    async def _stop_container(self, cid: str, grace: int) -> None:
        try:
            await self.client.stop_container(cid, grace)
        except grpc.aio.AioRpcError as err:
            _logger.warning("container stop failed", id=cid[:13], error=err.details())
        # A pod deleted while its StartContainer was still in flight: containerd refuses the removal
        # ("in starting state") until the start has finished; try again for a few seconds.
        for attempt in range(50):
            try:
                await self.client.remove_container(cid)
                return
            except grpc.aio.AioRpcError as err:
                if attempt == 49 or "starting state" not in (err.details() or ""):
                    _logger.warning("container removal failed", id=cid[:13], error=err.details())
                    return
                await asyncio.sleep(0.1)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.client.stop_container(cid, 0)

    async def close(self) -> None:
        for uid in list(self._pods):
            with contextlib.suppress(Exception):
                await self.remove_pod(uid, grace=1)
        await self.client.close()


def remove_pod_cgroups(parent: str) -> list[str]:
    """rmdir the pod's cgroup (and anything under it) in every hierarchy; the paths that remain."""
    left = []
    for mount in cgroup_mounts():
        top = Path(mount) / parent.lstrip("/")
        if not top.is_dir():
            continue
        for root, _dirs, _files in sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True):
            try:
                os.rmdir(root)
            except OSError:
                left.append(root)
    return left
