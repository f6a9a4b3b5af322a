"""Node labels: the GPU model and the labels given by ``--node-labels``, kept up to date.

gpu-manager set them once at start and never refreshed them, and its model label (the second word of
the name) was empty for most datacenter names (gpu-manager-reference.md 6.4). Here the model is the
GPU name without the vendor word, made a valid label value ("NVIDIA H100 80GB HBM3" -> "H100-80GB-HBM3"),
and the labels are checked at every reconciliation. Keys we set are remembered in an annotation, so a
label dropped from the configuration is removed from the node too.
"""

from __future__ import annotations

import re

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from libs.logger import get_logger

__all__ = ["MANAGED_ANNOTATION", "MODEL_LABEL", "NodeLabeler", "model_label_value"]

_logger = get_logger("watchdog")
MODEL_LABEL = "gaia.tencent.com/gpu-model"  # gpu-manager's key, so existing node selectors keep working
MANAGED_ANNOTATION = "gpuledger.io/managed-labels"
_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}


def model_label_value(gpu_name: str) -> str:
    words = gpu_name.split()
    while len(words) > 1 and words[0].lower() in _VENDOR_WORDS:
        words = words[1:]
    value = re.sub(r"[^A-Za-z0-9_.]+", "-", " ".join(words))[:63]
    return value.strip("-_.")


class NodeLabeler:
    def __init__(self, client: AsyncClient, node: str, configured: dict[str, str]) -> None:
        self.client = client
        self.node = node
        self.configured = configured
        self.updates = 0  # patches sent, for logs and tests

    def wanted(self, gpu_names: list[str]) -> dict[str, str]:
        labels = dict(self.configured)
        model = model_label_value(gpu_names[0]) if gpu_names else ""
        if model:
            labels[MODEL_LABEL] = model
        return labels

    async def ensure(self, gpu_names: list[str]) -> bool:
        """Patch the node when a label is missing, different, or no longer configured; True if patched."""
        wanted = self.wanted(gpu_names)
        node = await self.client.get(Node, self.node)
        meta = node.metadata
        have = dict(meta.labels or {}) if meta else {}
        managed_before = set(filter(None, ((meta.annotations or {}) if meta else {}).get(MANAGED_ANNOTATION, "")
                                    .split(",")))
        changes: dict[str, str | None] = {k: v for k, v in wanted.items() if have.get(k) != v}
        changes.update({k: None for k in managed_before - set(wanted) if k in have})
        managed = ",".join(sorted(wanted))
        if not changes and managed == ",".join(sorted(managed_before)):
            return False
        await self.client.patch(
            Node, self.node,
            {"metadata": {"labels": changes, "annotations": {MANAGED_ANNOTATION: managed}}},
            patch_type=PatchType.MERGE,
        )
        self.updates += 1
        _logger.info("node labels updated", node=self.node, changes=changes)
        return True
