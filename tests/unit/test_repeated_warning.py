"""RepeatedWarning: a warning whose cause comes and goes is written at once, then at most once a period,
each later line saying how many occurrences it stands for."""

from __future__ import annotations

from typing import Any

from libs.logger import RepeatedWarning


class _Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


def test_first_at_once_then_at_most_once_a_period_with_counts() -> None:
    now = [100.0]
    log = _Lines()
    warn = RepeatedWarning(log, "the kubelet's List failed", every=60.0, clock=lambda: now[0])
    assert warn(error="RESOURCE_EXHAUSTED") is True
    assert log.lines == [("the kubelet's List failed", {"error": "RESOURCE_EXHAUSTED"})]
    for _ in range(9):  # many more within the period: counted, not written
        now[0] += 1.0
        assert warn(error="RESOURCE_EXHAUSTED") is False
    assert len(log.lines) == 1 and warn.occurrences == 10
    now[0] = 160.0  # a period after the line written
    assert warn(error="UNAVAILABLE") is True
    assert log.lines[-1] == ("the kubelet's List failed", {"error": "UNAVAILABLE", "occurrences": 11, "left_out": 9})
    now[0] = 500.0  # long after: written at once again, none left out since
    assert warn(error="x") is True
    assert log.lines[-1][1] == {"error": "x", "occurrences": 12, "left_out": 0}
    assert len(log.lines) == 3


def test_successes_in_between_do_not_start_a_new_series() -> None:
    """The old rule (warn again after every success) wrote a line per failure when a kubelet past
    its rate limit rejected every other List; this writes one a period whatever the pattern."""
    now = [0.0]
    log = _Lines()
    warn = RepeatedWarning(log, "e", every=60.0, clock=lambda: now[0])
    for _ in range(100):  # fail, succeed, fail, ... 20 a second for 5 s: the caller does nothing on success
        warn()
        now[0] += 0.05
    assert len(log.lines) == 1 and warn.occurrences == 100
