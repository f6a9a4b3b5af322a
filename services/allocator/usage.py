"""GPU usage sampled in the background (never on a scrape), mapped to the containers that cause it.

Every ``--usage-interval`` seconds: one NVML sample of every GPU (utilisation, memory used, and per
process SM share and memory), then each process's container ID (from its cgroup) is matched with the
container statuses of the node's pods, asked of the watchdog only when some process runs in a
container. Scrapes, ``/usage`` and ``gpuledger status`` read the last result.
"""

from __future__ import annotations

import asyncio
import time

from libs.bus.client import Bus
from libs.commands import PodsReply, PodsRequest
from libs.errors import BusError
from libs.gpu.monitor import GpuMonitor, GpuSample
from libs.logger import get_logger

__all__ = ["ContainerKey", "ContainerUse", "UsageSampler"]

_logger = get_logger("allocator")

ContainerKey = tuple[str, str]                   # (pod uid, container name)
ContainerUse = dict[int, tuple[float, int, tuple[int, ...]]]  # gpu index -> (sm %, memory bytes, pids)


class UsageSampler:
    def __init__(self, monitor: GpuMonitor, bus: Bus, *, interval: float, timeout: float) -> None:
        self.monitor = monitor
        self.bus = bus
        self.interval = interval
        self.timeout = timeout
        self.gpus: tuple[GpuSample, ...] = ()
        self.containers: dict[ContainerKey, ContainerUse] = {}
        self.names: dict[ContainerKey, tuple[str, str]] = {}  # -> (namespace, pod name)
        self.sampled_at = 0.0  # unix time of the last sample; 0 before the first
        self.samples = 0

    async def run(self) -> None:
        while True:
            try:
                await self.sample_once()
            except Exception as exc:  # one failed sample must not end the service
                _logger.warning("GPU usage sample failed", error=str(exc))
            await asyncio.sleep(self.interval)

    async def sample_once(self) -> None:
        gpus = await asyncio.to_thread(self.monitor.sample)
        wanted = {p.container_id for g in gpus for p in g.processes if p.container_id}
        where = await self._containers(wanted) if wanted else {}
        containers: dict[ContainerKey, ContainerUse] = {}
        names: dict[ContainerKey, tuple[str, str]] = {}
        for g in gpus:
            for p in g.processes:
                found = where.get(p.container_id)
                if found is None:
                    continue
                uid, ns, pod, container = found
                key = (uid, container)
                names[key] = (ns, pod)
                sm, mem, pids = containers.setdefault(key, {}).get(g.index, (0.0, 0, ()))
                containers[key][g.index] = (sm + p.sm_util, mem + p.memory, (*pids, p.pid))
        self.gpus, self.containers, self.names = gpus, containers, names
        self.sampled_at = time.time()
        self.samples += 1

    async def _containers(self, ids: set[str]) -> dict[str, tuple[str, str, str, str]]:
        try:
            reply = await self.bus.request(self.bus.subjects.pods, PodsRequest(), PodsReply, timeout=self.timeout)
        except BusError as exc:
            _logger.info("cannot map GPU processes to containers this time", error=str(exc))
            return {}
        out = {}
        for pod in reply.pods:
            for st in pod.all_statuses():
                if st.runtime_id in ids:
                    out[st.runtime_id] = (pod.uid, pod.metadata.namespace, pod.metadata.name, st.name)
        return out
