"""Where a pod start's time goes: ``bench.pod_start --breakdown`` wraps the steps of one pod start
(kubelet, device plugin round trips, CRI calls, the vmanager's registration path) with timers.

Everything runs in the bench's process, one pod at a time, so one flat list of (step, start, end)
per pod is enough: ``Trace.begin()`` before ``create_pod``, ``Trace.end()`` when the container's
marker appears. Only for measuring: the wrappers add a few microseconds per step.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class Trace:
    def __init__(self) -> None:
        self._events: list[tuple[str, float, float]] = []
        self._t0 = 0.0
        self.pods: dict[str, list[dict[str, float]]] = defaultdict(list)  # kind -> per pod {step: ms}

    def wrap_async(self, owner: Any, attr: str, step: str, *, per: Callable[[Any], str] | None = None) -> None:
        """``per``: the step is split by what it returns for the call's first argument (the method's
        owner instance), e.g. one step per device plugin resource."""
        original = getattr(owner, attr)

        @functools.wraps(original)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                name = step if per is None else f"{step} {per(args[0])}"
                self._events.append((name, started, time.perf_counter()))

        setattr(owner, attr, timed)

    def wrap_sync(self, owner: Any, attr: str, step: str) -> None:
        original: Callable[..., Any] = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._events.append((step, started, time.perf_counter()))

        setattr(owner, attr, timed)

    def begin(self) -> None:
        self._events.clear()
        self._t0 = time.perf_counter()

    def end(self, kind: str) -> None:
        """Per step: the summed time in ms; ``@step``: when its first call began, ms after create."""
        done = time.perf_counter()
        row: dict[str, float] = defaultdict(float)
        for step, start, stop in self._events:
            if start < self._t0:
                continue
            row[step] += 1000 * (stop - start)
            row.setdefault("@" + step, 1000 * (start - self._t0))
        row["total"] = 1000 * (done - self._t0)
        self.pods[kind].append(dict(row))

    def table(self) -> dict[str, dict[str, float]]:
        """kind -> step -> median ms over the pods (steps a pod did not take count as 0)."""
        out = {}
        for kind, rows in self.pods.items():
            steps = sorted({k for r in rows for k in r}, key=lambda k: (k.startswith("@"), k))
            out[kind] = {k: round(statistics.median(r.get(k, 0.0) for r in rows), 2) for k in steps}
        return out


def install() -> Trace:
    """Wrap the steps of a pod start (import-time classes and module functions, patched in place)."""
    from services.allocator.handlers import Allocator
    from services.allocator.ledger import Ledger
    from services.allocator.podcache import PodCache
    from services.allocator.podresources import KubeletPodResources
    from services.registrar.plugin import DevicePlugin
    from services.vmanager import containers, peergate, register, runtimenames
    from services.vmanager.prepare import Prepare
    from simulator import kubelet
    from simulator.devicemanager import DeviceManager
    from simulator.endpoints import Endpoint
    from simulator.runtime import pods
    from simulator.runtime.cri import CriClient

    trace = Trace()
    trace.wrap_async(DeviceManager, "allocate", "admission: Allocate (per container)")
    trace.wrap_async(DeviceManager, "run_container_options", "PreStartContainer + options")
    trace.wrap_async(pods.PodRuntime, "_sandbox", "RunPodSandbox")
    trace.wrap_async(CriClient, "create_container", "CreateContainer")
    trace.wrap_async(CriClient, "start_container", "StartContainer")
    trace.wrap_sync(kubelet.Kubelet, "_write_status", "kubelet status write")
    trace.wrap_async(peergate.PeerGate, "_serve", "vcuda.sock connection (whole)")
    trace.wrap_sync(peergate, "check_caller", "caller check (/proc, cgroup)")
    trace.wrap_async(register.VDeviceRegistrations, "register", "RegisterVDevice handler")
    trace.wrap_async(containers.ContainerNames, "lookup", "container id -> name (whole)")
    trace.wrap_async(runtimenames.RuntimeNames, "lookup", " container id -> name: runtime ContainerStatus")
    trace.wrap_async(containers.ContainerNames, "_from_watchdog", " container id -> name: watchdog")
    trace.wrap_sync(register, "write_container_files", "vcuda.config + pids.config written")
    # Per resource: the two Allocates of a pod differ (the core one is the plugin's grant, the memory
    # one is answered at once by every plugin here), and their sum hides where a difference lies.
    trace.wrap_async(Endpoint, "allocate", " kubelet: Allocate rpc", per=lambda ep: ep.resource.rpartition("/")[2])
    trace.wrap_async(Endpoint, "get_preferred_allocation", " kubelet: GetPreferredAllocation rpc")
    trace.wrap_async(Endpoint, "pre_start_container", " kubelet: PreStartContainer rpc")
    trace.wrap_sync(DeviceManager, "write_checkpoint", " kubelet: checkpoint written")
    trace.wrap_async(DevicePlugin, "Allocate", "  plugin: Allocate")
    trace.wrap_async(DevicePlugin, "PreStartContainer", "  plugin: PreStartContainer")
    trace.wrap_async(Allocator, "allocate", "  allocator: allocate handler")
    trace.wrap_async(PodCache, "wait_for_change", "  allocator: waits for the pod's notification")
    trace.wrap_async(Ledger, "record", "  allocator: ledger record (append)")
    trace.wrap_async(Allocator, "prestart", "  allocator: prestart handler")
    trace.wrap_async(KubeletPodResources, "list", "  allocator: kubelet pod-resources List")
    trace.wrap_async(Allocator, "_pods", "  allocator: watchdog pods query")
    trace.wrap_async(Prepare, "__call__", "  vmanager: prepare")
    return trace
