"""gpu-manager's preStartContainerCheck (gpu-manager-reference.md 3.9, step 3), as a pure function.

Before a container starts, its grant must match what the kubelet holds for it: the cores equal the
number of vcore device IDs, the memory equals the vmemory count x 256 MiB (given, or from the pod
spec, which is where the kubelet's count came from), and the GPU count is exactly 1
below 100 cores and cores/100 from 100 on. The caller prefixes "PreStartContainer check failed, " so
that tools which look for that text (gpu-manager's ShouldDelete) recognise the failure.
"""

from __future__ import annotations

from libs.config import MEMORY_BLOCK
from libs.kube.pods import RESOURCE_VCORE, Pod
from libs.ledger.state import Allocation

__all__ = ["check_allocation"]


def check_allocation(alloc: Allocation, pod: Pod, *, cores: int, vmemory: int | None) -> str | None:
    """None when the grant matches; otherwise what does not, naming pod and container."""
    who = f"pod {alloc.pod_uid} container {alloc.container}"
    if vmemory is None:
        spec = [c for c in (*pod.spec.init_containers, *pod.spec.containers) if c.name == alloc.container]
        if not spec:
            return f"{who}: the pod has no such container"
        vmemory = spec[0].vmemory
    if alloc.cores != cores:
        return f"{who}: {alloc.cores} cores recorded, the kubelet holds {cores} {RESOURCE_VCORE} devices"
    if alloc.memory != vmemory * MEMORY_BLOCK:
        return f"{who}: memory {alloc.memory} recorded, the kubelet holds {vmemory * MEMORY_BLOCK} ({vmemory} blocks)"
    wanted = 1 if cores < 100 else cores // 100
    if len(alloc.shares) != wanted:
        return f"{who}: {len(alloc.shares)} GPU(s) recorded for {cores} cores, {wanted} expected"
    return None

