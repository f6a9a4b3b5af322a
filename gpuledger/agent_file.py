"""The runtime file ``gpuledger up`` keeps in its state directory, so that the other commands find the
running agent by themselves: ``<state_dir>/agent.json`` with the NATS URL, the node name, the metrics
addresses and the pid of ``up``.

``gpuledger status``, ``events --follow``, ``health`` and ``gpu`` read it from ``--state-dir`` (else
the default state directory, else the demo's directory under it). A file whose pid is gone is
stale (``up`` was killed) and is ignored. Flags still win: ``--nats-url`` and ``--node-name`` given
on the command line are used as given.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import msgspec

from gpuledger.agent import SERVICES
from libs.config import Settings, default_state_dir
from libs.lifeline import process_alive
from libs.metrics import metrics_port

__all__ = [
    "AGENT_FILE",
    "DEFAULT_NATS_URL",
    "AgentInfo",
    "Target",
    "find_agent",
    "locate",
    "locate_options",
    "read_agent",
    "remove_agent_file",
    "write_agent_file",
]

AGENT_FILE = "agent.json"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class AgentInfo(msgspec.Struct, kw_only=True):
    nats_url: str
    node: str
    pid: int                      # the `gpuledger up` process
    state_dir: str
    device_plugin_dir: str        # where the registrar's plugin sockets are (`health registrar`)
    metrics: dict[str, str] = {}  # service -> http://host:port; empty when metrics are off


def write_agent_file(settings: Settings, pid: int | None = None) -> Path:
    """Write (atomically) what a command needs to reach the agent ``settings`` describes."""
    host = settings.metrics_host if settings.metrics_host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    metrics = {s: f"http://{host}:{metrics_port(settings, s)}" for s in SERVICES} if settings.metrics_port else {}
    info = AgentInfo(nats_url=settings.nats_url, node=settings.node_name, pid=pid or os.getpid(),
                     state_dir=settings.state_dir, device_plugin_dir=settings.device_plugin_dir, metrics=metrics)
    path = Path(settings.state_dir) / AGENT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(info)) + b"\n")
    tmp.replace(path)
    return path


def remove_agent_file(state_dir: str, pid: int | None = None) -> None:
    """Remove the file if it is this process's (a second `up` on the same directory keeps its own)."""
    path = Path(state_dir) / AGENT_FILE
    info = _load(path)
    if info is not None and info.pid == (pid or os.getpid()):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _load(path: Path) -> AgentInfo | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=AgentInfo)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def read_agent(state_dir: str | Path) -> AgentInfo | None:
    """The running agent of ``state_dir``; None when there is none (no file, or its ``up`` is gone)."""
    info = _load(Path(state_dir) / AGENT_FILE)
    return info if info is not None and process_alive(info.pid) else None


def find_agent(state_dir: str | None) -> AgentInfo | None:
    """The agent of ``state_dir``; without one, of the default state directory, else of the demo's."""
    if state_dir:
        return read_agent(state_dir)
    default = Path(default_state_dir())
    return read_agent(default) or read_agent(default / "demo")


@dataclass(frozen=True)
class Target:
    """Where a command talks to the agent, and how it learnt it (for the error messages)."""

    nats_url: str
    node: str
    agent: AgentInfo | None   # the runtime file it came from, if any
    node_known: bool = True   # named by --node-name or the file, not only the host name guessed

    @property
    def origin(self) -> str:
        if self.agent is not None:
            return f"NATS URL and node from {Path(self.agent.state_dir) / AGENT_FILE}"
        return "no running `gpuledger up` found: give its --state-dir, or --nats-url and --node-name"


def locate(*, nats_url: str | None, node_name: str | None, state_dir: str | None) -> Target:
    """Flags first, then the running agent's file, then the defaults (localhost:4222, the host name)."""
    agent = find_agent(state_dir)
    if agent is not None and nats_url not in (None, agent.nats_url):
        agent = None  # another server than the local agent's: its node is not known from the file
    url = nats_url or (agent.nats_url if agent else DEFAULT_NATS_URL)
    node = node_name or (agent.node if agent else socket.gethostname())
    return Target(nats_url=url, node=node, agent=agent, node_known=bool(node_name or agent))


async def served_nodes(bus: object) -> list[str]:
    """The nodes whose event streams the bus's server holds (each agent creates GPULEDGER_<node>)."""
    from libs.events.subjects import unescape_token

    prefix = "GPULEDGER_"
    infos = await bus.js.streams_info()  # type: ignore[attr-defined]
    return sorted(unescape_token(i.config.name[len(prefix):]) for i in infos
                  if (i.config.name or "").startswith(prefix))


def wrong_node(where: str, answered: list[str], wanted: str) -> str | None:
    """The error when ``where`` serves other nodes than ``wanted``; None when it is not the case."""
    if not answered or wanted in answered:
        return None
    nodes = ", ".join(repr(n) for n in answered)
    hint = f"--node-name {answered[0]}" if len(answered) == 1 else "--node-name with one of them"
    return f"{where} answers for node {nodes}, not {wanted!r}: pass {hint}, or the agent's --state-dir"


def locate_options(fn: Any) -> Any:
    """``--state-dir``, ``--nats-url``, ``--node-name``: how a command finds the running agent (``locate``)."""
    for option in reversed((
        click.option("--state-dir", envvar="GPULEDGER_STATE_DIR", show_envvar=True, default=None,
                     help="Find the agent `gpuledger up` runs there (its agent.json) [default: the default state "
                          "directory, else its demo/]."),
        click.option("--nats-url", envvar="GPULEDGER_NATS_URL", show_envvar=True, default=None,
                     help="The agent's NATS server [default: the running agent's, else nats://127.0.0.1:4222]."),
        click.option("--node-name", envvar=["GPULEDGER_NODE_NAME", "NODE_NAME"], show_envvar=True, default=None,
                     help="The node whose agent to ask [default: the running agent's, else the host name]."),
    )):
        fn = option(fn)
    return fn
