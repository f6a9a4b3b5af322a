"""Fixtures for the end-to-end tests; the whole-node ``node`` and ``node_processes`` are in tests/conftest.py
(the audit tests use them too), the node itself in tests/e2e/helpers.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.bus.server import NatsServer
from services.allocator import app as allocator_app
from services.registrar import app as registrar_app
from services.vmanager import app as vmanager_app
from tests.builders import settings_for
from tests.e2e.helpers import WatchdogNode, base_node, wait_for_gpu_resources


@pytest.fixture
async def wnode(request: pytest.FixtureRequest, nats_server: NatsServer, short_dir: Path,
                ) -> AsyncIterator[WatchdogNode]:
    """A node whose watchdog the test stops and starts (reconciling every PERIOD), node labels set.
    Parametrized indirectly with "allocator checks", the registrar cannot reach pod-resources, so the
    allocator checks each grant against a List of its own (the registrar's check is the default)."""
    settings = settings_for(short_dir, nats_server.url, node_labels="team=ml,tier=gpu")
    registrar_settings = settings
    if getattr(request, "param", "registrar checks") == "allocator checks":
        registrar_settings = settings.replace(pod_resources_socket=str(short_dir / "no-pod-resources.sock"))
    async with AsyncExitStack() as stack:
        base = await base_node(stack, short_dir, nats_server.url, settings)
        node = WatchdogNode(sim=base.sim, settings=settings, bus=base.bus, tap=base.tap)
        node.services["allocator"] = await stack.enter_async_context(allocator_app.service(settings))
        await node.start_watchdog()
        stack.push_async_callback(node.stop_watchdog)
        node.services["vmanager"] = await stack.enter_async_context(vmanager_app.service(settings))
        node.services["registrar"] = await stack.enter_async_context(registrar_app.service(registrar_settings))
        await wait_for_gpu_resources(node.sim, 400, timeout=20)
        yield node
