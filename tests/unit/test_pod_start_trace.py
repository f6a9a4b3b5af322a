"""bench/pod_start_trace.py: steps timed per pod, and a step split by the instance it ran on."""

from __future__ import annotations

import asyncio

from bench.pod_start_trace import Trace


class _Endpoint:
    def __init__(self, resource: str, pause: float) -> None:
        self.resource = resource
        self.pause = pause

    async def allocate(self) -> str:
        await asyncio.sleep(self.pause)
        return self.resource


def test_a_step_split_per_instance_is_timed_under_each_name() -> None:
    class Endpoint(_Endpoint):  # patched in place: a class of this test's own
        pass

    trace = Trace()
    trace.wrap_async(Endpoint, "allocate", "rpc", per=lambda ep: ep.resource.rpartition("/")[2])
    core, memory = Endpoint("example.com/core", 0.02), Endpoint("example.com/memory", 0.0)

    async def one_pod() -> None:
        trace.begin()
        assert await core.allocate() == "example.com/core"  # the wrapped call still answers
        await memory.allocate()
        await memory.allocate()
        trace.end("gpu")

    asyncio.run(one_pod())
    row = trace.pods["gpu"][0]
    assert set(row) == {"rpc core", "rpc memory", "@rpc core", "@rpc memory", "total"}
    assert row["rpc core"] >= 20.0  # ms, the core call's own pause
    assert row["rpc memory"] < row["rpc core"]  # both memory calls summed, neither paused
    assert row["@rpc core"] <= row["@rpc memory"]  # the core call began first
    assert trace.table()["gpu"]["rpc core"] == round(row["rpc core"], 2)
