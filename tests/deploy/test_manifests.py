"""deploy/: the rendered base mounts every path the services open at the same host path, grants exactly
the API verbs the code uses, probes with a real `gpuledger health` target, binds metrics where Prometheus
scrapes them, and the kustomizations use every file. (test_rendering.py renders the overlays and the Helm
chart and validates everything against the Kubernetes schemas.)"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from gpuledger.agent import SERVICES
from gpuledger.cli import run
from gpuledger.health_cmd import health
from gpuledger.options import load_config_file
from libs.config import Settings
from libs.metrics import metrics_port
from tests.deploy.helpers import BASE, MONITORING, OVERLAY, ROOT, docs, kustomize
from tests.deploy.helpers import find as find_in


def base_objects() -> list[dict[str, Any]]:
    return kustomize(BASE)


def find(kind: str, objects: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return find_in(kind, objects or base_objects())


def settings_from_configmap(configmap: dict[str, Any]) -> Settings:
    """The Settings a container builds from the ConfigMap's config.yaml, through the real --config parser."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(configmap["data"]["config.yaml"])
        values = load_config_file(str(path), run.params)
    fields = set(Settings.__struct_fields__)
    return Settings(node_name="n", **{k: v for k, v in values.items() if k in fields})


def _containers() -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in find("DaemonSet")["spec"]["template"]["spec"]["containers"]}


# Which service opens each path setting of libs/config.Settings (a field or a derived path), and whether
# it writes there. The completeness test below derives the path settings from Settings itself, so a new
# path setting fails the tests until it is listed here (and mounted).
OPENS: dict[str, dict[str, bool]] = {
    "log_path": {"allocator": True},                      # ledger.sqlite (+ -wal, -shm, snapshots)
    "device_plugin_dir": {"registrar": True, "allocator": False},  # the allocator reads the kubelet's checkpoint
    "kubelet_plugins_dir": {"registrar": True},            # the DRA plugin's socket
    "plugins_registry_dir": {"registrar": True},           # its registration socket
    "cdi_dir": {"registrar": True},                        # CDI specs of prepared claims
    "pod_resources_socket": {"allocator": True, "watchdog": True},
    "vm_root": {"vmanager": True},
    "vdriver_root": {"vmanager": True},
    "hami_preload": {"vmanager": True},
    "hami_library": {"vmanager": False},
    "hami_lock_dir": {"vmanager": True},
    "cgroup_root": {"vmanager": False},
    "runtime_socket": {"vmanager": False},                # connects only: a read-only mount serves
    # the vmanager reads <proc_root>/<pid>/cgroup; the allocator reads /proc/<pid>/cgroup (usage sampling)
    "proc_root": {"vmanager": False, "allocator": False},
    "ld_cache": {"vmanager": False},
    "driver_bin_dirs": {"vmanager": False},
    "vcuda_control_library": {"vmanager": False},
    "extra_config": {"allocator": False},
    "kubeconfig": {"allocator": False, "watchdog": False},
    "gpus": {"allocator": False},                         # fake:FILE
}
# Path settings no service opens as such.
NOT_OPENED = {
    "state_dir": "opened through log_path, vm_root and vdriver_root",
    "vm_dir": "opened as vm_root",
    "vdriver_dir": "opened as vdriver_root",
    "hami_mount_dir": "a path inside GPU containers, not on the host",
}
_PATHY = re.compile(r"(_dir|_dirs|_root|_socket|_library|_cache|_path|config)$")
# The NVIDIA container runtime puts the driver's libraries into the container (listed in the container's
# /etc/ld.so.cache, which its ldconfig hook rewrites) and the utility binaries into /usr/bin.
NVIDIA_RUNTIME_PATHS = (Path("/etc/ld.so.cache"), Path("/usr/bin"))


def paths_of(settings: Settings, name: str) -> list[Path]:
    value = getattr(settings, name)
    if name == "gpus":
        return [Path(value.removeprefix("fake:"))] if value.startswith("fake:") else []
    if name == "driver_bin_dirs":
        return [Path(d) for d in value.split(":") if d]
    if name == "log_path":
        return [value.parent]  # SQLite creates its -wal and -shm files next to the log
    return [Path(value)] if value is not None and str(value) else []


def _nvidia_runtime(container: dict[str, Any]) -> bool:
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    caps = set(env.get("NVIDIA_DRIVER_CAPABILITIES", "").split(","))
    return bool(env.get("NVIDIA_VISIBLE_DEVICES")) and ("all" in caps or {"compute", "utility"} <= caps)


