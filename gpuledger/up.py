"""``gpuledger up``: the agent in the foreground, until SIGINT or SIGTERM; with ``--demo``, next to
the node simulator and a narrated walkthrough (``gpuledger/demo.py``)."""

from __future__ import annotations

import asyncio
import signal

import click

from gpuledger.agent_file import remove_agent_file, write_agent_file
from gpuledger.demo import DemoNode
from gpuledger.demo_runtime import DemoRuntime
from gpuledger.launcher import Launcher, LauncherError
from gpuledger.metrics_ports import check_metrics_ports
from libs.config import Settings
from libs.errors import ConfigError
from libs.logger import get_logger

__all__ = ["run_up"]


async def run_up(settings: Settings, *, embedded: bool, demo: bool, exit_after: bool,
                 runtime: DemoRuntime | None = None) -> int:
    """Start the broker (``embedded``) and the services, wait for a stop signal, stop them; the exit code.
    ``runtime``: with ``demo``, the demo's pods run as real containers."""
    logger = get_logger("up")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: its terminal was closed
        loop.add_signal_handler(sig, stop.set)
    node = DemoNode.prepare(settings, runtime) if demo else None
    if node is not None:
        settings = node.settings
    launcher = Launcher(settings, embedded_nats=embedded, log_dir=node.log_dir if node is not None else None)
    try:
        launcher.claim()  # another `up` on this state dir is the first thing to refuse for
        moved = check_metrics_ports(settings, move=node is not None)
    except (LauncherError, ConfigError) as exc:
        click.secho(f"gpuledger up: {exc}", fg="red", err=True)
        return 1
    if moved.metrics_port != settings.metrics_port:
        click.secho(f"metrics ports {settings.metrics_port}-{settings.metrics_port + 3} are taken; the demo serves "
                    f"them on {moved.metrics_port}-{moved.metrics_port + 3}", err=True)
        launcher.settings = settings = moved
    code = 0
    try:
        await launcher.start_nats()
        if node is not None:
            await node.start_simulator(launcher)
        await launcher.start_services()
        write_agent_file(launcher.settings)  # how `status`, `events`, `health`, `gpu` find this agent
        if node is not None:
            ended = await node.walk_through(launcher, stop, exit_after=exit_after)
            if ended is not None:
                return ended
        else:
            logger.info("agent running; Ctrl-C to stop", nats=launcher.settings.nats_url)
        await stop.wait()
    except Exception as exc:
        logger.error("up failed", error=str(exc))
        code = 1
    finally:
        click.secho("stopping…", err=True)
        remove_agent_file(launcher.settings.state_dir)
        await launcher.stop()
    return code
