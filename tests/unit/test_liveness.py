"""The liveness rules behind "never refused for room that only dead pods hold": positive evidence only."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from services.allocator.liveness import decide_gone
from services.allocator.podresources import KubeletRecord


def state(*pods: tuple[str, str]) -> Any:
    allocs = {f"a{i}": SimpleNamespace(pod_uid=uid, namespace="default", pod_name=name)
              for i, (uid, name) in enumerate(pods)}
    return SimpleNamespace(allocations=allocs)


def listing(*names: str) -> KubeletRecord:
    return KubeletRecord(holders={}, containers={("default", n): {"c": True} for n in names})


def cached(**phases: str) -> dict[str, Any]:
    return {uid: SimpleNamespace(status=SimpleNamespace(phase=p)) for uid, p in phases.items()}


def test_a_holder_the_kubelet_no_longer_lists_is_gone() -> None:
    assert decide_gone(state(("u1", "a"), ("u2", "b")), listing("a", "new"), {}) == ["u2"]


def test_a_stale_cache_does_not_keep_a_pod_the_kubelet_dropped_alive() -> None:
    assert decide_gone(state(("u1", "a")), listing("new"), cached(u1="Running")) == ["u1"]


def test_without_the_kubelet_only_a_terminated_pod_in_the_cache_is_gone() -> None:
    assert decide_gone(state(("u1", "a"), ("u2", "b"), ("u3", "c")), None, cached(u1="Succeeded", u2="Running")) \
        == ["u1"]  # u3: missing from the cache proves nothing


def test_neither_source_answering_releases_nothing() -> None:
    assert decide_gone(state(("u1", "a")), None, {}) == []


def test_an_empty_listing_is_not_believed() -> None:
    """A kubelet that just restarted lists nothing until it has synced: that is no proof of death."""
    assert decide_gone(state(("u1", "a")), listing(), {}) == []
