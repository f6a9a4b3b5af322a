"""The node's witness files in ``<state dir>/witness/``, and the leaf of a log row.

    node.key        the node's Ed25519 signer key (signed-note string), mode 0600, made on first start
    node.pub        its verifier key, to hand to witnesses and auditors
    witness.pub     the witness's verifier key, pinned from its first valid cosignature (an auditor passes
                    the one it trusts instead: ``--witness-key``)
    cosigned.jsonl  every cosigned checkpoint, one JSON line each ({"note": <signed note>}), oldest first
    leaves          the leaf hash of every row as first seen, 32 bytes each, seq order, never rewritten
                    (authenticated by a cosigned root before anything trusts it: it only sharpens where a
                    rewritten log first differs)

**The leaf of seq S** is the row's canonical bytes, the ones the hash chain covers:
``msgpack([seq, recorded_at, stream_id, version, type, schema_v, event_id, command_id, payload])``
(libs/store/rows.py COLUMNS order), and leaf index S - 1. Hashing the row rather than its chain hash
keeps an inclusion proof self-contained: the proof carries the row, anyone re-hashes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from libs.witness.merkle import leaf_hash
from libs.witness.note import ALG_ED25519, NoteError, SignedNote, Signer, Verifier

__all__ = ["NodeFiles", "load_or_create_key", "row_bytes", "row_leaf", "write_private"]

_pack = msgspec.msgpack.Encoder().encode


def row_bytes(row: Sequence[Any]) -> bytes:
    return _pack(row if type(row) in (tuple, list) else tuple(row))


def row_leaf(row: Sequence[Any]) -> bytes:
    return leaf_hash(row_bytes(row))


def write_private(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 (never readable by others, even for a moment), atomically."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_or_create_key(path: Path, name: str, alg: int = ALG_ED25519) -> Signer:
    """The signer key at ``path``; a fresh one (mode 0600) when there is none. A key readable by others is refused."""
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        signer = Signer.generate(name, alg)
        write_private(path, signer.encode() + "\n")
        return signer
    if mode & 0o077:
        raise NoteError(f"{path} is readable by others (mode {mode:o}): chmod 600 it, or delete it for a new key")
    signer = Signer.parse(path.read_text())
    if signer.name != name:
        raise NoteError(f"{path} is the key of {signer.name}, not {name}: a node keeps its key name for life")
    return signer


class NodeFiles:
    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir) / "witness"

    @property
    def key(self) -> Path:
        return self.dir / "node.key"

    @property
    def pub(self) -> Path:
        return self.dir / "node.pub"

    @property
    def witness_pub(self) -> Path:
        return self.dir / "witness.pub"

    @property
    def cosigned(self) -> Path:
        return self.dir / "cosigned.jsonl"

    @property
    def leaves(self) -> Path:
        return self.dir / "leaves"

    def node_verifier(self) -> Verifier | None:
        return Verifier.parse(self.pub.read_text()) if self.pub.exists() else None

    def witness_verifier(self) -> Verifier | None:
        return Verifier.parse(self.witness_pub.read_text()) if self.witness_pub.exists() else None

    # --- cosigned checkpoints ---
    def append_cosigned(self, note: SignedNote) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.cosigned, "a") as f:
            f.write(json.dumps({"note": note.encode()}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def cosigned_notes(self) -> list[SignedNote]:
        """Every stored cosigned checkpoint, oldest first (a torn last line, from a crash, is skipped)."""
        if not self.cosigned.exists():
            return []
        notes = []
        for line in self.cosigned.read_text().splitlines():
            try:
                notes.append(SignedNote.parse(json.loads(line)["note"]))
            except (ValueError, KeyError, TypeError):
                continue
        return notes

    def latest_cosigned(self) -> SignedNote | None:
        notes = self.cosigned_notes()
        return notes[-1] if notes else None

    # --- leaf hashes ---
    def read_leaves(self, start: int = 0, stop: int | None = None) -> list[bytes]:
        if not self.leaves.exists():
            return []
        with open(self.leaves, "rb") as f:
            f.seek(start * 32)
            data = f.read() if stop is None else f.read(max(0, stop - start) * 32)
        return [data[i : i + 32] for i in range(0, len(data) - len(data) % 32, 32)]

    def leaf_count(self) -> int:
        return self.leaves.stat().st_size // 32 if self.leaves.exists() else 0

    def iter_leaves(self, chunk: int = 65_536) -> Iterator[bytes]:
        start = 0
        while batch := self.read_leaves(start, start + chunk):
            yield from batch
            start += len(batch)
