"""Which GPU backend to open: the factories behind the ports in ``inventory`` and ``monitor``.

``inventory.py`` and ``monitor.py`` say what the allocator reads (an `Inventory`, a `GpuMonitor`) and
import no backend; the backends (``nvml``, ``fake``, ``nvml_monitor``) import those ports; only this
module knows them all and picks one, so no import circle runs through the ports.
Everything here blocks (NVML is ctypes): async callers use ``asyncio.to_thread(load_inventory, spec)``.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

from libs.errors import GpuError
from libs.gpu.fake import DEFAULT_FAKE_PROFILE, FakeBackend
from libs.gpu.inventory import Inventory
from libs.gpu.monitor import FakeMonitor, GpuMonitor
from libs.gpu.nvml import NvmlBackend, NvmlUnavailable
from libs.gpu.nvml_monitor import NvmlMonitor
from libs.logger import get_logger

__all__ = ["load_inventory", "open_monitor"]

_logger = get_logger("gpu")


def load_inventory(spec: str) -> Inventory:
    """Read the inventory named by ``spec``: "auto", "nvml", "fake" or "fake:PATH".

    "auto" uses NVML when it initialises and sees at least one GPU, else the bundled default
    profile (with a warning, so that fake GPUs on a real node never go unnoticed).
    """
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
        _logger.warning("using fake GPUs", reason=reason, profile=str(DEFAULT_FAKE_PROFILE))
        spec = "fake"
    if spec == "fake" or spec.startswith("fake:"):
        path = spec[len("fake:") :] if spec.startswith("fake:") else str(DEFAULT_FAKE_PROFILE)
        if not path:
            raise GpuError("GPU source 'fake:' needs a file: fake:PATH")
        with closing(FakeBackend(path)) as fake:
            return fake.inventory()
    raise GpuError(f"unknown GPU source {spec!r}: use auto, nvml, fake or fake:PATH")


def open_monitor(inventory: Inventory, proc: Path = Path("/proc")) -> GpuMonitor:
    """The monitor for the backend the inventory came from (NVML stays initialised until close).
    ``proc`` is the host's /proc (``--proc-root``), where GPU processes are matched to containers."""
    if inventory.backend == "nvml":
        return NvmlMonitor(inventory, proc=proc)
    return FakeMonitor(inventory)
