"""The registrar's Lists handed to their Allocates (services/allocator/podresources.py ``ForwardedLists``):
a List read when its Allocate waits for it, kept when it comes first, and dropped unread when its
Allocate gave up waiting for it (cancelled the wait), with nothing of it kept."""

from __future__ import annotations

import asyncio

import pytest

from libs.commands import KubeletListing
from libs.kubelet.podresources.v1 import api_pb2 as pr
from services.allocator.podresources import ForwardedLists, KubeletRecord, PodResourcesUnavailable

LISTING = pr.ListPodResourcesResponse(pod_resources=[
    pr.PodResources(name="p", namespace="default", containers=[pr.ContainerResources(name="c")]),
]).SerializeToString()


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_list_its_allocate_waits_for_is_read() -> None:
    lists = ForwardedLists()
    future = lists.expect("r1")
    await lists.on_listing(KubeletListing(request_id="r1", listing=LISTING))
    record = await asyncio.wait_for(future, 1)
    assert isinstance(record, KubeletRecord)
    assert record.containers == {("default", "p"): {"c": False}}
    assert lists.read == 1


async def test_a_list_that_comes_first_is_read_when_its_allocate_asks() -> None:
    lists = ForwardedLists()
    await lists.on_listing(KubeletListing(request_id="r1", listing=LISTING))
    assert lists.read == 0
    assert (await asyncio.wait_for(lists.expect("r1"), 1)).containers
    assert lists.read == 1


async def test_a_forgone_list_is_dropped_unread_and_not_kept() -> None:
    seen: list[str] = []
    lists = ForwardedLists(on_list=seen.append)
    future = lists.expect("r1")
    future.cancel()
    await settle()
    assert future.cancelled()
    await lists.on_listing(KubeletListing(request_id="r1", listing=LISTING))
    await settle()
    assert lists.read == 0
    assert seen == ["allocate"]  # still counted as a List the kubelet answered
    # Nothing of it is kept: a later request with the same id (a retry) waits for a List of its own.
    again = lists.expect("r1")
    await settle()
    assert not again.done()
    await lists.on_listing(KubeletListing(request_id="r1", error="rejected by rate limit"))
    with pytest.raises(PodResourcesUnavailable, match="rate limit"):
        await asyncio.wait_for(again, 1)


async def test_a_list_forgone_as_it_is_being_read_is_not_read() -> None:
    lists = ForwardedLists()
    future = lists.expect("r1")
    await lists.on_listing(KubeletListing(request_id="r1", listing=LISTING))  # its reading waits a loop turn
    future.cancel()
    await settle()
    assert future.cancelled()
    assert lists.read == 0


async def test_forgone_ids_are_bounded() -> None:
    lists = ForwardedLists()
    for i in range(ForwardedLists.KEEP + 10):
        lists.expect(f"r{i}").cancel()
    await settle()
    assert len(lists._unwanted) == ForwardedLists.KEEP
    assert not lists._waiting


async def test_forgoing_a_list_read_already_keeps_nothing() -> None:
    lists = ForwardedLists()
    await lists.on_listing(KubeletListing(request_id="r1", listing=LISTING))
    future = lists.expect("r1")  # it came first: read now
    future.cancel()
    await settle()
    assert lists.read == 1
    assert not lists._unwanted


async def test_a_wait_asked_again_after_its_first_was_given_up_gets_the_list() -> None:
    """An Allocate tried again under the same request id (placed again after no room was found) waits
    for the List once more: giving up the first wait must not drop the List the second waits for."""
    lists = ForwardedLists()
    lists.expect("r1").cancel()
    await settle()
    again = lists.expect("r1")
    await lists.on_listing(KubeletListing(request_id="r1", listing=LISTING))
    assert (await asyncio.wait_for(again, 1)).containers
    assert lists.read == 1
