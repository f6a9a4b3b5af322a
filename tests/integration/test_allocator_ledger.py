"""The allocator's Ledger on a real SQLite log: decide under the lock, append, fold, return the stored events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from libs.events.schema import AllocationRefused, Event
from libs.ledger.state import LedgerState
from libs.store import EventLog
from services.allocator.ledger import Ledger
from services.allocator.observer import AllocatorObserver


def refused(request_id: str) -> AllocationRefused:
    return AllocationRefused(request_id=request_id, resource="tencent.com/vcuda-core", device_count=1, reason="test")


class Appends(AllocatorObserver):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def append_done(self, seconds: float) -> None:
        self.seconds.append(seconds)


@pytest.fixture
async def event_log(tmp_path: Path) -> AsyncIterator[EventLog]:
    opened = await EventLog.open(tmp_path / "ledger.sqlite")
    yield opened
    await opened.close()


async def test_record_appends_folds_and_returns_the_stored_events(event_log: EventLog) -> None:
    appends = Appends()
    ledger = Ledger(event_log, LedgerState(), observer=appends)
    stored = await ledger.record_events([refused("a"), refused("b")], command_id="cmd")
    assert [s.seq for s in stored] == [1, 2] and [s.command_id for s in stored] == ["cmd", "cmd"]
    assert event_log.last_seq == 2 and ledger.state.seq == 2 and ledger.state.refusals == 2
    assert len(appends.seconds) == 1 and appends.seconds[0] >= 0
    replayed = LedgerState()
    await event_log.replay(replayed.apply)
    assert replayed.snapshot() == ledger.state.snapshot()


async def test_nothing_decided_or_a_refused_decision_records_nothing(event_log: EventLog) -> None:
    appends = Appends()
    ledger = Ledger(event_log, LedgerState(), observer=appends)
    assert await ledger.record(lambda _state: []) == []

    def refuse(_state: LedgerState) -> list[Event]:
        raise ValueError("no room")

    with pytest.raises(ValueError, match="no room"):
        await ledger.record(refuse)
    assert event_log.last_seq == 0 and ledger.state.seq == 0 and appends.seconds == []
    # The lock was let go: the next change is recorded.
    assert [s.seq for s in await ledger.record_events([refused("after")])] == [1]


async def test_each_decision_sees_every_change_recorded_before_it(event_log: EventLog) -> None:
    ledger = Ledger(event_log, LedgerState())

    async def decide(state: LedgerState) -> list[Event]:
        seen = state.refusals
        await asyncio.sleep(0.01)  # another writer's turn, were the decision not under the lock
        return [refused(f"after-{seen}")]

    results = await asyncio.wait_for(asyncio.gather(*(ledger.record(decide) for _ in range(5))), 10)
    ids = sorted(r[0].event.request_id for r in results)  # type: ignore[union-attr]
    assert ids == [f"after-{n}" for n in range(5)]
