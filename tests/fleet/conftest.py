"""Fixtures of the fleet tests: a real 3-server central cluster on loopback ports, and node brokers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.fleet.helpers import HubCluster


@pytest.fixture
async def hub(short_dir: Path) -> AsyncIterator[HubCluster]:
    cluster = HubCluster(short_dir / "hub")
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.stop()
