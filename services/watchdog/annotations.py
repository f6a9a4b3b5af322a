"""The annotations a running GPU pod must carry (gpu-manager-reference.md 3.3), from the ledger.

For each app container holding shares: ``tencent.com/predicate-gpu-idx-<container index>`` = the
GPU minors, comma-joined; and ``tencent.com/gpu-assigned: "true"``. The allocator writes them at
allocation time; the reconciliation patches a running pod whose annotations disagree (a failed
patch, a user edit), as gpu-manager's checkAllocation does.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod as KubePod
from lightkube.types import PatchType

from libs.kube.pods import ANNOTATION_GPU_ASSIGNED, ANNOTATION_PREDICATE_IDX, Pod
from libs.ledger.state import Allocation
from libs.log import get_logger

__all__ = ["AnnotationRepair", "disagreeing", "ready_annotations"]

_log = get_logger("watchdog")


def ready_annotations(allocations: Iterable[Allocation]) -> dict[str, str]:
    wanted: dict[str, str] = {}
    for alloc in sorted(allocations, key=lambda a: a.container_index):
        if alloc.init_container:
            continue
        wanted[f"{ANNOTATION_PREDICATE_IDX}{alloc.container_index}"] = ",".join(str(s.minor) for s in alloc.shares)
    if wanted:
        wanted[ANNOTATION_GPU_ASSIGNED] = "true"
    return wanted


def disagreeing(pod: Pod, wanted: dict[str, str]) -> dict[str, str]:
    """The wanted annotations the pod lacks or has with another value."""
    have = pod.metadata.annotations
    return {k: v for k, v in wanted.items() if have.get(k) != v}


class AnnotationRepair:
    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.patched: list[str] = []  # pod keys, for logs and tests

    async def repair(self, pod: Pod, allocations: Iterable[Allocation]) -> bool:
        fix = disagreeing(pod, ready_annotations(allocations))
        if not fix:
            return False
        await self.client.patch(KubePod, pod.metadata.name, {"metadata": {"annotations": fix}},
                                namespace=pod.metadata.namespace, patch_type=PatchType.MERGE)
        self.patched.append(pod.key)
        _log.info("patched annotations that disagreed with the ledger", pod=pod.key, annotations=fix)
        return True
