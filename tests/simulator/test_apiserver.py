"""The Kubernetes-shaped HTTP API, driven by lightkube itself and by raw HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import lightkube
import pytest
import yaml
from lightkube import ALL_NS, ApiError
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType

from simulator import NodeSimulator, SimConfig
from tests.builders import ctr, phase_is, pod_manifest

GPU = "example.com/gpu"


@pytest.fixture
async def kube(sim: NodeSimulator) -> AsyncIterator[lightkube.AsyncClient]:
    client = lightkube.AsyncClient(config=sim.lightkube_config())
    yield client
    await client.close()


@pytest.fixture
async def http(sim: NodeSimulator) -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(base_url=sim.api_url, timeout=10) as client:
        yield client


async def read_events(resp: httpx2.Response, count: int, timeout: float = 5) -> list[dict[str, Any]]:
    """The next `count` watch events of a streamed response (None-terminated when it ends)."""
    lines = resp.extensions.setdefault("sim_lines", resp.aiter_lines())
    events: list[dict[str, Any]] = []

    async def collect() -> None:
        while len(events) < count:
            line = await anext(lines, None)
            if line is None:
                return
            if line.strip():
                events.append(json.loads(line))

    await asyncio.wait_for(collect(), timeout)
    return events


async def test_lightkube_list_get_patch_delete(kube, sim) -> None:
    await sim.create_pod(pod_manifest("mine", labels={"app": "x"}))
    await sim.create_pod({**pod_manifest("other", namespace="ns2"), "spec": {
        "nodeName": "elsewhere", "containers": [ctr("c")]}})
    await sim.wait_for_pod("default", "mine", phase_is("Running"), timeout=5)

    ours = [p async for p in kube.list(Pod, namespace=ALL_NS, fields={"spec.nodeName": "sim-node"})]
    assert [p.metadata.name for p in ours] == ["mine"]
    everything = [p async for p in kube.list(Pod, namespace=ALL_NS)]
    assert {p.metadata.name for p in everything} == {"mine", "other"}
    in_ns2 = [p async for p in kube.list(Pod, namespace="ns2")]
    assert [p.metadata.name for p in in_ns2] == ["other"]
    assert [p.metadata.name async for p in kube.list(Pod, namespace=ALL_NS, labels={"app": "x"})] == ["mine"]

    pod = await kube.get(Pod, "mine", namespace="default")
    assert pod.status.phase == "Running" and pod.spec.nodeName == "sim-node"
    patched = await kube.patch(Pod, "mine", {"metadata": {"annotations": {"a/b": "1"}}}, namespace="default")
    assert patched.metadata.annotations == {"a/b": "1"}
    assert int(patched.metadata.resourceVersion) > int(pod.metadata.resourceVersion)
    patched = await kube.patch(
        Pod, "mine", [{"op": "add", "path": "/metadata/labels/extra", "value": "y"}],
        namespace="default", patch_type=PatchType.JSON,
    )
    assert patched.metadata.labels == {"app": "x", "extra": "y"}
    patched = await kube.patch(Pod, "mine", {"metadata": {"annotations": {"a/b": None}}},
                               namespace="default", patch_type=PatchType.MERGE)
    assert not patched.metadata.annotations

    await kube.delete(Pod, "mine", namespace="default")
    assert sim.get_pod("default", "mine") is None
    with pytest.raises(ApiError) as info:
        await kube.get(Pod, "mine", namespace="default")
    assert info.value.status.code == 404 and info.value.status.reason == "NotFound"


async def test_lightkube_watch_sees_added_modified_deleted(kube, sim) -> None:
    events: list[tuple[str, str, str]] = []
    done = asyncio.Event()

    async def watch() -> None:
        async for kind, pod in kube.watch(Pod, namespace=ALL_NS, fields={"spec.nodeName": "sim-node"}):
            events.append((kind, pod.metadata.name, (pod.status.phase if pod.status else "")))
            if kind == "DELETED":
                done.set()
                return

    task = asyncio.create_task(watch())
    try:
        await asyncio.sleep(0.1)
        await sim.create_pod(pod_manifest("w"))
        await sim.wait_for_pod("default", "w", phase_is("Running"), timeout=5)
        await sim.delete_pod("default", "w")
        await asyncio.wait_for(done.wait(), 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    kinds = [k for k, _, _ in events]
    assert kinds[0] == "ADDED" and kinds[-1] == "DELETED" and "MODIFIED" in kinds
    assert ("MODIFIED", "w", "Running") in events


async def test_create_conflict_and_status_errors(kube, http, sim) -> None:
    created = await kube.create(Pod.from_dict(pod_manifest("dup")))
    assert created.metadata.uid and created.status.phase == "Pending"
    with pytest.raises(ApiError) as info:
        await kube.create(Pod.from_dict(pod_manifest("dup")))
    assert info.value.status.code == 409 and info.value.status.reason == "AlreadyExists"
    resp = await http.get("/api/v1/pods", params={"fieldSelector": "spec.bogus=1"})
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert body["kind"] == "Status" and body["reason"] == "BadRequest"
    resp = await http.get("/api/v1/nowhere")
    assert resp.status_code == 404 and resp.json()["kind"] == "Status"


async def test_list_shape_and_selectors(http, sim) -> None:
    await sim.create_pod(pod_manifest("a", labels={"tier": "web", "env": "prod"}))
    await sim.create_pod(pod_manifest("b", labels={"tier": "db"}))
    await sim.create_pod(pod_manifest("c", namespace="other"))
    resp = await http.get("/api/v1/pods")
    body = resp.json()
    assert body["kind"] == "PodList" and body["apiVersion"] == "v1"
    assert body["metadata"]["resourceVersion"] == str(sim.store.resource_version)
    assert "kind" not in body["items"][0]

    async def names(**params: str) -> list[str]:
        r = await http.get("/api/v1/pods", params=params)
        assert r.status_code == 200, r.text
        return sorted(i["metadata"]["name"] for i in r.json()["items"])

    assert await names(labelSelector="tier=web") == ["a"]
    assert await names(labelSelector="tier!=web") == ["b", "c"]
    assert await names(labelSelector="tier") == ["a", "b"]
    assert await names(labelSelector="!tier") == ["c"]
    assert await names(labelSelector="tier in (web,db),env") == ["a"]
    assert await names(fieldSelector="metadata.namespace!=default") == ["c"]
    assert await names(fieldSelector="metadata.name==b,metadata.namespace=default") == ["b"]
    assert await names(fieldSelector="status.phase=Pending,spec.nodeName=nobody") == []


async def test_watch_resume_and_expired(plugin_dir) -> None:
    cfg = SimConfig(device_plugin_dir=plugin_dir / "dp", watch_history=5)
    async with NodeSimulator(cfg) as sim, httpx2.AsyncClient(base_url=sim.api_url, timeout=10) as http:
        first = await sim.create_pod(pod_manifest("p0"))
        rv = first["metadata"]["resourceVersion"]
        await sim.create_pod(pod_manifest("p1"))
        # Events after rv: p1 ADDED (and status updates of the kubelet).
        async with http.stream("GET", "/api/v1/namespaces/default/pods",
                               params={"watch": "true", "resourceVersion": rv}) as resp:
            assert resp.headers["content-type"] == "application/json"
            (event,) = await read_events(resp, 1)
        assert event["type"] in ("ADDED", "MODIFIED")
        assert int(event["object"]["metadata"]["resourceVersion"]) > int(rv)
        for i in range(2, 10):
            await sim.create_pod(pod_manifest(f"p{i}"))
        async with http.stream("GET", "/api/v1/pods", params={"watch": "1", "resourceVersion": rv}) as resp:
            events = await read_events(resp, 2)
        assert len(events) == 1  # the stream ended after the error
        status = events[0]["object"]
        assert status["kind"] == "Status" and status["code"] == 410 and status["reason"] == "Expired"


async def test_lightkube_relists_after_410(kube, plugin_dir) -> None:
    cfg = SimConfig(device_plugin_dir=plugin_dir / "dp2", watch_history=2)
    async with NodeSimulator(cfg) as sim:
        client = lightkube.AsyncClient(config=sim.lightkube_config())
        try:
            first = await sim.create_pod(pod_manifest("old"))
            for i in range(5):
                await sim.create_pod(pod_manifest(f"n{i}"))
            old_rv = first["metadata"]["resourceVersion"]
            stream = client.watch(Pod, namespace="default", resource_version=old_rv)
            with pytest.raises(ApiError) as info:
                await asyncio.wait_for(stream.__anext__(), 5)
            assert info.value.status.code == 410
        finally:
            await client.close()


async def test_watch_initial_state_bookmarks_and_timeout(plugin_dir) -> None:
    cfg = SimConfig(device_plugin_dir=plugin_dir / "dp", bookmark_interval=0.1)
    async with NodeSimulator(cfg) as sim, httpx2.AsyncClient(base_url=sim.api_url, timeout=10) as http:
        await sim.create_pod(pod_manifest("x"))
        async with http.stream("GET", "/api/v1/namespaces/default/pods", params={
            "watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": "1",
            "fieldSelector": "metadata.name=x",
        }) as resp:
            events = []
            async for line in resp.aiter_lines():
                if line.strip():
                    events.append(json.loads(line))
        types = [e["type"] for e in events]
        assert types[0] == "ADDED" and "BOOKMARK" in types
        bookmark = next(e for e in events if e["type"] == "BOOKMARK")
        assert bookmark["object"]["metadata"]["resourceVersion"] == str(sim.store.resource_version)


async def test_watch_selector_transition_is_deleted(http, sim) -> None:
    await sim.create_pod(pod_manifest("t", labels={"pick": "yes"}))
    rv = str(sim.store.resource_version)
    async with http.stream("GET", "/api/v1/pods", params={
        "watch": "true", "resourceVersion": rv, "labelSelector": "pick=yes"}) as resp:
        await asyncio.sleep(0.05)
        r = await http.patch("/api/v1/namespaces/default/pods/t",
                             content=json.dumps({"metadata": {"labels": {"pick": "no"}}}),
                             headers={"Content-Type": "application/merge-patch+json"})
        assert r.status_code == 200
        events = await read_events(resp, 1)
    # Any kubelet status update before the patch is MODIFIED; the label change must be DELETED.
    assert events[-1]["type"] in ("MODIFIED", "DELETED")
    if events[-1]["type"] == "MODIFIED":
        async with http.stream("GET", "/api/v1/pods", params={
            "watch": "true", "resourceVersion": rv, "labelSelector": "pick=yes"}) as resp:
            events = await read_events(resp, 3)
    assert any(e["type"] == "DELETED" and e["object"]["metadata"]["labels"]["pick"] == "no" for e in events)


async def test_status_subresource_and_conflicts(http, sim) -> None:
    await sim.create_pod(pod_manifest("s"))
    pod = await sim.wait_for_pod("default", "s", phase_is("Running"), timeout=5)
    url = "/api/v1/namespaces/default/pods/s/status"
    body = {"status": {"phase": "Succeeded"}, "spec": {"nodeName": "x"}}
    r = await http.patch(url, content=json.dumps(body),
                         headers={"Content-Type": "application/strategic-merge-patch+json"})
    assert r.status_code == 200
    assert r.json()["status"]["phase"] == "Succeeded" and r.json()["spec"]["nodeName"] == "sim-node"
    stale = dict(pod, status={"phase": "Failed"})
    r = await http.put(url, content=json.dumps(stale), headers={"Content-Type": "application/json"})
    assert r.status_code == 409 and r.json()["reason"] == "Conflict"
    fresh = r2 = (await http.get("/api/v1/namespaces/default/pods/s")).json()
    fresh["status"] = {"phase": "Failed", "reason": "Because"}
    r2 = await http.put(url, content=json.dumps(fresh), headers={"Content-Type": "application/json"})
    assert r2.status_code == 200 and sim.get_pod("default", "s")["status"]["reason"] == "Because"


async def test_http_create_and_delete_events(http, sim) -> None:
    r = await http.post("/api/v1/namespaces/ns1/pods", content=json.dumps(pod_manifest("h", namespace="ns1")),
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 201 and r.json()["metadata"]["namespace"] == "ns1"
    r = await http.post("/api/v1/namespaces/ns1/pods", content=json.dumps(pod_manifest("h", namespace="ns1")),
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 409 and r.json()["reason"] == "AlreadyExists"
    await sim.wait_for_pod("ns1", "h", phase_is("Running"), timeout=5)
    rv = str(sim.store.resource_version)
    async with http.stream("GET", "/api/v1/namespaces/ns1/pods",
                           params={"watch": "true", "resourceVersion": rv}) as resp:
        deleted = await http.delete("/api/v1/namespaces/ns1/pods/h")
        assert deleted.status_code == 200 and deleted.json()["metadata"]["deletionTimestamp"]
        events = await read_events(resp, 2)
    assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]
    terminating = events[0]["object"]
    assert terminating["metadata"]["deletionTimestamp"]
    assert "terminated" in terminating["status"]["containerStatuses"][0]["state"]
    assert (await http.delete("/api/v1/namespaces/ns1/pods/h")).status_code == 404


async def test_node_object_and_patch(kube, make_plugin, sim) -> None:
    await make_plugin(count=3)
    node = await kube.get(Node, "sim-node")
    assert node.status.capacity[GPU] == "3" and node.status.allocatable[GPU] == "3"
    patched = await kube.patch(Node, "sim-node", {"metadata": {"labels": {"gpu": "yes"}}})
    assert patched.metadata.labels["gpu"] == "yes"
    assert [n.metadata.name async for n in kube.list(Node)] == ["sim-node"]
    with pytest.raises(ApiError):
        await kube.get(Node, "other")


async def test_simulator_control_endpoints(http, make_plugin, sim) -> None:
    await make_plugin(count=2)
    await sim.create_pod(pod_manifest("p", [ctr("a", {GPU: 1})]))
    await sim.wait_for_pod("default", "p", phase_is("Running"), timeout=5)
    opts = (await http.get("/simulator/v1/pods/default/p/containers/a")).json()
    assert opts["envs"]["FAKE_VISIBLE_DEVICES"].startswith("dev")
    assert opts["mounts"] == [
        {"container_path": "/usr/local/fake", "host_path": "/opt/fake", "read_only": True}
    ]
    calls = (await http.get("/simulator/v1/calls")).json()
    assert [c["method"] for c in calls][:3] == ["Register", "GetDevicePluginOptions", "ListAndWatch"] or \
        [c["method"] for c in calls][:2] == ["Register", "GetDevicePluginOptions"]
    assert any(c["method"] == "Allocate" for c in calls)
    resources = (await http.get("/simulator/v1/resources")).json()
    assert resources[GPU]["capacity"] == 2
    assert (await http.get("/simulator/v1/pods/default/nope/containers/a")).status_code == 404


async def test_kubeconfig_file(plugin_dir) -> None:
    cfg = SimConfig(device_plugin_dir=plugin_dir / "dp", kubeconfig_path=plugin_dir / "kube" / "config")
    async with NodeSimulator(cfg) as sim:
        doc = yaml.safe_load(cfg.kubeconfig_path.read_text())
        assert doc["clusters"][0]["cluster"]["server"] == sim.api_url
        client = lightkube.AsyncClient(config=lightkube.KubeConfig.from_file(cfg.kubeconfig_path))
        try:
            await sim.create_pod(pod_manifest("k"))
            pod = await client.get(Pod, "k", namespace="default")
            assert pod.metadata.name == "k"
        finally:
            await client.close()


async def test_server_side_apply_creates_then_patches(kube, sim) -> None:
    manifest = pod_manifest("applied", labels={"v": "1"})
    created = await kube.apply(Pod.from_dict(manifest), field_manager="test")
    assert created.metadata.uid and sim.get_pod("default", "applied") is not None
    manifest["metadata"]["labels"] = {"v": "2"}
    updated = await kube.apply(Pod.from_dict(manifest), field_manager="test")
    assert updated.metadata.uid == created.metadata.uid and updated.metadata.labels == {"v": "2"}


async def test_wait_for_pod_timeout_reports_last_status(sim) -> None:
    await sim.create_pod(pod_manifest("idle", namespace="elsewhere") | {
        "spec": {"nodeName": "other-node", "containers": [ctr("c")]}})
    with pytest.raises(TimeoutError, match=r'pod elsewhere/idle .* last status: \{"phase": "Pending"'):
        await sim.wait_for_pod("elsewhere", "idle", phase_is("Running"), timeout=0.3)
