"""GPU health in the allocator: NVML events and probes in, ``gpu.health`` transitions into the log.

The allocator owns health because it owns the log and the placement: a transition is recorded through
the same `Ledger` as grants, so under the same lock (no grant lands on a GPU in the instant it turns
unhealthy), folded into the state (placement skips the GPU from then on), and published like every
event, which is how the registrar learns to advertise the GPU's device IDs as Unhealthy.

NVML's event wait blocks, so it runs in its own thread with a short timeout and hands batches to the
event loop; the probes run in the default executor. With fake GPUs, ``allocator.gpu-inject`` feeds
the same path (`libs.gpu.monitor.apply_injection`).
"""

from __future__ import annotations

import asyncio
import threading
import time

from libs.bus.client import Bus
from libs.config import Settings
from libs.errors import ServiceError
from libs.events.schema import GpuHealthChanged
from libs.gpu.health import GpuEvent, HealthTracker, Transition, parse_xids
from libs.gpu.monitor import FakeMonitor, GpuMonitor, InjectReply, InjectRequest, apply_injection, inject_subject
from libs.logger import get_logger
from libs.runtime import Supervisor
from services.allocator.ledger import Ledger

__all__ = ["HealthWatcher"]

_logger = get_logger("allocator")
_WAIT = 0.5  # seconds the event thread blocks in NVML before it checks whether to stop


class HealthWatcher:
    def __init__(self, settings: Settings, monitor: GpuMonitor, ledger: Ledger, bus: Bus) -> None:
        self.settings = settings
        self.monitor = monitor
        self.ledger = ledger
        self.bus = bus
        self.tracker = HealthTracker(ignored_xids=parse_xids(settings.health_ignored_xids),
                                     recovery_seconds=settings.health_recovery_seconds,
                                     recovery_checks=settings.health_recovery_checks)
        self._queue: asyncio.Queue[list[GpuEvent]] = asyncio.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def start(self, supervisor: Supervisor) -> list[asyncio.Task[None]]:
        now = time.monotonic()
        for gpu in self.ledger.state.gpus.values():
            self.tracker.restore(gpu.index, gpu.healthy, now)
        if isinstance(self.monitor, FakeMonitor):
            await self.bus.serve(inject_subject(self.bus.subjects.prefix), InjectRequest, self.inject)
        if not self.settings.health_checks:
            _logger.info("GPU health checks are off")
            return []
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._pump, args=(loop,), name="nvml-events", daemon=True)
        self._thread.start()
        return [supervisor.spawn(self._consume(), "health-events"),
                supervisor.spawn(self._probe_forever(), "health-probes")]

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5 * _WAIT + 1)

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.is_set():
            try:
                events = self.monitor.wait_events(_WAIT)
            except Exception as exc:  # never let the thread die silently; NVML errors are retried
                _logger.error("GPU event wait failed", error=str(exc))
                self._stop.wait(_WAIT)
                continue
            if events and not loop.is_closed():
                loop.call_soon_threadsafe(self._queue.put_nowait, events)

    async def _consume(self) -> None:
        while True:
            for ev in await self._queue.get():
                critical = self.tracker.critical(ev)
                _logger.warning("GPU event", gpu=ev.index, kind=ev.kind, xid=ev.xid or None, critical=critical,
                             detail=ev.detail)
                await self._record(self.tracker.on_event(ev, time.monotonic()))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_check_interval)
            await self.probe_all()

    async def probe_all(self) -> None:
        for index in sorted(self.ledger.state.gpus):
            error = await asyncio.to_thread(self.monitor.probe, index)
            await self._record(self.tracker.on_probe(index, error, time.monotonic()))

    async def _record(self, tr: Transition | None) -> None:
        if tr is None:
            return
        gpu = self.ledger.state.gpus.get(tr.index)
        if gpu is None:
            return
        event = GpuHealthChanged(index=tr.index, uuid=gpu.uuid, healthy=tr.healthy, reason=tr.reason, xid=tr.xid,
                                 detail=tr.detail)
        await self.ledger.record_events([event])
        say = _logger.info if tr.healthy else _logger.error
        say("GPU healthy again" if tr.healthy else "GPU marked unhealthy", gpu=tr.index, uuid=gpu.uuid,
            reason=tr.reason, xid=tr.xid or None, detail=tr.detail)

    async def inject(self, req: InjectRequest) -> InjectReply:
        assert isinstance(self.monitor, FakeMonitor)
        try:
            done = apply_injection(self.monitor, req)
        except ValueError as exc:
            raise ServiceError(400, str(exc)) from exc
        if req.probe_error and self.settings.health_checks:
            await self.probe_all()  # a failing probe is seen at once, not at the next interval
        _logger.info("injected", gpu=req.gpu, done=done)
        return InjectReply(done=done)
