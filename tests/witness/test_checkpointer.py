"""The node's checkpointer against a witness on a real nats-server, and the audit commands on what it left:
a log rewritten forward with a recomputed hash chain passes `audit verify` and fails `audit verify --witness`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.store import EventLog
from libs.store.verify import verify_log
from libs.witness import Checkpoint, Witness
from libs.witness.files import NodeFiles, load_or_create_key
from libs.witness.node import Checkpointer, origin_of
from libs.witness.note import verify_cosignature
from tests.builders import released_event
from tests.polling import eventually
from tests.witness.helpers import rewrite_forward

ORIGIN = origin_of("test", "node-a")


@asynccontextmanager
async def checkpointer(url: str, state: Path, *, every: int = 5, interval: float = 30.0) -> AsyncIterator[
        tuple[Checkpointer, EventLog]]:
    bus = await Bus.connect(url, name="allocator", node="node-a", wait=5)
    event_log = await EventLog.open(state / "ledger.sqlite")
    files = NodeFiles(state)
    cp = Checkpointer(bus, event_log, files, load_or_create_key(files.key, ORIGIN), origin=ORIGIN, every=every,
                      interval=interval, timeout=2.0)
    task = asyncio.create_task(cp.run())
    try:
        await eventually(lambda: cp._started, timeout=10, interval=0.02, what="the checkpointer started")
        yield cp, event_log
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await event_log.close()
        await bus.close()


def size_of(cp: Checkpointer) -> int:
    return Checkpoint.parse(cp.cosigned.text).size if cp.cosigned else 0


def gpuledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuledger", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


async def test_checkpoints_every_n_events_are_cosigned_and_survive_a_restart(
        nats_server: NatsServer, witness_bus: tuple[Witness, Bus], tmp_path: Path) -> None:
    witness, _ = witness_bus
    state = tmp_path / "state"
    async with checkpointer(nats_server.url, state, every=5) as (cp, event_log):
        # Five, then the rest: the trigger counts from the tree's size, which lags while a checkpoint reads
        # the log, so twelve appends at once can be checkpointed at 5 and 9, and the next not before 14.
        for i in range(5):
            await event_log.append([released_event(i)])
        await eventually(lambda: size_of(cp) >= 5, timeout=10, interval=0.05, what="a cosigned checkpoint at 5")
        for i in range(5, 12):
            await event_log.append([released_event(i)])
        await eventually(lambda: size_of(cp) >= 10, timeout=10, interval=0.05, what="a cosigned checkpoint at 10")
        assert verify_cosignature(cp.cosigned, witness.verifier) > 0  # type: ignore[arg-type]
    files = NodeFiles(state)
    assert (files.key.stat().st_mode & 0o777) == 0o600
    assert files.witness_verifier() == witness.verifier  # pinned from the first cosignature
    assert files.leaf_count() >= 10  # the leaves up to the last checkpoint at least; the rest at the next start
    # a restart resumes from the stored base: the witness sees a consistency proof from its last size
    async with checkpointer(nats_server.url, state, every=1000) as (cp, event_log):
        assert cp.source.base.size == size_of(cp)
        for i in range(12, 22):
            await event_log.append([released_event(i)])
        await cp.checkpoint()
        assert size_of(cp) == 22
    assert witness.store.get(ORIGIN).size == 22  # type: ignore[union-attr]
    assert cp.refusals == 0


async def test_the_interval_checkpoints_a_quiet_log(
        nats_server: NatsServer, witness_bus: tuple[Witness, Bus], tmp_path: Path) -> None:
    async with checkpointer(nats_server.url, tmp_path / "state", every=1000, interval=0.2) as (cp, event_log):
        await event_log.append([released_event(0), released_event(1)])
        await eventually(lambda: size_of(cp) == 2, timeout=10, interval=0.05, what="a checkpoint after the interval")


async def test_a_rewritten_log_is_refused_by_the_witness_and_caught_by_audit(
        nats_server: NatsServer, witness_bus: tuple[Witness, Bus], tmp_path: Path) -> None:
    witness, _ = witness_bus
    state = tmp_path / "state"
    async with checkpointer(nats_server.url, state, every=1000) as (cp, event_log):
        for i in range(30):
            await event_log.append([released_event(i)])
            if i % 10 == 9:  # cosigned at 10, 20 and 30
                await cp.checkpoint()
        assert size_of(cp) == 30
    log_path = state / "ledger.sqlite"
    run = gpuledger("audit", "verify", "--witness", "--state-dir", str(state))
    assert run.returncode == 0 and "the log matches the checkpoint" in run.stdout, run.stdout + run.stderr

    rewrite_forward(log_path, 17)
    assert verify_log(log_path).ok  # today's verify: the recomputed chain is intact
    run = gpuledger("audit", "verify", "--witness", "--state-dir", str(state),
                    "--witness-key", witness.verifier.encode())
    assert run.returncode == 1, run.stdout + run.stderr
    assert "intact. 30 events" in run.stdout and "witness: DIFFERS at seq 17" in run.stdout

    # the leaves file rewritten too: the cosigned history still brackets the row
    NodeFiles(state).leaves.unlink()
    run = gpuledger("audit", "verify", "--witness", "--json", "--state-dir", str(state))
    got = json.loads(run.stdout)["witness"]
    assert run.returncode == 1 and got["bad_range"] == [11, 20] and got["first_bad_seq"] == 11

    # the node goes on from the rewritten log: the witness refuses its next checkpoint (422), not stale (409)
    async with checkpointer(nats_server.url, state, every=1) as (cp, event_log):
        await event_log.append([released_event(99)])
        await eventually(lambda: cp.refusals > 0, timeout=10, interval=0.05, what="the witness's refusal")
        assert cp.last_refusal.startswith("422"), cp.last_refusal
    assert witness.store.get(ORIGIN).size == 30  # type: ignore[union-attr]


async def test_an_inclusion_proof_checks_with_the_public_keys_alone(
        nats_server: NatsServer, witness_bus: tuple[Witness, Bus], tmp_path: Path) -> None:
    witness, _ = witness_bus
    state = tmp_path / "state"
    async with checkpointer(nats_server.url, state, every=1000) as (cp, event_log):
        for i in range(7):
            await event_log.append([released_event(i)])
        await cp.checkpoint()
        assert size_of(cp) == 7
    run = gpuledger("audit", "prove", "--seq", "4", "--state-dir", str(state))
    assert run.returncode == 0, run.stderr
    proof = json.loads(run.stdout)
    assert (proof["seq"], proof["size"], proof["event"]["type"]) == (4, 7, "alloc.released")
    proof_file = tmp_path / "proof.json"
    proof_file.write_text(run.stdout)
    node_key = NodeFiles(state).pub.read_text().strip()
    keys = ["--node-key", node_key, "--witness-key", witness.verifier.encode()]
    run = gpuledger("audit", "check-proof", str(proof_file), *keys)
    assert run.returncode == 0 and run.stdout.startswith("OK: seq 4 is in gpuledger/test/node-a at size 7"), run.stdout
    # a proof moved to another seq, or checked against another witness, fails
    proof["seq"], proof["index"] = 5, 4
    proof_file.write_text(json.dumps(proof))
    assert gpuledger("audit", "check-proof", str(proof_file), *keys).returncode == 1
    run = gpuledger("audit", "prove", "--seq", "8", "--state-dir", str(state))
    assert run.returncode == 1 and "not covered" in run.stderr
