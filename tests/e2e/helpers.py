"""A whole simulated node: real nats-server, the simulator (kubelet + API over HTTP), the four services.

``start_in_process`` (the ``node`` fixture) runs the services in this process (fast, every boundary
still real: gRPC over unix sockets, NATS, SQLite files, HTTP); ``start_processes`` (the
``node_processes`` fixture) runs them as separate processes, as ``gpuledger up`` does, for the tests
that kill or freeze one of them. Beside them, the steps several end-to-end tests take on such a node.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import msgspec
import nats

from gpuledger.launcher import Launcher
from libs.bus.client import Bus
from libs.commands import PodsReply, PodsRequest, PrepareRequest, StateReply, StateRequest
from libs.config import MEMORY_BLOCK, Settings
from libs.errors import BusError
from libs.events.codec import EventRecord
from libs.events.subjects import Subjects
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from libs.ledger.state import LedgerSnapshot
from services.allocator import app as allocator_app
from services.registrar import app as registrar_app
from services.vmanager import app as vmanager_app
from services.watchdog import app as watchdog_app
from services.watchdog.app import WatchdogService
from simulator import NodeSimulator, SimConfig
from tests.builders import NODE, gpu_pod
from tests.builders.cgroups import enter_container
from tests.polling import eventually

_M = TypeVar("_M")


@dataclass
class EventTap:
    """A plain NATS subscriber on the documented event subjects, as an operator would run it."""

    records: list[EventRecord] = field(default_factory=list)
    subjects: list[str] = field(default_factory=list)
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def on_msg(self, msg: Any) -> None:
        async with self.arrived:
            self.records.append(msgspec.json.decode(msg.data, type=EventRecord))
            self.subjects.append(msg.subject)
            self.arrived.notify_all()

    async def wait(self, type_name: str, count: int, timeout: float = 10) -> list[EventRecord]:
        async with asyncio.timeout(timeout), self.arrived:
            await self.arrived.wait_for(lambda: len(self.of(type_name)) >= count)
        return self.of(type_name)

    def of(self, type_name: str) -> list[EventRecord]:
        return [r for r in self.records if r.type == type_name]


@dataclass
class Node:
    sim: NodeSimulator
    settings: Settings
    bus: Bus
    tap: EventTap
    services: dict[str, Any] = field(default_factory=dict)
    launcher: Launcher | None = None

    async def snapshot(self) -> LedgerSnapshot:
        reply = await self.bus.request(self.bus.subjects.state, StateRequest(), StateReply, timeout=5)
        return reply.snapshot

    def enter_container(self, pod_uid: str, container_id: str) -> list[int]:
        """Make this test process a process of that container, as the vmanager sees it (fake /proc, cgroups)."""
        return enter_container(Path(self.settings.proc_root).parent, pod_uid, container_id)

    async def run_pod(self, manifest: dict[str, Any], timeout: float = 20) -> dict[str, Any]:
        created = await self.sim.create_pod(manifest)
        ns, name = created["metadata"]["namespace"], created["metadata"]["name"]
        return await self.sim.wait_for_pod(
            ns, name, lambda p: p["status"].get("phase") in ("Running", "Failed"), timeout)


async def start_sim(root: Path) -> NodeSimulator:
    sim = NodeSimulator(SimConfig(
        node_name=NODE, device_plugin_dir=root / "dp", pod_resources_socket=root / "pr" / "kubelet.sock",
        kubeconfig_path=root / "kubeconfig", seed=7))
    await sim.start()
    return sim


async def event_tap(url: str, stack: AsyncExitStack) -> EventTap:
    tap = EventTap()
    nc = await nats.connect(url)
    stack.push_async_callback(nc.close)
    for subject in Subjects(NODE).event_subjects():
        await nc.subscribe(subject, cb=tap.on_msg)
    return tap


async def base_node(stack: AsyncExitStack, root: Path, url: str, settings: Settings) -> Node:
    """The simulator, an event tap and a bus of the test's own; no services yet."""
    sim = await start_sim(root)
    stack.push_async_callback(sim.stop)
    tap = await event_tap(url, stack)
    bus = await Bus.connect(url, name="test", node=NODE)
    stack.push_async_callback(bus.close)
    return Node(sim=sim, settings=settings, bus=bus, tap=tap)


async def wait_for_gpu_resources(sim: NodeSimulator, vcore: int, timeout: float) -> None:
    """The kubelet advertises ``vcore`` vcore devices and some vmemory: both plugins' ListAndWatch are in.
    A pod admitted while vmemory is registered but not yet advertised gets no vmemory devices (and its
    grant is never settled: the kubelet's count differs from the pod spec's), which is not what a
    test of a started node means to run."""
    await sim.wait_for_resource(RESOURCE_VCORE, vcore, timeout=timeout)
    try:
        await sim.manager.changes.wait_until(lambda: sim.allocatable(RESOURCE_VMEMORY) > 0, timeout)
    except TimeoutError:
        raise TimeoutError(f"{RESOURCE_VMEMORY}: nothing allocatable within {timeout:g}s") from None


async def start_in_process(stack: AsyncExitStack, root: Path, url: str, settings: Settings, *,
                           vcore: int = 400) -> Node:
    """The simulator and the four services in this process, registered with the simulated kubelet
    (``vcore``: the vcore devices to wait for; 400 is the default fake profile's four GPUs)."""
    node = await base_node(stack, root, url, settings)
    node.services = {
        "allocator": await stack.enter_async_context(allocator_app.service(settings)),
        "watchdog": await stack.enter_async_context(watchdog_app.service(settings, reconcile_period=1.0)),
        "vmanager": await stack.enter_async_context(vmanager_app.service(settings)),
        "registrar": await stack.enter_async_context(registrar_app.service(settings)),
    }
    await wait_for_gpu_resources(node.sim, vcore, timeout=20)
    return node


