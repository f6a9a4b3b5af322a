"""The bus's pace of reconnect attempts after losing the broker (libs/bus/client.py): short while a
restarted broker is due back, then backing off, and quiet in the log meanwhile."""

from __future__ import annotations

import pytest

from libs.bus import client
from libs.bus.client import RECONNECT_FAST_FOR_S, RECONNECT_FAST_S, RECONNECT_LOG_EVERY_S, RECONNECT_MAX_WAIT_S


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(client.time, "monotonic", c)
    return c


def test_attempts_are_quick_at_first_then_back_off_to_the_cap(clock: Clock) -> None:
    outage = client._Outage()
    outage.begin()
    quick = []
    while clock.now - 1000.0 < RECONNECT_FAST_FOR_S:
        quick.append(outage.next_wait())
        clock.now += quick[-1]
    assert set(quick) == {RECONNECT_FAST_S}
    later = []
    for _ in range(10):
        later.append(outage.next_wait())
        clock.now += later[-1]
    assert later[0] == 2 * RECONNECT_FAST_S and later == sorted(later) and later[-1] == RECONNECT_MAX_WAIT_S
    outage.end()
    outage.begin()  # the next outage starts quick again
    assert outage.next_wait() == RECONNECT_FAST_S


def test_one_log_line_per_period_while_the_broker_stays_away(clock: Clock) -> None:
    outage = client._Outage()
    outage.begin()  # the disconnect itself was logged
    logged = 0
    for _ in range(80):  # 20 s of attempts, every 0.25 s (exact in binary)
        clock.now += 0.25
        logged += outage.should_log()
    assert logged == int(20 / RECONNECT_LOG_EVERY_S)
