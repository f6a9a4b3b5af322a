"""RFC 6962 hashing and proofs, checked against a naive full-tree implementation written straight from the RFC."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.witness.merkle import (
    EMPTY_ROOT,
    CompactRange,
    ProofError,
    ProofSource,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    node_hash,
    tree_root,
    verify_consistency,
    verify_inclusion,
)


# --- the naive reference: RFC 9162 2.1.1, 2.1.3.1 and 2.1.4.1, recursion on the leaf data itself ---
def _k(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def naive_mth(data: list[bytes]) -> bytes:
    if not data:
        return hashlib.sha256(b"").digest()
    if len(data) == 1:
        return hashlib.sha256(b"\x00" + data[0]).digest()
    k = _k(len(data))
    return hashlib.sha256(b"\x01" + naive_mth(data[:k]) + naive_mth(data[k:])).digest()


def naive_path(m: int, data: list[bytes]) -> list[bytes]:
    if len(data) == 1:
        return []
    k = _k(len(data))
    if m < k:
        return [*naive_path(m, data[:k]), naive_mth(data[k:])]
    return [*naive_path(m - k, data[k:]), naive_mth(data[:k])]


def naive_subproof(m: int, data: list[bytes], b: bool) -> list[bytes]:
    n = len(data)
    if m == n:
        return [] if b else [naive_mth(data)]
    k = _k(n)
    if m <= k:
        return [*naive_subproof(m, data[:k], b), naive_mth(data[k:])]
    return [*naive_subproof(m - k, data[k:], False), naive_mth(data[:k])]


def naive_proof(m: int, data: list[bytes]) -> list[bytes]:
    return [] if m in (0, len(data)) else naive_subproof(m, data, True)


def entries(n: int) -> list[bytes]:
    return [f"row {i}".encode() for i in range(n)]


sizes = st.integers(min_value=1, max_value=300)


@given(sizes)
def test_the_root_matches_the_naive_tree(n: int) -> None:
    data = entries(n)
    leaves = [leaf_hash(d) for d in data]
    assert tree_root(leaves) == naive_mth(data)


def test_the_empty_tree_and_the_known_vectors() -> None:
    assert tree_root([]) == EMPTY_ROOT == bytes.fromhex(
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
    # RFC 6962's leaf/node prefixes: a leaf can never pass for a node
    assert leaf_hash(b"") == hashlib.sha256(b"\x00").digest()
    assert node_hash(b"a" * 32, b"b" * 32) == hashlib.sha256(b"\x01" + b"a" * 32 + b"b" * 32).digest()


@given(st.data())
def test_inclusion_proofs_match_the_naive_path_and_verify(data: st.DataObject) -> None:
    n = data.draw(sizes)
    index = data.draw(st.integers(min_value=0, max_value=n - 1))
    rows = entries(n)
    leaves = [leaf_hash(d) for d in rows]
    proof = inclusion_proof(index, n, leaves)
    assert proof == naive_path(index, rows)
    root = naive_mth(rows)
    verify_inclusion(index, n, leaves[index], proof, root)
    # another leaf, another index, a cut or a lengthened proof: all refused
    with pytest.raises(ProofError):
        verify_inclusion(index, n, leaf_hash(b"forged"), proof, root)
    if n > 1:
        with pytest.raises(ProofError):
            verify_inclusion((index + 1) % n, n, leaves[index], proof, root)
        with pytest.raises(ProofError):
            verify_inclusion(index, n, leaves[index], proof[:-1], root)
    with pytest.raises(ProofError):
        verify_inclusion(index, n, leaves[index], [*proof, root], root)


@given(st.data())
def test_consistency_proofs_match_the_naive_proof_and_verify(data: st.DataObject) -> None:
    n = data.draw(sizes)
    m = data.draw(st.integers(min_value=0, max_value=n))
    rows = entries(n)
    leaves = [leaf_hash(d) for d in rows]
    proof = consistency_proof(m, n, leaves)
    assert proof == naive_proof(m, rows)
    old_root, new_root = naive_mth(rows[:m]), naive_mth(rows)
    verify_consistency(m, n, old_root, new_root, proof)


@given(st.data())
@settings(max_examples=150)
def test_a_rewritten_history_fails_the_consistency_proof(data: st.DataObject) -> None:
    n = data.draw(st.integers(min_value=2, max_value=200))
    m = data.draw(st.integers(min_value=1, max_value=n - 1))
    changed = data.draw(st.integers(min_value=0, max_value=m - 1))
    honest = entries(n)
    rewritten = list(honest)
    rewritten[changed] = b"rewritten"
    old_root = naive_mth(honest[:m])  # what the witness cosigned
    leaves = [leaf_hash(d) for d in rewritten]
    with pytest.raises(ProofError):
        verify_consistency(m, n, old_root, naive_mth(rewritten), consistency_proof(m, n, leaves))


@given(st.data())
def test_an_appender_proves_consistency_from_its_compact_range(data: st.DataObject) -> None:
    n = data.draw(sizes)
    m = data.draw(st.integers(min_value=0, max_value=n))
    leaves = [leaf_hash(d) for d in entries(n)]
    base = CompactRange.of(leaves[:m])
    assert len(base.nodes) == bin(m).count("1")  # O(log n) state
    source = ProofSource(base)
    for leaf in leaves[m:]:
        source.append(leaf)
    assert source.head.root() == tree_root(leaves)
    assert source.consistency_from_base() == consistency_proof(m, n, leaves)
    mid = data.draw(st.integers(min_value=m, max_value=n))
    source.rebase(mid)
    assert source.base.root() == tree_root(leaves[:mid])
    assert source.consistency_from_base() == consistency_proof(mid, n, leaves)


def test_compact_range_refuses_a_wrong_shape() -> None:
    cr = CompactRange.of([leaf_hash(b"a")] * 5)
    CompactRange(5, cr.nodes)
    with pytest.raises(ValueError, match="compact range of size 6"):
        CompactRange(6, cr.nodes)


@pytest.mark.parametrize(("old", "new"), [(5, 4), (-1, 3)])
def test_impossible_proof_requests_are_refused(old: int, new: int) -> None:
    with pytest.raises(ProofError):
        consistency_proof(old, new, [leaf_hash(b"x")] * 5)
    with pytest.raises(ProofError):
        verify_consistency(old, new, EMPTY_ROOT, EMPTY_ROOT, [])


def test_equal_sizes_with_different_roots_are_a_fork() -> None:
    with pytest.raises(ProofError, match="two different roots"):
        verify_consistency(3, 3, b"a" * 32, b"b" * 32, [])