async def start_processes(stack: AsyncExitStack, root: Path, url: str, settings: Settings) -> Node:
    """The simulator here and the four services as their own processes (logs in ROOT/logs)."""
    node = await base_node(stack, root, url, settings)
    node.launcher = Launcher(settings, embedded_nats=False, log_dir=root / "logs")
    stack.push_async_callback(node.launcher.stop)
    await node.launcher.start_services()
    await wait_for_gpu_resources(node.sim, 400, timeout=60)
    return node


async def snapshot_when_back(node: Node, timeout: float) -> LedgerSnapshot:
    """The allocator's state, once it answers again (a restarted allocator process)."""

    async def answered() -> LedgerSnapshot | None:
        try:
            return await node.snapshot()
        except BusError:
            return None

    return await eventually(answered, timeout=timeout, interval=0.2, what="the allocator answering again")


# -- the watchdog, stopped and started on its own ---------------------------------------------------------

PERIOD = 0.5  # reconciliation period in these tests


class WatchdogNode(Node):
    _watchdog_cm: AbstractAsyncContextManager[WatchdogService] | None = None

    @property
    def watchdog(self) -> WatchdogService:
        return self.services["watchdog"]

    async def start_watchdog(self, settings: Settings | None = None) -> WatchdogService:
        self.settings = settings or self.settings
        self._watchdog_cm = watchdog_app.service(self.settings, reconcile_period=PERIOD)
        self.services["watchdog"] = await self._watchdog_cm.__aenter__()
        await asyncio.wait_for(self.watchdog.source.synced.wait(), 10)
        return self.watchdog

    async def stop_watchdog(self) -> None:
        cm, self._watchdog_cm = self._watchdog_cm, None
        if cm is not None:
            await cm.__aexit__(None, None, None)

    async def passes(self, count: int = 2, timeout: float = 15) -> None:
        """Wait until `count` more reconciliation passes have finished."""
        target = self.watchdog.recycler.passes + count
        await eventually(lambda: self.watchdog.recycler.passes >= target, timeout=timeout, interval=0.05,
                         what=f"{count} more reconciliation passes")


# -- pod identity: two pods the kubelet admits in the opposite order of their predicate times --------------

@contextlib.asynccontextmanager
async def seen_on(node: Node, subject: str, kind: type[_M]) -> AsyncIterator[list[_M]]:
    """The messages sent on ``subject`` meanwhile, decoded as ``kind`` (a copy of each, as its
    subscribers get it); all in by the end of the block."""
    seen: list[_M] = []

    async def keep(message: _M) -> None:
        seen.append(message)

    sub = await node.bus.subscribe(subject, kind, keep)
    await node.bus.flush()
    try:
        yield seen
        await node.bus.flush()
    finally:
        await sub.unsubscribe()


def prepares_seen(node: Node) -> AbstractAsyncContextManager[list[PrepareRequest]]:
    """The vmanager.prepare requests sent on the bus meanwhile (a copy of each, as the vmanager gets it)."""
    return seen_on(node, node.bus.subjects.prepare, PrepareRequest)


async def prestart(node: Node, ids: list[str]) -> None:
    sock = Path(node.settings.device_plugin_dir) / "vcore.sock"
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        await pb_grpc.DevicePluginStub(ch).PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=20)


async def watchdog_sees(node: Node, names: set[str], timeout: float = 10) -> None:
    """Wait (bounded) until the watchdog's pod cache, and the allocator's copy, hold these pods."""
    cache = node.services["allocator"].handlers.pod_cache

    async def both_hold() -> bool:
        reply = await node.bus.request(node.bus.subjects.pods, PodsRequest(phase="Pending"), PodsReply, timeout=5)
        return names <= {p.metadata.name for p in reply.pods} and names <= {p.metadata.name for p in cache.pending()}

    await eventually(both_hold, timeout=timeout, interval=0.05,
                     what=f"the watchdog's pod cache and the allocator's copy holding {sorted(names)}")


async def opposite_order(node: Node) -> tuple[dict[str, str], dict[str, int]]:
    """Pods B then A, equal cores, A with the earlier predicate time; both Running. (uids, memory)"""
    # 60 cores each: two such shares cannot sit on one GPU, so the two grants land on different GPUs.
    pod_a = gpu_pod("pod-a", ("main", 60, 4), annotations={"tencent.com/predicate-time": "1000"})
    pod_b = gpu_pod("pod-b", ("main", 60, 8), annotations={"tencent.com/predicate-time": "2000"})
    # Hold the simulated kubelet's admission until the allocator can see both pods: B is created
    # first, so the kubelet admits B first, while A's earlier predicate time puts A first for a
    # gpu-manager style guess.
    async with node.sim.kubelet.admission_lock:
        await node.sim.create_pod(pod_b)
        await node.sim.create_pod(pod_a)
        await watchdog_sees(node, {"pod-a", "pod-b"})
    running = {}
    for name in ("pod-a", "pod-b"):
        running[name] = await node.sim.wait_for_pod(
            "default", name, lambda p: p["status"].get("phase") in ("Running", "Failed"), 20)
        assert running[name]["status"]["phase"] == "Running", running[name]["status"]
    uid = {name: p["metadata"]["uid"] for name, p in running.items()}
    return uid, {"pod-a": 4 * MEMORY_BLOCK, "pod-b": 8 * MEMORY_BLOCK}
