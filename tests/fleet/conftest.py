"""Fixtures of the fleet tests: a real 3-server central cluster on loopback ports, and node brokers."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.fleet.helpers import REQUIRE_POSTGRES, HubCluster, PostgresServer, postgres_bindir


@pytest.fixture
async def hub(short_dir: Path) -> AsyncIterator[HubCluster]:
    cluster = HubCluster(short_dir / "hub")
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.stop()


@pytest.fixture
def postgres_bin() -> Path:
    """PostgreSQL's binaries; skipped (one line) without Debian's postgresql package, unless
    GPULEDGER_REQUIRE_POSTGRES=1 (CI), which makes a missing package a failure."""
    bindir = postgres_bindir()
    if bindir is None:
        if os.environ.get(REQUIRE_POSTGRES) == "1":
            pytest.fail("PostgreSQL is required (GPULEDGER_REQUIRE_POSTGRES=1) but not installed")
        pytest.skip("needs PostgreSQL (Debian's postgresql package)")
    return bindir


@pytest.fixture
async def postgres(postgres_bin: Path) -> AsyncIterator[PostgresServer]:
    """A real PostgreSQL server (see ``postgres_bin``)."""
    server = PostgresServer(postgres_bin)
    try:
        await server.start()
        yield server
    finally:
        await server.stop()

