"""Registration, ListAndWatch bookkeeping, stream end and the 1.25-1.36 re-registration bug."""

from __future__ import annotations

import asyncio
import stat

import grpc
import pytest

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from simulator import NodeSimulator, SimConfig
from tests.builders import ctr, phase_is, pod_manifest
from tests.polling import eventually
from tests.simulator.fakeplugin import FakePlugin, device


@pytest.mark.parametrize(
    ("version", "resource", "message"),
    [
        ("v1alpha", "example.com/gpu",
         'requested API version "v1alpha" is not supported by kubelet. Supported version is ["v1beta1"]'),
        ("v1beta1", "gpu", 'the ResourceName "gpu" is invalid'),
        ("v1beta1", "kubernetes.io/gpu", 'the ResourceName "kubernetes.io/gpu" is invalid'),
        ("v1beta1", "requests.x/y", 'the ResourceName "requests.x/y" is invalid'),
        ("v1beta1", "example.com/" + "a" * 64, f'the ResourceName "example.com/{"a" * 64}" is invalid'),
    ],
)
async def test_register_validation_errors(
    make_plugin, sim: NodeSimulator, version: str, resource: str, message: str
) -> None:
    plugin = await make_plugin(register=False)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await plugin.register(version=version, resource=resource)
    assert info.value.code() == grpc.StatusCode.UNKNOWN
    assert info.value.details() == message
    assert plugin.received == []  # never dialled
    assert sim.calls[-1].method == "Register" and sim.calls[-1].error == message


async def test_options_fetched_inside_register_and_register_options_ignored(make_plugin, sim) -> None:
    plugin = await make_plugin(register=False, pre_start_required=True)
    plugin.options_delay = 0.2
    returned_at = await plugin.register(options=dp.DevicePluginOptions())  # says "no PreStart"
    options_calls = plugin.calls("GetDevicePluginOptions")
    assert len(options_calls) == 1 and options_calls[0].at < returned_at
    register = next(c for c in sim.calls if c.method == "Register")
    get_options = next(c for c in sim.calls if c.method == "GetDevicePluginOptions")
    assert get_options.end is not None and register.end is not None and get_options.end <= register.end
    # What counts is GetDevicePluginOptions, not RegisterRequest.options.
    assert sim.registered_resources()["example.com/gpu"].pre_start_required is True
    await sim.wait_for_resource("example.com/gpu", 4, timeout=5)
    law = next(c for c in sim.calls if c.method == "ListAndWatch")
    assert law.start >= get_options.end


async def test_capacity_follows_list_and_watch(make_plugin, sim) -> None:
    plugin = await make_plugin(count=3)
    assert sim.capacity("example.com/gpu") == 3 and sim.allocatable("example.com/gpu") == 3
    plugin.set_devices([device("dev0"), device("dev1", "Unhealthy"), device("dev2", "healthy"),
                        device("dev3", "")])
    await sim.wait_for_resource("example.com/gpu", 1, timeout=5)
    assert sim.capacity("example.com/gpu") == 4
    plugin.set_devices([])  # empty snapshot: zero devices, still registered
    await sim.wait_for_resource("example.com/gpu", 0, timeout=5)
    assert sim.capacity("example.com/gpu") == 0
    assert "example.com/gpu" in sim.registered_resources()


async def test_stream_end_marks_devices_unhealthy_and_stops_endpoint(make_plugin, sim) -> None:
    plugin = await make_plugin(count=2)
    plugin.end_streams()
    await sim.wait_for_resource("example.com/gpu", 0, timeout=5)
    assert sim.capacity("example.com/gpu") == 2  # capacity unchanged, allocatable 0
    info = sim.registered_resources()["example.com/gpu"]
    assert info.stopped is True
    law = next(c for c in sim.calls if c.method == "ListAndWatch")
    assert law.end is not None and law.response["messages"] == 1


async def test_stopped_resource_removed_after_grace(plugin_dir) -> None:
    cfg = SimConfig(device_plugin_dir=plugin_dir / "dp", endpoint_grace=0.3, seed=1)
    async with NodeSimulator(cfg) as sim:
        plugin = FakePlugin(cfg.device_plugin_dir, count=2)
        await plugin.start()
        try:
            await plugin.register()
            await sim.wait_for_resource("example.com/gpu", 2, timeout=5)
            await plugin.stop()
            await sim.wait_for_resource("example.com/gpu", 0, timeout=5)
            assert sim.capacity("example.com/gpu") == 2
            await asyncio.sleep(0.4)
            sim.tick()
            assert sim.capacity("example.com/gpu") == 0
            assert "example.com/gpu" not in sim.registered_resources()
            node = sim.node.render()
            # Removed resources are set to 0 in the node status, not deleted.
            assert node["status"]["capacity"]["example.com/gpu"] == "0"
        finally:
            await plugin.stop()


