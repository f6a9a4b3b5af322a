"""The kubelet's pod-resources List, asked the moment a vcore Allocate comes in, to check the grant.

``Allocate`` names no pod, and the allocator's view of the pending pods can be stale (issue 13): a
grant must go to a pod the kubelet is admitting, which only a List sent after the Allocate shows. The
registrar has the Allocate first and the grant's reply passes through it, so it asks here, while the
request crosses the bus and the allocator matches and appends; the allocator's reply says what the
List must show (``AllocateReply.check``), and by then the List is usually in. Asked by the allocator
instead, the List left only once the request had reached it, and its answer was read after the
append, with the reply waiting for it.

The answer is kept as the kubelet sent it and goes on to the allocator the moment it comes
(``KubeletListing``): the allocator uses it when it needs the List itself (several pods could be
asking, or the pod's notification is late), so the kubelet is still asked once per Allocate, and
settles earlier grants with it (it drops it unread when there is none to settle). Every List is
bounded by its timeout; a failed one is sent on too (the allocator then asks itself) and checks
nothing here, as when the kubelet's List is not available to the allocator (the grant stands as
matched). Without a socket nothing is asked, and the request says so (the allocator then asks the
kubelet itself).
"""

from __future__ import annotations

import asyncio
import os

import grpc
import grpc.aio
import nats.errors
from google.protobuf.message import DecodeError

from libs.bus.client import Bus
from libs.commands import KubeletListing
from libs.kubelet.admission import AdmissionCheck, admitting, listed_containers
from libs.kubelet.podresources.v1 import api_pb2 as pr
from libs.logger import RepeatedWarning, get_logger

__all__ = ["KubeletLister"]

_logger = get_logger("registrar")

_LIST_METHOD = "/v1.PodResourcesLister/List"  # called with bytes in and out: the answer is sent on as it came
_EMPTY_LIST_REQUEST = b""  # ListPodResourcesRequest has no fields


class KubeletLister:
    def __init__(self, socket: str, bus: Bus, *, timeout: float) -> None:
        self.socket = socket
        self.bus = bus
        self.timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._list: grpc.aio.UnaryUnaryMultiCallable | None = None  # type: ignore[type-arg]
        self._pending: set[asyncio.Future[object]] = set()
        self.answered = 0  # Lists the kubelet answered (metrics; the failed ones: ``self.failures.occurrences``)
        # A kubelet past its rate limit (100 Lists a second) rejects some Lists and answers the next.
        self.failures = RepeatedWarning(_logger, "the kubelet's List failed: the allocator asks it itself where it "
                                               "needs it, and grants it could not check stand as matched")

    def begin(self, request_id: str) -> asyncio.Future[bytes | None] | None:
        """The List for the Allocate ``request_id``, asked now and sent on to the allocator when answered:
        its future gets the answer as sent, or None when it failed. None when there is no pod-resources
        socket (nothing is asked)."""
        if not os.path.exists(self.socket):  # one stat per Allocate, no Path to build
            return None
        return self._keep(asyncio.ensure_future(self._ask(request_id)))

    @staticmethod
    def admits(listing: bytes, check: AdmissionCheck) -> bool | None:
        """Whether the List shows the pod of ``check`` being admitted; None when it does not parse (then
        it checks nothing, as a List that failed)."""
        try:
            parsed = pr.ListPodResourcesResponse.FromString(listing)
        except DecodeError as exc:
            _logger.warning("the kubelet's List does not parse: the grant is not checked", error=str(exc))
            return None
        return admitting(listed_containers(parsed), check)

    def _keep(self, future: asyncio.Future[object]) -> asyncio.Future[object]:  # type: ignore[type-var]
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    async def _ask(self, request_id: str) -> bytes | None:
        await asyncio.sleep(0)  # the Allocate's own request leaves first: the allocator starts on it
        try:
            listing: bytes = await self._call()(_EMPTY_LIST_REQUEST, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self._reset()  # the kubelet may have restarted: dial afresh next time
            error = f"pod-resources List on {self.socket} failed: {exc.code().name} {exc.details()}"
        except Exception as exc:  # whatever else grpc raises: the grant is not held up by it
            error = f"pod-resources List on {self.socket} failed: {exc or type(exc).__name__}"
        else:
            self.answered += 1
            await self._publish(KubeletListing(request_id=request_id, listing=listing))
            return listing
        self.failures(error=error)
        await self._publish(KubeletListing(request_id=request_id, error=error))
        return None

    async def _publish(self, message: KubeletListing) -> None:
        try:
            await self.bus.publish(self.bus.subjects.kubelet_list, message)
        except nats.errors.Error as exc:  # the allocator stops waiting for it and asks itself
            _logger.info("could not send the kubelet's List on to the allocator", error=str(exc) or type(exc).__name__)

    def _call(self) -> grpc.aio.UnaryUnaryMultiCallable:  # type: ignore[type-arg]
        if self._list is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
            self._list = self._channel.unary_unary(_LIST_METHOD)
        return self._list

    async def _reset(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._list = self._channel, None, None
            await channel.close()

    async def close(self) -> None:
        for future in list(self._pending):
            future.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        await self._reset()
