"""CPU time inside each pod's timed window (``bench.pod_start --cpu``): per watched process, from the
per-thread ``/proc/<pid>/task/*/schedstat`` (nanoseconds on a CPU), and for the whole machine from
``/proc/stat`` (clock ticks, 10 ms: only its mean over many pods says anything). Not bench/footprint.py's
``cpu_seconds``: ``/proc/<pid>/stat`` counts in those ticks too, coarser than a window of a few ms.

Means, not medians: the machine's ticks are too coarse for a median, and means add up (a process's
extra CPU for a GPU pod is the difference of two means). A thread that ends inside a window takes
its time with it, which only undercounts.

``wrap_step`` (``bench.pod_start --cpu-steps``) also splits a window by the step of the pod start each
part of it fell in, to tell which step the services' CPU competes with. Each wrapped call reads
every watched process twice, in the bench's own process: about 2 ms a read here (containerd's and
grpcio's threads are many), so the start times of such a run are not the goal's.
"""

from __future__ import annotations

import functools
import itertools
import os
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
        self._in_steps: dict[str, dict[str, int]] | None = None  # the open window's: step -> {name: ns}
        self._calls: dict[int, tuple[str, dict[str, int]]] = {}  # the window's step calls running: step, reads at entry
        self._call_ids = itertools.count()
        # kind -> per pod {step: {name: ms}}
        self.steps: dict[str, list[dict[str, dict[str, float]]]] = defaultdict(list)

    def watch(self, name: str, pid: int | None) -> None:
        if pid:
            self.pids[name] = pid

    def _read(self) -> dict[str, int]:
        now = {name: process_cpu_ns(pid) for name, pid in self.pids.items()}
        now[MACHINE] = machine_cpu_ns()
        return now

    def wrap_step(self, owner: Any, attr: str, step: str) -> None:
        """Count what each watched process (and the machine) spends during ``owner.attr``, an async
        method patched in place, as ``step`` of the open window; a pod's calls of one step add up.
        A call begun outside a window is not counted; one still running when its window ends is
        counted up to that end (the plain pod's StartContainer: its container ends the window first)."""
        original: Callable[..., Any] = getattr(owner, attr)

        @functools.wraps(original)
        async def counted(*args: Any, **kwargs: Any) -> Any:
            if self._in_steps is None:
                return await original(*args, **kwargs)
            call = next(self._call_ids)
            self._calls[call] = (step, self._read())
            try:
                return await original(*args, **kwargs)
            finally:
                entered = self._calls.pop(call, None)  # None: its window ended and counted it
                if entered is not None:
                    self._charge(*entered, self._read())

        setattr(owner, attr, counted)

    def _charge(self, step: str, before: dict[str, int], after: dict[str, int]) -> None:
        assert self._in_steps is not None
        spent = self._in_steps.setdefault(step, {})
        for name, ns in after.items():
            spent[name] = spent.get(name, 0) + ns - before[name]

    def begin(self) -> None:
        self._start = self._read()
        self._in_steps = {}

    def end(self, kind: str) -> None:
        if not self._start:
            return  # no begin since the last end: no window to record
        now = self._read()
        self.windows[kind].append({k: (now[k] - self._start[k]) / 1e6 for k in now})
        for step, before in self._calls.values():
            self._charge(step, before, now)
        self._calls.clear()
        self.steps[kind].append({step: {n: ns / 1e6 for n, ns in spent.items()}
                                 for step, spent in (self._in_steps or {}).items()})
        self._start = {}
        self._in_steps = None

    def table(self) -> dict[str, dict[str, float]]:
        """kind -> {process: mean ms per pod}, the machine last."""
        out = {}
        for kind, rows in self.windows.items():
            names = [n for n in rows[0] if n != MACHINE] + [MACHINE]
            out[kind] = {n: round(statistics.fmean(r[n] for r in rows), 2) for n in names}
        return out

    def step_table(self) -> dict[str, dict[str, dict[str, float]]]:
        """kind -> step -> {process: mean ms per pod}, the machine last; a pod that did not take a
        step counts as 0 there. Empty when no step was wrapped."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        names = [*self.pids, MACHINE]
        for kind, pods in self.steps.items():
            taken = sorted({step for pod in pods for step in pod})
            if taken:
                out[kind] = {step: {n: round(statistics.fmean(pod.get(step, {}).get(n, 0.0) for pod in pods), 2)
                                    for n in names}
                             for step in taken}
        return out
