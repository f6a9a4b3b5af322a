"""PreStartContainer verdicts asked ahead after each vcore Allocate (services/registrar/prestart.py,
``AskedAhead``): which PreStart a verdict may answer, and when the kubelet's call asks again.

The asking itself (the allocator's check and the vmanager's socket over NATS) is covered end to end
in tests/e2e/test_prestart.py and, through real containers, tests/runtime; here it is a recorder of
the requests it gets, so that the rules can be shown one by one."""

from __future__ import annotations

import asyncio
import collections
import socket
from pathlib import Path

import pytest

from libs.commands import PreStartReply, PreStartRequest
from libs.errors import BusTimeout, RemoteError
from services.registrar.prestart import AskedAhead

AFTER = 0.05


class Asked:
    """Stands for the two bus round trips: answers each request with the pod's socket."""

    timeout = 2.0

    def __init__(self, socket_path: Path, *, fail: Exception | None = None) -> None:
        self.socket_path = socket_path
        self.requests: list[PreStartRequest] = []
        self.fail = fail

    async def __call__(self, req: PreStartRequest) -> PreStartReply:
        self.requests.append(req)
        await asyncio.sleep(0.01)
        if self.fail is not None:
            raise self.fail
        return PreStartReply(alloc_id="a1", pod_uid="p1", container="c", vcuda_socket=str(self.socket_path))


@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "vcuda.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    yield path
    listener.close()


def request(*ids: str) -> PreStartRequest:
    return PreStartRequest(request_id="r", resource="tencent.com/vcuda-core", device_ids=list(ids))


class InOrder(collections.Counter[str]):
    """``AskedAhead.answered``, also listing each PreStart's way in the order they came."""

    def __init__(self, hows: list[str]) -> None:
        super().__init__()
        self.hows = hows

    def __setitem__(self, how: str, count: int) -> None:
        self.hows.append(how)
        super().__setitem__(how, count)


def ahead(asked: Asked, **kwargs: float) -> tuple[AskedAhead, list[str]]:
    verdicts = AskedAhead(asked, after=AFTER, **kwargs)  # type: ignore[arg-type]
    hows: list[str] = []
    verdicts.answered = InOrder(hows)
    return verdicts, hows


async def test_the_prestart_after_an_allocate_gets_the_verdict_asked_ahead(served: Path) -> None:
    asked = Asked(served)
    verdicts, hows = ahead(asked)
    verdicts.allocated(request("d1", "d2"))
    await asyncio.sleep(AFTER + 0.1)
    assert len(asked.requests) == 1  # asked by itself, before any PreStart
    assert asked.requests[0].ahead  # so the allocator does not ask the kubelet for a grant gone already
    reply = await verdicts(request("d2", "d1"))  # the kubelet's order of the IDs does not matter
    assert reply.pod_uid == "p1" and len(asked.requests) == 1 and hows == ["ahead"]
    assert len(verdicts) == 0


async def test_a_prestart_while_the_early_ask_is_on_its_way_waits_for_it(served: Path) -> None:
    asked = Asked(served)
    verdicts, hows = ahead(asked)
    verdicts.allocated(request("d1"))
    await asyncio.sleep(AFTER + 0.002)  # asked, not answered yet
    await verdicts(request("d1"))
    assert len(asked.requests) == 1 and hows == ["ahead"]


async def test_a_prestart_before_the_early_ask_asks_now_and_the_early_one_never_goes(served: Path) -> None:
    asked = Asked(served)
    verdicts, hows = ahead(asked)
    verdicts.allocated(request("d1"))
    await verdicts(request("d1"))
    await asyncio.sleep(AFTER + 0.05)
    assert len(asked.requests) == 1 and hows == ["asked"]


async def test_a_verdict_answers_one_prestart_a_restart_asks_again(served: Path) -> None:
    asked = Asked(served)
    verdicts, hows = ahead(asked)
    verdicts.allocated(request("d1"))
    await asyncio.sleep(AFTER + 0.05)
    await verdicts(request("d1"))
    await verdicts(request("d1"))  # the container restarts
    assert len(asked.requests) == 2 and hows == ["ahead", "asked"]
    assert [r.ahead for r in asked.requests] == [True, False]


async def test_an_allocate_that_gives_any_of_its_devices_again_voids_it(served: Path) -> None:
    asked = Asked(served)
    verdicts, hows = ahead(asked)
    verdicts.allocated(request("d1", "d2"))
    await asyncio.sleep(AFTER + 0.05)
    verdicts.allocated(request("d2", "d3"))  # d2 went to another grant
    await verdicts(request("d1", "d2"))
    assert hows == ["asked"]
    assert len(verdicts) == 1  # the new grant's verdict still waits for its own PreStart


async def test_other_devices_are_not_answered_by_it(served: Path) -> None:
    asked = Asked(served)
    verdicts, hows = ahead(asked)
    verdicts.allocated(request("d1", "d2"))
    await asyncio.sleep(AFTER + 0.05)
    await verdicts(request("d1"))  # a subset is another container's devices, not this grant's
    assert hows == ["asked"] and len(verdicts) == 1


async def test_a_socket_gone_since_asks_again(served: Path) -> None:
    asked = Asked(served)
    verdicts, hows = ahead(asked)
    verdicts.allocated(request("d1"))
    await asyncio.sleep(AFTER + 0.05)
    served.unlink()
    await verdicts(request("d1"))
    assert hows == ["asked"] and len(asked.requests) == 2


async def test_a_stale_verdict_asks_again(served: Path) -> None:
    asked = Asked(served)
    verdicts, hows = ahead(asked, fresh_for=AFTER + 0.05)
    verdicts.allocated(request("d1"))
    await asyncio.sleep(AFTER + 0.1)
    await verdicts(request("d1"))
    assert hows == ["asked"] and len(asked.requests) == 2


async def test_an_early_ask_that_failed_is_asked_again(served: Path) -> None:
    asked = Asked(served, fail=BusTimeout("vmanager.prepare", 1.0))
    verdicts, hows = ahead(asked)
    verdicts.allocated(request("d1"))
    await asyncio.sleep(AFTER + 0.05)
    asked.fail = None  # the vmanager is back
    reply = await verdicts(request("d1"))
    assert reply.pod_uid == "p1" and hows == ["asked"] and len(asked.requests) == 2


async def test_a_failed_check_stands_the_pod_was_failed_already(served: Path) -> None:
    failed = RemoteError("allocator.prestart", 409, "PreStartContainer check failed, 30 cores recorded")
    asked = Asked(served, fail=failed)
    verdicts, hows = ahead(asked)
    verdicts.allocated(request("d1"))
    await asyncio.sleep(AFTER + 0.05)
    with pytest.raises(RemoteError, match="PreStartContainer check failed"):
        await verdicts(request("d1"))
    assert len(asked.requests) == 1 and hows == ["ahead"]


async def test_verdicts_nobody_asks_for_are_bounded(served: Path) -> None:
    asked = Asked(served)
    verdicts, _ = ahead(asked, limit=3)
    for i in range(10):
        verdicts.allocated(request(f"d{i}"))
    assert len(verdicts) == 3
    await verdicts.close()
    assert len(verdicts) == 0
    await asyncio.sleep(AFTER + 0.05)
    assert asked.requests == []  # closing cancelled the early asks that were still waiting
