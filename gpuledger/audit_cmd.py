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


def _key_text(value: str) -> str:
    """A key given inline, or as @FILE / a path to a file holding it."""
    candidate = Path(value[1:] if value.startswith("@") else value)
    if value.startswith("@") or ("+" not in value and candidate.exists()):
        return candidate.read_text().strip()
    return value.strip()


_witness_key = click.option("--witness-key", default=None, metavar="VKEY|@FILE",
                            help="The witness's verifier key you trust [default: the one the node pinned, in "
                                 "STATE_DIR/witness/witness.pub].")


@audit.command()
@_state_dir
@click.option("--json", "as_json", is_flag=True)
@click.option("--witness", "with_witness", is_flag=True,
              help="Also check the log against the latest checkpoint an outside witness cosigned: catches a log "
                   "rewritten with a recomputed hash chain.")
@_witness_key
@click.option("--checkpoint", "checkpoint_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A cosigned checkpoint note to check against, e.g. fetched from the witness [default: the "
                   "latest in STATE_DIR/witness/cosigned.jsonl].")
def verify(state_dir: str, as_json: bool, with_witness: bool, witness_key: str | None,
           checkpoint_file: Path | None) -> None:
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
    witnessed = _verify_witness(path, state_dir, witness_key, checkpoint_file) if with_witness else None
    if as_json:
        if witnessed is None:
            click.echo(msgspec.json.encode(report).decode())
        else:
            click.echo(msgspec.json.encode({**msgspec.to_builtins(report), "witness": witnessed}).decode())
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
        if witnessed is not None:
            _print_witness(witnessed)
    sys.exit(0 if report.ok and (witnessed is None or witnessed.ok) else 1)


def _verify_witness(path: Path, state_dir: str, witness_key: str | None, checkpoint_file: Path | None) -> Any:
    from libs.witness.audit import WitnessReport, verify_against_witness
    from libs.witness.files import NodeFiles
    from libs.witness.note import NoteError, SignedNote, Verifier

    files = NodeFiles(state_dir)
    try:
        key = Verifier.parse(_key_text(witness_key)) if witness_key else files.witness_verifier()
        note = SignedNote.parse(checkpoint_file.read_text()) if checkpoint_file else None
        node_key = files.node_verifier()
    except (NoteError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    if key is None:
        return WitnessReport(ok=False, problem=f"no witness key: pass --witness-key (none pinned in {files.dir})")
    return verify_against_witness(path, files, witness_key=key, node_key=node_key, note=note)


def _print_witness(report: Any) -> None:
    if report.ok:
        click.echo(f"witness: the log matches the checkpoint of {report.origin} at size {report.checkpoint_size} "
                   f"cosigned at {report.cosigned_at}")
    elif report.first_bad_seq is None:
        click.echo(f"witness: NOT CHECKED: {report.problem}")
    else:
        click.echo(f"witness: DIFFERS at seq {report.first_bad_seq}: {report.problem} (cosigned size "
                   f"{report.checkpoint_size})")


@audit.command()
@_state_dir
@click.option("--seq", type=click.IntRange(1), required=True, help="The event to prove.")
@_witness_key
def prove(state_dir: str, seq: int, witness_key: str | None) -> None:
    """Print (JSON) an inclusion proof of event SEQ against the latest cosigned checkpoint.

    Anyone holding the node's and the witness's public keys checks it with `gpuledger audit check-proof`.
    """
    from libs.witness.audit import prove as make_proof
    from libs.witness.files import NodeFiles
    from libs.witness.note import NoteError, Verifier

    try:
        key = Verifier.parse(_key_text(witness_key)) if witness_key else None
        proof = make_proof(_log_path(state_dir), NodeFiles(state_dir), seq, witness_key=key)
    except (GpuledgerError, NoteError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(msgspec.json.encode(proof).decode())


@audit.command("check-proof")
@click.argument("file", type=click.File("rb"), default="-")
@click.option("--node-key", default=None, metavar="VKEY|@FILE", help="The node's verifier key you trust.")
@click.option("--witness-key", default=None, metavar="VKEY|@FILE", help="The witness's verifier key you trust.")
def check_proof(file: Any, node_key: str | None, witness_key: str | None) -> None:
    """Check a proof printed by `audit prove` (FILE, or stdin). Needs no state dir and no log.

    Without --node-key/--witness-key the keys inside the proof are used, which proves only that the
    proof is self-consistent: pass the keys you got from the node's and the witness's operators.
    """
    from libs.witness.audit import InclusionProof
    from libs.witness.audit import check_proof as check
    from libs.witness.merkle import ProofError
    from libs.witness.note import NoteError, Verifier

    try:
        proof = msgspec.json.decode(file.read(), type=InclusionProof)
        if node_key is None or witness_key is None:
            click.echo("warning: using the keys carried in the proof; pass --node-key and --witness-key to check "
                       "against keys you trust", err=True)
        node = Verifier.parse(_key_text(node_key) if node_key else proof.node_key)
        witness = Verifier.parse(_key_text(witness_key) if witness_key else proof.witness_key)
        click.echo("OK: " + check(proof, node_key=node, witness_key=witness))
    except (msgspec.DecodeError, msgspec.ValidationError, NoteError, ProofError, ValueError, OSError) as exc:
        click.echo(f"FAILED: {exc}")
        sys.exit(1)


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
