"""Fixtures for the node-simulator tests: a short plugin dir, a running simulator, fake plugins."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from simulator import NodeSimulator, SimConfig
from tests.simulator.fakeplugin import FakePlugin


@pytest.fixture
def plugin_dir(short_dir: Path) -> Path:
    return short_dir  # the root conftest's short temp dir: unix socket paths stay under 108 bytes


@pytest.fixture
def sim_config(plugin_dir: Path) -> SimConfig:
    return SimConfig(
        device_plugin_dir=plugin_dir / "dp",
        pod_resources_socket=plugin_dir / "pr" / "kubelet.sock",
        seed=7,
        dial_timeout=1.0,
        allocate_timeout=5.0,
    )


@pytest.fixture
async def sim(sim_config: SimConfig) -> AsyncIterator[NodeSimulator]:
    async with NodeSimulator(sim_config) as node:
        yield node


@pytest.fixture
async def make_plugin(sim: NodeSimulator) -> AsyncIterator[Callable[..., Awaitable[FakePlugin]]]:
    """Start (and by default register) fake plugins; all are stopped at the end."""
    plugins: list[FakePlugin] = []

    async def make(resource: str = "example.com/gpu", *, register: bool = True, wait: bool = True,
                   **kwargs: Any) -> FakePlugin:
        plugin = FakePlugin(sim.cfg.device_plugin_dir, resource, **kwargs)
        plugins.append(plugin)
        await plugin.start()
        if register:
            await plugin.register()
            if wait:
                await sim.wait_for_resource(resource, len(plugin.devices), timeout=5)
        return plugin

    yield make
    for plugin in plugins:
        await plugin.stop()