async def test_dial_failure(make_plugin, sim) -> None:
    plugin = await make_plugin(register=False)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await plugin.register(endpoint="nobody-listens.sock")
    assert info.value.code() == grpc.StatusCode.UNKNOWN
    assert info.value.details().startswith("failed to dial device plugin:")


async def test_reregistration_while_old_stream_runs_ends_at_zero(make_plugin, sim) -> None:
    """1.25-1.36 bug (#121994): the old stream's end disconnects the new client."""
    old = await make_plugin(count=2)
    new = await make_plugin(count=3, socket_name="gpu-new.sock")
    await sim.wait_for_resource("example.com/gpu", 3, timeout=5)
    assert sim.registered_resources()["example.com/gpu"].socket.endswith("gpu-new.sock")
    old.end_streams()
    await sim.wait_for_resource("example.com/gpu", 0, timeout=5)
    assert sim.registered_resources()["example.com/gpu"].stopped is True
    # The new plugin's stream was cut by the kubelet, although the new plugin is fine.
    await eventually(lambda: new.streams_open == 0, timeout=2.5, interval=0.05, what="the new plugin's stream cut")
    assert new.streams_open == 0


async def test_plugin_restart_after_old_one_died_recovers(make_plugin, sim) -> None:
    old = await make_plugin(count=2)
    await old.stop()
    await sim.wait_for_resource("example.com/gpu", 0, timeout=5)
    await make_plugin(count=2, socket_name="gpu-2.sock")
    assert sim.allocatable("example.com/gpu") == 2
    assert sim.registered_resources()["example.com/gpu"].stopped is False


async def test_startup_wipes_only_sockets(plugin_dir) -> None:
    dp_dir = plugin_dir / "dp"
    dp_dir.mkdir()
    (dp_dir / "keep.txt").write_text("x")
    (dp_dir / "subdir").mkdir()
    stale = FakePlugin(dp_dir, socket_name="stale.sock")
    await stale.start()
    try:
        assert stat.S_ISSOCK((dp_dir / "stale.sock").stat().st_mode)
        async with NodeSimulator(SimConfig(device_plugin_dir=dp_dir)) as sim:
            assert not (dp_dir / "stale.sock").exists()
            assert (dp_dir / "keep.txt").exists() and (dp_dir / "subdir").is_dir()
            assert stat.S_ISSOCK(sim.registration.socket_path.stat().st_mode)
        assert not (dp_dir / "kubelet.sock").exists()
    finally:
        await stale.stop()


def test_unknown_profiles_are_refused(plugin_dir) -> None:
    with pytest.raises(ValueError, match="unknown kubelet profile"):
        NodeSimulator(SimConfig(device_plugin_dir=plugin_dir, profile="1.99"))


async def test_bug_disconnect_fails_in_flight_allocate(make_plugin, sim) -> None:
    old = await make_plugin(count=2)
    new = await make_plugin(count=2, socket_name="gpu-new.sock")
    new.allocate_delay = 2
    await sim.create_pod(pod_manifest("p", [ctr("a", {"example.com/gpu": 1})]))
    await eventually(lambda: new.calls("Allocate"), timeout=2, interval=0.02, what="Allocate reaching the new plugin")
    old.end_streams()  # the kubelet now closes the *new* connection, Allocate included
    pod = await sim.wait_for_pod("default", "p", phase_is("Failed"), timeout=5)
    assert pod["status"]["message"] == (
        "Pod was rejected: Allocate failed due to rpc error: code = Canceled desc = "
        "grpc: the client connection is closing, which is unexpected"
    )
    # Admission goes on: the next pod fails cleanly on the stopped endpoint's unhealthy devices.
    await sim.create_pod(pod_manifest("q", [ctr("a", {"example.com/gpu": 1})]))
    pod = await sim.wait_for_pod("default", "q", phase_is("Failed"), timeout=5)
    assert "no healthy devices present" in pod["status"]["message"]
