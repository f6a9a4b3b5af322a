"""What the allocator knows about a node's GPUs, and how to get it from a `--gpus` spec.

One frozen value (`Inventory`) whatever the source, so that the allocator, the simulator and the
tests cannot tell NVML from a fake profile. Everything here blocks (NVML is ctypes): async callers
use ``asyncio.to_thread(load_inventory, spec)``.
"""

from __future__ import annotations

from contextlib import closing
from typing import Protocol, runtime_checkable

import msgspec

from libs.errors import GpuError
from libs.events.schema import GpuInfo
from libs.log import get_logger

__all__ = ["GpuBackend", "Inventory", "load_inventory"]

_log = get_logger("gpu")


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


def load_inventory(spec: str) -> Inventory:
    """Read the inventory named by ``spec``: "auto", "nvml", "fake" or "fake:PATH".

    "auto" uses NVML when it initialises and sees at least one GPU, else the bundled default
    profile (with a warning, so that fake GPUs on a real node never go unnoticed).
    """
    # Imported here: both backends import Inventory from this module.
    from libs.gpu.fake import DEFAULT_FAKE_PROFILE, FakeBackend
    from libs.gpu.nvml import NvmlBackend, NvmlUnavailable

    if spec == "nvml":
        with closing(NvmlBackend()) as nvml:
            inventory = nvml.inventory()
        if not inventory.gpus:
            raise GpuError("NVML works but reports no GPUs; use --gpus fake:FILE to run with fake GPUs")
        return inventory
    if spec == "auto":
        try:
            nvml = NvmlBackend()
        except NvmlUnavailable as exc:
            reason = exc.reason
        else:
            with closing(nvml):
                if nvml.device_count() > 0:
                    return nvml.inventory()
            reason = "NVML reports no GPUs"
        _log.warning("using fake GPUs", reason=reason, profile=str(DEFAULT_FAKE_PROFILE))
        spec = "fake"
    if spec == "fake" or spec.startswith("fake:"):
        path = spec[len("fake:") :] if spec.startswith("fake:") else str(DEFAULT_FAKE_PROFILE)
        if not path:
            raise GpuError("GPU source 'fake:' needs a file: fake:PATH")
        with closing(FakeBackend(path)) as fake:
            return fake.inventory()
    raise GpuError(f"unknown GPU source {spec!r}: use auto, nvml, fake or fake:PATH")
