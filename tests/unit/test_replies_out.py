"""When the allocator's relay may publish: no Allocate in flight, and the last reply's head start over
(services/allocator/replies.py)."""

from __future__ import annotations

import asyncio

from services.allocator.replies import REPLY_HEADSTART_S, RepliesOut


async def timed_wait(replies: RepliesOut) -> float:
    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait_for(replies.wait(), 5)
    return loop.time() - began


async def test_nothing_answered_yet_publishes_at_once() -> None:
    assert await timed_wait(RepliesOut(headstart=10.0)) < 1.0


async def test_a_reply_just_sent_holds_publication_for_its_head_start() -> None:
    replies = RepliesOut(headstart=0.2)
    replies.replied()
    assert await timed_wait(replies) >= 0.19
    assert await timed_wait(replies) < 0.1  # the head start is over: the next round goes at once


async def test_an_allocate_in_flight_holds_publication_until_its_reply_and_head_start() -> None:
    replies = RepliesOut(headstart=0.2)
    loop = asyncio.get_running_loop()
    began = loop.time()
    waiting = asyncio.ensure_future(replies.wait())
    with replies.handling():
        await asyncio.sleep(0.3)
        assert not waiting.done()
        replies.replied()  # the handler's reply goes out as the handler returns
    await asyncio.wait_for(waiting, 5)
    assert loop.time() - began >= 0.49


async def test_overlapping_allocates_hold_until_the_last_is_answered() -> None:
    replies = RepliesOut(headstart=0.0)
    waiting = asyncio.ensure_future(replies.wait())
    with replies.handling():
        with replies.handling():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        assert not waiting.done()  # one still being handled
    await asyncio.wait_for(waiting, 5)


async def test_a_failed_handler_does_not_hold_publication() -> None:
    replies = RepliesOut()
    try:
        with replies.handling():
            raise RuntimeError("refused")
    except RuntimeError:
        pass
    assert await timed_wait(replies) < 1.0


def test_the_head_start_is_short() -> None:
    # The relay's bound (HOLD_AT_MOST_S, 50 ms) must stay well above it, and operators' publication
    # lag must not notice it.
    from libs.bus.outbox import HOLD_AT_MOST_S

    assert 0 < REPLY_HEADSTART_S <= HOLD_AT_MOST_S / 10
