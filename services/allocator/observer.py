"""What the allocator tells whoever watches it: how long each Allocate, its steps, and each append took.

Handed to the `Ledger` and the handlers when they are built, so that observing is part of the wiring
and nothing replaces their methods at run time. The default observes nothing; the metrics'
histograms implement it (`services.allocator.metrics.AllocatorMetrics`).
"""

from __future__ import annotations

__all__ = ["AllocatorObserver"]


class AllocatorObserver:
    """Observes nothing; subclasses override what they record. Called on the event loop, must not block."""

    def allocate_done(self, seconds: float, error: BaseException | None) -> None:
        """An Allocate answered ``seconds`` after its receipt (its refusal's record included);
        ``error`` is what it raised, None when it granted."""

    def allocate_hops(self, decide: float, append: float, confirm: float, reply: float) -> None:
        """A granted Allocate's steps, in seconds: ``decide`` from receipt to the event ready to append
        (pod lookup, matching, placement, response), ``append`` the durable append (fsync included),
        ``confirm`` the wait after it for the kubelet's pod-resources List that confirms a pod taken
        before the List answered (0 when it had answered by then), ``reply`` from there to the reply
        handed to the bus (encode, publish)."""

    def pod_found(self, via: str) -> None:
        """A granted Allocate's pod was found ``via`` "notification" (our copy of the watchdog's),
        "fetched" (by name, the kubelet listing it before its notification came) or "listed" (the
        watchdog's lists, once the short wait was over)."""

    def kubelet_listed(self, reason: str) -> None:
        """The allocator asked the kubelet's pod-resources List (rate-limited by the kubelet: 100 a
        second, 10 at once) ``reason``: "allocate", "prestart", "release", "verify" (a grant checked
        shortly after its reply), "reconcile" (the periodic check), "room" (holders gone from the
        node, looked for before a refusal)."""

    def checkpoint_settled(self, count: int) -> None:
        """``count`` grants settled from the kubelet's checkpoint file, each sparing a List."""

    def append_done(self, seconds: float) -> None:
        """Events were appended to the log in ``seconds`` (durable on return), or the append failed."""
