"""Shared fixtures: real nats-server, short temp dirs, settings; the gate for GPU-only tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from libs.bus.server import NatsServer


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
