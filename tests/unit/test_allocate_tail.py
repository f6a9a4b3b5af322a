"""bench/allocate_tail.py: the registrar's and the allocator's log lines of one Allocate joined, and the
slowest Allocates split leg by leg."""

from __future__ import annotations

import json
from pathlib import Path

from bench.allocate_tail import by_request, legs, log_size, phase_tail, read_events, tail_table


def _registrar(rid: str, allocator_ms: float, check_ms: float) -> str:
    return json.dumps({"request_id": rid, "allocator_ms": allocator_ms, "check_ms": check_ms, "event": "allocated",
                       "service": "registrar", "level": "info"})


def _allocator(rid: str, total_ms: float, append_ms: float) -> str:
    return json.dumps({"request_id": rid, "total_ms": total_ms, "append_ms": append_ms, "event": "granted",
                       "service": "allocator", "level": "info"})


def test_one_allocate_is_split_into_its_legs() -> None:
    reg = by_request([_registrar("a", 5.0, 0.5)], "allocated")
    alloc = by_request([_allocator("a", 3.0, 1.2)], "granted")
    (row,) = legs(reg, alloc)
    assert row == {"registrar total": 5.5, "check": 0.5, "append": 1.2, "allocator other": 1.8,
                   "bus and loops": 2.0}


def test_lines_of_other_events_requests_and_plain_text_are_left_out() -> None:
    lines = ["registrar grpc WARNING something", "{not json", _registrar("a", 5.0, 0.1),
             json.dumps({"request_id": "b", "event": "request refused"}), json.dumps({"event": "allocated"})]
    assert list(by_request(lines, "allocated")) == ["a"]
    # an Allocate only one service logged is not joined
    assert legs(by_request(lines, "allocated"), by_request([_allocator("z", 1.0, 0.5)], "granted")) == []


def test_the_slowest_are_told_apart_by_the_leg_that_made_them_slow() -> None:
    rows = []
    for i in range(98):  # ordinary: 3 ms, half of it the append
        rows.append({"registrar total": 3.0 + i / 1000, "check": 0.1, "append": 1.5, "allocator other": 0.4,
                     "bus and loops": 1.0})
    for _ in range(2):  # slow: the append took 10 ms more
        rows.append({"registrar total": 13.0, "check": 0.1, "append": 11.5, "allocator other": 0.4,
                     "bus and loops": 1.0})
    table = {r["leg"]: r for r in tail_table(rows, share=0.02)}
    assert table["append"]["added_ms"] == 10.0
    assert table["registrar total"]["added_ms"] > 9.9
    assert table["check"]["added_ms"] == table["bus and loops"]["added_ms"] == 0.0
    assert tail_table(rows[:50], share=0.02) == []  # one Allocate is no tail


def test_a_phase_reads_only_its_own_lines(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    reg, alloc = logs / "registrar.log", logs / "allocator.log"
    assert log_size(reg) == 0
    reg.write_text(_registrar("before", 50.0, 0.0) + "\n")
    alloc.write_text(_allocator("before", 40.0, 30.0) + "\n")
    starts = {"registrar": log_size(reg), "allocator": log_size(alloc)}
    with reg.open("a") as r, alloc.open("a") as a:
        for i in range(200):
            r.write(_registrar(f"r{i}", 20.0 if i < 4 else 3.0, 0.1) + "\n")
            a.write(_allocator(f"r{i}", 14.0 if i < 4 else 2.0, 12.0 if i < 4 else 1.0) + "\n")
    marks = {"registrar": (starts["registrar"], log_size(reg)), "allocator": (starts["allocator"], log_size(alloc))}
    assert "before" not in read_events(reg, *marks["registrar"], "allocated")
    tail = phase_tail(logs, marks, share=0.02)
    assert tail["joined"] == 200
    legs_by_name = {r["leg"]: r for r in tail["legs"]}  # type: ignore[union-attr]
    assert legs_by_name["append"]["slowest_ms"] == 12.0
    assert legs_by_name["bus and loops"]["slowest_ms"] == 6.0
    assert legs_by_name["allocator other"]["slowest_ms"] == 2.0
    # every joined grant's append, to be set beside the durable floor's
    assert sorted(tail["appends_ms"]) == [1.0] * 196 + [12.0] * 4  # type: ignore[arg-type]