def _covered(path: Path, container: dict[str, Any], spec: dict[str, Any], writes: bool) -> bool:
    """Mounted from the host at the same path (the kubelet gets host paths from us), or the host's /proc
    through hostPID, or driver files the NVIDIA runtime provides."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container.get("volumeMounts", []):
        host = volumes[mount["name"]].get("hostPath", {}).get("path")
        if host == mount["mountPath"] and path.is_relative_to(mount["mountPath"]) and \
                not (writes and mount.get("readOnly")):
            return True
    if path.is_relative_to("/proc"):
        return bool(spec.get("hostPID")) and not writes
    return path in NVIDIA_RUNTIME_PATHS and not writes and _nvidia_runtime(container)


def test_every_path_setting_is_listed() -> None:
    fields = set(Settings.__struct_fields__)
    defaults = Settings(node_name="n")
    pathy = {f for f in fields if _PATHY.search(f) or str(getattr(defaults, f)).startswith("/")}
    assert pathy, "no path settings found"
    undeclared = pathy - set(OPENS) - set(NOT_OPENED)
    assert not undeclared, f"path settings no service is declared to open: {undeclared}"
    for name in OPENS:
        assert name in fields or isinstance(getattr(Settings, name, None), property), name
        assert set(OPENS[name]) <= set(SERVICES)


@pytest.mark.parametrize("source", [BASE, OVERLAY], ids=["base", "overlay"])
def test_every_path_a_service_opens_is_mounted_at_its_host_path(source: Path) -> None:
    settings = settings_from_configmap(find("ConfigMap", kustomize(source)))
    containers = _containers()
    spec = find("DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    nats_args = containers["nats"]["command"]
    assert set(containers) == {*SERVICES, "nats"}
    assert _covered(Path(nats_args[nats_args.index("-sd") + 1]), containers["nats"], spec, True)
    checked = 0
    for name, services in OPENS.items():
        for service, writes in services.items():
            for path in paths_of(settings, name):
                checked += 1
                assert _covered(path, containers[service], spec, writes), \
                    f"{service} {'writes' if writes else 'reads'} {path} ({name}), which is not mounted"
    assert checked >= 15
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


def test_the_coverage_check_can_fail() -> None:
    containers = _containers()
    spec = find("DaemonSet")["spec"]["template"]["spec"]
    vm = containers["vmanager"]
    assert _covered(Path("/proc"), vm, spec, False)
    assert not _covered(Path("/proc"), vm, {**spec, "hostPID": False}, False)
    assert not _covered(Path("/sys/fs/cgroup"), vm, spec, True)  # mounted read-only
    assert not _covered(Path("/var/lib/gpuledger/ledger.sqlite"), vm, spec, True)
    assert not _covered(Path("/etc/ld.so.cache"), containers["watchdog"], spec, False)


def test_host_pid_namespace_where_proc_of_other_pods_is_read() -> None:
    spec = find("DaemonSet")["spec"]["template"]["spec"]
    settings = settings_from_configmap(find("ConfigMap"))
    # vcuda.sock callers (vmanager) and GPU processes (allocator) are pids of other pods
    assert spec.get("hostPID") is True and settings.proc_root == "/proc"


def test_declared_ports_are_the_metrics_ports() -> None:
    settings = settings_from_configmap(find("ConfigMap"))
    assert settings.metrics_port > 0
    assert settings.metrics_host == "0.0.0.0"  # the agent's default is loopback: Prometheus scrapes the pod IP
    containers = _containers()
    names: dict[str, str] = {}
    for service in SERVICES:
        ports = containers[service].get("ports", [])
        assert [p["containerPort"] for p in ports] == [metrics_port(settings, service)], service
        assert ports[0].get("protocol", "TCP") == "TCP"
        names[service] = ports[0]["name"]
    assert not containers["nats"].get("ports")  # NATS stays inside the pod
    assert len(set(names.values())) == len(names)
    annotations = find("DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == metrics_port(settings, "allocator")
    assert annotations["prometheus.io/path"] == "/metrics"
    monitor = docs(MONITORING / "podmonitor.yaml")[0]
    assert monitor["kind"] == "PodMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert sorted(e["port"] for e in monitor["spec"]["podMetricsEndpoints"]) == sorted(names.values())
    labels = find("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["metadata"]["namespace"] == find("Namespace")["metadata"]["name"]


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


_CALL = re.compile(r"\.(get|list|watch|patch|delete|create|replace|apply)\(\s*(KubePod|Node)(\.Status)?\b")
_WATCH = re.compile(r'prepare_request\(\s*"list",\s*res=(KubePod|Node)\b[^)]*watch=True', re.S)
_RESOURCES = {"KubePod": "pods", "Node": "nodes"}


def api_calls_in_code() -> set[tuple[str, str]]:
    used: set[tuple[str, str]] = set()
    for path in [*ROOT.joinpath("services").rglob("*.py"), *ROOT.joinpath("libs").rglob("*.py")]:
        text = path.read_text()
        used |= {(_RESOURCES[res] + ("/status" if sub else ""), verb) for verb, res, sub in _CALL.findall(text)}
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


def test_metrics_listen_where_prometheus_scrapes() -> None:
    """Outside a pod metrics stay on loopback by default; in the pod Prometheus scrapes the pod IP, so the
    config names every interface explicitly rather than relying on a default."""
    for source in (BASE, OVERLAY):
        configmap = find("ConfigMap", kustomize(source))
        assert yaml.safe_load(configmap["data"]["config.yaml"])["metrics-host"] == "0.0.0.0"
        assert settings_from_configmap(configmap).metrics_host == "0.0.0.0"


def test_kustomizations_use_every_file() -> None:
    base = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert sorted(base["resources"]) == sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    component = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    assert component["resources"] == ["podmonitor.yaml"]
    overlay = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert sorted(p["path"] for p in overlay["patches"]) == \
        sorted(p.name for p in OVERLAY.glob("*.yaml") if p.name != "kustomization.yaml")


def test_the_example_overlay_applies() -> None:
    objects = kustomize(OVERLAY)
    spec = find("DaemonSet", objects)["spec"]["template"]["spec"]
    overlay = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    image = overlay["images"][0]
    assert {c["image"] for c in spec["containers"]} == {f"{image['newName']}:{image['newTag']}"}
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    settings = settings_from_configmap(find("ConfigMap", objects))
    assert settings.node_label_map == {"team": "ml", "gpuledger.io/pool": "training"}
