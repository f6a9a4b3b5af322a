"""The node's GPUs: one `Inventory` value from NVML or from a fake profile file.

``load_inventory(spec)`` is the entry point (spec: auto | nvml | fake | fake:PATH) and
``open_monitor(inventory)`` watches the GPUs it found (both in `backends`); `topology`
holds the `nvidia-smi topo -m` tokens the links are written in; `tree` groups the GPUs by those
levels (gpu-manager's topology tree).
"""

from __future__ import annotations

from libs.gpu.backends import load_inventory, open_monitor
from libs.gpu.fake import DEFAULT_FAKE_PROFILE, FakeBackend
from libs.gpu.inventory import GpuBackend, Inventory
from libs.gpu.nvml import NvmlBackend
from libs.gpu.topology import link_level, nvlink_count, parse_topo_matrix
from libs.gpu.tree import TopologyTree, TreeNode, build_tree

__all__ = [
    "DEFAULT_FAKE_PROFILE",
    "FakeBackend",
    "GpuBackend",
    "Inventory",
    "NvmlBackend",
    "TopologyTree",
    "TreeNode",
    "build_tree",
    "link_level",
    "load_inventory",
    "nvlink_count",
    "open_monitor",
    "parse_topo_matrix",
]
