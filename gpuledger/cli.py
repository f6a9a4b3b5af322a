"""The ``gpuledger`` command: run the agent, the simulator, and inspect the allocation log."""

from __future__ import annotations

import asyncio
import importlib
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import click

from gpuledger.options import agent_options, log_options, settings_from
from libs.config import Settings
from libs.log import configure_logging, get_logger

SERVICE_NAMES = ("registrar", "allocator", "vmanager", "watchdog")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="gpuledger")
def main() -> None:
    """gpuledger: GPU sharing for Kubernetes nodes, with every allocation in an append-only log."""


# --- the agent ---------------------------------------------------------------------------------

@main.command()
@click.argument("service", type=click.Choice(SERVICE_NAMES))
@agent_options
def run(service: str, **values: Any) -> None:
    """Run one service in the foreground (what each DaemonSet container runs)."""
    from libs.runtime import run_service

    settings = settings_from(values, nats_url=values.get("nats_url") or "nats://127.0.0.1:4222")
    factory = importlib.import_module(f"services.{service}.app").service
    sys.exit(run_service(service, settings, factory))


@main.command()
@agent_options
@click.option("--demo", is_flag=True, help="Also start the node simulator and walk a sample pod through it.")
@click.option("--demo-exit", is_flag=True, help="With --demo: stop after the walkthrough instead of staying up.")
def up(demo: bool, demo_exit: bool, **values: Any) -> None:
    """Start the agent: an embedded nats-server (unless --nats-url) and the four services as processes."""
    embedded = values.get("nats_url") is None
    settings = settings_from(values, nats_url=values.get("nats_url") or "nats://127.0.0.1:4222")
    configure_logging("up", fmt=settings.log_format, level=settings.log_level)
    code = asyncio.run(_up(settings, embedded=embedded, demo=demo or demo_exit, exit_after=demo_exit))
    sys.exit(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _up(settings: Settings, *, embedded: bool, demo: bool, exit_after: bool) -> int:
    from gpuledger.launcher import Launcher

    log = get_logger("up")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: its terminal was closed
        loop.add_signal_handler(sig, stop.set)
    demo_dir = Path(settings.state_dir) / "demo"
    api_url = ""
    if demo:
        shutil.rmtree(demo_dir, ignore_errors=True)  # our own scratch area: every demo starts clean
        demo_dir.mkdir(parents=True)
        api_url = f"http://127.0.0.1:{_free_port()}"
        settings = settings.replace(
            node_name="demo-node", state_dir=str(demo_dir), vm_dir="", vdriver_dir="",
            device_plugin_dir=str(demo_dir / "device-plugins"),
            pod_resources_socket=str(demo_dir / "pod-resources" / "kubelet.sock"),
            kubeconfig=str(demo_dir / "kubeconfig"),
            proc_root=str(demo_dir / "proc"), cgroup_root=str(demo_dir / "cgroup"),  # simulated containers
        )
    launcher = Launcher(settings, embedded_nats=embedded, log_dir=demo_dir / "logs" if demo else None)
    code = 0
    try:
        await launcher.start_nats()
        if demo:
            click.secho(f"gpuledger demo: state, sockets and logs under {demo_dir}", bold=True)
            await launcher.start_child("sim", [
                "sim", "--node-name", settings.node_name, "--device-plugin-dir", settings.device_plugin_dir,
                "--pod-resources-socket", settings.pod_resources_socket, "--api-port", api_url.rsplit(":", 1)[1],
                "--kubeconfig-out", settings.kubeconfig,
            ])
            await _wait_file(Path(settings.kubeconfig), 30)
        await launcher.start_services()
        if demo:
            from gpuledger.demo import run_demo

            task = asyncio.create_task(run_demo(launcher.settings, api_url, Path(settings.kubeconfig)))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not task.done():
                task.cancel()
            elif task.exception() is not None:
                click.secho(f"demo failed: {task.exception()}", fg="red", err=True)
                click.secho(f"service logs: {demo_dir / 'logs'}", err=True)
                return 1
            if exit_after or stop.is_set():
                return 0
            click.secho(
                f"\nThe agent keeps running. In another terminal:\n"
                f"  gpuledger events --state-dir {demo_dir}\n"
                f"  gpuledger replay --state-dir {demo_dir}\n"
                f"Press Ctrl-C to stop.", bold=True)
        else:
            log.info("agent running; Ctrl-C to stop", nats=launcher.settings.nats_url)
        await stop.wait()
    except Exception as exc:
        log.error("up failed", error=str(exc))
        code = 1
    finally:
        click.secho("stopping…", err=True)
        await launcher.stop()
    return code


async def _wait_file(path: Path, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not path.exists():  # noqa: ASYNC110 (a file written by another process: poll it)
            await asyncio.sleep(0.1)


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
@log_options
def sim(**values: Any) -> None:
    """Run the node simulator: a kubelet device manager and a Kubernetes-shaped API for its pods."""
    from simulator import SimConfig, run_simulator

    configure_logging("sim", fmt=values["log_format"], level=values["log_level"])
    cfg = SimConfig(
        node_name=values["node_name"], device_plugin_dir=values["device_plugin_dir"],
        pod_resources_socket=values["pod_resources_socket"], api_host=values["api_host"],
        api_port=values["api_port"], kubeconfig_path=values["kubeconfig_out"], profile=values["profile"],
        seed=values["seed"],
    )
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
@click.option("--since", type=int, default=0, help="Only events after this seq.")
@click.option("--nats-url", envvar="GPULEDGER_NATS_URL", show_envvar=True, default=None,
              help="With --follow: read the node's JetStream stream on this server instead of the SQLite file.")
@click.option("--node-name", envvar=["GPULEDGER_NODE_NAME", "NODE_NAME"], default=None,
              help="With --nats-url: whose stream [default: the only gpuledger stream on the server].")
@click.option("--durable", default=None,
              help="With --nats-url: a durable consumer name; the server remembers what was printed.")
def events(state_dir: str, follow: bool, as_json: bool, since: int, nats_url: str | None, node_name: str | None,
           durable: str | None) -> None:
    """Print the allocation log (the SQLite file; with --follow --nats-url, the node's event stream)."""
    from gpuledger.inspect import follow_events, follow_stream, print_events
    from libs.errors import GpuledgerError

    try:
        if follow and nats_url:
            asyncio.run(follow_stream(nats_url, node=node_name, since=since, as_json=as_json, durable=durable))
        elif follow:
            follow_events(_log_path(state_dir), since=since, as_json=as_json)
        else:
            print_events(_log_path(state_dir), since=since, as_json=as_json)
    except GpuledgerError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        pass


@main.command()
@_state_dir
@click.option("--at", "at", default=None, help="The state at this time (ISO-8601 or unix seconds).")
@click.option("--seq", type=int, default=None, help="The state right after this seq.")
@click.option("--json", "as_json", is_flag=True)
def replay(state_dir: str, at: str | None, seq: int | None, as_json: bool) -> None:
    """Who held which GPU share, since when, granted by which request: now, or as of a time or seq."""
    from gpuledger.inspect import audit_view, print_snapshot
    from libs.errors import GpuledgerError
    from libs.events.codec import parse_time

    try:
        when = parse_time(at) if at else None
        print_snapshot(audit_view(_log_path(state_dir), at=when, seq=seq), as_json=as_json)
    except (GpuledgerError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc


# --- tools -------------------------------------------------------------------------------------

@main.command("gen-protos")
def gen_protos() -> None:
    """Regenerate the committed gRPC stubs from the .proto files (needs the dev extra)."""
    from libs.protogen import ROOT, generate

    for path in generate():
        click.echo(path.relative_to(ROOT))


# Commands that live in their own modules, each registered once `main` exists.
_COMMANDS = (
    ("status_cmd", "status"), ("gpu_cmd", "gpu"), ("simulate_cmd", "simulate"), ("health_cmd", "health"),
    ("audit_cmd", "history"), ("audit_cmd", "audit"), ("audit_cmd", "import_checkpoint"),
    ("vcuda_cmd", "gpu_client"),
)
for _module, _name in _COMMANDS:
    main.add_command(getattr(importlib.import_module(f"gpuledger.{_module}"), _name))
main.add_command(importlib.import_module("gpuledger.vcuda_cmd").gpu_client, name="vcuda-client")  # the old name


if __name__ == "__main__":
    main()
