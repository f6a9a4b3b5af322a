"""The kubelet's own record of who holds which device: a client of its pod-resources API.

``Allocate`` carries device IDs only, so the allocator must guess the pod (gpu-manager-reference.md
3.1). Once the kubelet has recorded the allocation, its pod-resources ``List`` names the pod and
container that hold each device ID: the truth the guess is checked against. Every call is bounded;
an absent socket (a kubelet older than 1.15, or a node where it is not mounted) is reported as
unavailable, and callers then keep the guess, as gpu-manager would.

A rate-limited List (RESOURCE_EXHAUSTED: the kubelet allows 100 a second, 10 at once) or a late one
keeps the channel; only UNAVAILABLE (the kubelet restarting) dials afresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import grpc.aio
import msgspec

from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY, Pod
from libs.kubelet.podresources.v1 import api_pb2 as pr
from libs.kubelet.podresources.v1 import api_pb2_grpc as pr_grpc

__all__ = ["DeviceHolder", "KubeletPodResources", "KubeletRecord", "PodResourcesUnavailable", "holders"]


class PodResourcesUnavailable(Exception):
    """The pod-resources socket is missing or the kubelet did not answer in time."""


class DeviceHolder(msgspec.Struct, frozen=True):
    """One container as the kubelet records it: its vcore device IDs and its vmemory count."""

    namespace: str
    pod_name: str
    container: str
    vcore_ids: frozenset[str]
    vmemory: int  # number of tencent.com/vcuda-memory devices


def holders(listing: pr.ListPodResourcesResponse) -> dict[frozenset[str], DeviceHolder]:
    """Every container that holds vcore devices, keyed by its set of vcore device IDs.

    The API lists one entry per device and NUMA node, so IDs are collected into sets. Ordinary init
    containers are not listed by the kubelet; their grants are left as guessed.
    """
    out: dict[frozenset[str], DeviceHolder] = {}
    for pod in listing.pod_resources:
        for ctr in pod.containers:
            vcore: set[str] = set()
            vmemory: set[str] = set()
            for dev in ctr.devices:
                if dev.resource_name == RESOURCE_VCORE:
                    vcore.update(dev.device_ids)
                elif dev.resource_name == RESOURCE_VMEMORY:
                    vmemory.update(dev.device_ids)
            if vcore:
                ids = frozenset(vcore)
                out[ids] = DeviceHolder(pod.namespace, pod.name, ctr.name, ids, len(vmemory))
    return out


class KubeletRecord(msgspec.Struct, frozen=True):
    """One pod-resources ``List``: who holds which vcore IDs, and which listed containers hold any."""

    holders: dict[frozenset[str], DeviceHolder]
    # (namespace, pod name) -> container -> holds vcore devices. The kubelet lists the pods it has
    # taken up (admitted, or being admitted right now), app containers and sidecars only.
    containers: dict[tuple[str, str], dict[str, bool]]

    def admitting(self, pod: Pod) -> bool:
        """Whether the kubelet may be admitting this pod now: it knows the pod and some GPU
        container of it holds no vcore devices yet (or it has GPU init containers, which the
        kubelet never lists)."""
        listed = self.containers.get((pod.metadata.namespace, pod.metadata.name))
        if listed is None:
            return False
        inits = pod.spec.init_containers
        if any(c.vcore > 0 and c.restart_policy != "Always" for c in inits):
            return True
        shown = [c for c in inits if c.restart_policy == "Always"] + list(pod.spec.containers)
        return any(c.vcore > 0 and not listed.get(c.name, False) for c in shown)


def record(listing: pr.ListPodResourcesResponse) -> KubeletRecord:
    containers = {
        (pod.namespace, pod.name): {
            ctr.name: any(d.resource_name == RESOURCE_VCORE and d.device_ids for d in ctr.devices)
            for ctr in pod.containers
        }
        for pod in listing.pod_resources
    }
    return KubeletRecord(holders=holders(listing), containers=containers)


class KubeletPodResources:
    def __init__(self, socket: str, *, timeout: float, on_list: Callable[[str], None] | None = None) -> None:
        """``on_list(reason)``: told of each List sent (the kubelet rate-limits them; the metrics count)."""
        self.socket = socket
        self.timeout = timeout
        self._on_list = on_list
        self._channel: grpc.aio.Channel | None = None
        self._stub: pr_grpc.PodResourcesListerStub | None = None

    def begin_list(self, reason: str) -> asyncio.Future[KubeletRecord]:
        """A List asked for ``reason``, started now: the future gets the record, or fails with
        PodResourcesUnavailable; cancelling it cancels the call. The request leaves in the call's own
        task, which the loop runs next: a caller about to block the loop (an inline append) yields
        once first."""
        if not Path(self.socket).exists():
            failed: asyncio.Future[KubeletRecord] = asyncio.get_running_loop().create_future()
            failed.set_exception(PodResourcesUnavailable(f"no pod-resources socket at {self.socket}"))
            return failed
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
            self._stub = pr_grpc.PodResourcesListerStub(self._channel)
        call = self._stub.List(pr.ListPodResourcesRequest(), timeout=self.timeout)
        if self._on_list is not None:
            self._on_list(reason)
        return asyncio.ensure_future(self._answer(call))

    async def _answer(self, call: grpc.aio.UnaryUnaryCall) -> KubeletRecord:  # type: ignore[type-arg]
        try:
            listing = await call
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self._reset()  # the kubelet may have restarted: dial afresh next time
            raise PodResourcesUnavailable(
                f"pod-resources List on {self.socket} failed: {exc.code().name} {exc.details()}") from exc
        return record(listing)

    async def list(self, reason: str) -> KubeletRecord:
        return await self.begin_list(reason)

    async def _reset(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()

    async def close(self) -> None:
        await self._reset()
