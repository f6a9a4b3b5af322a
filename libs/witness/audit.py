"""``gpuledger audit verify --witness``, ``audit prove`` and ``audit check-proof``: the log against what an
outside witness cosigned.

The hash chain proves a log is self-consistent, not that it is the log that was: a log rewritten from
seq S on, with every later hash recomputed, passes ``audit verify``. A cosigned checkpoint pins the RFC
6962 root of the first ``size`` rows as the node published them; the witness only cosigned it after a
consistency proof from the previous one, so a rewritten row changes the root and fails here.

Where they differ: the node's ``leaves`` file, when its first ``size`` leaf hashes give the cosigned
root, is authentic (a second preimage of SHA-256 would be needed to fake it) and names the exact first
seq. When it was rewritten too, the stored history of cosigned checkpoints brackets the seq: the first
cosigned size the log no longer matches, and the last one it does.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import msgspec

from libs.errors import StoreError
from libs.store.replay import iter_rows, open_reader
from libs.store.rows import COLUMNS
from libs.witness.files import NodeFiles, row_bytes, row_leaf
from libs.witness.merkle import ProofError, inclusion_proof, leaf_hash, tree_root, verify_inclusion
from libs.witness.note import Checkpoint, NoteError, SignedNote, Verifier, verify_cosignature

__all__ = ["InclusionProof", "WitnessReport", "check_proof", "log_leaves", "prove", "trusted_checkpoint",
           "verify_against_witness"]


class WitnessReport(msgspec.Struct, kw_only=True):
    ok: bool
    origin: str = ""
    checkpoint_size: int = 0      # the cosigned size the log was checked against
    cosigned_at: int = 0          # the witness's timestamp (unix seconds)
    first_bad_seq: int | None = None
    bad_range: tuple[int, int] | None = None  # (first, last) seq that may hold the first difference
    problem: str = ""
    notes: list[str] = msgspec.field(default_factory=list)


class InclusionProof(msgspec.Struct, kw_only=True):
    """What ``audit prove`` prints: everything an outsider needs, but the two public keys they trust."""

    seq: int
    row: str                       # base64 of the row's canonical bytes (the leaf data)
    index: int                     # seq - 1
    size: int
    proof: list[str]               # base64 hashes, leaf side first
    checkpoint: str                # the cosigned checkpoint note
    node_key: str                  # the keys as the node knows them (an auditor passes its own)
    witness_key: str
    event: dict[str, Any] = msgspec.field(default_factory=dict)  # the decoded row, for reading only


def log_leaves(path: Path, upto: int | None = None) -> list[bytes]:
    """The leaf hash of every row (seq order), up to ``upto``; stops at the first hole in seq."""
    conn = open_reader(path, merged=False)  # one scan: the segments are read one by one
    try:
        leaves = []
        for row in iter_rows(conn, COLUMNS, upto_seq=upto):
            if row[0] != len(leaves) + 1:
                break
            leaves.append(row_leaf(row))
        return leaves
    finally:
        conn.close()


def trusted_checkpoint(note: SignedNote, node_key: Verifier | None, witness_key: Verifier) -> tuple[Checkpoint, int]:
    """The checkpoint and the witness's timestamp, when the witness cosigned it (and the node signed it)."""
    timestamp = verify_cosignature(note, witness_key)
    if node_key is not None and not note.signed_by(node_key):
        raise NoteError(f"the checkpoint is not signed by the node key {node_key.name}")
    return Checkpoint.parse(note.text), timestamp


def verify_against_witness(
    path: Path, files: NodeFiles, *, witness_key: Verifier, node_key: Verifier | None = None,
    note: SignedNote | None = None,
) -> WitnessReport:
    note = note or files.latest_cosigned()
    if note is None:
        return WitnessReport(ok=False, problem=f"no cosigned checkpoint in {files.cosigned}: has a witness ever "
                                                "cosigned this node's log?")
    try:
        checkpoint, timestamp = trusted_checkpoint(note, node_key, witness_key)
    except NoteError as exc:
        return WitnessReport(ok=False, problem=f"the latest checkpoint is not trustworthy: {exc}")
    report = WitnessReport(ok=True, origin=checkpoint.origin, checkpoint_size=checkpoint.size, cosigned_at=timestamp)
    try:
        local = log_leaves(path, checkpoint.size)
    except StoreError as exc:
        return _fail(report, 1, str(exc))
    if len(local) < checkpoint.size:
        return _fail(report, len(local) + 1, f"the log holds {len(local)} rows in a row but the witness cosigned "
                                             f"{checkpoint.size}: rows were removed")
    if tree_root(local) == checkpoint.root:
        return report
    first = _first_difference(local, files, checkpoint)
    if first is not None:
        return _fail(report, first, "this row differs from the one the witness cosigned: the log was rewritten "
                                    "from here (its hash chain may still be intact)")
    low, high = _bracket(local, files, witness_key, checkpoint)
    report.bad_range = (low, high)
    return _fail(report, low, f"the log differs from what the witness cosigned; the first rewritten row is in seq "
                              f"{low}..{high} (the leaves file was rewritten too, so the seq cannot be narrowed)")


