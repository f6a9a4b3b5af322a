"""The health policy as pure logic: which events are critical, when a GPU recovers."""

from __future__ import annotations

import pytest

from libs.gpu.health import DEFAULT_IGNORED_XIDS, GpuEvent, HealthTracker, parse_xids


def xid(code: int, gpu: int = 0) -> GpuEvent:
    return GpuEvent(index=gpu, kind="xid", xid=code)


def test_parse_xids() -> None:
    assert parse_xids("13,31, 43 ;45") == {13, 31, 43, 45}
    assert parse_xids("") == frozenset()
    with pytest.raises(ValueError, match="'x1' is not a number"):
        parse_xids("13,x1")
    with pytest.raises(ValueError, match="negative"):
        parse_xids("-4")


def test_application_xids_are_ignored_and_others_are_critical() -> None:
    t = HealthTracker()
    for code in sorted(DEFAULT_IGNORED_XIDS):
        assert t.on_event(xid(code), now=0) is None
    tr = t.on_event(xid(79, gpu=2), now=1)
    assert tr is not None and (tr.index, tr.healthy, tr.reason, tr.xid) == (2, False, "xid", 79)
    assert t.on_event(xid(48, gpu=2), now=2) is None  # already unhealthy: no second transition
    assert t.unhealthy() == [2]


def test_ecc_double_bit_is_critical_single_bit_is_not() -> None:
    t = HealthTracker()
    assert t.on_event(GpuEvent(index=0, kind="ecc-single-bit"), now=0) is None
    tr = t.on_event(GpuEvent(index=0, kind="ecc-double-bit"), now=0)
    assert tr is not None and tr.reason == "ecc-double-bit"


def test_configured_ignore_list_replaces_the_default() -> None:
    t = HealthTracker(ignored_xids=frozenset({79}))
    assert t.on_event(xid(79), now=0) is None
    assert t.on_event(xid(13), now=0) is not None


def test_recovery_needs_quiet_time_then_consecutive_clean_probes() -> None:
    t = HealthTracker(recovery_seconds=10, recovery_checks=3)
    t.on_event(xid(79), now=0)
    assert t.on_probe(0, None, now=5) is None          # still within the quiet period
    assert t.on_probe(0, None, now=10) is None         # 1 clean
    assert t.on_probe(0, None, now=11) is None         # 2 clean
    assert t.on_event(xid(79), now=12) is None         # a new critical event: the clock restarts
    assert t.on_probe(0, None, now=21) is None         # quiet period not over (12 + 10)
    assert t.on_probe(0, None, now=22) is None         # 1
    assert t.on_probe(0, "GPU is lost", now=23) is None  # a failed probe resets the count
    assert t.on_probe(0, None, now=33) is None         # 1
    assert t.on_probe(0, None, now=34) is None         # 2
    tr = t.on_probe(0, None, now=35)                   # 3: healthy again
    assert tr is not None and tr.healthy and tr.reason == "recovered"
    assert t.unhealthy() == []


def test_failing_probe_marks_a_healthy_gpu_unhealthy() -> None:
    t = HealthTracker()
    assert t.on_probe(1, None, now=0) is None
    tr = t.on_probe(1, "Unknown Error", now=1)
    assert tr is not None and (tr.healthy, tr.reason, tr.detail) == (False, "query-failed", "Unknown Error")


def test_restored_unhealthy_gpu_recovers_from_the_restart_time() -> None:
    t = HealthTracker(recovery_seconds=5, recovery_checks=1)
    t.restore(0, healthy=False, now=100)
    assert t.unhealthy() == [0]
    assert t.on_probe(0, None, now=104) is None
    assert t.on_probe(0, None, now=105) is not None
