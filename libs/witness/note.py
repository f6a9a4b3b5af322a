"""C2SP signed notes (c2sp.org/signed-note), checkpoints (tlog-checkpoint) and cosignatures (tlog-cosignature).

A signed note is UTF-8 text ending in a newline, a blank line, then one line per signature:

    — <key name> base64(key ID (4 bytes) || signature)

The key ID of an Ed25519 note key is SHA-256(<key name> || "\\n" || 0x01 || public key)[:4]; a witness's
cosignature key uses the algorithm byte 0x04 instead, and its signature is over

    cosignature/v1\\n
    time <unix seconds>\\n
    <the checkpoint's origin, size and root lines>

with the line's bytes being key ID || timestamp (8 bytes, big-endian) || signature. Keys travel as the
spec's strings: a verifier key ``<name>+<key ID hex>+base64(alg || public key)`` and a signer key
``PRIVATE+KEY+<name>+<key ID hex>+base64(alg || seed)``.

A checkpoint's text is three lines: the origin (``gpuledger/<cluster>/<node>``), the tree size in
decimal (the log's last seq) and the base64 root hash.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# cryptography (about 7 MB of resident memory) is imported where a key is used, not with this module:
# keys, notes and checkpoints are parsed and encoded from their bytes, and an allocator whose
# checkpointer is off never loads it.

__all__ = [
    "ALG_COSIGNATURE_V1",
    "ALG_ED25519",
    "Checkpoint",
    "NoteError",
    "Signature",
    "SignedNote",
    "Signer",
    "Verifier",
    "cosign",
    "cosignature_message",
    "key_id",
    "sign_note",
    "verify_cosignature",
]

ALG_ED25519 = 0x01
ALG_COSIGNATURE_V1 = 0x04
DASH = "\u2014"  # the em dash that opens every signature line
COSIGNATURE_HEADER = "cosignature/v1\n"


class NoteError(ValueError):
    """A malformed note, key or checkpoint, or a signature that does not verify."""


def key_id(name: str, alg: int, public: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + bytes([alg]) + public).digest()[:4]


def _check_name(name: str) -> None:
    if not name or "+" in name or any(ch.isspace() for ch in name):
        raise NoteError(f"a key name must be non-empty, without spaces or '+': {name!r}")


def _public_bytes(key: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _key_bytes(role: str, name: str, blob: str, kind: str) -> bytes:
    """The algorithm byte and the 32 key bytes of a verifier or signer key's base64 part, checked."""
    _check_name(name)
    try:
        raw = base64.b64decode(blob, validate=True)
    except binascii.Error as exc:
        raise NoteError(f"the {role} key {name} is not base64: {exc}") from exc
    if len(raw) != 33 or raw[0] not in (ALG_ED25519, ALG_COSIGNATURE_V1):
        raise NoteError(f"the {role} key {name} is not {kind}")
    return raw


@dataclass(frozen=True)
class Verifier:
    """A public key with its name and algorithm (0x01 note signer, 0x04 witness)."""

    name: str
    alg: int
    public: bytes

    @property
    def id(self) -> bytes:
        return key_id(self.name, self.alg, self.public)

    def encode(self) -> str:
        return f"{self.name}+{self.id.hex()}+{base64.b64encode(bytes([self.alg]) + self.public).decode()}"

    @classmethod
    def parse(cls, text: str) -> Verifier:
        parts = text.strip().split("+", 2)  # the base64 key may hold '+'; a name never does
        if len(parts) != 3:
            raise NoteError(f"not a verifier key (<name>+<id>+<key>): {text.strip()!r}")
        name, hex_id, blob = parts
        raw = _key_bytes("verifier", name, blob, "an Ed25519 note or cosignature key")
        verifier = cls(name, raw[0], raw[1:])
        if verifier.id.hex() != hex_id.lower():
            raise NoteError(f"the verifier key {name} names key ID {hex_id} but its key gives {verifier.id.hex()}")
        return verifier

    def _key(self) -> Ed25519PublicKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        return Ed25519PublicKey.from_public_bytes(self.public)

    def check(self, signature: bytes, message: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self._key().verify(signature, message)
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True)
class Signer:
    name: str
    alg: int
    seed: bytes

    @classmethod
    def generate(cls, name: str, alg: int = ALG_ED25519) -> Signer:
        _check_name(name)
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        seed = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return cls(name, alg, seed)

    @property
    def verifier(self) -> Verifier:
        return Verifier(self.name, self.alg, _public_bytes(self._key().public_key()))

    def _key(self) -> Ed25519PrivateKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return Ed25519PrivateKey.from_private_bytes(self.seed)

    def sign(self, message: bytes) -> bytes:
        return self._key().sign(message)

    def encode(self) -> str:
        blob = base64.b64encode(bytes([self.alg]) + self.seed).decode()
        return f"PRIVATE+KEY+{self.name}+{self.verifier.id.hex()}+{blob}"

    @classmethod
    def parse(cls, text: str) -> Signer:
        parts = text.strip().split("+", 4)
        if len(parts) != 5 or parts[:2] != ["PRIVATE", "KEY"]:
            raise NoteError("not a signer key (PRIVATE+KEY+<name>+<id>+<key>)")
        _, _, name, hex_id, blob = parts
        raw = _key_bytes("signer", name, blob, "an Ed25519 key")
        signer = cls(name, raw[0], raw[1:])
        if signer.verifier.id.hex() != hex_id.lower():
            raise NoteError(f"the signer key {name} names key ID {hex_id} but its key gives another")
        return signer


