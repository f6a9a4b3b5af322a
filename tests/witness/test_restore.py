"""A ledger rebuilt from the node's own JetStream stream, checked against the hash chain and the cosigned
checkpoint: the allocator's store accepts it and goes on; a copy that differs from the witnessed log is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from libs.bus import Bus, Relay
from libs.bus.server import NatsServer
from libs.errors import StoreError
from libs.events.codec import EventRecord
from libs.ledger.snapshot import load_state
from libs.store import EventLog
from libs.store.verify import verify_log
from libs.witness import Witness
from libs.witness.audit import verify_against_witness
from libs.witness.files import NodeFiles, load_or_create_key
from libs.witness.node import Checkpointer, origin_of
from libs.witness.restore import install_witness_files, restore_ledger
from tests.builders import released_event
from tests.polling import eventually

ORIGIN = origin_of("test", "node-a")


async def test_a_ledger_restored_from_the_stream_is_accepted_and_goes_on(
        nats_server: NatsServer, witness_bus: tuple[Witness, Bus], tmp_path: Path) -> None:
    witness, _ = witness_bus
    state = tmp_path / "state"
    bus = await Bus.connect(nats_server.url, name="allocator", node="node-a", wait=5)
    event_log = await EventLog.open(state / "ledger.sqlite")
    files = NodeFiles(state)
    cp = Checkpointer(bus, event_log, files, load_or_create_key(files.key, ORIGIN), origin=ORIGIN, every=1000,
                      interval=30, timeout=2)
    relay = Relay(bus, event_log)
    tasks = [asyncio.create_task(cp.run()), asyncio.create_task(relay.run())]
    try:
        await eventually(lambda: cp._started, timeout=10, interval=0.02, what="the checkpointer started")
        for i in range(25):
            await event_log.append([released_event(i)], command_id=f"cmd-{i}" if i % 2 else None)
            if i == 19:
                await cp.checkpoint()  # cosigned at 20; the last 5 events are not witnessed yet
        await relay.wait_published(25, timeout=10)
        records = []
        for seq in range(1, 26):
            msg = await bus.js.get_msg(bus.subjects.stream, seq)
            records.append(msgspec.json.decode(msg.data, type=EventRecord))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await event_log.close()
        await bus.close()
    note = files.latest_cosigned()
    assert note is not None

    fresh = tmp_path / "restored"
    fresh.mkdir()
    report = restore_ledger(records, fresh / "ledger.sqlite", checkpoint=note, witness_key=witness.verifier,
                            node_key=files.node_verifier())
    assert (report.events, report.witnessed_size) == (25, 20)
    assert verify_log(fresh / "ledger.sqlite").head_hash == verify_log(state / "ledger.sqlite").head_hash
    install_witness_files(fresh, note, witness.verifier)
    assert verify_against_witness(fresh / "ledger.sqlite", NodeFiles(fresh), witness_key=witness.verifier).ok
    # the allocator's store takes it as its own: replays it and appends after it
    restored = load_state(fresh / "ledger.sqlite")
    assert restored.state.seq == 25
    reopened = await EventLog.open(fresh / "ledger.sqlite")
    try:
        assert (await reopened.append([released_event(25)]))[0].seq == 26
    finally:
        await reopened.close()
    assert verify_log(fresh / "ledger.sqlite").ok

    # a copy with an altered, a missing or a short witnessed history is refused, and nothing is written
    altered = list(records)
    altered[6] = msgspec.structs.replace(altered[6], command_id="forged")
    with pytest.raises(StoreError, match="do not give the root the witness cosigned"):
        restore_ledger(altered, tmp_path / "a.sqlite", checkpoint=note, witness_key=witness.verifier)
    with pytest.raises(StoreError, match="seq 7 is missing"):
        restore_ledger(records[:6] + records[7:], tmp_path / "b.sqlite", checkpoint=note, witness_key=witness.verifier)
    with pytest.raises(StoreError, match="events are missing"):
        restore_ledger(records[:15], tmp_path / "c.sqlite", checkpoint=note, witness_key=witness.verifier)
    with pytest.raises(StoreError, match="exists"):
        restore_ledger(records, fresh / "ledger.sqlite", checkpoint=note, witness_key=witness.verifier)
    assert not any((tmp_path / name).exists() for name in ("a.sqlite", "b.sqlite", "c.sqlite"))
