"""deploy/: the manifests are valid Kubernetes objects (offline schemas from kubernetes-validate), mount
every path the services open at the same host path, grant exactly the API verbs the code uses, probe
with a real `gpuledger health` target, and the kustomizations reference what exists."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import yaml

from gpuledger.cli import SERVICE_NAMES, run
from gpuledger.health_cmd import health
from gpuledger.options import load_config_file
from libs.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
OVERLAY = DEPLOY / "overlays" / "example"
VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base_objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [d for name in kustomization["resources"] for d in docs(BASE / name)]


def find(kind: str, objects: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    matches = [o for o in (objects or base_objects()) if o["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}"
    return matches[0]


def settings_from_configmap(configmap: dict[str, Any]) -> Settings:
    """The Settings a container builds from the ConfigMap's config.yaml, through the real --config parser."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(configmap["data"]["config.yaml"])
        values = load_config_file(str(path), run.params)
    fields = set(Settings.__struct_fields__)
    return Settings(node_name="n", **{k: v for k, v in values.items() if k in fields})


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_schema_valid(version: str) -> None:
    objects = base_objects() + docs(OVERLAY / "config-patch.yaml")
    assert {o["kind"] for o in objects} >= {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                             "ConfigMap", "DaemonSet"}
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_catches_mistakes() -> None:
    ds = find("DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # a typo'd field name
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, VERSIONS[-1], strict=True)


def _containers() -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in find("DaemonSet")["spec"]["template"]["spec"]["containers"]}


def _covered(path: Path, container: dict[str, Any], volumes: dict[str, dict[str, Any]]) -> bool:
    """Mounted from the host at the same path (the kubelet gets host paths from us)."""
    for mount in container.get("volumeMounts", []):
        host = volumes[mount["name"]].get("hostPath", {}).get("path")
        if host == mount["mountPath"] and path.is_relative_to(mount["mountPath"]) and not mount.get("readOnly"):
            return True
    return False


def test_every_path_a_service_opens_is_mounted_at_its_host_path() -> None:
    settings = settings_from_configmap(find("ConfigMap"))
    containers = _containers()
    volumes = {v["name"]: v for v in find("DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    nats_args = containers["nats"]["command"]
    opened = {
        "allocator": [settings.log_path.parent],
        "registrar": [Path(settings.device_plugin_dir)],
        "vmanager": [settings.vm_root],
        "watchdog": [Path(settings.pod_resources_socket)],
        "nats": [Path(nats_args[nats_args.index("-sd") + 1])],
    }
    assert set(containers) == set(opened) == {*SERVICE_NAMES, "nats"}
    for name, paths in opened.items():
        for path in paths:
            assert _covered(path, containers[name], volumes), f"{name} opens {path}, which is not mounted"
    # Every hostPath is mounted at its own path, wherever it is mounted.
    for container in containers.values():
        for mount in container["volumeMounts"]:
            host = volumes[mount["name"]].get("hostPath", {}).get("path")
            assert host in (None, mount["mountPath"]), (container["name"], mount)
    # The services read the config file from the ConfigMap and their node name from the pod spec.
    for container in containers.values():
        env = {e["name"]: e for e in container["env"]}
        config = Path(env["GPULEDGER_CONFIG"]["value"])
        mount = next(m for m in container["volumeMounts"] if config.is_relative_to(m["mountPath"]))
        assert "configMap" in volumes[mount["name"]]
        assert env["GPULEDGER_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_services_run_and_probe_real_commands() -> None:
    choices = next(p for p in health.params if p.name == "service").type
    assert isinstance(choices, click.Choice)
    for name, container in _containers().items():
        if name != "nats":
            assert container["command"] == ["gpuledger", "run", name]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[:3] == ["gpuledger", "health", name] and name in choices.choices, (name, probe)
            assert container[probe]["timeoutSeconds"] > float(command[command.index("--timeout") + 1])


_CALL = re.compile(r"\.(get|list|watch|patch|delete|create|replace|apply)\(\s*(KubePod|Node)\b")
_WATCH = re.compile(r'prepare_request\(\s*"list",\s*res=(KubePod|Node)\b[^)]*watch=True', re.S)
_RESOURCES = {"KubePod": "pods", "Node": "nodes"}


def api_calls_in_code() -> set[tuple[str, str]]:
    used: set[tuple[str, str]] = set()
    for path in [*ROOT.joinpath("services").rglob("*.py"), *ROOT.joinpath("libs").rglob("*.py")]:
        text = path.read_text()
        used |= {(_RESOURCES[res], verb) for verb, res in _CALL.findall(text)}
        used |= {(_RESOURCES[res], "watch") for res in _WATCH.findall(text)}
    return used


def test_rbac_grants_exactly_the_verbs_the_code_uses() -> None:
    role = find("ClusterRole")
    granted = {(res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]}
    assert all(rule["apiGroups"] == [""] for rule in role["rules"])
    assert granted == api_calls_in_code()
    binding = find("ClusterRoleBinding")
    sa = find("ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]
    assert find("DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_scheduling_node_selector_and_tolerations() -> None:
    spec = find("DaemonSet")["spec"]["template"]["spec"]
    assert spec["nodeSelector"]
    assert {t["key"] for t in spec["tolerations"]} >= {"tencent.com/vcuda-core"}


def test_kustomizations_reference_what_exists() -> None:
    base = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert sorted(base["resources"]) == sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    overlay = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    for res in overlay["resources"]:
        assert (OVERLAY / res / "kustomization.yaml").exists()
    objects = {(o["kind"], o["metadata"]["name"]) for o in base_objects()}
    for patch in overlay["patches"]:
        patch_doc = docs(OVERLAY / patch["path"])[0]
        target = (patch["target"]["kind"], patch["target"]["name"])
        assert target in objects and (patch_doc["kind"], patch_doc["metadata"]["name"]) == target
    images = {c["image"].split(":")[0] for c in _containers().values()}
    assert {i["name"] for i in overlay["images"]} <= images
    # The overlay's configuration is a valid configuration too.
    settings = settings_from_configmap(docs(OVERLAY / "config-patch.yaml")[0])
    assert settings.node_label_map == {"team": "ml", "gpuledger.io/pool": "training"}
