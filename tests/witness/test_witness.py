"""Signed notes, checkpoints, cosignatures and the witness's tlog-witness answers (200, 400, 403, 404, 409, 422)."""

from __future__ import annotations

import base64
import hashlib
import struct
from pathlib import Path

import pytest

from libs.witness.merkle import consistency_proof, leaf_hash, tree_root
from libs.witness.note import (
    ALG_COSIGNATURE_V1,
    Checkpoint,
    NoteError,
    SignedNote,
    Signer,
    Verifier,
    cosign,
    sign_note,
    verify_cosignature,
)
from libs.witness.witness import FileWitnessStore, Witness, WitnessState, add_checkpoint_body

ORIGIN = "gpuledger/test/node-a"


def leaves(n: int, tag: str = "row") -> list[bytes]:
    return [leaf_hash(f"{tag} {i}".encode()) for i in range(n)]


@pytest.fixture
def node_key() -> Signer:
    return Signer.generate(ORIGIN)


@pytest.fixture
def witness(tmp_path: Path, node_key: Signer) -> Witness:
    return Witness(Signer.generate("witness.gpuledger/test", ALG_COSIGNATURE_V1), FileWitnessStore(tmp_path / "w"),
                   keys={ORIGIN: node_key.verifier.encode()}, clock=lambda: 1_700_000_000)


def request(node_key: Signer, old: int, tree: list[bytes], size: int, *, proof: list[bytes] | None = None) -> str:
    note = sign_note(Checkpoint(ORIGIN, size, tree_root(tree[:size])).text(), node_key)
    return add_checkpoint_body(old, consistency_proof(old, size, tree) if proof is None else proof, note.encode())


def test_the_key_id_and_encodings_follow_the_signed_note_spec(node_key: Signer) -> None:
    v = node_key.verifier
    assert v.id == hashlib.sha256(ORIGIN.encode() + b"\n\x01" + v.public).digest()[:4]
    name, hex_id, blob = v.encode().split("+", 2)
    assert (name, hex_id, base64.b64decode(blob)[0]) == (ORIGIN, v.id.hex(), 1)
    assert Verifier.parse(v.encode()) == v
    assert Signer.parse(node_key.encode()) == node_key
    assert node_key.encode().startswith(f"PRIVATE+KEY+{ORIGIN}+{v.id.hex()}+")
    with pytest.raises(NoteError, match="key ID"):
        Verifier.parse(f"{name}+00000000+{blob}")


def test_a_signed_checkpoint_round_trips_and_binds_its_text(node_key: Signer) -> None:
    text = Checkpoint(ORIGIN, 7, bytes(range(32))).text()
    assert text == f"{ORIGIN}\n7\n{base64.b64encode(bytes(range(32))).decode()}\n"
    note = sign_note(text, node_key)
    encoded = note.encode()
    assert encoded.startswith(text + "\n\u2014 " + ORIGIN + " ")
    parsed = SignedNote.parse(encoded)
    assert parsed == note and parsed.signed_by(node_key.verifier)
    forged = SignedNote.parse(encoded.replace("\n7\n", "\n8\n"))
    assert not forged.signed_by(node_key.verifier)
    assert not note.signed_by(Signer.generate(ORIGIN).verifier)  # same name, another key


@pytest.mark.parametrize("text", [f"{ORIGIN}\n07\nAA==\n", f"{ORIGIN}\n7\n", f"\n7\n{'A' * 44}\n"])
def test_malformed_checkpoints_are_refused(text: str) -> None:
    with pytest.raises(NoteError):
        Checkpoint.parse(text)


def test_a_cosignature_is_cosignature_v1() -> None:
    w = Signer.generate("witness.example", ALG_COSIGNATURE_V1)
    cp = Checkpoint(ORIGIN, 3, bytes(32))
    sig = cosign(cp, w, 1_679_315_147)
    assert sig.id == hashlib.sha256(b"witness.example\n\x04" + w.verifier.public).digest()[:4]
    assert struct.unpack(">Q", sig.body[:8]) == (1_679_315_147,) and len(sig.body) == 72
    message = f"cosignature/v1\ntime 1679315147\n{cp.text()}".encode()
    assert w.verifier.check(sig.body[8:], message)
    note = SignedNote(cp.text(), (sig,))
    assert verify_cosignature(note, w.verifier) == 1_679_315_147
    with pytest.raises(NoteError, match="no valid cosignature"):
        verify_cosignature(note, Signer.generate("witness.example", ALG_COSIGNATURE_V1).verifier)


