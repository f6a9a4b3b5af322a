"""A whole simulated node with metrics servers on, fast health checks and fake GPUs (in-process services)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from libs.bus.server import NatsServer
from tests.builders import settings_for
from tests.e2e.helpers import Node, start_in_process
from tests.observability.helpers import HEALTH, free_port_base


@pytest.fixture
def obs_overrides() -> dict[str, Any]:
    """Settings to change for one test: ``@pytest.mark.parametrize("obs_overrides", [{...}])``."""
    return {}


@pytest.fixture
async def obs_node(nats_server: NatsServer, short_dir: Path, obs_overrides: dict[str, Any]) -> AsyncIterator[Node]:
    settings = settings_for(short_dir, nats_server.url, metrics_port=free_port_base(), metrics_host="127.0.0.1",
                            **{**HEALTH, **obs_overrides})
    async with AsyncExitStack() as stack:
        yield await start_in_process(stack, short_dir, nats_server.url, settings)
