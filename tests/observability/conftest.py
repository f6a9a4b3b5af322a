"""A whole simulated node with metrics servers on, fast health checks and fake GPUs (in-process services)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from libs.bus.server import NatsServer
from libs.kube.pods import RESOURCE_VCORE
from tests.builders import settings_for
from tests.e2e.helpers import Node, base_node
from tests.observability.helpers import HEALTH, free_port_base, start_services


@pytest.fixture
def obs_overrides() -> dict[str, Any]:
    """Settings to change for one test: ``@pytest.mark.parametrize("obs_overrides", [{...}])``."""
    return {}


@pytest.fixture
async def obs_node(nats_server: NatsServer, short_dir: Path, obs_overrides: dict[str, Any]) -> AsyncIterator[Node]:
    settings = settings_for(short_dir, nats_server.url, metrics_port=free_port_base(), metrics_host="127.0.0.1",
                            **{**HEALTH, **obs_overrides})
    async with AsyncExitStack() as stack:
        node = await base_node(stack, short_dir, nats_server.url, settings)
        await start_services(stack, node)
        await node.sim.wait_for_resource(RESOURCE_VCORE, 400, timeout=20)
        yield node
