"""The node's checkpointer: a follower of the committed log that keeps its RFC 6962 tree, signs a
checkpoint every N events or T seconds, and has it cosigned by the witness over NATS.

It never writes the log (the allocator's Ledger is its only writer): it reads the committed rows back
from SQLite, the exact bytes the hash chain covers, so its tree is derivable from the log at any time.
Its state is the compact range at the last cosigned size plus the leaves since: O(log n) hashes and the
recent leaves. It is derived from the log at every start (one read of the log, in a thread); ``leaves``
on disk records every leaf hash as it was first seen and is never rewritten, so a rewritten log shows
against it.

The request goes to ``gpuledger.<node>.checkpoint`` (the witness serves ``gpuledger.*.checkpoint``); the
cosigned checkpoint is stored in the state dir and published on ``gpuledger.<node>.checkpoint.cosigned``.
A witness that is away costs nothing: the next checkpoint proves consistency from the last cosigned size.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

from libs.bus.client import Bus
from libs.config import Settings
from libs.errors import BusError, RemoteError, StoreError
from libs.logger import get_logger
from libs.store.log import EventLog
from libs.store.replay import iter_rows, open_reader
from libs.store.rows import COLUMNS
from libs.witness.files import NodeFiles, load_or_create_key, row_leaf
from libs.witness.merkle import CompactRange, ProofSource
from libs.witness.note import Checkpoint, NoteError, SignedNote, Signer, Verifier, sign_note, verify_cosignature
from libs.witness.witness import AddCheckpoint, WitnessReply, add_checkpoint_body

__all__ = ["WITNESS_SUBJECT", "Checkpointer", "checkpoint_subject", "cosigned_subject", "open_checkpointer",
           "origin_of"]

WITNESS_SUBJECT = "gpuledger.*.checkpoint"  # what a witness serves (queue group "witness")

_logger = get_logger("checkpointer")


def origin_of(cluster: str, node: str) -> str:
    return f"gpuledger/{cluster}/{node}"


def checkpoint_subject(bus: Bus) -> str:
    return f"{bus.subjects.prefix}.checkpoint"


def cosigned_subject(bus: Bus) -> str:
    return f"{bus.subjects.prefix}.checkpoint.cosigned"


def open_checkpointer(settings: Settings, bus: Bus, event_log: EventLog) -> Checkpointer | None:
    """The allocator's checkpointer (None when ``checkpoint_every`` is 0); makes the node key on first use."""
    if settings.checkpoint_every <= 0:
        return None
    origin = origin_of(settings.cluster_name, settings.node_name)
    files = NodeFiles(settings.state_dir)
    signer = load_or_create_key(files.key, origin)
    return Checkpointer(bus, event_log, files, signer, origin=origin, every=settings.checkpoint_every,
                        interval=settings.checkpoint_interval, timeout=settings.request_timeout)


