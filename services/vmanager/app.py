"""vmanager composition root: NATS -> folded allocation log -> per-pod vcuda.sock servers -> prepare."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from libs.bus import Bus
from libs.commands import PrepareRequest
from libs.config import Settings
from libs.ledger import LedgerState
from libs.runtime import Supervisor
from services.vmanager.claimpods import ClaimPods
from services.vmanager.containers import ContainerNames
from services.vmanager.hamidirs import CacheDirs, prepare_node
from services.vmanager.metrics import observe
from services.vmanager.peergate import Callers
from services.vmanager.podsockets import PodSockets
from services.vmanager.prepare import Prepare
from services.vmanager.register import VcudaMethods, VDeviceRegistrations
from services.vmanager.tracker import AllocationTracker
from services.vmanager.volumes import build_from_settings

__all__ = ["VmanagerService", "service"]


@dataclass
class VmanagerService:
    bus: Bus
    state: LedgerState
    tracker: AllocationTracker  # .follower (LogFollower), .caught_up (asyncio.Event)
    sockets: PodSockets
    registrations: VDeviceRegistrations
    supervisor: Supervisor


@asynccontextmanager
async def service(settings: Settings) -> AsyncIterator[VmanagerService]:
    async with AsyncExitStack() as stack:
        if settings.driver_volumes:  # before any pod is served: containers mount them at start
            await asyncio.to_thread(build_from_settings, settings)
        bus = await Bus.connect(settings.nats_url, name="vmanager", node=settings.node_name)
        stack.push_async_callback(bus.close)
        state = LedgerState()
        runtime = ahead = None
        if settings.runtime_socket is not None:
            from services.vmanager.namesahead import NamesAhead
            from services.vmanager.runtimenames import RUNTIME_TIMEOUT, RuntimeNames  # loads the CRI stubs

            runtime = RuntimeNames(settings.runtime_socket, timeout=min(RUNTIME_TIMEOUT, settings.request_timeout))
            stack.push_async_callback(runtime.close)
            ahead = NamesAhead(runtime, Path(settings.cgroup_root))
            ahead.start()
            stack.callback(ahead.close)
        names = ContainerNames(bus, timeout=settings.request_timeout, runtime=runtime)
        registrations = VDeviceRegistrations(state, names, lookup_patience=settings.request_timeout,
                                             cgroup_root=Path(settings.cgroup_root), ahead=ahead)
        callers = Callers(look_ahead=registrations.look_ahead)
        hami = settings.limit_delivery == "hami-core"
        if hami:
            prepare_node(settings.hami_preload, settings.hami_mount_dir, Path(settings.hami_lock_dir),
                         Path(settings.hami_library))
        claim_pods = ClaimPods(state, bus, timeout=settings.request_timeout)
        sockets = PodSockets(
            settings.vm_root, VcudaMethods(registrations, settings.vm_root).for_caller,
            lambda key: state.holds(key) or claim_pods.is_claim(key),
            callers=callers, proc_root=Path(settings.proc_root),
            on_prepare=CacheDirs(state) if hami else None, admit_for=claim_pods.admission,
            on_served=ahead.expect if ahead else None, on_unserved=ahead.forget if ahead else None,
        )
        registrations.on_spare_taken = sockets.respare_soon
        stack.push_async_callback(sockets.close)  # after the follower stopped: nothing restarts them
        tracker = AllocationTracker(bus, state, sockets, settings.vm_root)
        supervisor = Supervisor("vmanager")
        stack.push_async_callback(supervisor.aclose)
        await stack.enter_async_context(observe(settings, tracker, sockets, names, ahead))  # /metrics
        supervisor.spawn(tracker.run(), "follow")
        sub = await bus.serve(bus.subjects.prepare, PrepareRequest,
                              Prepare(tracker, sockets, timeout=settings.request_timeout))
        stack.push_async_callback(sub.unsubscribe)
        yield VmanagerService(bus=bus, state=state, tracker=tracker, sockets=sockets,
                              registrations=registrations, supervisor=supervisor)
