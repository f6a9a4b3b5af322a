"""The NVML monitor: usage samples, probes and XID/ECC events of the real GPUs.

One NVML session for the monitor's lifetime. Events come from an NVML event set
(`nvmlEventSetCreate`, `nvmlDeviceRegisterEvents` per GPU with the types it supports,
`nvmlEventSetWait_v2` with a timeout), so the thread that waits always comes back to check whether it
should stop. Per-process utilisation uses the previous call's timestamp, so each sample covers the
time since the last one; a GPU that does not support a query simply reports nothing for it.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from libs.gpu.health import ECC_DOUBLE, ECC_SINGLE, XID, GpuEvent
from libs.gpu.inventory import Inventory
from libs.gpu.monitor import GpuSample, ProcessSample, container_id_of
from libs.gpu.nvml import _text, _why, init_nvml
from libs.logger import get_logger

__all__ = ["NvmlMonitor"]

_logger = get_logger("gpu")


class NvmlMonitor:
    def __init__(self, inventory: Inventory, *, proc: Path = Path("/proc")) -> None:
        pynvml = init_nvml()
        self._nv: ModuleType = pynvml
        self._proc = proc
        self._lock = threading.Lock()  # NVML is thread-safe, but our timestamps and handles are not
        self._closed = False
        self._handles: dict[int, Any] = {}
        self._index_by_uuid: dict[str, int] = {}
        for g in inventory.gpus:
            h = pynvml.nvmlDeviceGetHandleByIndex(g.index)
            self._handles[g.index] = h
            self._index_by_uuid[g.uuid] = g.index
        self._last_ts: dict[int, int] = dict.fromkeys(self._handles, 0)
        self._events: Any = None
        self._register_events()

    def _register_events(self) -> None:
        nv = self._nv
        wanted = (nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeDoubleBitEccError
                  | nv.nvmlEventTypeSingleBitEccError)
        try:
            self._events = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            _logger.warning("no NVML event set: XID/ECC events will not be seen", error=_why(exc))
            return
        for index, h in self._handles.items():
            try:
                supported = nv.nvmlDeviceGetSupportedEventTypes(h)
                nv.nvmlDeviceRegisterEvents(h, wanted & supported, self._events)
            except nv.NVMLError as exc:
                _logger.warning("GPU does not report XID/ECC events", gpu=index, error=_why(exc))

    # --- events ---
    def wait_events(self, timeout: float) -> list[GpuEvent]:
        nv = self._nv
        if self._events is None or self._closed:
            threading.Event().wait(timeout)
            return []
        out: list[GpuEvent] = []
        wait_ms = max(1, int(timeout * 1000))
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(self._events, wait_ms)
            except nv.NVMLError_Timeout:
                return out
            except nv.NVMLError as exc:
                # e.g. GPU is lost: the probes will mark the GPU; do not spin on a broken event set.
                _logger.warning("waiting for NVML events failed", error=_why(exc))
                threading.Event().wait(timeout)
                return out
            event = self._event(data)
            if event is not None:
                out.append(event)
            wait_ms = 1  # drain what is already there, then hand the batch over

    def _event(self, data: Any) -> GpuEvent | None:
        nv = self._nv
        index = self._index_of(data.device)
        if index is None:
            return None
        kind = {nv.nvmlEventTypeXidCriticalError: XID, nv.nvmlEventTypeDoubleBitEccError: ECC_DOUBLE,
                nv.nvmlEventTypeSingleBitEccError: ECC_SINGLE}.get(int(data.eventType))
        if kind is None:
            return None
        xid = int(data.eventData) if kind == XID else 0
        return GpuEvent(index=index, kind=kind, xid=xid, detail=f"NVML event type {int(data.eventType)}")

    def _index_of(self, handle: Any) -> int | None:
        with contextlib.suppress(self._nv.NVMLError):
            return self._index_by_uuid.get(_text(self._nv.nvmlDeviceGetUUID(handle)))
        return None

    # --- probes and samples ---
    def probe(self, index: int) -> str | None:
        nv = self._nv
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            nv.nvmlDeviceGetMemoryInfo(h)
            nv.nvmlDeviceGetUtilizationRates(h)
        except nv.NVMLError as exc:
            return _why(exc)
        return None

    def sample(self) -> tuple[GpuSample, ...]:
        with self._lock:
            return tuple(self._sample(i, h) for i, h in sorted(self._handles.items()))

    def _sample(self, index: int, h: Any) -> GpuSample:
        nv = self._nv

        def optional(fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except nv.NVMLError:
                return None

        rates = optional(nv.nvmlDeviceGetUtilizationRates, h)
        memory = optional(nv.nvmlDeviceGetMemoryInfo, h)
        running = optional(nv.nvmlDeviceGetComputeRunningProcesses, h) or []
        util = optional(nv.nvmlDeviceGetProcessUtilization, h, self._last_ts[index]) or []
        sm: dict[int, float] = {}
        for s in util:
            sm[int(s.pid)] = max(sm.get(int(s.pid), 0.0), float(s.smUtil))
            self._last_ts[index] = max(self._last_ts[index], int(s.timeStamp))
        procs = []
        for p in running:
            used = p.usedGpuMemory
            procs.append(ProcessSample(pid=int(p.pid), sm_util=sm.get(int(p.pid), 0.0),
                                       memory=int(used) if isinstance(used, int) else 0,
                                       container_id=container_id_of(int(p.pid), self._proc)))
        return GpuSample(index=index, utilization=float(rates.gpu) if rates is not None else 0.0,
                         memory_used=int(memory.used) if memory is not None else 0, processes=tuple(procs))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        nv = self._nv
        if self._events is not None:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(self._events)
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()
