"""deploy/ rendered by kustomize and by Helm: both give the same objects, overlays compose with the
monitoring component, and everything is valid against the schemas of every supported Kubernetes version."""

from __future__ import annotations

from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

from tests.deploy.helpers import (
    BASE,
    CHART,
    CHART_EXAMPLE_VALUES,
    MONITORING,
    NAMESPACE,
    OVERLAY,
    SUPPORTED_KUBERNETES,
    Objects,
    by_identity,
    find,
    helm_notes,
    helm_template,
    kustomize,
    user_overlay,
    validate,
    without_helm_additions,
)

EXAMPLE_VALUES = yaml.safe_load(CHART_EXAMPLE_VALUES.read_text())


def assert_same_objects(helm: Objects, kustomized: Objects) -> None:
    """Helm renders what kustomize renders, less the Namespace (`helm install --create-namespace` makes
    it) and the labels and annotations Helm adds."""
    chart = by_identity(without_helm_additions(helm))
    base = by_identity(without_helm_additions(kustomized))
    assert base.pop(("Namespace", NAMESPACE))
    assert sorted(chart) == sorted(base)
    for identity, obj in chart.items():
        assert obj == base[identity], f"{identity} differs between the chart and kustomize"


def test_the_chart_renders_the_base() -> None:
    assert_same_objects(helm_template(), kustomize(BASE))


def test_the_chart_with_example_values_renders_the_example_overlay() -> None:
    assert_same_objects(helm_template(EXAMPLE_VALUES), kustomize(OVERLAY))


def test_the_chart_pod_monitor_is_the_components(tmp_path: Path) -> None:
    overlay = user_overlay(tmp_path / "monitored", resources=[BASE], components=[MONITORING])
    assert_same_objects(helm_template({"podMonitor": {"enabled": True}}), kustomize(overlay))


def test_the_comparison_sees_a_difference() -> None:
    changed = helm_template({"config": {"log-level": "debug"}})
    with pytest.raises(AssertionError, match="ConfigMap"):
        assert_same_objects(changed, kustomize(BASE))
    with pytest.raises(AssertionError):
        assert_same_objects(helm_template({"podMonitor": {"enabled": True}}), kustomize(BASE))


def test_helm_adds_only_its_own_labels() -> None:
    for obj in helm_template():
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["app.kubernetes.io/instance"]


def test_the_monitoring_component_keeps_the_users_overlay(tmp_path: Path) -> None:
    """A user's overlay plus the component: their image, runtime class, node selector and config stay."""
    mine = user_overlay(tmp_path / "cluster", resources=[OVERLAY], components=[MONITORING],
                        images=[{"name": "registry.example.com/gpuledger", "newTag": "0.1.0-mine"}])
    objects = kustomize(mine)
    without = by_identity(kustomize(user_overlay(tmp_path / "plain", resources=[OVERLAY],
                                                 images=[{"name": "registry.example.com/gpuledger",
                                                          "newTag": "0.1.0-mine"}])))
    composed = by_identity(objects)
    monitor = composed.pop(("PodMonitor", "gpuledger"))
    assert composed == without  # the component adds the PodMonitor and changes nothing else
    spec = find("DaemonSet", objects)["spec"]["template"]["spec"]
    assert {c["image"] for c in spec["containers"]} == {"registry.example.com/gpuledger:0.1.0-mine"}
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "team=ml" in find("ConfigMap", objects)["data"]["config.yaml"]
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        find("DaemonSet", objects)["spec"]["template"]["metadata"]["labels"].items()


def test_the_component_follows_the_users_namespace(tmp_path: Path) -> None:
    objects = kustomize(user_overlay(tmp_path / "ns", resources=[BASE], components=[MONITORING],
                                     namespace="gpu-agents"))
    namespaced = [o for o in objects if o["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding")]
    assert {o["metadata"]["namespace"] for o in namespaced} == {"gpu-agents"}
    assert find("ClusterRoleBinding", objects)["subjects"][0]["namespace"] == "gpu-agents"


