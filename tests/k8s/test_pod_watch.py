"""The watchdog's pod source (list + watch via lightkube) over real HTTP against the simulator's API,
including the faults a real API server produces: a dropped watch, a 410 Gone, an outage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from libs.kube.pods import Pod
from libs.kube.source import PodSource, make_client
from simulator import NodeSimulator, SimConfig
from tests.builders import ctr, pod_manifest
from tests.polling import eventually


@dataclass
class Recorder:
    seen: list[tuple[str, str]] = field(default_factory=list)  # (kind, pod name)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, kind: str, old: Pod | None, new: Pod | None) -> None:
        pod = new or old
        assert pod is not None
        self.seen.append((kind, pod.metadata.name))
        self.changed.set()

    async def wait_for(self, check: Callable[[], bool], timeout: float = 15) -> None:
        async with asyncio.timeout(timeout):
            while not check():
                self.changed.clear()
                await self.changed.wait()


@dataclass
class Watched:
    sim: NodeSimulator
    source: PodSource
    events: Recorder


@pytest.fixture
async def watched(short_dir: Path) -> AsyncIterator[Watched]:
    cfg = SimConfig(device_plugin_dir=short_dir / "dp", kubeconfig_path=short_dir / "kubeconfig",
                    node_name="n1", bookmark_interval=0.3)
    async with NodeSimulator(cfg) as sim:
        client = make_client(str(cfg.kubeconfig_path))
        events = Recorder()
        source = PodSource(client, "n1")
        task = asyncio.create_task(source.run(events))
        try:
            await asyncio.wait_for(source.synced.wait(), 10)
            yield Watched(sim, source, events)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()


async def _post(sim: NodeSimulator, path: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http, \
            http.post(sim.api_url + path) as resp:
        resp.raise_for_status()
        return await resp.json()


async def test_only_this_nodes_pods_and_bookmarks_advance_the_version(watched: Watched) -> None:
    sim, source, events = watched.sim, watched.source, watched.events
    await sim.create_pod(pod_manifest("mine", [ctr("c")]))
    other = pod_manifest("elsewhere", [ctr("c")])
    other["spec"]["nodeName"] = "n2"
    await sim.create_pod(other)
    await events.wait_for(lambda: ("ADDED", "mine") in events.seen)
    before = source.bookmarks
    await eventually(lambda: source.bookmarks >= before + 2, timeout=5, interval=0.05, what="two more bookmarks")
    assert source.resource_version == str(sim.store.resource_version)
    assert all(name != "elsewhere" for _, name in events.seen)
    assert {p.metadata.name for p in source.pods.values()} == {"mine"}


async def test_a_dropped_watch_resumes_from_its_version_without_listing(watched: Watched) -> None:
    sim, source, events = watched.sim, watched.source, watched.events
    await sim.create_pod(pod_manifest("a", [ctr("c")]))
    await events.wait_for(lambda: ("ADDED", "a") in events.seen)
    assert (await _post(sim, "/simulator/v1/faults/drop-watches"))["dropped"] == 1
    await sim.delete_pod("default", "a")
    await events.wait_for(lambda: ("DELETED", "a") in events.seen)
    assert source.relists == 1 and source.resumes >= 1 and source.expired == 0
    assert events.seen.count(("ADDED", "a")) == 1  # resumed, not replayed from scratch


async def test_a_410_lists_again_and_reports_what_was_missed(watched: Watched) -> None:
    sim, source, events = watched.sim, watched.source, watched.events
    await sim.create_pod(pod_manifest("old", [ctr("c")]))
    await events.wait_for(lambda: ("ADDED", "old") in events.seen)
    await sim.stop_api()  # the watch is cut and cannot come back yet
    await sim.delete_pod("default", "old")
    await sim.create_pod(pod_manifest("new", [ctr("c")]))
    sim.store.expire_history()  # ...and what happened meanwhile is compacted away
    await sim.start_api()
    await events.wait_for(lambda: ("DELETED", "old") in events.seen and ("ADDED", "new") in events.seen)
    assert source.expired >= 1 and source.relists == 2
    assert {p.metadata.name for p in source.pods.values()} == {"new"}


async def test_the_410_comes_through_the_http_fault_endpoints_too(watched: Watched) -> None:
    sim, source, events = watched.sim, watched.source, watched.events
    await sim.create_pod(pod_manifest("x", [ctr("c")]))
    await events.wait_for(lambda: ("ADDED", "x") in events.seen)
    await _post(sim, "/simulator/v1/faults/outage?seconds=1")
    # The outage begins in the background.
    await eventually(lambda: not sim.api_serving, timeout=5, interval=0.01, what="the API outage beginning")
    await sim.delete_pod("default", "x")
    sim.store.expire_history()
    await events.wait_for(lambda: ("DELETED", "x") in events.seen)
    assert source.expired >= 1


async def test_an_api_server_down_for_a_while_is_retried_with_backoff(watched: Watched) -> None:
    sim, source, events = watched.sim, watched.source, watched.events
    await sim.stop_api()
    await sim.create_pod(pod_manifest("while-down", [ctr("c")]))
    await asyncio.sleep(3)  # several failed attempts, backing off
    assert ("ADDED", "while-down") not in events.seen
    await sim.start_api()
    await events.wait_for(lambda: ("ADDED", "while-down") in events.seen, timeout=15)
    assert source.resumes >= 1


async def test_without_kubeconfig_option_the_environment_is_used(watched: Watched, monkeypatch) -> None:
    """No --kubeconfig: lightkube's in-cluster service account, else $KUBECONFIG (here: no service account)."""
    from lightkube.config.kubeconfig import SERVICE_ACCOUNT

    assert not Path(SERVICE_ACCOUNT).exists()
    assert watched.sim.cfg.kubeconfig_path is not None
    monkeypatch.setenv("KUBECONFIG", str(watched.sim.cfg.kubeconfig_path))
    await watched.sim.create_pod(pod_manifest("env", [ctr("c")]))
    client = make_client("")
    try:
        pods = await PodSource(client, "n1").list_fresh()
    finally:
        await client.close()
    assert [p.metadata.name for p in pods] == ["env"]
