"""Audit and operations commands: ``history``, ``audit verify``, ``import-checkpoint``.

All of them read the SQLite log directly, so they work with every service stopped.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click
import msgspec

from gpuledger.options import OptionConflict
from libs.config import Settings
from libs.errors import GpuledgerError

__all__ = ["audit", "history", "import_checkpoint"]

_state_dir = click.option("--state-dir", envvar="GPULEDGER_STATE_DIR", show_envvar=True,
                          default=lambda: Settings().state_dir, help="The agent's state directory.")


def _log_path(state_dir: str) -> Path:
    return Settings(state_dir=state_dir).log_path


@click.command()
@_state_dir
@click.option("--pod", default=None, help="A pod UID, name, or namespace/name.")
@click.option("--gpu", default=None, help="A GPU's NVML index or UUID.")
@click.option("--json", "as_json", is_flag=True, help="JSON lines, one per event: docs/schemas/cli/history.json.")
def history(state_dir: str, pod: str | None, gpu: str | None, as_json: bool) -> None:
    """The timeline of one pod or one GPU: grants, releases, refusals, inventory changes."""
    from gpuledger.inspect import print_history
    from libs.ledger.timeline import NOT_IN_INVENTORY, gpu_history, pod_history

    if (pod is None) == (gpu is None):
        raise OptionConflict("give exactly one of --pod or --gpu")
    try:
        path = _log_path(state_dir)
        entries = pod_history(path, pod) if pod is not None else gpu_history(path, gpu or "")
    except GpuledgerError as exc:
        raise click.ClickException(str(exc)) from exc
    if not any(e.detail != NOT_IN_INVENTORY for e in entries):  # nothing but "GPU not in the inventory"
        named = f"pod {pod!r}" if pod is not None else f"GPU {gpu!r} (an NVML index or UUID)"
        raise click.ClickException(f"no {named} in the log at {path}")
    print_history(entries, as_json=as_json)


@click.group()
def audit() -> None:
    """Check the allocation log."""


@audit.command()
@_state_dir
@click.option("--json", "as_json", is_flag=True)
def verify(state_dir: str, as_json: bool) -> None:
    """Check the whole hash chain; report the first bad seq. Exit code 1 when the log is not intact."""
    from libs.ledger.snapshot import read_header
    from libs.store.replay import restore_hint
    from libs.store.verify import verify_log

    path = _log_path(state_dir)

    def progress(seq: int) -> None:
        if not as_json:
            click.echo(f"  verified up to seq {seq:,}", err=True)

    try:
        expect = None
        try:
            found = read_header(path)
        except (msgspec.DecodeError, msgspec.ValidationError):
            found = None
        if found is not None:
            expect = (found[0].seq, bytes.fromhex(found[0].hash))
        report = verify_log(path, expect=expect, progress=progress)
    except GpuledgerError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(msgspec.json.encode(report).decode())
    elif report.ok:
        click.echo(f"{path}: intact. {report.events:,} events, seq 1..{report.last_seq}, every hash chained; "
                   f"head hash {report.head_hash or '-'}")
    else:
        click.echo(f"{path}: NOT INTACT at seq {report.first_bad_seq}: {report.problem}")
        if report.last_seq:
            click.echo(f"intact up to seq {report.last_seq} (head hash {report.head_hash})")
        click.echo(restore_hint(path))
    if not as_json:
        for note in report.notes:
            click.echo(f"note: {note}")
    sys.exit(0 if report.ok else 1)


@click.command("import-checkpoint")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@_state_dir
@click.option("--node-name", envvar=["GPULEDGER_NODE_NAME", "NODE_NAME"], default=None,
              help="This node's name [default: the host name].")
@click.option("--gpus", envvar="GPULEDGER_GPUS", default="auto", show_default=True,
              help="The GPU inventory, as for `gpuledger run` (used when the log has none yet).")
@click.option("--vm-dir", envvar="GPULEDGER_VM_DIR", default="", help="As for `gpuledger run`.")
@click.option("--vdriver-dir", envvar="GPULEDGER_VDRIVER_DIR", default="", help="As for `gpuledger run`.")
@click.option("--kubelet-checkpoint", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The kubelet's kubelet_internal_checkpoint: records each container's device IDs, so that "
                   "PreStartContainer finds imported allocations when a container restarts.")
def import_checkpoint(file: Path, kubelet_checkpoint: Path | None, **values: Any) -> None:
    """Turn gpu-manager's gpumanager_internal_checkpoint into the log's first events.

    Run it once, with the allocator stopped, before gpuledger's first start on a node that ran
    gpu-manager: the pods keep their GPUs.
    """
    from gpuledger.checkpoint import import_checkpoint as do_import
    from libs.events.schema import InventoryRecorded
    from libs.gpu import load_inventory

    fields = {k: v for k, v in values.items() if v is not None}
    try:
        settings = Settings(**fields)
        found = load_inventory(settings.gpus)
        inventory = InventoryRecorded(node=settings.node_name, backend=found.backend,
                                      driver_version=found.driver_version, gpus=found.gpus, links=found.links)
        result = asyncio.run(do_import(file, settings, inventory, kubelet_checkpoint))
    except (GpuledgerError, msgspec.ValidationError) as exc:
        raise click.ClickException(str(exc)) from exc
    if result.already:
        click.echo(f"{file} was already imported (seq {result.stored[0].seq}..{result.stored[-1].seq}); "
                   "nothing written")
    elif not result.stored:
        click.echo(f"{file} holds no allocation; nothing imported")
    else:
        click.echo(f"imported {result.allocations} allocations of {result.pods} pods from {file} into "
                   f"{settings.log_path} (seq {result.stored[0].seq}..{result.stored[-1].seq})")
