"""A placement dry run: pods added and deleted on a node, placed by the allocator's own code.

`Simulation` plays what the kubelet and the allocator do for each pod, without any process: the
kubelet's device-ID accounting (``requested number of devices unavailable`` comes before any
Allocate; a non-sidecar init container's IDs are reused by the later containers of its pod), then
for every container that asks for ``tencent.com/vcuda-core``, in the kubelet's order (init
containers first), the allocator's `place()` over the `LedgerState` folded from the same
``alloc.granted``/``alloc.released`` events the allocator writes. A refusal is reported with the
text the pod's ``UnexpectedAdmissionError`` would carry, and the pod's earlier grants go back (the
watchdog recycles a rejected pod).

Each grant carries the kubelet's device IDs, as the allocator records them, so the allocator's own
reuse rule applies (``libs.placement.reuse``, ``LedgerState._absorb_reused``): an app container
that reuses its init containers' devices goes on their GPUs and takes over their hold (charged once).
Used by ``gpuledger simulate`` and by bench/placement_quality.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from libs.config import MEMORY_BLOCK
from libs.errors import ServiceError
from libs.events.codec import StoredEvent
from libs.events.schema import (
    AllocationGranted,
    AllocationReleased,
    ContainerResponse,
    Event,
    GpuShare,
    InventoryRecorded,
)
from libs.gpu.inventory import Inventory
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY, Container, Pod
from libs.ledger.state import GpuUsage, LedgerState
from libs.placement.placement import Links, place
from libs.placement.reuse import place_on_reused, reuse_view

__all__ = ["Placer", "Simulation", "admission_error"]

Placer = Callable[..., tuple[GpuShare, ...]]

# How the registrar hands a ServiceError's code to the kubelet (gRPC status), in Go's spelling.
_GO_CODES = {400: "InvalidArgument", 404: "NotFound", 409: "FailedPrecondition", 503: "Unavailable",
             504: "DeadlineExceeded"}


def admission_error(detail: str) -> str:
    """The message of a pod rejected because Allocate failed (kubelet's UnexpectedAdmissionError)."""
    return f"Allocate failed due to {detail}, which is unexpected"


def _rpc_error(exc: ServiceError) -> str:
    return f"rpc error: code = {_GO_CODES.get(exc.code, 'Internal')} desc = {exc.message}"


@dataclass
class _SimPod:
    pod: Pod
    failed: bool = False
    ids: dict[str, int] = field(default_factory=dict)     # kubelet device IDs held, per resource
    reuse: dict[str, list[str]] = field(default_factory=dict)  # init containers' IDs later ones may take


class Simulation:
    def __init__(self, inventory: Inventory, *, share_mode: bool = True, placer: Placer = place) -> None:
        self.inventory = inventory
        self.share_mode = share_mode
        self.placer = placer
        self.state = LedgerState()
        self.pods: dict[str, _SimPod] = {}
        self._seq = itertools.count(1)
        self._uids = itertools.count(1)
        self._device_ids = itertools.count(1)
        self.capacity = {
            RESOURCE_VCORE: 100 * len(inventory.gpus),
            RESOURCE_VMEMORY: sum(g.memory for g in inventory.gpus) // MEMORY_BLOCK,
        }
        self._record(InventoryRecorded(node="simulate", backend=inventory.backend,
                                       driver_version=inventory.driver_version, gpus=inventory.gpus,
                                       links=inventory.links))

    @property
    def links(self) -> Links:
        return self.inventory.links

    def _record(self, event: Event) -> None:
        seq = next(self._seq)
        self.state.apply(StoredEvent(seq=seq, recorded_at=seq, stream_id=event.stream(), version=1,
                                     event_id=f"{seq:032x}", event=event))

    def gpus(self) -> list[GpuUsage]:
        return [self.state.gpus[i] for i in sorted(self.state.gpus)]

    # --- operations ---
    def add(self, pod: Pod) -> list[dict[str, Any]]:
        """Admit a pod; one result per vcuda-core container, up to the first refusal."""
        key = pod.key
        if key in self.pods:
            raise ValueError(f"pod {key} already exists; delete it first")
        if not pod.metadata.uid:
            pod.metadata.uid = f"sim-{next(self._uids):06d}"
        sim = _SimPod(pod)
        self.pods[key] = sim
        results = []
        order = [(c, i, True) for i, c in enumerate(pod.spec.init_containers)]
        order += [(c, i, False) for i, c in enumerate(pod.spec.containers)]
        for container, index, init in order:
            result = self._admit(sim, container, index, init)
            if result is not None:
                results.append(result)
                if "error" in result:
                    sim.failed = True
                    self._release(sim, "failed")
                    break
        return results

    def delete(self, key: str) -> dict[str, Any]:
        sim = self.pods.pop(key, None)
        if sim is None:
            raise KeyError(key)
        gpus = sorted({s.index for a in self.state.pod_allocations(sim.pod.uid) for s in a.shares})
        self._release(sim, "deleted")
        return {"pod": key, "deleted": True, "gpus": gpus}

    # --- the kubelet, then the allocator ---
    def _admit(self, sim: _SimPod, c: Container, index: int, init: bool) -> dict[str, Any] | None:
        cores, blocks = c.vcore, c.vmemory
        if cores <= 0 and blocks <= 0:
            return None
        base = {"pod": sim.pod.key, "container": c.name, "init": init, "cores": cores,
                "memory": blocks * MEMORY_BLOCK}
        device_ids: list[str] = []
        for resource, wanted in ((RESOURCE_VCORE, cores), (RESOURCE_VMEMORY, blocks)):
            taken = self._take_ids(sim, resource, wanted, release_to_reuse=init and c.restart_policy != "Always")
            if isinstance(taken, str):
                return {**base, "error": admission_error(taken)}
            if resource == RESOURCE_VCORE:
                device_ids = taken
        if cores <= 0:
            return None  # vcuda-memory only: its Allocate is answered without a placement
        memory = blocks * MEMORY_BLOCK
        reused, view = reuse_view(self.state, sim.pod.uid, device_ids, init=init)
        try:
            shares = place_on_reused(reused, view, self.links, cores=cores, memory=memory,
                                     share_mode=self.share_mode, placer=self.placer) or self.placer(
                view, self.links, cores=cores, memory=memory, share_mode=self.share_mode)
        except ServiceError as exc:
            return {**base, "error": admission_error(_rpc_error(exc))}
        self._record(AllocationGranted(
            alloc_id=f"{sim.pod.uid}/{'init' if init else 'app'}/{index}", request_id=f"sim-{self.state.seq}",
            pod_uid=sim.pod.uid, namespace=sim.pod.metadata.namespace, pod_name=sim.pod.metadata.name,
            container=c.name, container_index=index, init_container=init, cores=cores,
            memory=memory, device_ids=tuple(device_ids), shares=shares, core_limit=None,
            response=ContainerResponse(),
        ))
        return {**base, "gpus": [s.index for s in shares]}

    def _take_ids(self, sim: _SimPod, resource: str, wanted: int, *, release_to_reuse: bool) -> list[str] | str:
        """The kubelet's device-ID check: the IDs given (its init containers' first), else its error."""
        if wanted <= 0:
            return []
        pool = sim.reuse.setdefault(resource, [])
        from_reuse = min(wanted, len(pool))
        needed = wanted - from_reuse
        in_use = sum(p.ids.get(resource, 0) for p in self.pods.values())
        available = self.capacity[resource] - in_use
        if needed > available:
            return (f"requested number of devices unavailable for {resource}. "
                    f"Requested: {needed}, Available: {available}")
        given = pool[:from_reuse] + [f"{resource}-{next(self._device_ids)}" for _ in range(needed)]
        del pool[:from_reuse]
        sim.ids[resource] = sim.ids.get(resource, 0) + needed
        if release_to_reuse:  # a finished init container's devices go to the pod's later containers
            pool.extend(given)
        return given

    def _release(self, sim: _SimPod, reason: str) -> None:
        for alloc in self.state.pod_allocations(sim.pod.uid):
            self._record(AllocationReleased(alloc_id=alloc.alloc_id, pod_uid=alloc.pod_uid,
                                            container=alloc.container, reason=reason))
        sim.ids.clear()
        sim.reuse.clear()

    # --- measures ---
    def utilisation(self) -> float:
        """Fraction of the node's cores held by grants."""
        gpus: Sequence[GpuUsage] = self.gpus()
        return sum(min(g.cores_used, 100) for g in gpus) / (100 * len(gpus)) if gpus else 0.0
