"""Outside witness: an RFC 6962 Merkle tree over the event log, C2SP signed checkpoints, and a witness
that cosigns them (tlog-witness). The node side (the checkpointer) is ``libs.witness.node``; the audit
commands are ``libs.witness.audit``; the rebuild of a ledger from a stream of records ``libs.witness.restore``."""

from libs.witness.merkle import CompactRange, ProofError
from libs.witness.note import Checkpoint, NoteError, SignedNote, Signer, Verifier
from libs.witness.witness import AddCheckpoint, FileWitnessStore, Witness, WitnessReply, WitnessState, WitnessStore

__all__ = [
    "AddCheckpoint",
    "Checkpoint",
    "CompactRange",
    "FileWitnessStore",
    "NoteError",
    "ProofError",
    "SignedNote",
    "Signer",
    "Verifier",
    "Witness",
    "WitnessReply",
    "WitnessState",
    "WitnessStore",
]
