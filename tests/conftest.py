"""Shared fixtures: real nats-server, short temp dirs, a whole simulated node; the gate for GPU-only tests."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.bus.server import NatsServer
from tests.builders import settings_for
from tests.e2e.helpers import Node, start_in_process, start_processes


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # GPU tests need real NVML: they run on a machine with a GPU when GPULEDGER_GPU_TESTS=1, never in CI.
    if os.environ.get("GPULEDGER_GPU_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="needs a real GPU: set GPULEDGER_GPU_TESTS=1 on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A temp dir with a short path: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gl", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def nats_server(short_dir: Path) -> AsyncIterator[NatsServer]:
    server = NatsServer(short_dir / "nats")
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def node(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[Node]:
    """The simulator and the four services in this process (tests/e2e/helpers.py)."""
    settings = settings_for(short_dir, nats_server.url)
    async with AsyncExitStack() as stack:
        yield await start_in_process(stack, short_dir, nats_server.url, settings)


@pytest.fixture
async def node_processes(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[Node]:
    """The simulator here and the four services as their own processes, as ``gpuledger up`` runs them."""
    settings = settings_for(short_dir, nats_server.url, log_format="json")
    async with AsyncExitStack() as stack:
        yield await start_processes(stack, short_dir, nats_server.url, settings)


@pytest.fixture
async def procs() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Processes a test started: killed at teardown if still running."""
    started: list[asyncio.subprocess.Process] = []
    yield started
    for p in started:
        if p.returncode is None:
            p.kill()
            await p.wait()
