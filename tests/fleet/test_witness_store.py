"""The witness's state in the recorder's SQL database (SQLite and a real PostgreSQL): advance is a
compare-and-set on size and root, a first INSERT loses to another writer's, and the witness on it keeps
the tlog-witness answers (200, 409 stale, 422 bad proof) and the cosigned note."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine

from libs.fleet.witness_store import SqlWitnessStore
from libs.witness.merkle import consistency_proof, leaf_hash, tree_root
from libs.witness.note import ALG_COSIGNATURE_V1, Checkpoint, SignedNote, Signer, sign_note, verify_cosignature
from libs.witness.witness import Witness, WitnessState, add_checkpoint_body
from services.fleet.app import open_engine
from tests.fleet.helpers import PostgresServer

ORIGIN = "gpuledger/test/node-a"


def _exercise(engine: Engine) -> None:
    store = SqlWitnessStore(engine)
    first = WitnessState(3, b"\x01" * 32, "key-a", "note-3")
    assert store.get(ORIGIN) is None
    assert store.advance(ORIGIN, None, first)
    assert not store.advance(ORIGIN, None, first)  # another writer inserted the origin first
    assert store.get(ORIGIN) == first
    nxt = WitnessState(7, b"\x02" * 32, "key-a", "note-7")
    assert not store.advance(ORIGIN, WitnessState(3, b"\x09" * 32, "key-a"), nxt)  # same size, another root
    assert not store.advance(ORIGIN, WitnessState(2, b"\x01" * 32, "key-a"), nxt)  # another size
    assert store.advance(ORIGIN, first, nxt)
    assert not store.advance(ORIGIN, first, WitnessState(9, b"\x03" * 32, "key-a"))  # lost the race to nxt
    assert store.get(ORIGIN) == nxt and store.origins() == [ORIGIN]

    # the witness on this store: consistent series cosigned, a stale size 409, a bad proof 422
    node_key = Signer.generate("gpuledger/test/node-b")
    witness = Witness(Signer.generate("witness.gpuledger/test", ALG_COSIGNATURE_V1), SqlWitnessStore(engine),
                      enroll=True)
    tree = [leaf_hash(f"row {i}".encode()) for i in range(30)]

    def ask(old: int, size: int, proof: list[bytes] | None = None, *, leaves: list[bytes] = tree) -> tuple[int, str]:
        note = sign_note(Checkpoint("gpuledger/test/node-b", size, tree_root(leaves[:size])).text(), node_key)
        body = add_checkpoint_body(old, consistency_proof(old, size, leaves) if proof is None else proof,
                                   note.encode())
        reply = witness.add_checkpoint(body, key=node_key.verifier.encode())
        return reply.status, reply.body

    assert ask(0, 10)[0] == 200
    assert ask(10, 25)[0] == 200
    assert ask(10, 30) == (409, "25")
    forked = [*tree[:12], leaf_hash(b"forged"), *tree[13:]]
    assert ask(25, 30, leaves=forked)[0] == 422
    held = witness.store.get("gpuledger/test/node-b")
    assert held is not None and held.size == 25 and held.root == tree_root(tree[:25])
    assert verify_cosignature(SignedNote.parse(held.note), witness.verifier) > 0


def test_the_witness_store_on_sqlite(tmp_path: Path) -> None:
    engine = open_engine(f"sqlite:///{tmp_path / 'fleet.sqlite'}")
    try:
        _exercise(engine)
    finally:
        engine.dispose()


@pytest.mark.timeout(120)
async def test_the_witness_store_on_postgresql(postgres: PostgresServer) -> None:
    engine = open_engine(postgres.url)
    try:
        _exercise(engine)
    finally:
        engine.dispose()