class Checkpointer:
    def __init__(
        self,
        bus: Bus,
        event_log: EventLog,
        files: NodeFiles,
        signer: Signer,
        *,
        origin: str,
        every: int,
        interval: float,
        timeout: float,
        witness_key: Verifier | None = None,
    ) -> None:
        self.bus = bus
        self.event_log = event_log
        self.files = files
        self.signer = signer
        self.origin = origin
        self.every = max(1, every)
        self.interval = interval
        self.timeout = timeout
        self.witness_key = witness_key or files.witness_verifier()
        self.source = ProofSource(CompactRange())
        self.cosigned: SignedNote | None = None
        self.refusals = 0              # the witness's 4xx answers other than 409
        self.last_refusal = ""
        self._wake = asyncio.Event()
        self._started = False
        self._pending_note: SignedNote | None = None
        self._frozen = False  # the leaves file disagrees with the log: kept as evidence, no longer appended
        self._one_at_a_time = asyncio.Lock()  # run() and a direct caller (tests, a CLI) never interleave

    # --- start: the leaves file against the log, the base at the last cosigned size ---
    async def start(self) -> None:
        self.files.dir.mkdir(parents=True, exist_ok=True)
        if not self.files.pub.exists():
            self.files.pub.write_text(self.signer.verifier.encode() + "\n")
        await asyncio.to_thread(self._load)
        self.event_log.on_commit(self._committed)
        self._started = True

    def _committed(self, last_seq: int) -> None:
        if last_seq - self.source.size >= self.every:
            self._wake.set()

    def _load(self) -> None:
        """Derive the tree from the log, row by row, and hold it against the leaves file.

        The file only ever grows: where the log disagrees with it, the log was rewritten (or the file
        damaged); the file is kept as it is, as evidence that ``audit verify --witness`` uses, and the tree
        stays the log's own, so the witness refuses the next checkpoint instead of being shown a tree the
        log does not hold. O(n) once per start, in a thread, off the allocation path.
        """
        self.cosigned = self.files.latest_cosigned()
        witnessed = Checkpoint.parse(self.cosigned.text) if self.cosigned else None
        size = witnessed.size if witnessed else 0
        kept = self.files.leaf_count()
        tree, base, fresh = CompactRange(), CompactRange(), []
        new_leaves: list[bytes] = []  # what the file lacks
        diverged = 0
        conn = self._reader()
        try:
            chunk: list[bytes] = []
            for row in iter_rows(conn, COLUMNS) if conn is not None else ():
                chunk.append(row_leaf(row))
                if len(chunk) == 4096:
                    diverged = diverged or self._compare(tree.size, chunk, kept)
                    new_leaves.extend(chunk[max(0, kept - tree.size):])
                    base = _grow(tree, base, fresh, chunk, size)
                    chunk = []
            diverged = diverged or self._compare(tree.size, chunk, kept)
            new_leaves.extend(chunk[max(0, kept - tree.size):])
            base = _grow(tree, base, fresh, chunk, size)
        finally:
            if conn is not None:
                conn.close()
        if not diverged and kept > tree.size:
            diverged = tree.size + 1  # the file saw rows the log no longer holds
        if diverged:
            self._frozen = True
            _logger.error("the log differs from the leaves recorded when it was written: it was rewritten",
                          first_seq=diverged, leaves=str(self.files.leaves))
        else:
            with open(self.files.leaves, "ab") as f:
                f.truncate(kept * 32)  # a torn last leaf (a crash mid-write) goes; whole leaves stay
                f.write(b"".join(new_leaves))
        if witnessed is not None and tree.size >= size and base.root() != witnessed.root:
            _logger.error("the log no longer gives the root the witness cosigned: the next checkpoint will be "
                          "refused", size=size)
        self.source = ProofSource(base)
        for leaf in fresh:
            self.source.append(leaf)

    def _all_after(self, after: int) -> list[bytes]:
        conn = self._reader()
        if conn is None:
            return []
        try:
            return [row_leaf(row) for row in iter_rows(conn, COLUMNS, after_seq=after)]
        finally:
            conn.close()

    def _compare(self, start: int, chunk: list[bytes], kept: int) -> int:
        """The first seq in ``chunk`` (leaves from index ``start``) that the leaves file records otherwise; 0."""
        if start >= kept or not chunk:
            return 0
        recorded = self.files.read_leaves(start, min(kept, start + len(chunk)))
        for i, leaf in enumerate(recorded):
            if leaf != chunk[i]:
                return start + i + 1
        return 0

    def _reader(self) -> sqlite3.Connection | None:
        path = Path(self.event_log.path)
        return open_reader(path) if path.exists() else None

    def _extend(self) -> None:
        """Read the rows committed since the tree's size and append their leaves (file and tree)."""
        conn = self._reader()
        if conn is None:
            return
        try:
            fresh = [row_leaf(row) for row in iter_rows(conn, COLUMNS, after_seq=self.source.size)]
        finally:
            conn.close()
        if not fresh:
            return
        if not self._frozen:
            with open(self.files.leaves, "ab") as f:
                f.write(b"".join(fresh))
        for leaf in fresh:
            self.source.append(leaf)

    # --- the loop ---
    async def run(self) -> None:
        # A checkpointer that cannot read the log or write its files must never stop the allocator (a
        # failed supervised task ends the service): it says so and tries again later.
        while not self._started:
            try:
                await self.start()
            except (StoreError, NoteError, OSError, sqlite3.DatabaseError) as exc:
                _logger.error("the checkpointer cannot start", error=str(exc), retry_in=self.interval)
                await asyncio.sleep(self.interval)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.checkpoint()
            except (BusError, OSError) as exc:
                _logger.debug("no witness reached", error=str(exc) or type(exc).__name__)
            except (StoreError, sqlite3.DatabaseError) as exc:
                _logger.error("the checkpointer cannot read the log", error=str(exc))

    async def checkpoint(self) -> SignedNote | None:
        """Sign the tree as it is now and ask the witness to cosign it; the cosigned note, or None."""
        async with self._one_at_a_time:
            return await self._checkpoint()

    async def _checkpoint(self) -> SignedNote | None:
        await asyncio.to_thread(self._extend)
        size = self.source.size
        witnessed = Checkpoint.parse(self.cosigned.text).size if self.cosigned else 0
        if size == 0 or size == witnessed:
            return self.cosigned
        for _ in range(2):  # a 409 moves the base to the witness's size, then one more try
            reply = await self._ask(size)
            if reply is None or reply.status != 409:
                cosigned = self._answered(reply, size)
                if cosigned is not None:
                    with contextlib.suppress(BusError, OSError):
                        await self.publish_cosigned()
                return cosigned
            if not await self._move_base(reply.body.strip(), size):
                return None
        return None

    async def _ask(self, size: int) -> WitnessReply | None:
        checkpoint = Checkpoint(self.origin, size, self.source.head.root())
        note = sign_note(checkpoint.text(), self.signer)
        body = add_checkpoint_body(self.source.base.size, self.source.consistency_from_base(size), note.encode())
        try:
            request = AddCheckpoint(body, self.signer.verifier.encode())
            reply = await self.bus.request(checkpoint_subject(self.bus), request, WitnessReply, timeout=self.timeout)
        except RemoteError as exc:
            _logger.debug("no witness answers", error=str(exc))
            return None
        self._pending_note = note
        return reply

    def _answered(self, reply: WitnessReply | None, size: int) -> SignedNote | None:
        if reply is None or self._pending_note is None:
            return None
        if reply.status != 200:
            self.refusals += 1
            self.last_refusal = f"{reply.status}: {reply.body}"
            _logger.error("the witness refused the checkpoint", origin=self.origin, size=size, status=reply.status,
                          reason=reply.body)
            return None
        try:
            cosigned = self._pending_note.with_signatures(*SignedNote.parse(self._pending_note.text + "\n" +
                                                                             reply.body).signatures)
            if self.witness_key is None and reply.witness_key:  # pinned from the first cosignature
                self.witness_key = Verifier.parse(reply.witness_key)
                verify_cosignature(cosigned, self.witness_key)
                self.files.witness_pub.write_text(reply.witness_key + "\n")
            elif self.witness_key is not None:
                verify_cosignature(cosigned, self.witness_key)
        except NoteError as exc:
            self.refusals += 1
            self.last_refusal = f"bad cosignature: {exc}"
            _logger.error("the witness's cosignature does not verify", origin=self.origin, error=str(exc))
            return None
        self.files.append_cosigned(cosigned)
        self.source.rebase(size)
        self.cosigned = cosigned
        _logger.info("checkpoint cosigned", origin=self.origin, size=size)
        return cosigned

    async def _move_base(self, text: str, size: int) -> bool:
        """The witness holds another size: prove from there (it may have lost a cosigned note we kept, or
        we lost one it kept). A witness ahead of the log means the log lost events: say so."""
        if not text.isdigit():
            return False
        held = int(text)
        if held > size:
            self.refusals += 1
            self.last_refusal = f"409: the witness cosigned size {held} but the log holds {size} events"
            _logger.error("the witness cosigned more than the log holds: events were lost or the log was replaced",
                          origin=self.origin, witness_size=held, log_size=size)
            return False
        leaves = (await asyncio.to_thread(self._all_after, 0))[:size]
        source = ProofSource(CompactRange.of(leaves[:held]))
        for leaf in leaves[held:]:
            source.append(leaf)
        self.source = source
        return True

    async def publish_cosigned(self) -> None:
        if self.cosigned is not None:
            await self.bus.publish(cosigned_subject(self.bus), {"note": self.cosigned.encode()})


def _grow(tree: CompactRange, base: CompactRange, fresh: list[bytes], chunk: list[bytes], size: int) -> CompactRange:
    """Append ``chunk`` to ``tree`` (and the leaves past ``size`` to ``fresh``); the compact range at ``size``."""
    for leaf in chunk:
        if tree.size == size:
            base = tree.copy()
        if tree.size >= size:
            fresh.append(leaf)
        tree.append(leaf)
    if tree.size == size:
        base = tree.copy()
    return base
