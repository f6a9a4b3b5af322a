"""`audit verify --witness` without NATS: a witness in this process cosigns, then the log loses rows or is
rewritten; the report names the seq."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from libs.store import EventLog
from libs.witness import Checkpoint, FileWitnessStore, SignedNote, Signer, Witness
from libs.witness.audit import log_leaves, verify_against_witness
from libs.witness.files import NodeFiles
from libs.witness.merkle import tree_root
from libs.witness.note import ALG_COSIGNATURE_V1, sign_note
from libs.witness.witness import add_checkpoint_body
from tests.builders import released_event
from tests.witness.helpers import TRIGGERS, rewrite_forward

ORIGIN = "gpuledger/test/node-a"


async def cosigned_log(tmp_path: Path, count: int) -> tuple[Path, NodeFiles, Witness]:
    state = tmp_path / "state"
    event_log = await EventLog.open(state / "ledger.sqlite")
    try:
        for i in range(count):
            await event_log.append([released_event(i)])
    finally:
        await event_log.close()
    node, files = Signer.generate(ORIGIN), NodeFiles(state)
    witness = Witness(Signer.generate("w", ALG_COSIGNATURE_V1), FileWitnessStore(tmp_path / "w"),
                      keys={ORIGIN: node.verifier.encode()})
    leaves = log_leaves(state / "ledger.sqlite")
    note = sign_note(Checkpoint(ORIGIN, count, tree_root(leaves)).text(), node)
    reply = witness.add_checkpoint(add_checkpoint_body(0, [], note.encode()))
    assert reply.status == 200
    files.append_cosigned(note.with_signatures(*SignedNote.parse(note.text + "\n" + reply.body).signatures))
    return state / "ledger.sqlite", files, witness


async def test_rows_cut_off_the_end_are_named(tmp_path: Path) -> None:
    path, files, witness = await cosigned_log(tmp_path, 10)
    assert verify_against_witness(path, files, witness_key=witness.verifier).ok
    conn = sqlite3.connect(path, isolation_level=None)
    for trigger in TRIGGERS:
        conn.execute(f"DROP TRIGGER IF EXISTS {trigger}")
    conn.execute("DELETE FROM rows WHERE seq > 7")
    conn.close()
    report = verify_against_witness(path, files, witness_key=witness.verifier)
    assert (report.ok, report.first_bad_seq) == (False, 8) and "removed" in report.problem


async def test_without_leaves_and_history_the_whole_range_is_named(tmp_path: Path) -> None:
    path, files, witness = await cosigned_log(tmp_path, 10)
    rewrite_forward(path, 4)
    report = verify_against_witness(path, files, witness_key=witness.verifier)
    assert (report.ok, report.bad_range, report.first_bad_seq) == (False, (1, 10), 1)


async def test_a_checkpoint_from_another_witness_is_not_trusted(tmp_path: Path) -> None:
    path, files, _ = await cosigned_log(tmp_path, 3)
    other = Signer.generate("w", ALG_COSIGNATURE_V1).verifier
    report = verify_against_witness(path, files, witness_key=other)
    assert not report.ok and report.first_bad_seq is None and "not trustworthy" in report.problem
