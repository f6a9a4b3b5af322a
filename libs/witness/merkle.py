"""RFC 6962 (RFC 9162 section 2.1) Merkle tree hashing, compact ranges, and inclusion/consistency proofs.

Hashes, as the RFC defines them (SHA-256):

    leaf_hash(d)    = SHA-256(0x00 || d)
    node_hash(l, r) = SHA-256(0x01 || l || r)
    MTH({})         = SHA-256("")
    MTH(D[0:n])     = node_hash(MTH(D[0:k]), MTH(D[k:n])), k the largest power of two < n

Leaves are indexed from 0; the event log's seq S is leaf S-1, so a tree of size n covers seq 1..n.

``CompactRange`` is what an appender keeps: the roots of the perfect subtrees that cover [0, n), one per
set bit of n, O(log n) hashes. It gives the root at n and, with the leaf hashes appended since some
earlier size m kept alongside (``ProofSource``), the RFC consistency proof from m: every node such a
proof takes from the old tree is one of the compact range's subtrees at m (see ``consistency_proof``).
Inclusion proofs need the whole tree (``leaf_hashes``), which ``gpuledger audit prove`` rebuilds from
the log.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "EMPTY_ROOT",
    "CompactRange",
    "ProofError",
    "ProofSource",
    "consistency_proof",
    "inclusion_proof",
    "leaf_hash",
    "node_hash",
    "root_from_inclusion",
    "tree_root",
    "verify_consistency",
    "verify_inclusion",
]

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()


class ProofError(ValueError):
    """A proof that does not verify, or a request for a proof that cannot exist."""


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


# A function giving MTH of the leaves [lo, hi): proofs are built over it, so that one generator serves
# a full list of leaf hashes and an appender's compact range alike.
SubtreeHash = Callable[[int, int], bytes]


def _range_hasher(leaves: Sequence[bytes]) -> SubtreeHash:
    def mth(lo: int, hi: int) -> bytes:
        if hi - lo == 1:
            return leaves[lo]
        k = _split(hi - lo)
        return node_hash(mth(lo, lo + k), mth(lo + k, hi))

    return mth


def tree_root(leaves: Sequence[bytes]) -> bytes:
    """MTH over ``leaves`` (leaf hashes). Iterative, so a million leaves need no deep recursion."""
    return CompactRange.of(leaves).root()


def inclusion_proof(index: int, size: int, subtree: SubtreeHash | Sequence[bytes]) -> list[bytes]:
    """PATH(index, D[0:size]) of RFC 9162 2.1.3.1, leaf first, root-side last."""
    if not 0 <= index < size:
        raise ProofError(f"leaf {index} is not in a tree of size {size}")
    mth = subtree if callable(subtree) else _range_hasher(subtree)
    path: list[bytes] = []
    lo, hi = 0, size
    while hi - lo > 1:
        k = _split(hi - lo)
        if index < lo + k:
            path.append(mth(lo + k, hi))
            hi = lo + k
        else:
            path.append(mth(lo, lo + k))
            lo = lo + k
    path.reverse()
    return path


def consistency_proof(old: int, new: int, subtree: SubtreeHash | Sequence[bytes]) -> list[bytes]:
    """PROOF(old, D[0:new]) of RFC 9162 2.1.4.1 (empty when old == new or old == 0).

    Every node it takes lies wholly in [0, old) or wholly in [old, new), and the ones in [0, old) are
    perfect subtrees of the compact range at ``old``: that is what lets an appender prove consistency
    from its last cosigned size with O(log n) stored hashes plus the leaves appended since.
    """
    if not 0 <= old <= new:
        raise ProofError(f"no consistency proof from size {old} to size {new}")
    if old in (0, new):
        return []
    mth = subtree if callable(subtree) else _range_hasher(subtree)
    proof: list[bytes] = []
    lo, hi, complete = 0, new, True  # complete: [lo, lo + m) is the whole old tree seen so far
    m = old
    while True:
        n = hi - lo
        if m == n:
            if not complete:
                proof.append(mth(lo, hi))
            break
        k = _split(n)
        if m <= k:
            proof.append(mth(lo + k, hi))
            hi = lo + k
        else:
            proof.append(mth(lo, lo + k))
            lo, m, complete = lo + k, m - k, False
    proof.reverse()
    return proof


def root_from_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes:
    """The root that ``proof`` and ``leaf`` (a leaf hash) imply (RFC 9162 2.1.3.2)."""
    if not 0 <= index < size:
        raise ProofError(f"leaf {index} is not in a tree of size {size}")
    fn, sn = index, size - 1
    r = leaf
    for p in proof:
        if sn == 0:
            raise ProofError("the inclusion proof is too long")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("the inclusion proof is too short")
    return r


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes) -> None:
    """Raise ProofError unless ``leaf`` is leaf ``index`` of the tree of ``size`` with ``root``."""
    if root_from_inclusion(index, size, leaf, proof) != root:
        raise ProofError(f"leaf {index} is not in the tree of size {size} with that root")


def verify_consistency(old: int, new: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]) -> None:
    """Raise ProofError unless the tree (new, new_root) extends the tree (old, old_root) (RFC 9162 2.1.4.2)."""
    if not 0 <= old <= new:
        raise ProofError(f"size {new} is smaller than size {old}: a log only grows")
    if old == new:
        if proof:
            raise ProofError("a proof between equal sizes must be empty")
        if old_root != new_root:
            raise ProofError(f"two different roots for size {old}")
        return
    if old == 0:
        if proof:
            raise ProofError("a proof from the empty tree must be empty")
        return
    if not proof:
        raise ProofError("the consistency proof is empty")
    nodes = list(proof)
    if old & (old - 1) == 0:  # old is a power of two: its root is the first node of the path
        nodes.insert(0, old_root)
    fn, sn = old - 1, new - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = nodes[0]
    for c in nodes[1:]:
        if sn == 0:
            raise ProofError("the consistency proof is too long")
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError("the consistency proof is too short")
    if fr != old_root:
        raise ProofError(f"the proof does not lead to the root at size {old}: the log was not extended from it")
    if sr != new_root:
        raise ProofError(f"the proof does not lead to the root at size {new}")


class CompactRange:
    """The perfect subtrees covering leaves [0, size): ``(start, height, hash)``, left to right.

    Appending a leaf merges equal-height neighbours, like a binary counter; the list holds one subtree
    per set bit of ``size``.
    """

    __slots__ = ("nodes", "size")

    def __init__(self, size: int = 0, nodes: Iterable[tuple[int, int, bytes]] = ()) -> None:
        self.size = size
        self.nodes: list[tuple[int, int, bytes]] = list(nodes)
        covered = sum(1 << h for _, h, _ in self.nodes)
        if covered != size or [h for _, h, _ in self.nodes] != _heights(size):
            raise ValueError(f"these subtrees do not form the compact range of size {size}")

    @classmethod
    def of(cls, leaves: Iterable[bytes]) -> CompactRange:
        cr = cls()
        for leaf in leaves:
            cr.append(leaf)
        return cr

    def copy(self) -> CompactRange:
        clone = CompactRange.__new__(CompactRange)
        clone.size, clone.nodes = self.size, list(self.nodes)
        return clone

    def append(self, leaf: bytes) -> None:
        start, height, digest = self.size, 0, leaf
        nodes = self.nodes
        while nodes and nodes[-1][1] == height:
            left_start, _, left = nodes.pop()
            start, height, digest = left_start, height + 1, node_hash(left, digest)
        nodes.append((start, height, digest))
        self.size += 1

    def root(self) -> bytes:
        if not self.nodes:
            return EMPTY_ROOT
        digest = self.nodes[-1][2]
        for _, _, left in reversed(self.nodes[:-1]):
            digest = node_hash(left, digest)
        return digest

    def subtree(self, lo: int, hi: int) -> bytes | None:
        """The hash of [lo, hi) when it is one of this range's subtrees, or inside one (None otherwise)."""
        for start, height, digest in self.nodes:
            if start == lo and start + (1 << height) == hi:
                return digest
        return None


