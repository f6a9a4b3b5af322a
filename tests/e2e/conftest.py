"""Fixtures for the end-to-end tests; the whole-node ``node`` and ``node_processes`` are in tests/conftest.py
(the audit tests use them too), the node itself in tests/e2e/helpers.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.bus.server import NatsServer
from libs.kube.pods import RESOURCE_VCORE
from services.allocator import app as allocator_app
from services.registrar import app as registrar_app
from services.vmanager import app as vmanager_app
from tests.builders import settings_for
from tests.e2e.helpers import WatchdogNode, base_node


@pytest.fixture
async def wnode(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[WatchdogNode]:
    """A node whose watchdog the test stops and starts (reconciling every PERIOD), node labels set."""
    settings = settings_for(short_dir, nats_server.url, node_labels="team=ml,tier=gpu")
    async with AsyncExitStack() as stack:
        base = await base_node(stack, short_dir, nats_server.url, settings)
        node = WatchdogNode(sim=base.sim, settings=settings, bus=base.bus, tap=base.tap)
        node.services["allocator"] = await stack.enter_async_context(allocator_app.service(settings))
        await node.start_watchdog()
        stack.push_async_callback(node.stop_watchdog)
        node.services["vmanager"] = await stack.enter_async_context(vmanager_app.service(settings))
        node.services["registrar"] = await stack.enter_async_context(registrar_app.service(settings))
        await node.sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=20)
        yield node
