"""Snapshots: a restart replays only the tail; a snapshot from other code or another log is ignored."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from bench.make_log import synthetic, write_log
from libs.ledger import snapshot as snap
from libs.ledger.snapshot import load_state, save_snapshot, snapshot_path
from libs.ledger.state import LedgerState
from libs.store import replay


def full_replay(path: Path) -> LedgerState:
    state = LedgerState()
    replay(path, state.apply)
    return state


def same(a: LedgerState, b: LedgerState) -> None:
    assert a.snapshot() == b.snapshot()
    assert a.__dict__.keys() == b.__dict__.keys()
    assert (a.seq, a.time, a.refusals, a.inventory) == (b.seq, b.time, b.refusals, b.inventory)


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.sqlite"
    events = synthetic(3_000)
    write_log(path, itertools.islice(events, 2_000), progress=False)
    return path


def test_a_restart_replays_only_the_tail(log_path: Path) -> None:
    first = load_state(log_path)
    assert (first.snapshot_seq, first.replayed, first.discarded) == (0, 2_000, "")
    header = save_snapshot(log_path, first.state)
    assert header is not None and header.seq == 2_000
    write_log(log_path, itertools.islice(synthetic(3_000), 2_000, 3_000), progress=False)  # more events
    second = load_state(log_path)
    assert (second.snapshot_seq, second.replayed) == (2_000, 1_000)
    same(second.state, full_replay(log_path))


def test_a_snapshot_from_other_code_is_discarded(log_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_snapshot(log_path, load_state(log_path).state)
    monkeypatch.setattr(snap, "code_rev", lambda: "another-release")
    restored = load_state(log_path)
    assert restored.snapshot_seq == 0 and "other code" in restored.discarded
    same(restored.state, full_replay(log_path))


def test_a_snapshot_of_another_log_is_discarded(log_path: Path, tmp_path: Path) -> None:
    save_snapshot(log_path, load_state(log_path).state)
    saved = snapshot_path(log_path).read_bytes()
    other = tmp_path / "other" / "ledger.sqlite"
    other.parent.mkdir()
    write_log(other, synthetic(2_500), seed=99, progress=False)  # same length and more, other event ids
    snapshot_path(other).write_bytes(saved)
    restored = load_state(other)
    assert restored.snapshot_seq == 0 and "differs from the snapshot" in restored.discarded
    same(restored.state, full_replay(other))


def test_a_log_shorter_than_its_snapshot_is_replayed_in_full(log_path: Path, tmp_path: Path) -> None:
    save_snapshot(log_path, load_state(log_path).state)
    short = tmp_path / "short" / "ledger.sqlite"
    short.parent.mkdir()
    write_log(short, synthetic(1_000), progress=False)
    snapshot_path(short).write_bytes(snapshot_path(log_path).read_bytes())
    restored = load_state(short)
    assert "no longer reaches seq 2000" in restored.discarded
    assert restored.state.seq == 1_000


def test_a_damaged_snapshot_file_is_ignored(log_path: Path) -> None:
    snapshot_path(log_path).write_bytes(b"{not json\n\x00")
    restored = load_state(log_path)
    assert restored.snapshot_seq == 0 and "unreadable snapshot" in restored.discarded
    assert restored.state.seq == 2_000


# Modules the fold imports whose code cannot change what the state holds: exception classes; the
# settings module (a reproduced response depends on the settings recorded in the log, not on the
# running configuration; the HAMi-core response reads only its MIB constant from it).
_FOLD_NEUTRAL = {"libs.errors", "libs.config"}


def test_code_rev_covers_every_module_the_fold_reads_events_with() -> None:
    """A change to any module that decides the pickled state must retire old snapshots: every libs
    module imported by a fold module is itself a fold module (or holds nothing that folds)."""
    import ast
    import importlib

    covered = {m.__name__ for m in snap.FOLD_MODULES}
    assert {"libs.ledger.state", "libs.events.schema", "libs.events.codec", "libs.store.rows"} <= covered
    for module in snap.FOLD_MODULES:
        tree = ast.parse(Path(module.__file__ or "").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        for name in sorted(i for i in imported if i.startswith("libs.")):
            target = importlib.import_module(name)
            if Path(target.__file__ or "").name == "__init__.py":
                continue  # a package's own __init__ only re-exports
            assert name in covered | _FOLD_NEUTRAL, f"{module.__name__} imports {name}, which code_rev does not hash"


def test_code_rev_changes_with_the_fold_modules(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = snap.code_rev()
    for module in snap.FOLD_MODULES:
        copy = tmp_path / f"{module.__name__}.py"
        copy.write_bytes(Path(module.__file__ or "").read_bytes() + b"\n# changed\n")
        monkeypatch.setattr(module, "__file__", str(copy))
        assert snap.code_rev() != before, module.__name__
        monkeypatch.undo()
    assert snap.code_rev() == before
