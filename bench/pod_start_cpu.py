"""CPU time inside each pod's timed window (``bench.pod_start --cpu``): per watched process, from the
per-thread ``/proc/<pid>/task/*/schedstat`` (nanoseconds on a CPU), and for the whole machine from
``/proc/stat`` (clock ticks, 10 ms: only its mean over many pods says anything). Not bench/footprint.py's
``cpu_seconds``: ``/proc/<pid>/stat`` counts in those ticks too, coarser than a window of a few ms.

Means, not medians: the machine's ticks are too coarse for a median, and means add up (a process's
extra CPU for a GPU pod is the difference of two means). A thread that ends inside a window takes
its time with it, which only undercounts.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from pathlib import Path

MACHINE = "machine"


def process_cpu_ns(pid: int) -> int:
    """Nanoseconds the process's threads that are alive now have run; 0 when it is gone."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended between the listing and the read
    return total


def machine_cpu_ns() -> int:
    """Nanoseconds all CPUs were busy (not idle, not waiting for I/O) since boot."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(f) for f in fields]
    busy = sum(ticks) - ticks[3] - ticks[4]  # idle, iowait
    return busy * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


class CpuMeter:
    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self._start: dict[str, int] = {}
        self.windows: dict[str, list[dict[str, float]]] = defaultdict(list)  # kind -> per pod {name: ms}

    def watch(self, name: str, pid: int | None) -> None:
        if pid:
            self.pids[name] = pid

    def _read(self) -> dict[str, int]:
        now = {name: process_cpu_ns(pid) for name, pid in self.pids.items()}
        now[MACHINE] = machine_cpu_ns()
        return now

    def begin(self) -> None:
        self._start = self._read()

    def end(self, kind: str) -> None:
        if not self._start:
            return  # no begin since the last end: no window to record
        now = self._read()
        self.windows[kind].append({k: (now[k] - self._start[k]) / 1e6 for k in now})
        self._start = {}

    def table(self) -> dict[str, dict[str, float]]:
        """kind -> {process: mean ms per pod}, the machine last."""
        out = {}
        for kind, rows in self.windows.items():
            names = [n for n in rows[0] if n != MACHINE] + [MACHINE]
            out[kind] = {n: round(statistics.fmean(r[n] for r in rows), 2) for n in names}
        return out
