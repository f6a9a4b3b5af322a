"""A kubelet restart under each behaviour profile (kubelet-device-plugin.md 2.10, 4.1): the kubelet
deletes every socket in its directory; the registrar (in-process, real gRPC, real NATS) notices, serves
again and re-registers within 2 s without exiting, and no allocation is lost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.bus.client import Bus
from libs.bus.server import NatsServer
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY
from services.allocator import app as allocator_app
from services.registrar import app as registrar_app
from services.vmanager import app as vmanager_app
from services.watchdog import app as watchdog_app
from simulator import NodeSimulator, SimConfig
from simulator.config import PROFILES
from tests.builders import NODE, gpu_pod, settings_for
from tests.e2e.helpers import Node, event_tap
from tests.polling import eventually


@pytest.fixture(params=PROFILES)
async def profiled_node(request: pytest.FixtureRequest, nats_server: NatsServer,
                        short_dir: Path) -> AsyncIterator[Node]:
    settings = settings_for(short_dir, nats_server.url)
    async with AsyncExitStack() as stack:
        sim = NodeSimulator(SimConfig(
            node_name=NODE, device_plugin_dir=short_dir / "dp", pod_resources_socket=short_dir / "pr" / "kubelet.sock",
            kubeconfig_path=short_dir / "kubeconfig", seed=7, profile=request.param))
        await sim.start()
        stack.push_async_callback(sim.stop)
        tap = await event_tap(nats_server.url, stack)
        bus = await Bus.connect(nats_server.url, name="test", node=NODE)
        stack.push_async_callback(bus.close)
        node = Node(sim=sim, settings=settings, bus=bus, tap=tap)
        node.services = {
            "allocator": await stack.enter_async_context(allocator_app.service(settings)),
            "watchdog": await stack.enter_async_context(watchdog_app.service(settings)),
            "vmanager": await stack.enter_async_context(vmanager_app.service(settings)),
            "registrar": await stack.enter_async_context(registrar_app.service(settings)),
        }
        # Both resources: a test that wipes the sockets while the kubelet still dials the second one
        # leaves that dial hanging for its 10 s, and the registrar's next Register behind it.
        await sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=20)
        await sim.wait_for_resource(RESOURCE_VMEMORY, 256, timeout=20)
        yield node


async def test_kubelet_restart_reregisters_within_two_seconds(profiled_node: Node) -> None:
    node = profiled_node
    pod = await node.run_pod(gpu_pod("before", ("c", 50, 2)))
    assert pod["status"]["phase"] == "Running", pod["status"]
    before = await node.snapshot()
    keeper = node.services["registrar"].kubelet
    count = keeper.registrations

    restarted_at = time.monotonic()
    await node.sim.restart_kubelet()
    # Generous waits (a loaded machine); the bound is asserted on the kubelet's own Register timestamps.
    await node.sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=5)
    await node.sim.wait_for_resource(RESOURCE_VMEMORY, 256, timeout=5)
    registered = {c.resource: c.end for c in node.sim.calls
                  if c.method == "Register" and c.start >= restarted_at and c.ok}
    assert set(registered) == {RESOURCE_VCORE, RESOURCE_VMEMORY}
    took = max(registered.values()) - node.sim.registration.started_at  # type: ignore[operator]
    assert took <= 2.0, registered

    assert keeper.registrations == count + 1  # the same keeper, so the process never exited
    assert (await node.snapshot()).allocations == before.allocations  # nothing lost
    after = await node.run_pod(gpu_pod("after", ("c", 50, 2)))
    assert after["status"]["phase"] == "Running", after["status"]


async def test_wiped_plugin_sockets_are_served_and_registered_again(profiled_node: Node) -> None:
    """Only our sockets vanish (someone cleaned the directory), the kubelet keeps running: the registrar
    re-serves and registers again, and the resources end up healthy under every profile."""
    node = profiled_node
    keeper = node.services["registrar"].kubelet
    count = keeper.registrations
    for name in ("vcore.sock", "vmemory.sock"):
        (Path(node.settings.device_plugin_dir) / name).unlink()
    await eventually(lambda: keeper.registrations >= count + 1, timeout=10, interval=0.05,
                     what="the registrar registering again")
    await asyncio.sleep(1.0)  # let the old streams' ends reach the kubelet
    await node.sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=5)
    await node.sim.wait_for_resource(RESOURCE_VMEMORY, 256, timeout=5)
    pod = await node.run_pod(gpu_pod("after-wipe", ("c", 50, 2)))
    assert pod["status"]["phase"] == "Running", pod["status"]
