"""What the allocator knows about a node's GPUs; ``backends.load_inventory`` gets it from a `--gpus` spec.

One frozen value (`Inventory`) whatever the source, so that the allocator, the simulator and the
tests cannot tell NVML from a fake profile. Reading one blocks (NVML is ctypes): async callers
use ``asyncio.to_thread(load_inventory, spec)``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec

from libs.events.schema import GpuInfo

__all__ = ["GpuBackend", "Inventory"]


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    backend: str                              # "nvml" or "fake"
    driver_version: str                       # "" when unknown
    gpus: tuple[GpuInfo, ...]                 # sorted by index
    links: tuple[tuple[str, ...], ...]        # links[i][j]: nvidia-smi topo token, "X" on the diagonal


@runtime_checkable
class GpuBackend(Protocol):
    """A source of inventories; `close` releases what the backend holds (NVML's handle)."""

    def inventory(self) -> Inventory: ...

    def close(self) -> None: ...
