"""A whole simulated node: real nats-server, the simulator (kubelet + API over HTTP), the four services.

``node`` runs the services in this process (fast, every boundary still real: gRPC over unix sockets,
NATS, SQLite files, HTTP); ``node_processes`` runs them as separate processes, as ``gpuledger up``
does, for the tests that kill or freeze one of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from gpuledger.launcher import Launcher
from libs.bus.client import Bus
from libs.bus.server import NatsServer
from libs.commands import StateReply, StateRequest
from libs.config import Settings
from libs.events.codec import EventRecord
from libs.events.subjects import Subjects
from libs.kube.pods import RESOURCE_VCORE
from libs.ledger.state import LedgerSnapshot
from services.allocator import app as allocator_app
from services.registrar import app as registrar_app
from services.vmanager import app as vmanager_app
from services.watchdog import app as watchdog_app
from simulator import NodeSimulator, SimConfig
from tests.fakecgroups import enter_container

NODE = "node-1.example"  # a dot, to exercise subject escaping end to end


def gpu_pod(name: str, *containers: tuple[str, int, int], namespace: str = "default",
            annotations: dict[str, str] | None = None, owner: bool = False) -> dict[str, Any]:
    def spec(c: tuple[str, int, int]) -> dict[str, Any]:
        limits = {"tencent.com/vcuda-core": str(c[1])}
        if c[2]:
            limits["tencent.com/vcuda-memory"] = str(c[2])
        return {"name": c[0], "image": "cuda", "resources": {"limits": limits, "requests": dict(limits)}}

    meta: dict[str, Any] = {"name": name, "namespace": namespace, "annotations": annotations or {}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [spec(c) for c in containers]}}


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


def settings_for(root: Path, nats_url: str, **overrides: Any) -> Settings:
    return Settings(
        node_name=NODE, state_dir=str(root / "state"), device_plugin_dir=str(root / "dp"),
        pod_resources_socket=str(root / "pr" / "kubelet.sock"), kubeconfig=str(root / "kubeconfig"),
        nats_url=nats_url, gpus="fake", allocate_timeout=5.0, request_timeout=3.0,
        cgroup_root=str(root / "cgroup"), proc_root=str(root / "proc"),
        driver_volumes=False,  # never mirror a GPU host's real driver into temp dirs (tests/vmanager/test_volumes.py)
        **overrides,
    )


async def _start_sim(root: Path) -> NodeSimulator:
    sim = NodeSimulator(SimConfig(
        node_name=NODE, device_plugin_dir=root / "dp", pod_resources_socket=root / "pr" / "kubelet.sock",
        kubeconfig_path=root / "kubeconfig", seed=7))
    await sim.start()
    return sim


async def _tap(url: str, stack: AsyncExitStack) -> EventTap:
    tap = EventTap()
    nc = await nats.connect(url)
    stack.push_async_callback(nc.close)
    for subject in Subjects(NODE).event_subjects():
        await nc.subscribe(subject, cb=tap.on_msg)
    return tap


async def _base(stack: AsyncExitStack, root: Path, url: str, settings: Settings) -> Node:
    sim = await _start_sim(root)
    stack.push_async_callback(sim.stop)
    tap = await _tap(url, stack)
    bus = await Bus.connect(url, name="test", node=NODE)
    stack.push_async_callback(bus.close)
    return Node(sim=sim, settings=settings, bus=bus, tap=tap)


@pytest.fixture
async def node(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[Node]:
    settings = settings_for(short_dir, nats_server.url)
    async with AsyncExitStack() as stack:
        yield await start_in_process(stack, short_dir, nats_server.url, settings)


async def start_in_process(stack: AsyncExitStack, root: Path, url: str, settings: Settings) -> Node:
    """The simulator and the four services in this process, registered with the simulated kubelet."""
    node = await _base(stack, root, url, settings)
    node.services = {
        "allocator": await stack.enter_async_context(allocator_app.service(settings)),
        "watchdog": await stack.enter_async_context(watchdog_app.service(settings, reconcile_period=1.0)),
        "vmanager": await stack.enter_async_context(vmanager_app.service(settings)),
        "registrar": await stack.enter_async_context(registrar_app.service(settings)),
    }
    await node.sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=20)
    return node


@pytest.fixture
async def node_processes(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[Node]:
    settings = settings_for(short_dir, nats_server.url, log_format="json")
    async with AsyncExitStack() as stack:
        yield await start_processes(stack, short_dir, nats_server.url, settings)


async def start_processes(stack: AsyncExitStack, root: Path, url: str, settings: Settings) -> Node:
    """The simulator here and the four services as their own processes (logs in ROOT/logs)."""
    node = await _base(stack, root, url, settings)
    node.launcher = Launcher(settings, embedded_nats=False, log_dir=root / "logs")
    stack.push_async_callback(node.launcher.stop)
    await node.launcher.start_services()
    await node.sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=60)
    return node
