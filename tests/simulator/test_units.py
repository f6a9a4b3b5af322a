"""Pure helpers of the simulator: names, quantities, patches, selectors, checkpoint codec."""

from __future__ import annotations

import asyncio

import pytest

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp
from simulator import SimConfig, run_simulator
from simulator.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointRow,
    decode_checkpoint,
    encode_checkpoint,
)
from simulator.errors import ApiError
from simulator.names import is_extended_resource_name
from simulator.patches import apply_patch, json_patch, merge_patch
from simulator.podspec import quantity_value
from simulator.selectors import parse_field_selector, parse_label_selector
from tests.polling import eventually


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("tencent.com/vcuda-core", True), ("nvidia.com/gpu", True), ("example.com/GPU_1.x", True),
        ("gpu", False), ("kubernetes.io/gpu", False), ("foo.kubernetes.io/gpu", False),
        ("x/kubernetes.io/gpu", False), ("requests.x/y", False), ("Example.com/gpu", False),
        ("example.com/" + "a" * 63, True), ("example.com/" + "a" * 64, False), ("a/b/c", False),
        ("example.com/-gpu", False), ("/gpu", False),
    ],
)
def test_extended_resource_names(name: str, ok: bool) -> None:
    assert is_extended_resource_name(name) is ok


def test_quantities() -> None:
    assert quantity_value("3") == 3 and quantity_value(2) == 2 and quantity_value("1k") == 1000
    assert quantity_value("1Ki") == 1024 and quantity_value("500m") == 1 and quantity_value("1500m") == 2
    with pytest.raises(ValueError):
        quantity_value("lots")


def test_merge_and_json_patch() -> None:
    doc = {"metadata": {"labels": {"a": "1", "b": "2"}}, "spec": {"list": [1, 2]}}
    assert merge_patch(doc, {"metadata": {"labels": {"a": None, "c": "3"}}, "spec": {"list": [9]}}) == {
        "metadata": {"labels": {"b": "2", "c": "3"}}, "spec": {"list": [9]}}
    out = json_patch(doc, [
        {"op": "add", "path": "/metadata/annotations", "value": {"x/y": "1"}},
        {"op": "replace", "path": "/metadata/labels/a", "value": "10"},
        {"op": "remove", "path": "/metadata/labels/b"},
        {"op": "add", "path": "/spec/list/-", "value": 3},
        {"op": "add", "path": "/metadata/annotations/k~1v", "value": "slash"},
        {"op": "test", "path": "/spec/list/2", "value": 3},
        {"op": "copy", "from": "/spec/list", "path": "/spec/copy"},
        {"op": "move", "from": "/spec/copy", "path": "/spec/moved"},
    ])
    assert out["metadata"] == {"labels": {"a": "10"}, "annotations": {"x/y": "1", "k/v": "slash"}}
    assert out["spec"] == {"list": [1, 2, 3], "moved": [1, 2, 3]}
    assert doc["metadata"]["labels"] == {"a": "1", "b": "2"}  # input untouched
    with pytest.raises(ApiError):
        json_patch(doc, [{"op": "remove", "path": "/nope"}])
    with pytest.raises(ApiError) as info:
        apply_patch(doc, "text/plain", {})
    assert info.value.code == 415


def test_selectors() -> None:
    pod = {"metadata": {"name": "p", "namespace": "ns", "labels": {"app": "x", "tier": "web"}},
           "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}}
    assert parse_field_selector("spec.nodeName=n1,status.phase==Running")(pod)
    assert not parse_field_selector("metadata.name!=p")(pod)
    assert parse_field_selector("")(pod)
    with pytest.raises(ApiError) as info:
        parse_field_selector("spec.foo=1")
    assert info.value.code == 400 and "field label not supported: spec.foo" in info.value.message
    assert parse_label_selector("app=x,tier in (web, db),!gone")(pod)
    assert not parse_label_selector("app notin (x)")(pod)
    assert parse_label_selector("app!=y,tier")(pod)
    assert not parse_label_selector("missing=1")(pod)


def test_checkpoint_round_trip() -> None:
    resp = dp.ContainerAllocateResponse(envs={"A": "1"})
    cp = Checkpoint(rows=[CheckpointRow("uid", "c", "x.com/y", {-1: ["d1"], 0: ["d2"]}, resp)],
                    registered={"x.com/y": ["d1", "d2"]})
    back = decode_checkpoint(encode_checkpoint(cp))
    assert back.rows[0].devices_per_numa == {-1: ["d1"], 0: ["d2"]} and back.rows[0].response == resp
    assert back.registered == cp.registered
    empty = decode_checkpoint(encode_checkpoint(Checkpoint(rows=[], registered={})))
    assert empty.rows == [] and empty.registered == {}
    with pytest.raises(CheckpointError):
        decode_checkpoint(b'{"Data":{"PodDeviceEntries":[{"PodUID":"u","ContainerName":"c",'
                          b'"ResourceName":"r","DeviceIDs":["flat"],"AllocResp":""}]}}')


async def test_run_simulator_until_stopped(plugin_dir) -> None:
    stop = asyncio.Event()
    cfg = SimConfig(device_plugin_dir=plugin_dir / "dp", kubeconfig_path=plugin_dir / "kubeconfig")
    task = asyncio.create_task(run_simulator(cfg, stop=stop))
    await eventually(lambda: cfg.kubeconfig_path.exists() and (cfg.device_plugin_dir / "kubelet.sock").exists(),
                     timeout=2, interval=0.02, what="the simulator's kubeconfig and kubelet.sock")
    assert (cfg.device_plugin_dir / "kubelet.sock").exists()
    stop.set()
    await asyncio.wait_for(task, 5)
    assert not (cfg.device_plugin_dir / "kubelet.sock").exists()