def _fail(report: WitnessReport, seq: int, problem: str) -> WitnessReport:
    report.ok, report.first_bad_seq, report.problem = False, seq, problem
    return report


def _first_difference(local: list[bytes], files: NodeFiles, checkpoint: Checkpoint) -> int | None:
    kept = files.read_leaves(0, checkpoint.size)
    if len(kept) != checkpoint.size or tree_root(kept) != checkpoint.root:
        return None
    for i, (mine, theirs) in enumerate(zip(local, kept, strict=True)):
        if mine != theirs:
            return i + 1
    return None


def _bracket(local: list[bytes], files: NodeFiles, witness_key: Verifier, latest: Checkpoint) -> tuple[int, int]:
    sizes: list[tuple[int, bytes]] = []
    for note in files.cosigned_notes():
        try:
            checkpoint, _ = trusted_checkpoint(note, None, witness_key)
        except NoteError:
            continue
        if checkpoint.origin == latest.origin and checkpoint.size <= latest.size:
            sizes.append((checkpoint.size, checkpoint.root))
    sizes.sort()
    low = 0
    for size, root in sizes:
        if tree_root(local[:size]) == root:
            low = size
        else:
            return low + 1, size
    return low + 1, latest.size


def prove(path: Path, files: NodeFiles, seq: int, *, witness_key: Verifier | None = None) -> InclusionProof:
    from libs.events.codec import to_record
    from libs.store.rows import row_to_stored

    note = files.latest_cosigned()
    if note is None:
        raise StoreError(f"no cosigned checkpoint in {files.cosigned} yet")
    checkpoint = Checkpoint.parse(note.text)
    if not 1 <= seq <= checkpoint.size:
        raise StoreError(f"seq {seq} is not covered by the latest cosigned checkpoint (size {checkpoint.size})")
    conn = open_reader(path)
    try:
        rows = list(iter_rows(conn, COLUMNS, upto_seq=checkpoint.size))
        leaves = [row_leaf(r) for r in rows]
        if len(leaves) < checkpoint.size or tree_root(leaves) != checkpoint.root:
            raise StoreError("the log does not match its latest cosigned checkpoint: run `gpuledger audit verify "
                             "--witness`; no proof from a log the witness would not recognise")
        row = rows[seq - 1]
        stored = row_to_stored(row, conn)  # a compact grant's response settings are in the log's meta
    finally:
        conn.close()
    node_key = files.node_verifier()
    witness = witness_key or files.witness_verifier()
    return InclusionProof(
        seq=seq, row=base64.b64encode(row_bytes(row)).decode(), index=seq - 1, size=checkpoint.size,
        proof=[base64.b64encode(h).decode() for h in inclusion_proof(seq - 1, checkpoint.size, leaves)],
        checkpoint=note.encode(), node_key=node_key.encode() if node_key else "",
        witness_key=witness.encode() if witness else "",
        event=msgspec.to_builtins(to_record(stored)),
    )


def check_proof(proof: InclusionProof, *, node_key: Verifier, witness_key: Verifier) -> str:
    """A line saying what was proven; ProofError/NoteError when anything does not hold."""
    note = SignedNote.parse(proof.checkpoint)
    checkpoint, timestamp = trusted_checkpoint(note, node_key, witness_key)
    data = base64.b64decode(proof.row)
    row = msgspec.msgpack.decode(data)
    if not isinstance(row, list) or not row or row[0] != proof.seq or proof.index != proof.seq - 1:
        raise ProofError(f"the row is not the row of seq {proof.seq}")
    if proof.size != checkpoint.size:
        raise ProofError(f"the proof is for size {proof.size} but the checkpoint is size {checkpoint.size}")
    path = [base64.b64decode(h) for h in proof.proof]
    verify_inclusion(proof.index, checkpoint.size, leaf_hash(data), path, checkpoint.root)
    return (f"seq {proof.seq} is in {checkpoint.origin} at size {checkpoint.size}, signed by {node_key.name} and "
            f"cosigned by {witness_key.name} at {timestamp}")
