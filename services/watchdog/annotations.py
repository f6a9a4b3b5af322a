"""Repairing the annotations of a running GPU pod from the ledger (gpu-manager-reference.md 4.3).

What a pod should carry is libs/kube/annotations.py's rule, the very one the allocator writes with;
for a Running pod (PreStartContainer passed) ``gpu-assigned`` is ``"true"``. The periodic
reconciliation patches a running pod whose annotations disagree (a failed patch, a user edit), as
gpu-manager's checkAllocation does; a pod that agrees is never patched.
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

__all__ = ["AnnotationRepair"]

_logger = get_logger("watchdog")


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
