"""``gpuledger gpu ...``: debugging commands for fake GPUs (inject XID/ECC events, failing probes).

They send ``allocator.gpu-inject`` to an allocator running with fake GPUs (``--gpus fake...``), which
feeds the injection through the same health path a real NVML event takes. An allocator on real GPUs
does not answer them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import click

from gpuledger.agent_file import locate_options

__all__ = ["gpu"]


async def _send(nats_url: str, node: str, timeout: float, **fields: Any) -> list[str]:
    from gpuledger.agent_file import served_nodes, wrong_node
    from libs.bus.client import Bus
    from libs.errors import ConfigError, RemoteError
    from libs.gpu.monitor import InjectReply, InjectRequest, inject_subject

    bus = await Bus.connect(nats_url, name="gpuledger-gpu", node=node, wait=timeout)
    try:
        subject = inject_subject(bus.subjects.prefix)
        try:
            return (await bus.request(subject, InjectRequest(**fields), InjectReply, timeout=timeout)).done
        except RemoteError as exc:
            problem = wrong_node(f"NATS at {nats_url}", await served_nodes(bus), node) if exc.code == 503 else None
            if problem:
                raise ConfigError(problem) from exc
            raise
    finally:
        await bus.close()


def _run(ctx: click.Context, **fields: Any) -> None:
    from libs.errors import GpuledgerError, RemoteError

    opts = ctx.obj
    try:
        done = asyncio.run(_send(opts["nats_url"], opts["node_name"], opts["timeout"], **fields))
    except RemoteError as exc:
        hint = " (only an allocator with fake GPUs answers)" if exc.code == 503 else ""
        raise click.ClickException(f"{exc.message}{hint}") from exc
    except GpuledgerError as exc:
        raise click.ClickException(str(exc)) from exc
    for line in done:
        click.echo(f"injected: {line}")


@click.group()
@locate_options
@click.option("--timeout", type=float, default=5.0, show_default=True)
@click.pass_context
def gpu(ctx: click.Context, state_dir: str | None, nats_url: str | None, node_name: str | None,
        timeout: float) -> None:
    """Debugging commands for fake GPUs: inject health events."""
    from gpuledger.agent_file import locate

    target = locate(nats_url=nats_url, node_name=node_name, state_dir=state_dir)
    ctx.obj = {"nats_url": target.nats_url, "node_name": target.node, "timeout": timeout}


@gpu.command("inject-xid")
@click.argument("index", type=click.IntRange(0))
@click.argument("xid", type=click.IntRange(1))
@click.pass_context
def inject_xid(ctx: click.Context, index: int, xid: int) -> None:
    """Inject XID event XID on GPU INDEX (critical unless in --health-ignored-xids)."""
    _run(ctx, gpu=index, xid=xid)


@gpu.command("inject-ecc")
@click.argument("index", type=click.IntRange(0))
@click.option("--single-bit", "kind", flag_value="single-bit", help="A corrected error (reported only).")
@click.option("--double-bit", "kind", flag_value="double-bit", default=True, help="An uncorrectable error.")
@click.pass_context
def inject_ecc(ctx: click.Context, index: int, kind: str) -> None:
    """Inject an ECC error event on GPU INDEX."""
    _run(ctx, gpu=index, ecc=kind)


@gpu.command("fail-probe")
@click.argument("index", type=click.IntRange(0))
@click.option("--error", default="GPU is lost", show_default=True, help="What the failing NVML query says.")
@click.option("--clear", is_flag=True, help="Let the probes of GPU INDEX pass again.")
@click.pass_context
def fail_probe(ctx: click.Context, index: int, error: str, clear: bool) -> None:
    """Make the health probes of GPU INDEX fail (or pass again with --clear)."""
    _run(ctx, gpu=index, probe_error="" if clear else error)
