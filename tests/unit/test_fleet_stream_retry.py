"""ensure_fleet_stream asks again when a JetStream API request goes unanswered (a leader election),
and gives up after a few tries. The cluster's side is in tests/fleet; here the JetStream context is a
stand-in that loses the first replies, which a real cluster does only now and then."""

from __future__ import annotations

from typing import Any

import nats.errors
import pytest
from nats.js.errors import NotFoundError

from libs.fleet.stream import _ENSURE_TRIES, ensure_fleet_stream


class LosesReplies:
    def __init__(self, lost: int) -> None:
        self.lost = lost
        self.calls: list[str] = []

    async def stream_info(self, name: str) -> Any:
        self.calls.append("info")
        if self.lost:
            self.lost -= 1
            raise nats.errors.TimeoutError
        raise NotFoundError

    async def add_stream(self, config: Any) -> Any:
        self.calls.append("add")
        return config


async def test_an_unanswered_request_is_asked_again() -> None:
    js = LosesReplies(lost=1)
    config = await ensure_fleet_stream(js, ["node-a"])  # type: ignore[arg-type]
    assert js.calls == ["info", "info", "add"]
    assert [s.name for s in config.sources] == ["GPULEDGER_node-a"]


async def test_a_cluster_that_never_answers_is_an_error_after_a_few_tries() -> None:
    js = LosesReplies(lost=100)
    with pytest.raises(nats.errors.TimeoutError):
        await ensure_fleet_stream(js, ["node-a"])  # type: ignore[arg-type]
    assert js.calls == ["info"] * _ENSURE_TRIES
