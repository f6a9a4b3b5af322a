"""The kubelet behaviour profiles other than the default (kubelet-device-plugin.md 2.2, 4.1)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from simulator import NodeSimulator, SimConfig
from tests.polling import eventually
from tests.simulator.fakeplugin import FakePlugin


@pytest.fixture
async def plugins() -> AsyncIterator[list[FakePlugin]]:
    made: list[FakePlugin] = []
    yield made
    for plugin in made:
        await plugin.stop()


async def _sim(plugin_dir: Path, profile: str) -> NodeSimulator:
    return NodeSimulator(SimConfig(device_plugin_dir=plugin_dir / "dp", profile=profile, dial_timeout=1.0))


async def _plugin(sim: NodeSimulator, plugins: list[FakePlugin], **kw) -> FakePlugin:  # type: ignore[no-untyped-def]
    plugin = FakePlugin(sim.cfg.device_plugin_dir, **kw)
    plugins.append(plugin)
    await plugin.start()
    return plugin


async def test_legacy_register_answers_at_once_with_the_request_options(plugin_dir, plugins) -> None:
    async with await _sim(plugin_dir, "legacy-1.24") as sim:
        plugin = await _plugin(sim, plugins, count=2)
        plugin.options_delay = 3  # a synchronous Register would take 3 s
        started = asyncio.get_running_loop().time()
        returned = await plugin.register(options=dp.DevicePluginOptions(pre_start_required=True))
        assert returned - started < 1.0
        await sim.wait_for_resource("example.com/gpu", 2, timeout=5)
        assert plugin.calls("GetDevicePluginOptions") == []
        assert sim.registered_resources()["example.com/gpu"].pre_start_required is True


async def test_legacy_reregistration_replaces_and_the_old_stream_end_does_no_harm(plugin_dir, plugins) -> None:
    async with await _sim(plugin_dir, "legacy-1.24") as sim:
        old = await _plugin(sim, plugins, count=2)
        await old.register()
        await sim.wait_for_resource("example.com/gpu", 2, timeout=5)
        new = await _plugin(sim, plugins, count=3, socket_name="gpu-new.sock")
        await new.register()
        await sim.wait_for_resource("example.com/gpu", 3, timeout=5)
        old.end_streams()
        await asyncio.sleep(0.3)
        assert sim.allocatable("example.com/gpu") == 3 and new.streams_open == 1


async def test_legacy_start_wipes_every_file_but_the_checkpoint(plugin_dir) -> None:
    dp_dir = plugin_dir / "dp"
    dp_dir.mkdir()
    (dp_dir / "stale.txt").write_text("x")
    (dp_dir / "kubelet_internal_checkpoint").write_text("{}")
    (dp_dir / "subdir").mkdir()
    async with await _sim(plugin_dir, "legacy-1.24"):
        assert not (dp_dir / "stale.txt").exists()
        assert (dp_dir / "subdir").is_dir() and (dp_dir / "kubelet_internal_checkpoint").exists()


async def test_main_same_socket_registration_is_deduplicated(plugin_dir, plugins) -> None:
    async with await _sim(plugin_dir, "main-2026") as sim:
        plugin = await _plugin(sim, plugins, count=2)
        await plugin.register()
        await sim.wait_for_resource("example.com/gpu", 2, timeout=5)
        await plugin.register()
        assert len(plugin.calls("GetDevicePluginOptions")) == 1 and plugin.streams_open == 1
        register = [c for c in sim.calls if c.method == "Register"]
        assert register[-1].response == {"deduplicated": True}


async def test_main_a_survivor_is_promoted_when_the_old_stream_ends(plugin_dir, plugins) -> None:
    async with await _sim(plugin_dir, "main-2026") as sim:
        old = await _plugin(sim, plugins, count=2)
        await old.register()
        new = await _plugin(sim, plugins, count=3, socket_name="gpu-new.sock")
        await new.register()
        await sim.wait_for_resource("example.com/gpu", 3, timeout=5)
        old.end_streams()
        await eventually(lambda: old.streams_open == 0, timeout=5, interval=0.02, what="the old plugin's stream ended")
        await asyncio.sleep(0.2)
        info = sim.registered_resources()["example.com/gpu"]
        assert info.socket.endswith("gpu-new.sock") and info.stopped is False
        assert sim.allocatable("example.com/gpu") == 3 and new.streams_open == 1
        new.end_streams()  # the last one going makes the resource unhealthy
        await sim.wait_for_resource("example.com/gpu", 0, timeout=5)
