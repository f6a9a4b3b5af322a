"""A witness with the semantics of c2sp.org/tlog-witness: it cosigns a node's checkpoint only when the
checkpoint extends, by a valid RFC 6962 consistency proof, the last one it cosigned for that origin.

The request body is tlog-witness's ``add-checkpoint`` body, byte for byte:

    old <size the caller believes the witness holds>\\n
    <base64 consistency proof hash>\\n      (zero or more)
    \\n
    <the signed checkpoint note>

and the answer carries the spec's HTTP status with its meaning:

    200  the body is the cosignature line(s), to append to the note
    400  malformed request, or ``old`` above the checkpoint's size
    403  the checkpoint is not signed by the origin's key
    404  an origin this witness does not know (and does not enroll)
    409  ``old`` is not the size this witness last cosigned: stale; the body is the witness's size
    422  the consistency proof does not verify: the log is not an extension of what was cosigned

The witness persists the new size and root through ``WitnessStore.advance`` (a compare-and-set on the
old size and root) before it answers, so it never cosigns two checkpoints of one origin that are
inconsistent with each other, nor a smaller one after a larger one, across restarts too.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec

from libs.witness.merkle import EMPTY_ROOT, ProofError, verify_consistency
from libs.witness.note import Checkpoint, NoteError, SignedNote, Signer, Verifier, cosign

__all__ = [
    "AddCheckpoint",
    "FileWitnessStore",
    "Witness",
    "WitnessReply",
    "WitnessState",
    "WitnessStore",
    "add_checkpoint_body",
    "parse_add_checkpoint",
    "same_tree",
]

MAX_PROOF_LINES = 63  # tlog-witness: a consistency proof has at most 63 hashes


class AddCheckpoint(msgspec.Struct, frozen=True):
    """The NATS request: tlog-witness's add-checkpoint body as text, and the node's verifier key (used
    only to enrol an origin the witness does not know yet, when it enrols on first use)."""

    body: str
    key: str = ""


class WitnessReply(msgspec.Struct, frozen=True):
    """The NATS reply: tlog-witness's HTTP status and body, and the witness's verifier key (a node pins
    it from its first cosignature; an auditor passes the key it trusts instead)."""

    status: int
    body: str
    witness_key: str = ""


@dataclass(frozen=True)
class WitnessState:
    """What a witness holds for one origin: the last size and root it cosigned, and the origin's key."""

    size: int
    root: bytes
    key: str  # the origin's verifier key (pinned at enrolment or configured)
    note: str = ""  # the checkpoint at ``size`` with the witness's cosignature (what a restore starts from)


class WitnessStore(Protocol):
    """Where a witness keeps its per-origin state. The recorder can back it with its SQL database."""

    def get(self, origin: str) -> WitnessState | None: ...

    def advance(self, origin: str, old: WitnessState | None, new: WitnessState) -> bool:
        """Atomically replace ``old`` (None: no row yet) by ``new``; False when the stored state is not ``old``
        (compared by size and root: a compare-and-set on the tree the witness vouched for)."""
        ...


