"""The options every agent command shares: a flag, a GPULEDGER_* environment variable, a config-file key.

Precedence: a flag beats the environment, which beats the ``--config`` YAML file, which beats the
default (the file fills click's ``default_map``, which click consults after flags and variables). A
file key is an option's long name without the dashes, with ``-`` or ``_`` (``node-name``,
``node_name``); gpu-manager's names (``hostname-override`` ...) work too. The collected values become
one ``libs.config.Settings``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import msgspec

from libs.config import Settings, default_state_dir

__all__ = ["OptionConflict", "agent_options", "config_option", "load_config_file", "log_options", "settings_from"]

F = Callable[..., Any]


class OptionConflict(click.ClickException):
    """Options that contradict each other or mean nothing together: one line, exit code 2 (click's usage code)."""

    exit_code = 2


def _opt(*names: str, env: str | list[str], **kw: Any) -> Callable[[F], F]:
    return click.option(*names, envvar=env, show_envvar=True, **kw)


def log_options(fn: F) -> F:
    fn = _opt("--log-format", env=["GPULEDGER_LOG_FORMAT", "LOG_FORMAT"],
              type=click.Choice(["auto", "json", "console"]), default="auto",
              help="Log format; auto = readable on a terminal, JSON otherwise.")(fn)
    fn = _opt("--log-level", env="GPULEDGER_LOG_LEVEL", default="info",
              type=click.Choice(["debug", "info", "warning", "error"]), help="Log level.")(fn)
    return fn


def agent_options(fn: F) -> F:
    decorators = [
        _opt("--node-name", "--hostname-override", env=["GPULEDGER_NODE_NAME", "NODE_NAME"], default=None,
             help="This node's Kubernetes name [default: the host name]."),
        _opt("--state-dir", env="GPULEDGER_STATE_DIR", default=default_state_dir, show_default=True,
             help="Where the event log (ledger.sqlite) and, by default, vm/ and vdriver/ live."),
        _opt("--device-plugin-dir", "--device-plugin-path", env="GPULEDGER_DEVICE_PLUGIN_DIR",
             default="/var/lib/kubelet/device-plugins", show_default=True,
             help="The kubelet's device-plugin directory (kubelet.sock, our vcore.sock and vmemory.sock)."),
        _opt("--dra-gpus", env="GPULEDGER_DRA_GPUS", default="",
             help="GPUs served by the DRA driver (indexes or UUIDs, comma-separated, or all); the others "
                  "stay with the device plugin [default: none, DRA off]."),
        _opt("--kubelet-plugins-dir", env="GPULEDGER_KUBELET_PLUGINS_DIR", default="/var/lib/kubelet/plugins",
             show_default=True, help="The kubelet's plugins directory (DRA socket <dir>/gpu.gpuledger.io/dra.sock)."),
        _opt("--plugins-registry-dir", env="GPULEDGER_PLUGINS_REGISTRY_DIR",
             default="/var/lib/kubelet/plugins_registry", show_default=True,
             help="The kubelet's plugin-watcher directory (our registration socket gpu.gpuledger.io-reg.sock)."),
        _opt("--cdi-dir", env="GPULEDGER_CDI_DIR", default="/var/run/cdi", show_default=True,
             help="Where CDI spec files for prepared DRA claims are written (rebuilt from the log at start)."),
        _opt("--dra-prepare-timeout", env="GPULEDGER_DRA_PREPARE_TIMEOUT", type=float, default=20.0,
             show_default=True, help="Seconds one NodePrepareResources may take (below the kubelet's 45 s)."),
        _opt("--pod-resources-socket", env="GPULEDGER_POD_RESOURCES_SOCKET",
             default="/var/lib/kubelet/pod-resources/kubelet.sock", show_default=True,
             help="The kubelet's pod-resources socket."),
        _opt("--vm-dir", "--virtual-manager-path", env="GPULEDGER_VM_DIR", default="",
             help="Per-pod vcuda directories, mounted at /etc/vcuda [default: STATE_DIR/vm]."),
        _opt("--vdriver-dir", env="GPULEDGER_VDRIVER_DIR", default="",
             help="Driver volumes nvidia/ and origin/ mounted at /usr/local/nvidia [default: STATE_DIR/vdriver]."),
        _opt("--nats-url", env="GPULEDGER_NATS_URL", default=None,
             help="NATS server [default for `up`: an embedded nats-server; for `run`: nats://127.0.0.1:4222]."),
        _opt("--kubeconfig", env="GPULEDGER_KUBECONFIG", default="",
             help="Kubeconfig for the API server [default: in-cluster service account, else $KUBECONFIG]."),
        _opt("--gpus", env="GPULEDGER_GPUS", default="auto", show_default=True,
             help="GPU inventory: auto (NVML, else fake GPUs), nvml, fake, or fake:FILE (a topology file)."),
        _opt("--share-mode/--no-share-mode", env="GPULEDGER_SHARE_MODE", default=True, show_default=True,
             help="Allow fractional GPUs (fewer than 100 vcuda-core)."),
        _opt("--allocate-timeout", env="GPULEDGER_ALLOCATE_TIMEOUT", type=float, default=10.0, show_default=True,
             help="Seconds the kubelet's Allocate may wait for the allocator before it gets an error."),
        _opt("--request-timeout", env="GPULEDGER_REQUEST_TIMEOUT", type=float, default=5.0, show_default=True,
             help="Seconds any internal request between services may take."),
        # Kubernetes integration: gpu-manager's --node-labels and --allocation-check-period
        _opt("--node-labels", env="GPULEDGER_NODE_LABELS", default="",
             help="Labels the watchdog keeps on the node, k=v,k2=v2 (the GPU model label is always set)."),
        _opt("--allocation-check-period", env="GPULEDGER_ALLOCATION_CHECK_PERIOD", type=float, default=30.0,
             show_default=True, help="Seconds between reconciliations of allocations against the node's pods."),
        # Observability: metrics, status view and GPU health
        _opt("--metrics-port", env="GPULEDGER_METRICS_PORT", type=click.IntRange(0, 65532), default=5678,
             show_default=True, help="Base HTTP port for /metrics: allocator (also /graph, /usage, /version) "
             "on it, registrar +1, vmanager +2, watchdog +3; 0 turns the servers off."),
        _opt("--metrics-host", env="GPULEDGER_METRICS_HOST", default="127.0.0.1", show_default=True,
             help="Address the metrics servers listen on (0.0.0.0: every interface, as a scraped pod needs)."),
        _opt("--usage-interval", env="GPULEDGER_USAGE_INTERVAL", type=float, default=5.0, show_default=True,
             help="Seconds between background NVML usage samples (scrapes read the last sample)."),
        _opt("--health-checks/--no-health-checks", env="GPULEDGER_HEALTH_CHECKS", default=True,
             show_default=True, help="Watch NVML XID/ECC events and mark GPUs unhealthy."),
        _opt("--health-ignored-xids", env="GPULEDGER_HEALTH_IGNORED_XIDS", default="13,31,43,45,68,109",
             show_default=True, help="Comma-separated XIDs that never mark a GPU unhealthy (application errors)."),
        _opt("--health-recovery-seconds", env="GPULEDGER_HEALTH_RECOVERY_SECONDS", type=float, default=60.0,
             show_default=True, help="An unhealthy GPU recovers only after this long without a critical event."),
        _opt("--health-recovery-checks", env="GPULEDGER_HEALTH_RECOVERY_CHECKS", type=click.IntRange(1),
             default=3, show_default=True, help="...and this many clean NVML probes in a row."),
        _opt("--health-check-interval", env="GPULEDGER_HEALTH_CHECK_INTERVAL", type=float, default=10.0,
             show_default=True, help="Seconds between the probes of an unhealthy GPU."),
        # Limit delivery, pid discovery, caller checks, driver volumes
        _opt("--limit-delivery", env="GPULEDGER_LIMIT_DELIVERY", type=click.Choice(["vcuda", "hami-core"]),
             default="vcuda", show_default=True,
             help="How containers get their limits: gpu-manager's vcuda.config, or HAMi-core's environment."),
        _opt("--cgroup-root", env="GPULEDGER_CGROUP_ROOT", default="/sys/fs/cgroup", show_default=True,
             help="Where the host's cgroup hierarchies are mounted (v1, v2 or hybrid)."),
        _opt("--proc-root", env="GPULEDGER_PROC_ROOT", default="/proc", show_default=True,
             help="The host's /proc, to check which pod a vcuda.sock caller belongs to."),
        _opt("--container-runtime-endpoint", env="GPULEDGER_CONTAINER_RUNTIME_ENDPOINT", default="",
             help="The CRI runtime's socket (PATH or unix://PATH): the vmanager asks it which container a "
                  "registering container id is [default: none, the pod's status through the watchdog]."),
        _opt("--hami-library", env="GPULEDGER_HAMI_LIBRARY", default="/usr/local/vgpu/libvgpu.so",
             show_default=True, help="hami-core mode: host path of HAMi-core's libvgpu.so."),
        _opt("--hami-mount-dir", env="GPULEDGER_HAMI_MOUNT_DIR", default="/usr/local/vgpu", show_default=True,
             help="hami-core mode: the directory inside containers holding libvgpu.so and the cache file."),
        _opt("--hami-lock-dir", env="GPULEDGER_HAMI_LOCK_DIR", default="/tmp/vgpulock", show_default=True,
             help="hami-core mode: host lock directory shared by all containers."),
        _opt("--ld-cache", env="GPULEDGER_LD_CACHE", default="/etc/ld.so.cache", show_default=True,
             help="ld.so.cache listing the host's NVIDIA libraries, for the driver volumes."),
        _opt("--driver-bin-dirs", env="GPULEDGER_DRIVER_BIN_DIRS",
             default="/usr/bin:/usr/local/bin:/usr/local/nvidia/bin", show_default=True,
             help="':'-separated directories searched for the NVIDIA binaries of the driver volumes."),
        _opt("--vcuda-control-library", env="GPULEDGER_VCUDA_CONTROL_LIBRARY", default="",
             help="libcuda-control.so for the share volume [default: found through the ld.so.cache]."),
        _opt("--driver-volumes/--no-driver-volumes", env="GPULEDGER_DRIVER_VOLUMES", default=True,
             show_default=True, help="Build VDRIVER_DIR/nvidia and origin when the vmanager starts."),
        # Pod identity check period, gpu-manager's extra config
        _opt("--identity-check-period", env="GPULEDGER_IDENTITY_CHECK_PERIOD", type=float, default=30.0,
             show_default=True,
             help="Seconds between checks of every grant against the kubelet's pod-resources record "
                  "(0: only at PreStartContainer)."),
        # Fleet: join the central cluster as a leaf node; the recorder's database
        _opt("--fleet-url", env="GPULEDGER_FLEET_URL", default="",
             help="The central cluster's leafnode URLs (nats://HOST:7422, comma-separated): the embedded broker "
                  "joins the fleet as a leaf node with its own JetStream domain [default: no fleet]."),
        _opt("--fleet-credentials", env="GPULEDGER_FLEET_CREDENTIALS", default="",
             help="YAML file with this node's user: and password: in the central cluster."),
        _opt("--fleet-db", env="GPULEDGER_FLEET_DB", default="",
             help="Fleet recorder: SQLAlchemy database URL [default: SQLite at STATE_DIR/fleet.sqlite]."),
        _opt("--fleet-silent-after", env="GPULEDGER_FLEET_SILENT_AFTER", type=float, default=600.0,
             show_default=True, help="Fleet recorder: seconds without an event after which a node counts as silent."),
        _opt("--extra-config", env="GPULEDGER_EXTRA_CONFIG", default="",
             help='gpu-manager\'s extra config JSON ({"default": {"devices": [...]}}): device nodes added to '
                  "every Allocate response."),
        # Outside witness: signed checkpoints of the log
        _opt("--cluster-name", env="GPULEDGER_CLUSTER_NAME", default="default", show_default=True,
             help="The cluster's name in this node's checkpoint origin, gpuledger/<cluster>/<node>."),
        _opt("--checkpoint-every", env="GPULEDGER_CHECKPOINT_EVERY", type=click.IntRange(0), default=1000,
             show_default=True, help="Sign a checkpoint of the log and have the witness cosign it every this many "
             "events (0: never)."),
        _opt("--checkpoint-interval", env="GPULEDGER_CHECKPOINT_INTERVAL", type=float, default=60.0,
             show_default=True, help="...and at least every this many seconds while the log grew."),
        # Bounded log growth
        _opt("--log-retention", "log_retention_events", env="GPULEDGER_LOG_RETENTION_EVENTS",
             type=click.IntRange(0), default=0, show_default=True,
             help="Keep this many events in the live log and move older ones into compressed archive segments "
                  "(still read by replay, events, history and audit verify); 0: never archive by itself."),
    ]
    for deco in reversed(decorators):
        fn = deco(fn)
    return config_option(log_options(fn))


def load_config_file(path: str, params: list[click.Parameter]) -> dict[str, Any]:
    """The YAML file as click's ``default_map``: option name -> value; unknown keys are an error."""
    import yaml  # here: only a service started with --config reads YAML (about 1 MB resident otherwise)

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise click.BadParameter(f"cannot read {path}: {exc}", param_hint="--config") from exc
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path} must hold a mapping of option: value", param_hint="--config")
    names: dict[str, str] = {}
    for param in params:
        if isinstance(param, click.Option) and param.name and param.name != "config":
            for opt in param.opts:
                names[opt.lstrip("-").replace("-", "_")] = param.name
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        name = names.get(str(key).replace("-", "_"))
        if name is None:
            known = ", ".join(sorted({n for n in names.values()}))
            raise click.BadParameter(f"{path}: unknown key {key!r}; known keys: {known}", param_hint="--config")
        defaults[name] = value
    return defaults


def _use_config_file(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value:
        ctx.default_map = {**(ctx.default_map or {}), **load_config_file(value, ctx.command.params)}
    return value


def config_option(fn: F) -> F:
    return _opt("--config", env="GPULEDGER_CONFIG", default=None, is_eager=True, expose_value=False,
                type=click.Path(dir_okay=False), callback=_use_config_file,
                help="A YAML file of option: value (flags and environment variables beat it).")(fn)


def settings_from(values: dict[str, Any], **overrides: Any) -> Settings:
    fields = {f for f in Settings.__struct_fields__}
    given = {k: v for k, v in values.items() if k in fields and v is not None}
    given.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Settings(**given)
    except (msgspec.ValidationError, TypeError) as exc:
        raise click.BadParameter(str(exc)) from exc
