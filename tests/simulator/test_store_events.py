"""The emulated API server's pod store hands out copies, and its watch events share the stored
objects instead of copying them: what a caller does with what it got never reaches the store or an
event, and an event keeps the object as it was when it was emitted, whatever comes after."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.store import Event, PodStore


def _pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "labels": {"app": "a"}},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}


def _events(store: PodStore, since: int) -> list[Event]:
    watcher, backlog = store.watch(since)
    store.unwatch(watcher)
    return backlog


def test_an_event_keeps_the_object_as_it_was_emitted() -> None:
    store = PodStore()
    created = store.create(_pod("p"))
    store.update("default", "p", lambda pod: pod["metadata"]["labels"].update(app="b"))
    store.update("default", "p", lambda pod: pod.setdefault("status", {}).update(phase="Running"))
    store.remove("default", "p")

    added, relabelled, running, deleted = _events(store, 0)
    assert [e.type for e in (added, relabelled, running, deleted)] == ["ADDED", "MODIFIED", "MODIFIED", "DELETED"]
    assert added.object["metadata"]["labels"] == {"app": "a"} and "status" not in added.object
    assert relabelled.previous is not None and relabelled.previous["metadata"]["labels"] == {"app": "a"}
    assert relabelled.object["metadata"]["labels"] == {"app": "b"} and "status" not in relabelled.object
    assert running.object["status"] == {"phase": "Running"}
    # each event carries its own resourceVersion, the DELETED one a fresh one
    versions = [int(e.object["metadata"]["resourceVersion"]) for e in (added, relabelled, running, deleted)]
    assert versions == sorted(set(versions)) and versions[0] == int(created["metadata"]["resourceVersion"])


def test_what_a_caller_changes_reaches_neither_the_store_nor_an_event() -> None:
    store = PodStore()
    manifest = _pod("p")
    created = store.create(manifest)
    manifest["metadata"]["labels"]["app"] = "from the manifest"
    created["metadata"]["labels"]["app"] = "from the answer"
    updated = store.update("default", "p", lambda pod: None)
    updated["spec"]["containers"].clear()
    fetched = store.get("default", "p")
    assert fetched is not None
    fetched["metadata"]["labels"]["app"] = "from a get"

    assert store.get("default", "p") == {**fetched, "metadata": {**fetched["metadata"], "labels": {"app": "a"}}}
    for event in _events(store, 0):
        assert event.object["metadata"]["labels"] == {"app": "a"}
        assert event.object["spec"]["containers"] == [{"name": "c", "image": "busybox"}]


def test_a_mutation_that_fails_leaves_the_store_and_its_events_alone() -> None:
    store = PodStore()
    store.create(_pod("p"))

    def half_done(pod: dict[str, Any]) -> None:
        pod["metadata"]["labels"]["app"] = "half"
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        store.update("default", "p", half_done)
    assert (store.peek("default", "p") or {})["metadata"]["labels"] == {"app": "a"}
    (added,) = _events(store, 0)
    assert added.object["metadata"]["labels"] == {"app": "a"}
