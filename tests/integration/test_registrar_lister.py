"""The registrar's kubelet List (services/registrar/kubeletlist.py) against the simulated kubelet's real
pod-resources server, past its rate limit: each rejected List is counted (the registrar's /metrics
shows how many grants went unchecked), sent on to the allocator as failed, and warned about once,
not once per rejection: the kubelet answering every other List (as at the Allocate benchmark's pace
in a fast hour, where the warning that started again after each answered List wrote 115 lines in
seconds) makes one line."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from libs.bus.client import Bus
from libs.bus.server import NatsServer
from libs.commands import KubeletListing
from services.registrar.kubeletlist import KubeletLister
from simulator import NodeSimulator, SimConfig


async def test_lists_past_the_rate_limit_are_counted_sent_on_and_warned_about_once(
        short_dir: Path, nats_server: NatsServer) -> None:
    cfg = SimConfig(device_plugin_dir=short_dir / "dp", pod_resources_socket=short_dir / "pr" / "kubelet.sock",
                    pod_resources_qps=1.0, pod_resources_burst=1)  # one List, then one a second
    bus = await Bus.connect(nats_server.url, name="test", node="n1")
    sent: list[KubeletListing] = []
    all_sent = asyncio.Event()

    async def on_listing(listing: KubeletListing) -> None:
        sent.append(listing)
        if len(sent) == 6:
            all_sent.set()

    await bus.subscribe(bus.subjects.kubelet_list, KubeletListing, on_listing)
    async with NodeSimulator(cfg):
        lister = KubeletLister(str(cfg.pod_resources_socket), bus, timeout=2.0)
        try:
            with structlog.testing.capture_logs() as logs:
                answers = []
                for i in range(6):  # answered, rejected (no token left), a token back, answered, ...
                    future = lister.begin(f"r{i}")
                    assert future is not None
                    answers.append(await asyncio.wait_for(future, 5))
                    if i % 2:
                        await asyncio.sleep(1.1)
            assert [a is not None for a in answers] == [True, False] * 3
            assert (lister.answered, lister.failures.occurrences) == (3, 3)
            warnings = [entry for entry in logs if entry["log_level"] == "warning"]
            assert len(warnings) == 1 and "RESOURCE_EXHAUSTED" in warnings[0]["error"], warnings
            await asyncio.wait_for(all_sent.wait(), 5)
            assert {m.request_id: bool(m.error) for m in sent} == {f"r{i}": bool(i % 2) for i in range(6)}
        finally:
            await lister.close()
            await bus.close()
