"""GPU health: which NVML events are critical, and when an unhealthy GPU may count as healthy again.

Pure logic (time is passed in), so that the policy is tested without a GPU or a clock:

- an XID event is critical unless its code is in the ignored list (by default the application-caused
  XIDs 13, 31, 43, 45, 68 and 109, which NVIDIA's device plugin skips too: a faulting kernel says
  nothing about the GPU); a double-bit (uncorrectable) ECC error is critical; a single-bit
  (corrected) one is only reported;
- an NVML probe that fails (the GPU fell off the bus, "GPU is lost") marks the GPU unhealthy too;
- unlike NVIDIA's plugin, a GPU recovers: once no critical event has arrived for
  ``recovery_seconds`` and ``recovery_checks`` probes in a row have passed, it is healthy again.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from libs.config import parse_xids  # the settings validate the list; the tracker reads it

__all__ = [
    "DEFAULT_IGNORED_XIDS",
    "GpuEvent",
    "HealthTracker",
    "Transition",
    "parse_xids",
]

DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})

XID = "xid"
ECC_DOUBLE = "ecc-double-bit"
ECC_SINGLE = "ecc-single-bit"
QUERY_FAILED = "query-failed"
RECOVERED = "recovered"
EVENT_KINDS = (XID, ECC_DOUBLE, ECC_SINGLE)


class GpuEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One NVML event (or an injected one, with the fake backend)."""

    index: int
    kind: str          # xid | ecc-double-bit | ecc-single-bit
    xid: int = 0
    detail: str = ""


@dataclass(frozen=True)
class Transition:
    """A change of one GPU's health, to be recorded as a ``gpu.health`` event."""

    index: int
    healthy: bool
    reason: str
    xid: int = 0
    detail: str = ""


@dataclass
class _Gpu:
    healthy: bool = True
    last_bad: float = 0.0
    clean: int = 0


class HealthTracker:
    def __init__(self, *, ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS, recovery_seconds: float = 60.0,
                 recovery_checks: int = 3) -> None:
        self.ignored_xids = ignored_xids
        self.recovery_seconds = recovery_seconds
        self.recovery_checks = recovery_checks
        self._gpus: dict[int, _Gpu] = {}

    def _gpu(self, index: int) -> _Gpu:
        return self._gpus.setdefault(index, _Gpu())

    def restore(self, index: int, healthy: bool, now: float) -> None:
        """What the log says at start; an unhealthy GPU's recovery clock starts now."""
        self._gpus[index] = _Gpu(healthy=healthy, last_bad=now if not healthy else 0.0)

    def critical(self, ev: GpuEvent) -> bool:
        if ev.kind == XID:
            return ev.xid not in self.ignored_xids
        return ev.kind == ECC_DOUBLE

    def on_event(self, ev: GpuEvent, now: float) -> Transition | None:
        if not self.critical(ev):
            return None
        return self._bad(ev.index, now, ev.kind, xid=ev.xid, detail=ev.detail)

    def on_probe(self, index: int, error: str | None, now: float) -> Transition | None:
        """One NVML probe of a GPU: ``error`` is None when every query answered."""
        if error is not None:
            return self._bad(index, now, QUERY_FAILED, detail=error)
        gpu = self._gpu(index)
        if gpu.healthy:
            return None
        if now - gpu.last_bad < self.recovery_seconds:
            gpu.clean = 0  # probes count only once the quiet period has passed
            return None
        gpu.clean += 1
        if gpu.clean < self.recovery_checks:
            return None
        gpu.healthy, gpu.clean = True, 0
        return Transition(index, True, RECOVERED,
                          detail=f"{self.recovery_checks} clean probes, no critical event for "
                                 f"{self.recovery_seconds:g}s")

    def _bad(self, index: int, now: float, reason: str, *, xid: int = 0, detail: str = "") -> Transition | None:
        gpu = self._gpu(index)
        gpu.last_bad, gpu.clean = now, 0
        if not gpu.healthy:
            return None  # already unhealthy: only the recovery clock restarts
        gpu.healthy = False
        return Transition(index, False, reason, xid=xid, detail=detail)

    def unhealthy(self) -> list[int]:
        return sorted(i for i, g in self._gpus.items() if not g.healthy)
