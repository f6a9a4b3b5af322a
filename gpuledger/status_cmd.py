"""``gpuledger status``: the topology tree with what is free on each GPU and the pods holding it.

The same information as gpu-manager's ``/graph`` and ``/usage``. By default it asks the running
allocator over NATS (``allocator.state`` and ``allocator.inventory``); ``--url`` reads the allocator's
HTTP endpoint instead (``/graph`` and ``/usage``, which add the last sampled GPU usage).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import click

from gpuledger.agent_file import locate_options
from gpuledger.options import OptionConflict
from libs.status import graph_json, render_graph, usage_json

__all__ = ["status"]


async def _from_bus(nats_url: str, node: str, timeout: float) -> tuple[Any, Any]:
    from gpuledger.agent_file import served_nodes, wrong_node
    from libs.bus.client import Bus
    from libs.commands import InventoryReply, InventoryRequest, StateReply, StateRequest
    from libs.errors import ConfigError, RemoteError

    bus = await Bus.connect(nats_url, name="gpuledger-status", node=node, wait=timeout)
    try:
        try:
            state = await bus.request(bus.subjects.state, StateRequest(), StateReply, timeout=timeout)
        except RemoteError as exc:
            if exc.code == 503:  # nobody serves this node here: perhaps another node's agent does
                problem = wrong_node(f"NATS at {nats_url}", await served_nodes(bus), node)
                if problem:
                    raise ConfigError(problem) from exc
            raise
        try:
            inv = (await bus.request(bus.subjects.inventory, InventoryRequest(), InventoryReply,
                                     timeout=timeout)).inventory
        except RemoteError:
            inv = None  # no inventory recorded yet: the tree says so
        return state.snapshot, inv
    finally:
        await bus.close()


def _get(url: str, timeout: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, TimeoutError, ValueError) as exc:
        raise click.ClickException(f"cannot read {url}: {exc}") from exc


@click.command()
@locate_options
@click.option("--url", default=None, help="Read the allocator's HTTP endpoint instead, e.g. http://127.0.0.1:5678.")
@click.option("--json", "as_json", is_flag=True, help="Print {graph, usage} as JSON (what /graph and /usage serve).")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for the agent.")
def status(state_dir: str | None, nats_url: str | None, node_name: str | None, url: str | None, as_json: bool,
           timeout: float) -> None:
    """Show the GPUs as a topology tree: free cores and memory per GPU, the pods on each, health."""
    from gpuledger.agent_file import locate, wrong_node
    from libs.errors import ConfigError, GpuledgerError

    target = locate(nats_url=nats_url, node_name=node_name, state_dir=state_dir)
    if url:
        if nats_url:
            raise OptionConflict("give --url or --nats-url, not both")
        base = url.rstrip("/")
        served = _get(f"{base}/version", timeout).get("node")
        # a node named by --node-name or a running agent's file must be the one answering there
        problem = wrong_node(base, [served] if served else [], target.node) if target.node_known else None
        if problem:
            raise click.ClickException(problem)
        graph, usage = _get(f"{base}/graph", timeout), _get(f"{base}/usage", timeout)
    else:
        try:
            snapshot, inventory = asyncio.run(_from_bus(target.nats_url, target.node, timeout))
        except ConfigError as exc:  # another node answers there
            raise click.ClickException(str(exc)) from exc
        except GpuledgerError as exc:
            raise click.ClickException(
                f"{exc} (is the agent running for node {target.node!r}? {target.origin})"
            ) from exc
        graph, usage = graph_json(snapshot, inventory), usage_json(snapshot, inventory)
        if not as_json:
            click.echo(render_graph(snapshot, inventory), nl=False)
            return
    if as_json:
        click.echo(json.dumps({"graph": graph, "usage": usage["usage"]}, indent=2, sort_keys=True))
    else:
        click.echo(graph["graph"], nl=False)
