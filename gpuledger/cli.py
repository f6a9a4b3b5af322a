"""The ``gpuledger`` command: run the agent, the simulator, and inspect the allocation log."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from gpuledger.audit_cmd import audit, history, import_checkpoint
from gpuledger.demo_runtime import RUNTIMES, demo_runtime
from gpuledger.fleet_cmd import fleet
from gpuledger.gpu_cmd import gpu
from gpuledger.health_cmd import health
from gpuledger.log_cmd import log_group
from gpuledger.options import OptionConflict, agent_options, log_options, settings_from
from gpuledger.run_cmd import run
from gpuledger.simulate_cmd import simulate
from gpuledger.status_cmd import status
from gpuledger.vcuda_cmd import gpu_client
from libs.config import Settings
from libs.logger import configure_logging


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="gpuledger")
def main() -> None:
    """gpuledger: GPU sharing for Kubernetes nodes, with every allocation in an append-only log."""


# --- the agent ---------------------------------------------------------------------------------

@main.command()
@agent_options
@click.option("--demo", is_flag=True, help="Also start the node simulator and walk a sample pod through it.")
@click.option("--demo-exit", is_flag=True, help="With --demo: stop after the walkthrough instead of staying up.")
@click.option("--runtime", type=click.Choice(RUNTIMES), default="none", show_default=True,
              help="With --demo: containerd runs the demo's pods as real containers when the machine allows "
                   "it (root, containerd, runc, busybox-static, gcc); otherwise one line says why it falls back.")
def up(demo: bool, demo_exit: bool, runtime: str, **values: Any) -> None:
    """Start the agent: an embedded nats-server (unless --nats-url) and the four services as processes."""
    from gpuledger.up import run_up

    embedded = values.get("nats_url") is None
    settings = settings_from(values, nats_url=values.get("nats_url") or "nats://127.0.0.1:4222")
    configure_logging("up", fmt=settings.log_format, level=settings.log_level)
    demo = demo or demo_exit
    with demo_runtime(runtime if demo else "none") as real:
        code = asyncio.run(run_up(settings, embedded=embedded, demo=demo, exit_after=demo_exit, runtime=real))
    sys.exit(code)


# --- the simulator -----------------------------------------------------------------------------

@main.command()
@click.option("--node-name", default="sim-node", show_default=True, envvar="GPULEDGER_NODE_NAME")
@click.option("--device-plugin-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where the simulated kubelet serves kubelet.sock.")
@click.option("--pod-resources-socket", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Serve the kubelet's pod-resources API here.")
@click.option("--api-host", default="127.0.0.1", show_default=True)
@click.option("--api-port", type=int, default=0, help="Port of the Kubernetes-shaped API [default: any free port].")
@click.option("--kubeconfig-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a kubeconfig pointing at the simulator's API here.")
@click.option("--profile", default="1.25-1.36", show_default=True,
              type=click.Choice(["legacy-1.24", "1.25-1.36", "main-2026"]),
              help="Kubelet behaviour profile (kubelet-device-plugin.md 4.1).")
@click.option("--seed", type=int, default=None, help="Seed every random choice, for repeatable runs.")
@click.option("--runtime", type=click.Choice(["none", "containerd"]), default="none", show_default=True,
              help="containerd: run every admitted pod as real containers on a private containerd "
                   "(root, containerd, runc, busybox-static, gcc; see docs/development.md).")
@click.option("--runtime-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="With --runtime containerd: its config, root, state and socket here [default: a temp dir].")
@log_options
def sim(**values: Any) -> None:
    """Run the node simulator: a kubelet device manager and a Kubernetes-shaped API for its pods."""
    from simulator import SimConfig, run_simulator

    configure_logging("sim", fmt=values["log_format"], level=values["log_level"])
    cfg = SimConfig(
        node_name=values["node_name"], device_plugin_dir=values["device_plugin_dir"],
        pod_resources_socket=values["pod_resources_socket"], api_host=values["api_host"],
        api_port=values["api_port"], kubeconfig_path=values["kubeconfig_out"], profile=values["profile"],
        seed=values["seed"], runtime=values["runtime"], runtime_dir=values["runtime_dir"],
    )
    if cfg.runtime == "containerd":
        from simulator.runtime import runtime_unavailable_reason

        reason = runtime_unavailable_reason()
        if reason:
            raise OptionConflict(f"--runtime containerd cannot run on this machine: {reason}")
    asyncio.run(run_simulator(cfg))


# --- inspecting the log ------------------------------------------------------------------------

def _log_path(state_dir: str) -> Path:
    return Settings(state_dir=state_dir).log_path


_state_dir = click.option("--state-dir", envvar="GPULEDGER_STATE_DIR", show_envvar=True,
                          default=lambda: Settings().state_dir, help="The agent's state directory.")


@main.command()
@_state_dir
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events as they are committed.")
@click.option("--json", "as_json", is_flag=True, help="JSON lines: seq, time, type, data, ...")
@click.option("--since", type=click.IntRange(0), default=0, help="Only events after this seq.")
@click.option("--nats-url", envvar="GPULEDGER_NATS_URL", show_envvar=True, default=None,
              help="With --follow: read the node's JetStream stream on this server instead of the SQLite file.")
@click.option("--node-name", envvar=["GPULEDGER_NODE_NAME", "NODE_NAME"], default=None,
              help="With --nats-url: whose stream [default: the only gpuledger stream on the server].")
@click.option("--durable", default=None,
              help="With --nats-url: a durable consumer name; the server remembers what was printed.")
def events(state_dir: str, follow: bool, as_json: bool, since: int, nats_url: str | None, node_name: str | None,
           durable: str | None) -> None:
    """Print the allocation log (the SQLite file; with --follow --nats-url, the node's event stream)."""
    from gpuledger.inspect import follow_events, follow_stream, last_seq, print_events
    from libs.errors import GpuledgerError

    ctx = click.get_current_context()
    if nats_url and not follow and ctx.get_parameter_source("nats_url") == ParameterSource.COMMANDLINE:
        raise OptionConflict("--nats-url reads the stream only with --follow")
    if durable and not nats_url:
        raise OptionConflict("--durable needs --follow --nats-url (a consumer on the node's stream)")
    try:
        if follow and nats_url:
            asyncio.run(follow_stream(nats_url, node=node_name, since=since, as_json=as_json, durable=durable))
            return
        path = _log_path(state_dir)
        if not follow and since and since > (last := last_seq(path)):
            raise click.ClickException(f"--since {since} is past the end of the log (its last seq is {last})")
        if follow:
            follow_events(path, since=since, as_json=as_json)
        else:
            print_events(path, since=since, as_json=as_json)
    except GpuledgerError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        pass


@main.command()
@_state_dir
@click.option("--at", "at", default=None, help="The state at this time (ISO-8601 or unix seconds).")
@click.option("--seq", type=click.IntRange(0), default=None, help="The state right after this seq.")
@click.option("--json", "as_json", is_flag=True, help="JSON: docs/schemas/cli/replay.json.")
def replay(state_dir: str, at: str | None, seq: int | None, as_json: bool) -> None:
    """Who held which GPU share, since when, granted by which request: now, or as of a time or seq."""
    from gpuledger.inspect import audit_view, last_seq, print_snapshot
    from libs.errors import GpuledgerError
    from libs.events.codec import parse_time

    if at is not None and seq is not None:
        raise OptionConflict("give --at or --seq, not both")
    try:
        when = parse_time(at) if at else None
        path = _log_path(state_dir)
        if seq is not None and seq > (last := last_seq(path)):
            raise click.ClickException(f"--seq {seq} is past the end of the log (its last seq is {last})")
        print_snapshot(audit_view(path, at=when, seq=seq), as_json=as_json)
    except (GpuledgerError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc


# --- tools -------------------------------------------------------------------------------------

@main.command("gen-protos")
def gen_protos() -> None:
    """Regenerate the committed gRPC stubs from the .proto files (needs the dev extra)."""
    from libs.protogen import ROOT, generate

    for path in generate():
        click.echo(path.relative_to(ROOT))


# Commands that live in their own modules.
for _command in (run, status, gpu, simulate, health, history, audit, import_checkpoint, gpu_client, log_group,
                 fleet):
    main.add_command(_command)
main.add_command(gpu_client, name="vcuda-client")  # the old name


if __name__ == "__main__":
    main()