class FileWitnessStore:
    """One JSON file per origin in ``directory``, replaced atomically (write, fsync, rename, fsync the dir);
    a lock file serialises writers, across processes too."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _path(self, origin: str) -> Path:
        return self.directory / f"{hashlib.sha256(origin.encode()).hexdigest()[:32]}.json"

    def get(self, origin: str) -> WitnessState | None:
        try:
            data = json.loads(self._path(origin).read_text())
        except FileNotFoundError:
            return None
        if data.get("origin") != origin:
            raise ValueError(f"{self._path(origin)} holds another origin ({data.get('origin')!r})")
        return WitnessState(int(data["size"]), base64.b64decode(data["root"]), data["key"], data.get("note", ""))

    def advance(self, origin: str, old: WitnessState | None, new: WitnessState) -> bool:
        with self._lock, open(self.directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not same_tree(self.get(origin), old):
                return False
            path = self._path(origin)
            tmp = path.with_suffix(".tmp")
            record = {"origin": origin, "size": new.size, "root": base64.b64encode(new.root).decode(), "key": new.key,
                      "note": new.note}
            with open(tmp, "w") as f:
                f.write(json.dumps(record))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            return True


def same_tree(a: WitnessState | None, b: WitnessState | None) -> bool:
    """Whether two states vouch for the same tree (size and root), None for no state yet."""
    if a is None or b is None:
        return a is b
    return (a.size, a.root) == (b.size, b.root)


def add_checkpoint_body(old: int, proof: list[bytes], signed_checkpoint: str) -> str:
    lines = [f"old {old}\n", *(base64.b64encode(h).decode() + "\n" for h in proof), "\n"]
    return "".join(lines) + signed_checkpoint


def parse_add_checkpoint(body: str) -> tuple[int, list[bytes], SignedNote]:
    """(old size, proof, signed checkpoint); NoteError (a 400) when malformed."""
    head, sep, note = body.partition("\n\n")
    if not sep:
        raise NoteError("no blank line after the consistency proof")
    lines = head.split("\n")
    first = lines[0]
    if not first.startswith("old ") or not first[4:].isdigit() or not first[4:].isascii():
        raise NoteError(f"the first line is 'old <size>', not {first!r}")
    if len(lines) - 1 > MAX_PROOF_LINES:
        raise NoteError(f"a consistency proof has at most {MAX_PROOF_LINES} hashes")
    proof = []
    for line in lines[1:]:
        try:
            digest = base64.b64decode(line, validate=True)
        except binascii.Error as exc:
            raise NoteError(f"a proof line is not base64: {line!r}") from exc
        if len(digest) != 32:
            raise NoteError("a proof hash is 32 bytes")
        proof.append(digest)
    return int(first[4:]), proof, SignedNote.parse(note)


class Witness:
    """Cosigns checkpoints for the origins it knows (``keys``: origin -> verifier key string) or, with
    ``enroll``, for any origin whose first checkpoint pins its key (trust on first use)."""

    def __init__(
        self,
        signer: Signer,
        store: WitnessStore,
        *,
        keys: Mapping[str, str] | None = None,
        enroll: bool = False,
        accept_origin: Callable[[str], bool] = lambda _origin: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.signer = signer
        self.store = store
        self.keys = dict(keys or {})
        self.enroll = enroll
        self.accept_origin = accept_origin
        self.clock = clock

    @property
    def verifier(self) -> Verifier:
        return self.signer.verifier

    def add_checkpoint(self, body: str, *, key: str = "", origin: str | None = None) -> WitnessReply:
        """``origin``: the origin the transport vouches for (the fleet recorder: the node whose subject
        carried the request); a checkpoint of any other origin is refused with 403."""
        try:
            old, proof, note = parse_add_checkpoint(body)
            checkpoint = Checkpoint.parse(note.text)
        except NoteError as exc:
            return WitnessReply(400, f"malformed add-checkpoint request: {exc}")
        if origin is not None and checkpoint.origin != origin:
            return WitnessReply(403, f"a checkpoint of {checkpoint.origin} sent as {origin}: a node speaks only for "
                                     "itself")
        origin = checkpoint.origin
        if old > checkpoint.size:
            return WitnessReply(400, f"old size {old} is above the checkpoint's size {checkpoint.size}")
        if not self.accept_origin(origin):
            return WitnessReply(404, f"this witness does not serve the origin {origin}")
        state = self.store.get(origin)
        key_text = state.key if state else self.keys.get(origin)
        if key_text is None:
            if not self.enroll:
                return WitnessReply(404, f"unknown origin {origin}: no key configured for it")
            if not key:
                return WitnessReply(403, f"{origin} is not enrolled yet and its request carries no key")
            key_text = key
        try:
            key = Verifier.parse(key_text)
        except NoteError as exc:
            return WitnessReply(403, f"the key of {origin} is unusable: {exc}")
        if not note.signed_by(key):
            return WitnessReply(403, f"the checkpoint is not signed by the key of {origin} ({key.name})")
        held = state.size if state else 0
        if old != held:
            return WitnessReply(409, str(held))
        old_root = state.root if state else EMPTY_ROOT
        try:
            verify_consistency(old, checkpoint.size, old_root, checkpoint.root, proof)
        except ProofError as exc:
            return WitnessReply(422, f"{origin}: size {checkpoint.size} is not consistent with size {old} that this "
                                     f"witness cosigned: {exc}")
        # Signed before the store advances (it is pure), returned only after: the store keeps the
        # cosigned note beside its size, the copy a restore starts from.
        signature = cosign(checkpoint, self.signer, int(self.clock()))
        cosigned = note.with_signatures(signature)
        new = WitnessState(checkpoint.size, checkpoint.root, key_text, cosigned.encode())
        if not self.store.advance(origin, state, new):
            now = self.store.get(origin)
            return WitnessReply(409, str(now.size if now else 0))
        return WitnessReply(200, signature.line(), self.verifier.encode())

    async def handle(self, request: AddCheckpoint) -> WitnessReply:
        """The NATS handler: ``bus.serve(WITNESS_SUBJECTS, AddCheckpoint, witness.handle, queue="witness")``.
        The store's fsync runs off the event loop."""
        return await asyncio.to_thread(self.add_checkpoint, request.body, key=request.key)

