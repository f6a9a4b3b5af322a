"""Fixtures: a DRA node (tests/dra/e2e/helpers.py) on the 4-GPU PCIe profile, GPUs 0 and 1 in DRA mode,
2 and 3 with the device plugin; and one on the DGX A100 profile with every GPU in DRA mode."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from libs.bus.server import NatsServer
from tests.dra.e2e.helpers import DraNode, dra_settings, start_dra_node


@pytest.fixture
async def dra_node(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[DraNode]:
    settings = dra_settings(short_dir, nats_server.url, dra_gpus="0,1")
    async with AsyncExitStack() as stack:
        yield await start_dra_node(stack, short_dir, nats_server.url, settings, device_plugin_cores=200,
                                   dra_devices=2)


@pytest.fixture
async def dgx_node(nats_server: NatsServer, short_dir: Path) -> AsyncIterator[DraNode]:
    settings = dra_settings(short_dir, nats_server.url, dra_gpus="all", profile="dgx-a100-8gpu.yaml")
    async with AsyncExitStack() as stack:
        yield await start_dra_node(stack, short_dir, nats_server.url, settings, device_plugin_cores=0,
                                   dra_devices=8)