def _heights(size: int) -> list[int]:
    return [h for h in range(size.bit_length() - 1, -1, -1) if size >> h & 1]


class ProofSource:
    """An appender's view of its tree: the compact range at ``base`` plus every leaf hash appended since.

    It answers ``consistency_proof(base, size, ...)`` and the root at any size >= base, without the
    leaves before ``base``.
    """

    def __init__(self, base: CompactRange) -> None:
        self.base = base.copy()
        self.head = base.copy()
        self.fresh: list[bytes] = []

    @property
    def size(self) -> int:
        return self.head.size

    def append(self, leaf: bytes) -> None:
        self.fresh.append(leaf)
        self.head.append(leaf)

    def subtree(self, lo: int, hi: int) -> bytes:
        b = self.base.size
        if hi <= b:
            found = self.base.subtree(lo, hi)
            if found is None:
                raise ProofError(f"[{lo}, {hi}) is not a subtree of the compact range at {b}")
            return found
        if lo >= b:
            return tree_root(self.fresh[lo - b : hi - b])
        raise ProofError(f"[{lo}, {hi}) straddles the base size {b}")

    def consistency_from_base(self, size: int | None = None) -> list[bytes]:
        return consistency_proof(self.base.size, self.size if size is None else size, self.subtree)

    def rebase(self, size: int | None = None) -> None:
        """Make ``size`` (default: the head) the new base: drop the leaves before it."""
        size = self.size if size is None else size
        if not self.base.size <= size <= self.size:
            raise ValueError(f"cannot rebase to {size}: outside [{self.base.size}, {self.size}]")
        keep = self.fresh[size - self.base.size :]
        base = self.base.copy()
        for leaf in self.fresh[: size - self.base.size]:
            base.append(leaf)
        self.base, self.fresh = base, keep