def test_the_witness_cosigns_a_consistent_series(witness: Witness, node_key: Signer) -> None:
    tree = leaves(40)
    old = 0
    for size in (1, 5, 8, 8, 23, 40):
        reply = witness.add_checkpoint(request(node_key, old, tree, size))
        assert reply.status == 200, reply.body
        note = sign_note(Checkpoint(ORIGIN, size, tree_root(tree[:size])).text(), node_key)
        cosigned = note.with_signatures(*SignedNote.parse(note.text + "\n" + reply.body).signatures)
        assert verify_cosignature(cosigned, witness.verifier) == 1_700_000_000
        assert Verifier.parse(reply.witness_key) == witness.verifier
        old = size
    held = witness.store.get(ORIGIN)
    assert held == WitnessState(40, tree_root(tree), node_key.verifier.encode(), held.note)  # type: ignore[union-attr]
    # the store keeps the last cosigned note itself: what a restore checks the fleet copy against
    assert SignedNote.parse(held.note) == cosigned  # type: ignore[union-attr]


def test_a_stale_size_is_409_with_the_witness_size(witness: Witness, node_key: Signer) -> None:
    tree = leaves(20)
    assert witness.add_checkpoint(request(node_key, 0, tree, 10)).status == 200
    reply = witness.add_checkpoint(request(node_key, 5, tree, 20))
    assert (reply.status, reply.body) == (409, "10")
    assert witness.add_checkpoint(request(node_key, 10, tree, 20)).status == 200
    reply = witness.add_checkpoint(request(node_key, 10, tree, 15))  # a smaller tree after a larger one
    assert (reply.status, reply.body) == (409, "20")


def test_a_rewritten_log_is_422_and_changes_nothing(witness: Witness, node_key: Signer) -> None:
    honest = leaves(20)
    assert witness.add_checkpoint(request(node_key, 0, honest, 10)).status == 200
    rewritten = honest[:6] + leaves(14, "forged")
    reply = witness.add_checkpoint(request(node_key, 10, rewritten, 20))
    assert reply.status == 422 and "not consistent" in reply.body
    forged_same_size = request(node_key, 10, rewritten, 10)
    assert witness.add_checkpoint(forged_same_size).status == 422
    assert witness.store.get(ORIGIN).size == 10  # type: ignore[union-attr]
    # a proof made up to fit the new root, without the old one: still refused
    assert witness.add_checkpoint(request(node_key, 10, rewritten, 20, proof=[bytes(32)])).status == 422


def test_signature_origin_and_malformed_refusals(witness: Witness, node_key: Signer) -> None:
    tree = leaves(4)
    stranger = Signer.generate(ORIGIN)
    assert witness.add_checkpoint(request(stranger, 0, tree, 4)).status == 403
    other = Signer.generate("gpuledger/test/node-b")
    note = sign_note(Checkpoint("gpuledger/test/node-b", 4, tree_root(tree)).text(), other)
    assert witness.add_checkpoint(add_checkpoint_body(0, [], note.encode())).status == 404
    assert witness.add_checkpoint("old x\n\n" + note.encode()).status == 400
    assert witness.add_checkpoint(request(node_key, 5, tree, 4, proof=[])).status == 400


def test_enrolment_on_first_use_pins_the_first_key(tmp_path: Path, node_key: Signer) -> None:
    w = Witness(Signer.generate("w", ALG_COSIGNATURE_V1), FileWitnessStore(tmp_path / "w"), enroll=True)
    tree = leaves(6)
    assert w.add_checkpoint(request(node_key, 0, tree, 3)).status == 403  # no key to pin
    assert w.add_checkpoint(request(node_key, 0, tree, 3), key=node_key.verifier.encode()).status == 200
    impostor = Signer.generate(ORIGIN)
    reply = w.add_checkpoint(request(impostor, 3, tree, 6), key=impostor.verifier.encode())
    assert reply.status == 403


def test_the_file_store_survives_a_restart_and_compares_before_it_sets(tmp_path: Path) -> None:
    store = FileWitnessStore(tmp_path / "w")
    first = WitnessState(3, b"r" * 32, "k")
    assert store.advance(ORIGIN, None, first)
    assert not store.advance(ORIGIN, None, WitnessState(4, b"s" * 32, "k"))  # someone else moved first
    assert FileWitnessStore(tmp_path / "w").get(ORIGIN) == first
