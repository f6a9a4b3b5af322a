"""deploy/dra: the DeviceClass, the RBAC for the DRA side, and the example ResourceClaimTemplates are valid
resource.k8s.io/v1 objects for every release that serves that API (1.34+), and they work together with
the slice the registrar publishes, through the simulator's allocator (CEL by cel-python)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from libs.dra import DRIVER_NAME
from libs.dra_objects import device_class, node_slice
from libs.events.schema import InventoryRecorded
from libs.gpu.fake import FakeBackend
from simulator.dra.allocator import allocate
from tests.deploy.helpers import DEPLOY, ROOT, SUPPORTED_KUBERNETES, docs, find, kustomize

DRA = DEPLOY / "dra"
DRA_RELEASES = [v for v in SUPPORTED_KUBERNETES if int(v.split(".")[1]) >= 34]
PROFILES = ROOT / "libs" / "gpu" / "profiles"


def dgx_slice() -> dict:
    found = FakeBackend(PROFILES / "dgx-a100-8gpu.yaml").inventory()
    inv = InventoryRecorded(node="n", backend="fake", driver_version=found.driver_version, gpus=found.gpus,
                            links=found.links)
    return node_slice(inv, inv.gpus, 1, unhealthy={inv.gpus[7].uuid: "unhealthy"}, taint_time="2026-01-01T00:00:00Z")


@pytest.mark.parametrize("version", DRA_RELEASES)
def test_manifests_validate_against_the_release_schema(version: str) -> None:
    objects = kustomize(DRA) + docs(DRA / "examples" / "claimtemplates.yaml")
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    assert {o["kind"] for o in objects} == {"DeviceClass", "ClusterRole", "ClusterRoleBinding",
                                            "ResourceClaimTemplate"}


def test_the_published_slice_validates_where_consumable_capacity_is_served() -> None:
    # allowMultipleAllocations, requestPolicy and device taints are in the v1 schema from 1.34 on.
    for version in DRA_RELEASES:
        kubernetes_validate.validate(dgx_slice(), version, strict=True)


def test_device_class_is_the_one_the_code_builds() -> None:
    shipped = find("DeviceClass", kustomize(DRA))
    built = device_class()
    assert shipped["metadata"]["name"] == built["metadata"]["name"] == DRIVER_NAME
    assert shipped["spec"] == built["spec"]


def test_rbac_covers_slices_and_claim_status_writes() -> None:
    role = find("ClusterRole", kustomize(DRA))
    granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert all(rule["apiGroups"] == ["resource.k8s.io"] for rule in role["rules"])
    assert {("resourceslices", v) for v in ("get", "create", "update", "delete")} <= granted
    assert ("resourceclaims/driver", "associated-node:patch") in granted
    assert ("resourceclaims", "get") in granted
    binding = find("ClusterRoleBinding", kustomize(DRA))
    assert binding["subjects"][0]["name"] == "gpuledger"


@pytest.mark.parametrize(("template", "devices"), [
    ("gpu-share", 1), ("gpu-whole", 1), ("gpu-nvlink-pair", 2)])
def test_example_templates_allocate_on_a_dgx(template: str, devices: int) -> None:
    templates = {t["metadata"]["name"]: t for t in docs(DRA / "examples" / "claimtemplates.yaml")}
    claim = {"metadata": {"name": "c"}, "spec": templates[template]["spec"]["spec"]}
    got = allocate(claim, {DRIVER_NAME: device_class()}, [dgx_slice()], [], "n")
    results = got["devices"]["results"]
    assert len(results) == devices
    assert all(r["device"] != "gpu-7" for r in results)  # the tainted GPU is avoided
    if template == "gpu-share":
        assert results[0]["consumedCapacity"] == {"cores": "30", "memory": "4Gi"}


def test_kustomization_uses_every_file() -> None:
    import yaml

    listed = yaml.safe_load((DRA / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in Path(DRA).glob("*.yaml") if p.name != "kustomization.yaml")
