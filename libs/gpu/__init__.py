"""The node's GPUs: one `Inventory` value from NVML or from a fake profile file.

``load_inventory(spec)`` is the entry point (spec: auto | nvml | fake | fake:PATH); `topology`
holds the `nvidia-smi topo -m` tokens the links are written in.
"""

from __future__ import annotations

from libs.gpu.fake import DEFAULT_FAKE_PROFILE, FakeBackend
from libs.gpu.inventory import GpuBackend, Inventory, load_inventory
from libs.gpu.nvml import NvmlBackend
from libs.gpu.topology import link_level, nvlink_count, parse_topo_matrix

__all__ = [
    "DEFAULT_FAKE_PROFILE",
    "FakeBackend",
    "GpuBackend",
    "Inventory",
    "NvmlBackend",
    "link_level",
    "load_inventory",
    "nvlink_count",
    "parse_topo_matrix",
]
