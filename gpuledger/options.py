"""The options every agent command shares, each with a GPULEDGER_* environment variable.

Precedence is the usual one: a flag beats the environment, which beats the default. The collected
values become one ``libs.config.Settings``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
import msgspec

from libs.config import Settings, default_state_dir

__all__ = ["agent_options", "log_options", "settings_from"]

F = Callable[..., Any]


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
        _opt("--node-name", env=["GPULEDGER_NODE_NAME", "NODE_NAME"], default=None,
             help="This node's Kubernetes name [default: the host name]."),
        _opt("--state-dir", env="GPULEDGER_STATE_DIR", default=default_state_dir, show_default=True,
             help="Where the event log (ledger.sqlite) and, by default, vm/ and vdriver/ live."),
        _opt("--device-plugin-dir", env="GPULEDGER_DEVICE_PLUGIN_DIR",
             default="/var/lib/kubelet/device-plugins", show_default=True,
             help="The kubelet's device-plugin directory (kubelet.sock, our vcore.sock and vmemory.sock)."),
        _opt("--pod-resources-socket", env="GPULEDGER_POD_RESOURCES_SOCKET",
             default="/var/lib/kubelet/pod-resources/kubelet.sock", show_default=True,
             help="The kubelet's pod-resources socket."),
        _opt("--vm-dir", env="GPULEDGER_VM_DIR", default="",
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
        # issue 3: pod identity check period, gpu-manager's extra config
        _opt("--identity-check-period", env="GPULEDGER_IDENTITY_CHECK_PERIOD", type=float, default=30.0,
             show_default=True,
             help="Seconds between checks of every grant against the kubelet's pod-resources record "
                  "(0: only at PreStartContainer)."),
        _opt("--extra-config", env="GPULEDGER_EXTRA_CONFIG", default="",
             help='gpu-manager\'s extra config JSON ({"default": {"devices": [...]}}): device nodes added to '
                  "every Allocate response."),
    ]
    for deco in reversed(decorators):
        fn = deco(fn)
    return log_options(fn)


def settings_from(values: dict[str, Any], **overrides: Any) -> Settings:
    fields = {f for f in Settings.__struct_fields__}
    given = {k: v for k, v in values.items() if k in fields and v is not None}
    given.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Settings(**given)
    except (msgspec.ValidationError, TypeError) as exc:
        raise click.BadParameter(str(exc)) from exc
