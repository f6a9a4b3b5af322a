"""Rebuild a node's ledger from the fleet copy (``gpuledger fleet restore --node N``).

The records are the fleet stream's messages on the node's subjects, read in stream order by an
ephemeral consumer (the fleet stream keeps each node's commit order), taken only when NATS's
``Nats-Stream-Source`` header says they came from that node's own stream: a node that published on
another node's subjects into its own stream is not that node's history. Each message carries the
``EventRecord`` JSON and the row hash (``Gpuledger-Row-Hash``) the node's chain gave it. The checkpoint
is the latest one the recorder cosigned for the node, from the witness store in the recorder's
database. ``restore_ledger`` checks the records against both (hash chain, cosigned root) before it
writes a fresh ``ledger.sqlite``; ``install_witness_files`` gives the state dir the checkpoint and
the witness key, so ``audit verify --witness`` works there at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import msgspec
from nats.js import JetStreamContext, api

from libs.bus.outbox import ROW_HASH_HEADER
from libs.errors import StoreError
from libs.events.codec import EventRecord
from libs.events.subjects import Subjects
from libs.fleet.naming import FLEET_STREAM, SOURCE_HEADER, source_stream
from libs.placement.recorded import ResponseSettings
from libs.witness.note import NoteError, SignedNote, Verifier
from libs.witness.restore import RestoreReport, install_witness_files, restore_ledger
from libs.witness.witness import WitnessStore

__all__ = ["FleetCopy", "read_node_records", "restore_node"]
_record = msgspec.json.Decoder(EventRecord)


class FleetCopy(msgspec.Struct, kw_only=True):
    """What the fleet stream holds of one node."""

    records: list[tuple[EventRecord, bytes | None]]
    skipped: int  # messages on the node's subjects that did not come from the node's own stream


async def read_node_records(js: JetStreamContext, node: str, *, batch: int = 1000,
                            timeout: float = 10.0) -> FleetCopy:
    """Every event of ``node`` in the fleet stream, in stream order, with its row hash."""
    subjects = Subjects(node)
    sub = await js.pull_subscribe(
        f"{subjects.prefix}.>", stream=FLEET_STREAM,
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL,
                                  mem_storage=True, num_replicas=1, inactive_threshold=60.0))
    try:
        total = (await sub.consumer_info()).num_pending or 0
        records: list[tuple[EventRecord, bytes | None]] = []
        skipped = seen = 0
        while seen < total:
            msgs = await sub.fetch(min(batch, total - seen), timeout=timeout)
            for msg in msgs:
                seen += 1
                headers = msg.headers or {}
                if source_stream(headers.get(SOURCE_HEADER, "")) != subjects.stream:
                    skipped += 1
                    continue
                row_hash = headers.get(ROW_HASH_HEADER, "")
                records.append((_record.decode(msg.data), bytes.fromhex(row_hash) if row_hash else None))
        return FleetCopy(records=records, skipped=skipped)
    finally:
        await asyncio.shield(sub.unsubscribe())


def restore_node(copy: FleetCopy, store: WitnessStore, origin: str, state_dir: Path, *,
                 witness_key: Verifier, response_settings: Sequence[ResponseSettings] = ()) -> RestoreReport:
    """Write ``state_dir/ledger.sqlite`` from the fleet copy, checked against the latest checkpoint the
    witness cosigned for ``origin``; then the witness files of the state dir. ``response_settings``: the
    node's (compact grants are rebuilt byte for byte under them, see libs/store/rows.rebuilt_row)."""
    state = store.get(origin)
    if state is None or not state.note:
        raise StoreError(f"the witness holds no cosigned checkpoint of {origin}: nothing to check a restore against")
    try:
        note = SignedNote.parse(state.note)
        node_key = Verifier.parse(state.key)
    except NoteError as exc:
        raise StoreError(f"the witness's checkpoint of {origin} is unreadable: {exc}") from exc
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        report = restore_ledger(copy.records, state_dir / "ledger.sqlite", checkpoint=note, witness_key=witness_key,
                                node_key=node_key, response_settings=response_settings)
    except NoteError as exc:
        raise StoreError(f"the cosigned checkpoint of {origin} does not verify: {exc}") from exc
    install_witness_files(state_dir, note, witness_key)
    return report
