"""The simulated API server's resource.k8s.io/v1 objects, over real HTTP (lightkube and raw)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx2
import lightkube
import pytest
from lightkube import ALL_NS, ApiError
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceSlice
from lightkube.types import PatchType

from simulator import NodeSimulator

BASE = "/apis/resource.k8s.io/v1"


@pytest.fixture
async def kube(sim: NodeSimulator) -> AsyncIterator[lightkube.AsyncClient]:
    client = lightkube.AsyncClient(config=sim.lightkube_config())
    yield client
    await client.close()


@pytest.fixture
async def http(sim: NodeSimulator) -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(base_url=sim.api_url, timeout=10) as client:
        yield client


def a_slice(name: str, node: str = "sim-node", driver: str = "gpu.example.com") -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1,
                                                                   "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0", "attributes": {"index": {"int": 0}}}]}}


async def test_discovery_names_the_group(http) -> None:
    groups = (await http.get("/apis")).json()["groups"]
    assert [g["name"] for g in groups] == ["resource.k8s.io"]
    names = {r["name"] for r in (await http.get(BASE)).json()["resources"]}
    assert {"deviceclasses", "resourceslices", "resourceclaims", "resourceclaims/status",
            "resourceclaimtemplates"} <= names


async def test_slices_through_lightkube_with_field_selectors(kube) -> None:
    await kube.create(ResourceSlice.from_dict(a_slice("mine")))
    await kube.create(ResourceSlice.from_dict(a_slice("theirs", node="other")))
    mine = [s async for s in kube.list(ResourceSlice, fields={"spec.nodeName": "sim-node"})]
    assert [s.metadata.name for s in mine] == ["mine"]
    by_driver = [s async for s in kube.list(ResourceSlice, fields={"spec.driver": "gpu.example.com"})]
    assert len(by_driver) == 2
    patched = await kube.patch(ResourceSlice, "mine", {"spec": {"pool": {"generation": 2}}},
                               patch_type=PatchType.MERGE)
    assert patched.spec.pool.generation == 2
    assert patched.metadata.generation == 2
    await kube.delete(ResourceSlice, "mine")
    with pytest.raises(ApiError) as err:
        await kube.get(ResourceSlice, "mine")
    assert err.value.status.code == 404


async def test_claim_status_subresource_and_immutable_spec(kube) -> None:
    claim = ResourceClaim.from_dict({"metadata": {"name": "c1", "namespace": "default"}, "spec": {"devices": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}}})
    created = await kube.create(claim)
    assert created.metadata.uid and created.status is None
    status = {"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u1"}]}}
    # A status written through the main resource is ignored; through /status it sticks.
    after = await kube.patch(ResourceClaim, "c1", status, namespace="default", patch_type=PatchType.MERGE)
    assert after.status is None
    after = await kube.patch(ResourceClaim.Status, "c1", status, namespace="default", patch_type=PatchType.MERGE)
    assert after.status.reservedFor[0].uid == "u1"
    with pytest.raises(ApiError) as err:
        await kube.patch(ResourceClaim, "c1", {"spec": {"devices": {"requests": []}}}, namespace="default",
                         patch_type=PatchType.MERGE)
    assert err.value.status.code == 422
    everywhere = [c async for c in kube.list(ResourceClaim, namespace=ALL_NS)]
    assert [c.metadata.name for c in everywhere] == ["c1"]


async def test_watch_resumes_from_a_version(http, kube) -> None:
    await kube.create(DeviceClass.from_dict({"metadata": {"name": "a"}, "spec": {}}))
    listed = (await http.get(f"{BASE}/deviceclasses")).json()
    rv = listed["metadata"]["resourceVersion"]
    await kube.create(DeviceClass.from_dict({"metadata": {"name": "b"}, "spec": {}}))
    async with http.stream("GET", f"{BASE}/deviceclasses",
                           params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": "1"}) as resp:
        lines = [json.loads(line) async for line in resp.aiter_lines() if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in lines] == [("ADDED", "b")]
    assert lines[0]["object"]["kind"] == "DeviceClass"


async def test_bad_input_is_refused_clearly(http) -> None:
    resp = await http.post(f"{BASE}/resourceslices", json={"kind": "Pod", "metadata": {"name": "x"}})
    assert resp.status_code == 400 and "expected kind ResourceSlice" in resp.json()["message"]
    resp = await http.get(f"{BASE}/resourceslices", params={"fieldSelector": "spec.bogus=1"})
    assert resp.status_code == 400
    resp = await http.get(f"{BASE}/deviceclasses/none")
    assert resp.status_code == 404 and resp.json()["kind"] == "Status"


