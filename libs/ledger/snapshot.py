"""Snapshots of the allocator's state: a cache that makes a restart cost the log's tail, not the log.

``<state-dir>/ledger.snapshot`` holds one JSON header line and the pickled ``LedgerState``. The header
names what the snapshot covers and which code folded it:

    {"format": 1, "code_rev": "...", "seq": 1000000, "hash": "<hex of the row hash at seq>", ...}

It is used only when all of these hold, otherwise it is ignored (and replaced by the next save):
- ``code_rev`` equals the running code's: a hash of the sources that define the events and the fold
  (``libs/events/schema.py``, ``codec.py`` with its upcasters, ``libs/store/rows.py`` which turns rows
  into events, ``libs/ledger/state.py``; ``FOLD_MODULES``), so any change to them, in this release or a
  later one, means a full replay;
- the log still holds ``seq`` and its chain hash there is the recorded one (the log was not replaced,
  rewritten or cut below the snapshot).
Then only the events after ``seq`` are replayed. The whole state object is pickled (not a list of its
fields) so that folds added to ``LedgerState`` later are covered without touching this module. The
file lives in the agent's own state directory, next to the log it describes, written atomically.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from libs import hami
from libs.events import codec, schema
from libs.ledger import rules
from libs.ledger import state as state_module
from libs.ledger.state import LedgerState
from libs.logger import get_logger
from libs.placement import recorded, responses
from libs.store import compact, packed, rows
from libs.store.replay import open_reader, replay

__all__ = [
    "Restored",
    "SnapshotKeeper",
    "code_rev",
    "load_state",
    "read_header",
    "save_snapshot",
    "snapshot_path",
    "write_snapshot",
]

FORMAT = 1
_logger = get_logger("snapshot")


class Header(msgspec.Struct, kw_only=True):
    format: int
    code_rev: str
    seq: int
    hash: str
    written_at: int
    allocations: int


@dataclass
class Restored:
    state: LedgerState
    snapshot_seq: int       # 0: no usable snapshot, the whole log was replayed
    replayed: int           # events folded after the snapshot
    discarded: str = ""     # why a snapshot that was there was not used


def snapshot_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.stem + ".snapshot")


# Every module whose code decides what the pickled state holds: the fold and all it reads events with
# (tests/audit/test_snapshots.py checks that each libs module they import is listed or fold-neutral).
# The compact log's modules are among them: a grant's response is reproduced when its row is read.
# (libs.placement re-exports a function named like its hami_response module, hence import_module.)
FOLD_MODULES = (schema, codec, rows, compact, packed, recorded, responses,
                importlib.import_module("libs.placement.hami_response"), hami, rules, state_module)


def code_rev() -> str:
    digest = hashlib.sha256()
    for module in FOLD_MODULES:
        digest.update(Path(module.__file__ or "").read_bytes())
    return digest.hexdigest()[:20]


def _hash_at(log_path: Path, seq: int) -> bytes | None:
    conn = open_reader(log_path, from_seq=seq)  # the live log holds it when the snapshot is recent
    try:
        row = conn.execute("SELECT hash FROM events WHERE seq = ?", (seq,)).fetchone()
        return row[0] if row else None
    finally:
        conn.close()


def save_snapshot(log_path: Path, state: LedgerState) -> Header | None:
    """Write a snapshot of ``state`` now (blocking: it hashes, writes and fsyncs)."""
    return write_snapshot(log_path, state.seq, pickle.dumps(state.__dict__, protocol=pickle.HIGHEST_PROTOCOL),
                          allocations=len(state.allocations))


def write_snapshot(log_path: Path, seq: int, body: bytes, *, allocations: int) -> Header | None:
    if seq == 0:
        return None
    digest = _hash_at(log_path, seq)
    if digest is None:  # cannot happen for a state folded from this log; refuse to write a lie
        raise ValueError(f"the log at {log_path} has no seq {seq}")
    header = Header(format=FORMAT, code_rev=code_rev(), seq=seq, hash=digest.hex(), written_at=time.time_ns(),
                    allocations=allocations)
    path = snapshot_path(log_path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(header) + b"\n")
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return header


class SnapshotKeeper:
    """The allocator's snapshot policy: after every ``every_events`` events, and at a clean stop."""

    def __init__(self, log_path: Path, state: LedgerState, *, saved_seq: int = 0, every_events: int = 10_000,
                 check_interval: float = 5.0) -> None:
        self.log_path = log_path
        self.state = state
        self.saved_seq = saved_seq
        self.every_events = every_events
        self.check_interval = check_interval

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            if self.state.seq - self.saved_seq >= self.every_events:
                await self.save()

    async def save(self) -> None:
        if self.state.seq == self.saved_seq:
            return
        # Pickled here, on the loop, between two events: a consistent state at exactly state.seq.
        seq, count = self.state.seq, len(self.state.allocations)
        body = pickle.dumps(self.state.__dict__, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            await asyncio.to_thread(write_snapshot, self.log_path, seq, body, allocations=count)
        except OSError as exc:  # a cache: failing to write one costs a slower start, nothing else
            _logger.warning("could not write a snapshot", error=str(exc))
            return
        self.saved_seq = seq
        _logger.info("snapshot written", seq=seq, allocations=count)


def read_header(log_path: Path) -> tuple[Header, bytes] | None:
    path = snapshot_path(log_path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    line, _, body = raw.partition(b"\n")
    return msgspec.json.decode(line, type=Header), body


def _usable(log_path: Path) -> tuple[Header, dict[str, object]] | str:
    try:
        found = read_header(log_path)
    except (msgspec.DecodeError, msgspec.ValidationError, OSError) as exc:
        return f"unreadable snapshot: {exc}"
    if found is None:
        return ""
    header, body = found
    if header.format != FORMAT or header.code_rev != code_rev():
        return f"written by other code (code_rev {header.code_rev}, running {code_rev()})"
    digest = _hash_at(log_path, header.seq)
    if digest is None:
        return f"the log no longer reaches seq {header.seq}"
    if digest.hex() != header.hash:
        return f"the log's hash at seq {header.seq} differs from the snapshot's: the log was replaced or rewritten"
    try:
        fields = pickle.loads(body)  # our own file in our own state dir, checked against the log above
    except Exception as exc:
        return f"unreadable snapshot body: {exc}"
    return header, fields


def load_state(log_path: Path) -> Restored:
    """The state after the last committed event: from the snapshot if valid, else the whole log."""
    state = LedgerState()
    usable = _usable(log_path) if log_path.exists() else ""
    discarded = ""
    if isinstance(usable, str):
        discarded = usable
        if discarded:
            _logger.warning("snapshot discarded, replaying the whole log", reason=discarded)
    else:
        state.__dict__.update(usable[1])
    start = state.seq
    last = replay(log_path, state.apply, after_seq=start) if log_path.exists() else 0
    return Restored(state=state, snapshot_seq=start, replayed=max(0, last - start), discarded=discarded)
