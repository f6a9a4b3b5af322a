"""Checking the Allocate-time guess against the kubelet's record, and planning the corrections.

gpu-manager identifies a container only by "same vcore count, oldest predicate time", so two pending
pods with equal requests can be swapped (tkestack/gpu-manager#109). Here the guess is checked against
pod-resources (``holders``): a grant whose device IDs the kubelet records under another pod or
container is moved there, with that container's memory and core limit. A move keeps the GPU when the
new memory still fits on it, else the container is placed afresh; when nothing fits the correction is
refused and the caller fails only that container.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import msgspec

from libs.config import MEMORY_BLOCK
from libs.errors import ServiceError
from libs.events.schema import AllocationCorrected, GpuShare
from libs.kube.pods import Container, Pod
from libs.ledger.state import CLAIM_PREFIX, Allocation, GpuUsage, LedgerState
from libs.placement.placement import place
from libs.placement.recorded import ResponseSettings, reproduce
from services.allocator.extender import core_limit
from services.allocator.podresources import DeviceHolder, RecordedDevices

__all__ = ["Misattributed", "can_settle", "confirmed_grants", "misattributed", "plan_corrections", "settled_grants",
           "suspects"]


class Misattributed(msgspec.Struct, frozen=True):
    alloc: Allocation
    pod: Pod
    container: Container
    index: int
    init: bool


def suspects(state: LedgerState, found: dict[frozenset[str], DeviceHolder]) -> list[Allocation]:
    """Grants the kubelet records under a different (namespace, pod name, container)."""
    return [alloc for alloc, holder in sorted(_listed(state.allocations.values(), found),
                                              key=lambda pair: pair[0].granted_seq)
            if not _reused(alloc, holder) and not _holds(holder, alloc)]


def settled_grants(state: LedgerState, found: dict[frozenset[str], DeviceHolder], *,
                   among: Iterable[Allocation] | None = None) -> dict[str, DeviceHolder]:
    """The grants (of ``among``, by default all) the kubelet records under their own (namespace, pod
    name, container), with exactly their device IDs and their memory: alloc id -> that holder. The
    kubelet records a container's resources one Allocate at a time, vcore before vmemory: a List
    between the two shows the vcore IDs with no vmemory yet, which settles nothing (the PreStart then
    reads the kubelet itself)."""
    allocs = state.allocations.values() if among is None else among
    return {alloc.alloc_id: holder for alloc, holder in _listed(allocs, found)
            if _holds(holder, alloc) and holder.vmemory * MEMORY_BLOCK == alloc.memory}


def confirmed_grants(allocs: Iterable[Allocation], recorded: Mapping[tuple[str, str], RecordedDevices],
                     ) -> dict[str, DeviceHolder]:
    """The grants of ``allocs`` that the kubelet's checkpoint records under their own pod UID and
    container, with exactly their device IDs and their memory: alloc id -> that holder (as a List's
    ``settled_grants``, which it spares). Only confirms: a grant recorded otherwise, or not at all, is
    left to a List."""
    out: dict[str, DeviceHolder] = {}
    for alloc in allocs:
        got = recorded.get((alloc.pod_uid, alloc.container))
        if (got is not None and alloc.device_ids and got.vcore_ids == frozenset(alloc.device_ids)
                and got.vmemory * MEMORY_BLOCK == alloc.memory):
            out[alloc.alloc_id] = DeviceHolder(alloc.namespace, alloc.pod_name, alloc.container, got.vcore_ids,
                                               got.vmemory)
    return out


def can_settle(alloc: Allocation) -> bool:
    """Whether a List can settle the grant: pod-resources never lists an ordinary init container as
    itself, and a DRA claim's devices are not the device plugin's."""
    return not alloc.init_container and not alloc.alloc_id.startswith(CLAIM_PREFIX)


def _listed(allocs: Iterable[Allocation], found: dict[frozenset[str], DeviceHolder],
            ) -> Iterator[tuple[Allocation, DeviceHolder]]:
    """Each grant whose exact device IDs the kubelet lists, with the container listed for them."""
    for alloc in allocs:
        holder = found.get(frozenset(alloc.device_ids))
        if holder is not None:
            yield alloc, holder


def _holds(holder: DeviceHolder, alloc: Allocation) -> bool:
    return (holder.namespace, holder.pod_name, holder.container) == (alloc.namespace, alloc.pod_name, alloc.container)


def _reused(alloc: Allocation, holder: DeviceHolder) -> bool:
    """An ordinary init container's devices, listed under the later container of the same pod that
    reused them (pod-resources never lists ordinary init containers themselves)."""
    return alloc.init_container and (holder.namespace, holder.pod_name) == (alloc.namespace, alloc.pod_name)


def _locate(pod: Pod, name: str) -> tuple[Container, int, bool] | None:
    for i, c in enumerate(pod.spec.init_containers):
        if c.name == name:
            return c, i, True
    for i, c in enumerate(pod.spec.containers):
        if c.name == name:
            return c, i, False
    return None


def misattributed(
    state: LedgerState, found: dict[frozenset[str], DeviceHolder], pods: Sequence[Pod]
) -> list[Misattributed]:
    """Every grant held, per the kubelet, by another pod or container, with that real owner.

    The kubelet names pods by namespace and name; ``pods`` (the node's pods) gives their UID and
    spec. A pod recreated under the same name has a new UID, so the UID is compared too.
    """
    by_key = {(p.metadata.namespace, p.metadata.name): p for p in pods}
    out = []
    for alloc in sorted(state.allocations.values(), key=lambda a: a.granted_seq):
        holder = found.get(frozenset(alloc.device_ids))
        if holder is None or _reused(alloc, holder):
            continue
        pod = by_key.get((holder.namespace, holder.pod_name))
        if pod is None or (pod.uid, holder.container) == (alloc.pod_uid, alloc.container):
            continue
        located = _locate(pod, holder.container)
        if located is None:
            continue
        container, index, init = located
        out.append(Misattributed(alloc, pod, container, index, init))
    return out


def plan_corrections(
    state: LedgerState,
    wrong: Sequence[Misattributed],
    *,
    share_mode: bool,
    responses: ResponseSettings,
    reason: str,
) -> list[AllocationCorrected]:
    """The events that move every misattributed grant to its real owner, all or nothing; each carries
    the response the node's grants are built with (``responses``: hami-core delivery included).

    Raises ServiceError (409) naming the container that does not fit.
    """
    moving = {w.alloc.alloc_id for w in wrong}
    # The free capacity as if every moving grant were released: a swap of two pods must see both.
    view = {i: msgspec.structs.replace(g, alloc_ids=list(g.alloc_ids)) for i, g in state.gpus.items()}
    for w in wrong:
        if w.alloc.charged:
            _charge(view, w.alloc.alloc_id, w.alloc.shares, -1)
    links = state.inventory.links if state.inventory else ()
    events = []
    for w in wrong:
        alloc, pod = w.alloc, w.pod
        memory = w.container.vmemory * MEMORY_BLOCK
        shares = _keep_or_place(view, links, alloc, memory, share_mode, pod, w.container.name)
        if alloc.charged:
            _charge(view, alloc.alloc_id, shares, +1)
        response = reproduce(
            responses, shares=shares, cores=alloc.cores, memory=memory, pod_uid=pod.uid, container=w.container.name,
            compat32=w.container.compat32,
        )
        events.append(AllocationCorrected(
            alloc_id=alloc.alloc_id, pod_uid=pod.uid, namespace=pod.metadata.namespace,
            pod_name=pod.metadata.name, container=w.container.name, container_index=w.index,
            init_container=w.init, memory=memory, shares=shares, core_limit=core_limit(pod),
            response=response, previous_pod_uid=alloc.pod_uid, previous_container=alloc.container,
            reason=reason,
        ))
    assert len(events) == len(moving)
    return events


def _keep_or_place(
    view: dict[int, GpuUsage], links: Sequence[Sequence[str]], alloc: Allocation, memory: int,
    share_mode: bool, pod: Pod, container: str,
) -> tuple[GpuShare, ...]:
    if alloc.cores >= 100:
        return alloc.shares  # whole GPUs: the memory limit does not change what is held
    here = view.get(alloc.shares[0].index) if alloc.shares else None
    if here is not None and memory > 0 and here.cores_free >= alloc.cores and here.memory_free >= memory:
        return (msgspec.structs.replace(alloc.shares[0], memory=memory),)
    try:
        return place(list(view.values()), links, cores=alloc.cores, memory=memory, share_mode=share_mode)
    except ServiceError as exc:
        raise ServiceError(409, (
            f"the kubelet gave the devices of this grant to pod {pod.key} ({pod.uid}) container {container}, "
            f"whose {alloc.cores} vcuda-core and {memory} bytes cannot be placed: {exc.message}"
        )) from exc


def _charge(view: dict[int, GpuUsage], alloc_id: str, shares: Sequence[GpuShare], sign: int) -> None:
    for share in shares:
        gpu = view.get(share.index)
        if gpu is None:
            continue
        gpu.cores_used += sign * share.cores
        gpu.memory_used += sign * share.memory
        if sign > 0:
            gpu.alloc_ids.append(alloc_id)
        elif alloc_id in gpu.alloc_ids:
            gpu.alloc_ids.remove(alloc_id)
