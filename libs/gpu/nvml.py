"""The NVML backend: the real node's GPUs and their links, in nvidia-smi's topology tokens.

`pynvml` comes from the `nvidia-ml-py` distribution (never the deprecated `pynvml` dist, whose import
hook warns). It is imported when the backend is created, so a test can put a small fake module in
``sys.modules`` first. Calls block (ctypes); callers run them in a thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from libs.errors import GpuError
from libs.events.schema import GpuInfo
from libs.gpu.inventory import Inventory

__all__ = ["NvmlBackend", "NvmlUnavailable", "init_nvml"]

T = TypeVar("T")

# nvmlGpuTopologyLevel_t -> token. INTERNAL between two different devices is a multi-GPU board: PIX, as
# gpu-manager does (its commit 2df5958d).
_LEVEL_TOKENS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


class NvmlUnavailable(GpuError):
    """NVML cannot be used on this machine (no driver, no library); "auto" then falls back to fake."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"NVML is not available: {reason}; use --gpus fake:FILE (or fake) to run without GPUs"
        )
        self.reason = reason


def init_nvml() -> ModuleType:
    """The pynvml module after ``nvmlInit`` (each caller pairs it with ``nvmlShutdown``), or NvmlUnavailable."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable(f"cannot import pynvml ({exc}); install nvidia-ml-py") from exc
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as exc:
        raise NvmlUnavailable(_why(exc)) from exc
    return pynvml


def _why(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # pynvml formats messages through the library, which may be the thing missing
        text = ""
    return text or type(exc).__name__


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", "replace")
    return str(value).strip("\x00 \t\r\n")


def _norm_bus_id(bus_id: str) -> str:
    """One spelling for a PCI address: NVML mixes 8- and 4-digit domains and letter case."""
    try:
        head, function = bus_id.strip().rsplit(".", 1)
        parts = head.split(":")
        domain, bus, device = (["0", *parts] if len(parts) == 2 else parts)
        return f"{int(domain, 16):08x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function, 16):x}"
    except ValueError:
        return bus_id.strip().lower()


class NvmlBackend:
    """GpuBackend over NVML: `nvmlInit` in the constructor, `nvmlShutdown` in `close`."""

    def __init__(self) -> None:
        self._nv: ModuleType = init_nvml()
        self._open = True

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._open:
            self._open = False
            with contextlib.suppress(self._nv.NVMLError):  # nothing left to release
                self._nv.nvmlShutdown()

    def _required(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except self._nv.NVMLError as exc:
            raise GpuError(f"NVML query {what} failed: {_why(exc)}") from exc

    def _optional(self, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except self._nv.NVMLError:
            return None

    def device_count(self) -> int:
        return int(self._required("nvmlDeviceGetCount", self._nv.nvmlDeviceGetCount))

    def inventory(self) -> Inventory:
        if not self._open:
            raise GpuError("NVML backend is closed")
        nv = self._nv
        driver = self._optional(nv.nvmlSystemGetDriverVersion)
        handles = [
            self._required(f"nvmlDeviceGetHandleByIndex({i})", nv.nvmlDeviceGetHandleByIndex, i)
            for i in range(self.device_count())
        ]
        gpus = tuple(self._gpu(i, h) for i, h in enumerate(handles))
        return Inventory(
            backend="nvml",
            driver_version=_text(driver) if driver is not None else "",
            gpus=gpus,
            links=self._links(handles, gpus),
        )

    def _gpu(self, i: int, h: Any) -> GpuInfo:
        nv = self._nv

        def required(fn: Callable[..., T]) -> T:
            return self._required(f"{fn.__name__}(GPU {i})", fn, h)

        name = self._optional(nv.nvmlDeviceGetName, h)
        return GpuInfo(
            index=i,
            minor=int(required(nv.nvmlDeviceGetMinorNumber)),
            uuid=_text(required(nv.nvmlDeviceGetUUID)),
            pci_bus_id=_text(required(nv.nvmlDeviceGetPciInfo).busId),
            memory=int(required(nv.nvmlDeviceGetMemoryInfo).total),
            name=_text(name) if name is not None else "",
        )

    def _links(self, handles: list[Any], gpus: tuple[GpuInfo, ...]) -> tuple[tuple[str, ...], ...]:
        n = len(handles)
        direct, switch = self._nvlinks(handles, gpus)
        ancestor = self._nv.nvmlDeviceGetTopologyCommonAncestor
        rows = [["X"] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                links = max(direct[i][j], direct[j][i]) or min(switch[i], switch[j])
                if links:
                    token = f"NV{links}"
                else:
                    level = self._optional(ancestor, handles[i], handles[j])
                    # Unknown or unreadable (some VMs): the farthest level, rather than invent closeness.
                    token = _LEVEL_TOKENS.get(int(level), "SYS") if level is not None else "SYS"
                rows[i][j] = rows[j][i] = token
        return tuple(tuple(row) for row in rows)

    def _nvlinks(self, handles: list[Any], gpus: tuple[GpuInfo, ...]) -> tuple[list[list[int]], list[int]]:
        """Active NVLinks per GPU pair (direct[i][j]) and per GPU into NVSwitches (switch[i]).

        GPUs behind NVSwitches (DGX/HGX) see no GPU at the far end of their links; nvidia-smi shows
        every such pair as NV<links>, and so do we (the smaller link count of the two).
        """
        nv = self._nv
        n = len(handles)
        by_bus = {_norm_bus_id(g.pci_bus_id): g.index for g in gpus}
        enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
        switch_type = getattr(nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        remote_type = getattr(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
        direct = [[0] * n for _ in range(n)]
        switch = [0] * n
        for i, h in enumerate(handles):
            for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
                if self._optional(nv.nvmlDeviceGetNvLinkState, h, link) != enabled:
                    continue  # inactive, or NotSupported (no NVLink on this GPU)
                pci = self._optional(nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
                j = by_bus.get(_norm_bus_id(_text(pci.busId))) if pci is not None else None
                if j is not None and j != i:
                    direct[i][j] += 1
                elif j is None and remote_type is not None:
                    switch[i] += int(self._optional(remote_type, h, link) == switch_type)
        return direct, switch
