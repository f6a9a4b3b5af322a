"""Where gpuledger's slowest Allocates spent their time, one request at a time, from the services' own logs.

The per-hop histograms (bench/allocate_rtt.py) give each hop's distribution, but not whether the slow
Allocates are slow in the same hop. The registrar's ``allocated`` line and the allocator's ``granted``
line of one Allocate share its ``request_id``; joined, they split the registrar's time into:

- ``check``: the registrar's wait, after the allocator's reply, for the kubelet's List it asked at once;
- ``append``: the allocator's fsync'd append;
- ``allocator other``: the rest of the allocator's handling (finding the pod, deciding, confirming);
- ``bus and loops``: the registrar's wait for the reply less the allocator's handling: the two NATS hops
  each way and the turns of both event loops.

The Allocates are ordered by the registrar's total (its wait for the reply plus ``check``); the slowest
``share`` of them is compared with the faster half. The phase's warm-up Allocates are among them (the
logs do not tell them apart; 100 of the 4,100 in a default run). The kubelet's own gRPC call to the
registrar is not in these lines (it is the bare plugin's floor).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path

LEGS = ("registrar total", "check", "append", "allocator other", "bus and loops")


def log_size(path: Path) -> int:
    """Where the next line will start (0 when the file is not there yet)."""
    return path.stat().st_size if path.exists() else 0


def read_events(path: Path, start: int, end: int, event: str) -> dict[str, dict[str, object]]:
    """The JSON lines of ``event`` between byte offsets ``start`` and ``end``, by request id."""
    if not path.exists():
        return {}
    with path.open("rb") as f:
        f.seek(start)
        chunk = f.read(max(0, end - start))
    return by_request(chunk.decode(errors="replace").splitlines(), event)


def by_request(lines: Iterable[str], event: str) -> dict[str, dict[str, object]]:
    out = {}
    for line in lines:
        if not line.startswith("{"):
            continue  # a library's plain line, or one cut at the phase's edge
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event and isinstance(entry.get("request_id"), str):
            out[entry["request_id"]] = entry
    return out


def legs(registrar: dict[str, dict[str, object]], allocator: dict[str, dict[str, object]]) -> list[dict[str, float]]:
    """One row per Allocate that both services logged: each leg in ms."""
    rows = []
    for request_id, reg in registrar.items():
        alloc = allocator.get(request_id)
        if alloc is None:
            continue
        try:
            waited, check = float(reg["allocator_ms"]), float(reg.get("check_ms", 0.0))  # type: ignore[arg-type]
            handled, append = float(alloc["total_ms"]), float(alloc.get("append_ms", 0.0))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):
            continue
        rows.append({"registrar total": waited + check, "check": check, "append": append,
                     "allocator other": max(0.0, handled - append), "bus and loops": max(0.0, waited - handled)})
    return rows


def tail_table(rows: list[dict[str, float]], share: float = 0.02) -> list[dict[str, object]]:
    """Mean of each leg over the faster half and over the slowest ``share``, and the difference: what
    made the slow ones slow. [] when there are too few Allocates to have a tail."""
    ordered = sorted(rows, key=lambda r: r["registrar total"])
    n = len(ordered)
    slow_n = int(n * share)
    if slow_n < 2:
        return []
    fast, slow = ordered[: n // 2], ordered[n - slow_n:]
    table = []
    for leg in LEGS:
        f, s = statistics.fmean(r[leg] for r in fast), statistics.fmean(r[leg] for r in slow)
        table.append({"leg": leg, "fast_half_ms": round(f, 3), "slowest_ms": round(s, 3), "added_ms": round(s - f, 3)})
    return table


def phase_tail(log_dir: Path, marks: dict[str, tuple[int, int]], share: float = 0.02) -> dict[str, object]:
    """The tail table of one phase: ``marks`` holds each service's log offsets at its start and end."""
    registrar = read_events(log_dir / "registrar.log", *marks["registrar"], "allocated")
    allocator = read_events(log_dir / "allocator.log", *marks["allocator"], "granted")
    rows = legs(registrar, allocator)
    return {"joined": len(rows), "share": share, "legs": tail_table(rows, share),
            "appends_ms": [r["append"] for r in rows]}