@dataclass(frozen=True)
class Signature:
    name: str
    id: bytes
    body: bytes  # what follows the key ID: the signature (with a cosignature's timestamp before it)

    def line(self) -> str:
        return f"{DASH} {self.name} {base64.b64encode(self.id + self.body).decode()}\n"


@dataclass(frozen=True)
class SignedNote:
    text: str
    signatures: tuple[Signature, ...]

    def encode(self) -> str:
        return self.text + "\n" + "".join(s.line() for s in self.signatures)

    @classmethod
    def parse(cls, data: str) -> SignedNote:
        head, sep, tail = data.rpartition("\n\n")
        if not sep:
            raise NoteError("not a signed note: no blank line before the signatures")
        text = head + "\n"
        _check_text(text)
        if not tail.endswith("\n"):
            raise NoteError("a signed note ends with a newline")
        signatures = []
        for line in tail[:-1].split("\n"):
            if not line.startswith(DASH + " "):
                raise NoteError(f"not a signature line: {line!r}")
            name, _, blob = line[2:].rpartition(" ")
            _check_name(name)
            try:
                raw = base64.b64decode(blob, validate=True)
            except binascii.Error as exc:
                raise NoteError(f"the signature of {name} is not base64") from exc
            if len(raw) < 5:
                raise NoteError(f"the signature of {name} is too short")
            signatures.append(Signature(name, raw[:4], raw[4:]))
        if not signatures:
            raise NoteError("a signed note has at least one signature")
        return cls(text, tuple(signatures))

    def signed_by(self, verifier: Verifier) -> bool:
        """True when a line names this key and its signature over the text verifies (0x01 keys)."""
        for sig in self.signatures:
            if sig.name == verifier.name and sig.id == verifier.id and verifier.check(sig.body, self.text.encode()):
                return True
        return False

    def with_signatures(self, *extra: Signature) -> SignedNote:
        known = {(s.name, s.id) for s in self.signatures}
        return SignedNote(self.text, self.signatures + tuple(s for s in extra if (s.name, s.id) not in known))


def _check_text(text: str) -> None:
    if not text.endswith("\n") or text == "\n":
        raise NoteError("a note's text is non-empty and ends with a newline")
    if any(ord(ch) < 0x20 and ch != "\n" for ch in text):
        raise NoteError("a note's text holds no control characters but newlines")


def sign_note(text: str, signer: Signer) -> SignedNote:
    _check_text(text)
    if signer.alg != ALG_ED25519:
        raise NoteError("notes are signed with 0x01 (Ed25519) keys; 0x04 keys cosign checkpoints")
    return SignedNote(text, (Signature(signer.name, signer.verifier.id, signer.sign(text.encode())),))


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes

    def text(self) -> str:
        return f"{self.origin}\n{self.size}\n{base64.b64encode(self.root).decode()}\n"

    @classmethod
    def parse(cls, text: str) -> Checkpoint:
        lines = text.split("\n")
        if len(lines) < 4 or lines[-1] != "":
            raise NoteError("a checkpoint has an origin, a size and a root hash line")
        origin, size_text, root_text = lines[:3]
        if not origin:
            raise NoteError("a checkpoint's origin is not empty")
        if not size_text.isdigit() or (size_text != "0" and size_text.startswith("0")) or not size_text.isascii():
            raise NoteError(f"a checkpoint's size is a decimal without leading zeros: {size_text!r}")
        try:
            root = base64.b64decode(root_text, validate=True)
        except binascii.Error as exc:
            raise NoteError("a checkpoint's root hash is not base64") from exc
        if len(root) != 32:
            raise NoteError("a checkpoint's root hash is 32 bytes")
        return cls(origin, int(size_text), root)


def cosignature_message(checkpoint: Checkpoint, timestamp: int) -> bytes:
    return f"{COSIGNATURE_HEADER}time {timestamp}\n{checkpoint.text()}".encode()


def cosign(checkpoint: Checkpoint, witness: Signer, timestamp: int) -> Signature:
    if witness.alg != ALG_COSIGNATURE_V1:
        raise NoteError("a witness cosigns with a 0x04 (cosignature/v1) key")
    signature = witness.sign(cosignature_message(checkpoint, timestamp))
    return Signature(witness.name, witness.verifier.id, struct.pack(">Q", timestamp) + signature)


def verify_cosignature(note: SignedNote, witness: Verifier) -> int:
    """The timestamp of ``witness``'s valid cosignature on the checkpoint ``note``; NoteError if there is none."""
    checkpoint = Checkpoint.parse(note.text)
    for sig in note.signatures:
        if sig.name != witness.name or sig.id != witness.id or len(sig.body) != 72:
            continue
        (timestamp,) = struct.unpack(">Q", sig.body[:8])
        if witness.check(sig.body[8:], cosignature_message(checkpoint, timestamp)):
            return int(timestamp)
    raise NoteError(f"no valid cosignature of witness {witness.name} on {checkpoint.origin} size {checkpoint.size}")