def _renderings(tmp_path: Path) -> dict[str, Objects]:
    return {
        "kustomize base": kustomize(BASE),
        "kustomize example overlay + monitoring": kustomize(
            user_overlay(tmp_path / "all", resources=[OVERLAY], components=[MONITORING])),
        "helm defaults": helm_template(),
        "helm example values + podMonitor": helm_template({**EXAMPLE_VALUES, "podMonitor": {"enabled": True}}),
    }


@pytest.mark.parametrize("version", SUPPORTED_KUBERNETES)
def test_every_rendering_is_valid_for_every_supported_version(version: str, tmp_path: Path) -> None:
    for name, objects in _renderings(tmp_path).items():
        assert {o["kind"] for o in objects} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                                 "ConfigMap", "DaemonSet"}, name
        try:
            skipped = validate(objects, version)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name} is not valid for Kubernetes {version}: {exc}") from exc
        assert skipped in ([], ["PodMonitor"]), name


def test_the_validator_has_the_supported_versions() -> None:
    def parsed(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))

    assert parsed(kubernetes_validate.latest_version()) >= parsed(SUPPORTED_KUBERNETES[-1])
    ds = find("DaemonSet", kustomize(BASE))
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # a typo'd field name
    for version in (SUPPORTED_KUBERNETES[0], SUPPORTED_KUBERNETES[-1]):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(ds, version, strict=True)


def test_the_chart_lints_clean() -> None:
    report = helm_python.lint(str(CHART), strict=True, kube_version=f"v{SUPPORTED_KUBERNETES[0]}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_values_reach_the_objects() -> None:
    objects = helm_template({"image": {"repository": "r.example/gl", "tag": "t1", "pullPolicy": "Always"},
                             "config": {"metrics-port": 9100}, "runtimeClassName": "nvidia",
                             "podMonitor": {"enabled": True, "labels": {"release": "prom"}}},
                            namespace="agents")
    ds = find("DaemonSet", objects)
    containers = ds["spec"]["template"]["spec"]["containers"]
    assert {(c["image"], c["imagePullPolicy"]) for c in containers} == {("r.example/gl:t1", "Always")}
    assert [p["containerPort"] for c in containers for p in c.get("ports", [])] == [9100, 9101, 9102, 9103]
    assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    assert yaml.safe_load(find("ConfigMap", objects)["data"]["config.yaml"])["metrics-port"] == 9100
    assert find("PodMonitor", objects)["metadata"]["labels"]["release"] == "prom"
    assert {o["metadata"]["namespace"] for o in objects if "namespace" in o["metadata"]} == {"agents"}


def test_the_default_image_is_one_you_build_and_load() -> None:
    """No image is published: the default is a local tag used as loaded, and the chart says how."""
    for objects in (kustomize(BASE), helm_template()):
        for container in find("DaemonSet", objects)["spec"]["template"]["spec"]["containers"]:
            assert container["image"] == "gpuledger:0.1.0" and container["imagePullPolicy"] == "IfNotPresent"
    assert "deploy/Dockerfile" in helm_notes() and "kind load" in helm_notes()
    assert "deploy/Dockerfile" not in helm_notes(EXAMPLE_VALUES)
    readme = (BASE.parent / "README.md").read_text()
    assert "docker build -f deploy/Dockerfile -t gpuledger:0.1.0" in readme
    assert "kind load docker-image gpuledger:0.1.0" in readme and "ctr -n k8s.io images import" in readme



@pytest.mark.parametrize(("values", "message"), [
    ({"config": {"metrics-port": "5678"}}, "/config/metrics-port"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"nodeselector": {"a": "b"}}, "nodeselector"),
], ids=["port-as-string", "pull-policy", "misspelt-key"])
def test_bad_values_are_refused_with_where(values: dict, message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=message):
        helm_template(values)
