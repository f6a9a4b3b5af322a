"""Watching the GPUs while the agent runs: usage samples, health probes and NVML events.

`GpuMonitor` is what the allocator keeps open for its lifetime (`Inventory` is read once at start).
Every method blocks (NVML is ctypes): callers use a thread. `backends.open_monitor(inventory)` picks
NVML or the fake monitor by the inventory's backend.

The fake monitor is deterministic: a GPU is idle (0 % and 0 bytes used) until processes are put on
it with ``set_processes``; its events and probe failures are injected (the allocator does it on the
``allocator.gpu-inject`` command, which ``gpuledger gpu inject-xid`` sends), so health and usage are
tested end to end without a GPU.
"""

from __future__ import annotations

import queue
import re
import threading
from pathlib import Path
from typing import Protocol

import msgspec

from libs.gpu.health import GpuEvent
from libs.gpu.inventory import Inventory

__all__ = [
    "FakeMonitor",
    "GpuMonitor",
    "GpuSample",
    "InjectReply",
    "InjectRequest",
    "ProcessSample",
    "apply_injection",
    "container_id_of",
    "inject_subject",
]

# The last 64-hex token of a cgroup path is the container ID for docker, containerd and cri-o
# (docker-<id>.scope, cri-containerd-<id>.scope, crio-<id>.scope, /kubepods/.../<id>).
_CONTAINER_ID = re.compile(r"([0-9a-f]{64})")


class ProcessSample(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    sm_util: float = 0.0        # percent of the GPU's SMs over the last sample window
    memory: int = 0             # bytes of GPU memory the process holds
    container_id: str = ""      # from /proc/<pid>/cgroup; "" when not in a container


class GpuSample(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    utilization: float = 0.0    # percent, the whole GPU
    memory_used: int = 0        # bytes, the whole GPU
    processes: tuple[ProcessSample, ...] = ()


class GpuMonitor(Protocol):
    def sample(self) -> tuple[GpuSample, ...]: ...

    def probe(self, index: int) -> str | None:
        """None when the GPU answers every query, else what failed."""
        ...

    def wait_events(self, timeout: float) -> list[GpuEvent]:
        """Health events that arrived, waiting up to ``timeout`` seconds for the first one."""
        ...

    def close(self) -> None: ...


def container_id_of(pid: int, proc: Path = Path("/proc")) -> str:
    """The container a host pid runs in ("" if none or the pid is gone); needs the host pid namespace."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return ""
    found = ""
    for line in text.splitlines():
        ids = _CONTAINER_ID.findall(line.rsplit(":", 1)[-1])
        if ids:
            found = ids[-1]
    return found


class FakeMonitor:
    def __init__(self, inventory: Inventory) -> None:
        self._n = len(inventory.gpus)
        self._lock = threading.Lock()
        self._events: queue.Queue[GpuEvent] = queue.Queue()
        self._processes: dict[int, tuple[ProcessSample, ...]] = {}
        self._probe_errors: dict[int, str] = {}

    def check(self, index: int) -> None:
        if not 0 <= index < self._n:
            raise ValueError(f"no GPU {index} on this node (it has {self._n})")

    # --- injection ---
    def inject(self, event: GpuEvent) -> None:
        self.check(event.index)
        self._events.put(event)

    def set_probe_error(self, index: int, error: str | None) -> None:
        self.check(index)
        with self._lock:
            if error:
                self._probe_errors[index] = error
            else:
                self._probe_errors.pop(index, None)

    def set_processes(self, index: int, processes: tuple[ProcessSample, ...]) -> None:
        self.check(index)
        with self._lock:
            self._processes[index] = processes

    # --- GpuMonitor ---
    def sample(self) -> tuple[GpuSample, ...]:
        with self._lock:
            out = []
            for i in range(self._n):
                procs = self._processes.get(i, ())
                out.append(GpuSample(index=i, utilization=min(100.0, sum(p.sm_util for p in procs)),
                                     memory_used=sum(p.memory for p in procs), processes=procs))
            return tuple(out)

    def probe(self, index: int) -> str | None:
        with self._lock:
            return self._probe_errors.get(index)

    def wait_events(self, timeout: float) -> list[GpuEvent]:
        try:
            first = self._events.get(timeout=timeout)
        except queue.Empty:
            return []
        out = [first]
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Nothing to release."""


# --- the fake backend's injection command (``gpuledger gpu inject-xid``) ---

class InjectRequest(msgspec.Struct, kw_only=True):
    """Sent to ``gpuledger.<node>.allocator.gpu-inject``; only a fake-GPU allocator answers it."""

    gpu: int
    xid: int = 0                              # > 0: an XID event
    ecc: str = ""                             # "double-bit" | "single-bit": an ECC event
    probe_error: str | None = None            # a text makes probes fail; "" makes them pass again
    processes: list[ProcessSample] | None = None  # replaces the processes the GPU runs


class InjectReply(msgspec.Struct, kw_only=True):
    done: list[str]


def inject_subject(prefix: str) -> str:
    return f"{prefix}.allocator.gpu-inject"


def apply_injection(monitor: FakeMonitor, req: InjectRequest) -> list[str]:
    """Apply one injection; ValueError explains a request that cannot be applied."""
    from libs.gpu.health import ECC_DOUBLE, ECC_SINGLE, XID

    done = []
    monitor.check(req.gpu)
    if req.ecc and req.ecc not in ("double-bit", "single-bit"):
        raise ValueError(f"ecc must be double-bit or single-bit, not {req.ecc!r}")
    if req.processes is not None:
        monitor.set_processes(req.gpu, tuple(req.processes))
        done.append(f"{len(req.processes)} process(es) on GPU {req.gpu}")
    if req.probe_error is not None:
        monitor.set_probe_error(req.gpu, req.probe_error or None)
        done.append(f"probes of GPU {req.gpu} " + (f"fail: {req.probe_error}" if req.probe_error else "pass"))
    if req.xid > 0:
        monitor.inject(GpuEvent(index=req.gpu, kind=XID, xid=req.xid, detail="injected"))
        done.append(f"XID {req.xid} on GPU {req.gpu}")
    if req.ecc:
        kind = ECC_DOUBLE if req.ecc == "double-bit" else ECC_SINGLE
        monitor.inject(GpuEvent(index=req.gpu, kind=kind, detail="injected"))
        done.append(f"{kind} ECC error on GPU {req.gpu}")
    if not done:
        raise ValueError("nothing to inject: give an xid, an ecc kind, a probe error or processes")
    return done
