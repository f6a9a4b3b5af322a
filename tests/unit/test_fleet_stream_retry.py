"""ensure_fleet_stream asks again when a JetStream API request goes unanswered (a leader election),
and gives up after a few tries; and when the create is refused for want of online peers for the
replicas (a server just started), for a while. The cluster's side is in tests/fleet; here the JetStream context is a
stand-in that loses the first replies, which a real cluster does only now and then."""

from __future__ import annotations

from typing import Any

import nats.errors
import pytest
from nats.js.errors import BadRequestError, NotFoundError

from libs.fleet.stream import _ENSURE_TRIES, NO_PEERS_FOR_PLACEMENT, ensure_fleet_stream


class LosesReplies:
    def __init__(self, lost: int, *, refused: int = 0, err_code: int = NO_PEERS_FOR_PLACEMENT) -> None:
        self.lost = lost
        self.refused = refused  # creates refused with err_code before one works
        self.err_code = err_code
        self.calls: list[str] = []

    async def stream_info(self, name: str) -> Any:
        self.calls.append("info")
        if self.lost:
            self.lost -= 1
            raise nats.errors.TimeoutError
        raise NotFoundError

    async def add_stream(self, config: Any) -> Any:
        self.calls.append("add")
        if self.refused:
            self.refused -= 1
            raise BadRequestError(code=400, err_code=self.err_code,
                                  description="no suitable peers for placement, peer offline")
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


async def test_a_create_refused_for_want_of_online_peers_is_asked_again() -> None:
    js = LosesReplies(lost=0, refused=2)
    config = await ensure_fleet_stream(js, ["node-a"])  # type: ignore[arg-type]
    assert js.calls == ["info", "add"] * 3
    assert [s.name for s in config.sources] == ["GPULEDGER_node-a"]


async def test_peers_that_stay_offline_are_an_error_once_the_wait_is_over() -> None:
    js = LosesReplies(lost=0, refused=100)
    with pytest.raises(BadRequestError):
        await ensure_fleet_stream(js, ["node-a"], placement_wait=0.5)  # type: ignore[arg-type]
    assert 2 <= js.calls.count("add") <= 4  # 0.1, 0.2 s waits fit in 0.5 s; the next would not


async def test_another_refusal_is_the_callers_at_once() -> None:
    js = LosesReplies(lost=0, refused=1, err_code=10058)  # not a placement problem: nothing to wait for
    with pytest.raises(BadRequestError):
        await ensure_fleet_stream(js, ["node-a"])  # type: ignore[arg-type]
    assert js.calls == ["info", "add"]
