"""Placement of an app container that reuses its init containers' kubelet devices.

The kubelet hands a finished (non-sidecar) init container's device IDs on to the pod's later
containers. Such a container goes on the GPUs of the init grants it takes over (``LedgerState
.reused_by``), placed as if their shares were already free, since the fold moves the hold to it
(``LedgerState._absorb_reused``). Shared by the allocator's Allocate and by ``gpuledger simulate``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from libs.errors import ServiceError
from libs.events.schema import GpuShare
from libs.ledger.state import Allocation, GpuUsage, LedgerState
from libs.placement.placement import Links, place

__all__ = ["place_on_reused", "reuse_view", "without"]

Placer = Callable[..., tuple[GpuShare, ...]]


def reuse_view(
    state: LedgerState, pod_uid: str, device_ids: Iterable[str], *, init: bool,
) -> tuple[list[Allocation], list[GpuUsage]]:
    """The init grants this container takes over, and the GPUs' usage as if they were handed on."""
    reused = [] if init else state.reused_by(pod_uid, set(device_ids))
    return reused, without(state.gpus, reused)


def without(gpus: dict[int, GpuUsage], reused: list[Allocation]) -> list[GpuUsage]:
    """The GPUs' usage as if the reused init-container grants were already handed on (to read: with
    nothing reused, the state's own, uncopied, in index order)."""
    if not reused:  # the usual case: every Allocate asks this, and a copy per GPU costs more than placing
        return [g for _, g in sorted(gpus.items())]
    view = {i: msgspec.structs.replace(g, alloc_ids=list(g.alloc_ids)) for i, g in sorted(gpus.items())}
    for alloc in reused:
        for share in alloc.shares:
            gpu = view.get(share.index)
            if gpu is not None:
                gpu.cores_used -= share.cores
                gpu.memory_used -= share.memory
                if alloc.alloc_id in gpu.alloc_ids:
                    gpu.alloc_ids.remove(alloc.alloc_id)
    return list(view.values())


def place_on_reused(
    reused: list[Allocation], view: list[GpuUsage], links: Links, *, cores: int, memory: int, share_mode: bool,
    placer: Placer = place,
) -> tuple[GpuShare, ...] | None:
    """Shares on the reused grants' GPUs; None when there are none or they are too small for it
    (then it is placed anywhere, on ``view``)."""
    if not reused:
        return None
    theirs = {s.index for a in reused for s in a.shares}
    try:
        return placer([g for g in view if g.index in theirs], links, cores=cores, memory=memory,
                      share_mode=share_mode)
    except ServiceError:
        return None
