"""The node's GPUs: one `Inventory` value from NVML or from a fake profile file.

``load_inventory(spec)`` is the entry point (spec: auto | nvml | fake | fake:PATH) and
``open_monitor(inventory)`` watches the GPUs it found (both in `backends`); `topology`
holds the `nvidia-smi topo -m` tokens the links are written in; `tree` groups the GPUs by those
levels (gpu-manager's topology tree).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libs.gpu.backends import load_inventory, open_monitor
    from libs.gpu.fake import DEFAULT_FAKE_PROFILE, FakeBackend
    from libs.gpu.inventory import GpuBackend, Inventory
    from libs.gpu.nvml import NvmlBackend
    from libs.gpu.topology import link_level, nvlink_count, parse_topo_matrix
    from libs.gpu.tree import TopologyTree, TreeNode, build_tree

# Names are loaded on first use: a service that only needs a submodule (the topology tokens, via
# placement) must not pay for the backends, NVML and the fake profiles' YAML at import.
_HOMES = {
    "load_inventory": "backends", "open_monitor": "backends",
    "DEFAULT_FAKE_PROFILE": "fake", "FakeBackend": "fake",
    "GpuBackend": "inventory", "Inventory": "inventory",
    "NvmlBackend": "nvml",
    "link_level": "topology", "nvlink_count": "topology", "parse_topo_matrix": "topology",
    "TopologyTree": "tree", "TreeNode": "tree", "build_tree": "tree",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


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
