"""Repairing the annotations of a running GPU pod from the ledger (gpu-manager-reference.md 4.3).

What a pod should carry is libs/kube/annotations.py's rule, the very one the allocator writes with;
for a Running pod (PreStartContainer passed) ``gpu-assigned`` is ``"true"``. The periodic
reconciliation patches a running pod whose annotations disagree (a failed patch, a user edit), as
gpu-manager's checkAllocation does; a pod that agrees is never patched. A pod granted less than
``ALLOCATOR_WRITES_FOR_S`` ago is left to the allocator's own write, which waits a second for the
pod's next step and is retried for 10 s (services/allocator/extender.py): repairing it meanwhile
would patch the pod twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod as KubePod
from lightkube.types import PatchType

from libs.kube.annotations import disagreeing, ready_annotations, started
from libs.kube.pods import Pod
from libs.ledger.state import Allocation
from libs.logger import get_logger

__all__ = ["ALLOCATOR_WRITES_FOR_S", "AnnotationRepair", "left_to_the_allocator"]

ALLOCATOR_WRITES_FOR_S = 15.0

_logger = get_logger("watchdog")


def left_to_the_allocator(allocations: Iterable[Allocation], now_ns: int) -> bool:
    """Some grant of the pod is younger than ALLOCATOR_WRITES_FOR_S: its annotations are on their way."""
    return any(now_ns - a.granted_at < ALLOCATOR_WRITES_FOR_S * 1e9 for a in allocations)


class AnnotationRepair:
    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.patched: list[str] = []  # pod keys, for logs and tests

    async def repair(self, pod: Pod, allocations: Iterable[Allocation], indexes: Mapping[int, int] | None = None,
                     ) -> bool:
        """``indexes``: ``extender_indexes`` of the node's GPUs (None: the minors themselves)."""
        wanted = ready_annotations(allocations, assigned=started(pod.status.phase), indexes=indexes)
        fix = disagreeing(pod.metadata.annotations, wanted)
        if not fix:
            return False
        await self.client.patch(KubePod, pod.metadata.name, {"metadata": {"annotations": fix}},
                                namespace=pod.metadata.namespace, patch_type=PatchType.MERGE)
        self.patched.append(pod.key)
        _logger.info("patched annotations that disagreed with the ledger", pod=pod.key, annotations=fix)
        return True
