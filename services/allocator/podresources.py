"""The kubelet's own record of who holds which device: a client of its pod-resources API.

``Allocate`` carries device IDs only, so the allocator must guess the pod (gpu-manager-reference.md
3.1). Once the kubelet has recorded the allocation, its pod-resources ``List`` names the pod and
container that hold each device ID: the truth the guess is checked against. Every call is bounded;
an absent socket (a kubelet older than 1.15, or a node where it is not mounted) is reported as
unavailable, and callers then keep the guess, as gpu-manager would.

A rate-limited List (RESOURCE_EXHAUSTED: the kubelet allows 100 a second, 10 at once) or a late one
keeps the connection; one the kubelet closed (restarting) is dialled afresh at the next List. The
calls are made with ``h2`` (libs/grpcchannel.py): the allocator loads no grpcio.

The kubelet's device-manager checkpoint (``KubeletCheckpoint``) is the same record as a file, read
first where it can only confirm: it spares a List for each grant it shows as made.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import msgspec
from google.protobuf.message import DecodeError

from libs.commands import KubeletListing
from libs.grpcchannel import UnaryChannel
from libs.grpcwire import CallFailed
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY, Pod
from libs.kubelet.admission import AdmissionCheck, ListedContainers, admitting, listed_containers
from libs.kubelet.checkpoint import MAX_CHECKPOINT_BYTES, CheckpointUnreadable, checkpoint_entries
from libs.kubelet.podresources.v1 import api_pb2 as pr
from libs.logger import RepeatedWarning, get_logger

__all__ = ["DeviceHolder", "ForwardedLists", "KubeletCheckpoint", "KubeletPodResources", "KubeletRecord",
           "PodResourcesUnavailable", "RecordedDevices", "holders", "parse_record"]

_logger = get_logger("allocator")


class PodResourcesUnavailable(Exception):
    """The pod-resources socket is missing or the kubelet did not answer in time."""


class DeviceHolder(msgspec.Struct, frozen=True):
    """One container as the kubelet records it: its vcore device IDs and its vmemory count."""

    namespace: str
    pod_name: str
    container: str
    vcore_ids: frozenset[str]
    vmemory: int  # number of tencent.com/vcuda-memory devices


def holders(listing: pr.ListPodResourcesResponse) -> dict[frozenset[str], DeviceHolder]:
    """Every container that holds vcore devices, keyed by its set of vcore device IDs.

    The API lists one entry per device and NUMA node, so IDs are collected into sets. Ordinary init
    containers are not listed by the kubelet; their grants are left as guessed.
    """
    out: dict[frozenset[str], DeviceHolder] = {}
    for pod in listing.pod_resources:
        for ctr in pod.containers:
            vcore: set[str] = set()
            vmemory: set[str] = set()
            for dev in ctr.devices:
                if dev.resource_name == RESOURCE_VCORE:
                    vcore.update(dev.device_ids)
                elif dev.resource_name == RESOURCE_VMEMORY:
                    vmemory.update(dev.device_ids)
            if vcore:
                ids = frozenset(vcore)
                out[ids] = DeviceHolder(pod.namespace, pod.name, ctr.name, ids, len(vmemory))
    return out


class KubeletRecord(msgspec.Struct, frozen=True):
    """One pod-resources ``List``: who holds which vcore IDs, and which listed containers hold any."""

    holders: dict[frozenset[str], DeviceHolder]
    # (namespace, pod name) -> container -> holds vcore devices. The kubelet lists the pods it has
    # taken up (admitted, or being admitted right now), app containers and sidecars only.
    containers: ListedContainers

    def admitting(self, pod: Pod) -> bool:
        """Whether the kubelet may be admitting this pod now (libs/kubelet/admission.py)."""
        return admitting(self.containers, AdmissionCheck.of(pod))


def record(listing: pr.ListPodResourcesResponse) -> KubeletRecord:
    return KubeletRecord(holders=holders(listing), containers=listed_containers(listing))


def parse_record(listing: bytes, *, source: str = "as forwarded") -> KubeletRecord:
    """The record of a List as the kubelet sent it (forwarded by the registrar, or asked here);
    PodResourcesUnavailable when it does not parse."""
    try:
        return record(pr.ListPodResourcesResponse.FromString(listing))
    except DecodeError as exc:
        raise PodResourcesUnavailable(f"the kubelet's List, {source}, does not parse: {exc}") from exc


class RecordedDevices(msgspec.Struct, frozen=True):
    """One container's devices in the kubelet's checkpoint."""

    vcore_ids: frozenset[str]
    vmemory: int  # number of tencent.com/vcuda-memory devices


class KubeletCheckpoint:
    """The kubelet's checkpoint file (libs/kubelet/checkpoint.py): (pod uid, container) -> the devices
    it was given. Read again only when the file changed (its inode, size or times). Callers only
    confirm with it: an entry that names a grant's own pod UID and container with exactly its device
    IDs records the kubelet's allocation of those IDs to that container, however old the file, so a
    stale file can miss a grant but not confirm a wrong one; anything else is left to a List (which
    also corrects). A missing file (a kubelet without device plugins yet, a directory not mounted)
    or one this cannot read is None."""

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self._seen: tuple[int, int, int, int] | None = None
        self._recorded: dict[tuple[str, str], RecordedDevices] | None = None
        self.unreadable = RepeatedWarning(_logger, "the kubelet's checkpoint cannot be read: grants are "
                                                   "confirmed by its pod-resources List instead")

    def recorded(self) -> dict[tuple[str, str], RecordedDevices] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._seen = self._recorded = None
            return None
        except OSError as exc:
            self.unreadable(path=self.path, error=str(exc))
            return None
        seen = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if seen != self._seen:
            self._recorded = self._read(st.st_size)
            self._seen = seen
        return self._recorded

    def _read(self, size: int) -> dict[tuple[str, str], RecordedDevices] | None:
        if size > MAX_CHECKPOINT_BYTES:
            self.unreadable(path=self.path, error=f"{size} bytes, more than {MAX_CHECKPOINT_BYTES}")
            return None
        try:
            with open(self.path, "rb") as fh:  # bounded again: the file may be replaced since its stat
                entries = checkpoint_entries(fh.read(MAX_CHECKPOINT_BYTES))
        except (OSError, CheckpointUnreadable) as exc:
            self.unreadable(path=self.path, error=str(exc))
            return None
        vcore: dict[tuple[str, str], frozenset[str]] = {}
        vmemory: dict[tuple[str, str], int] = {}
        for e in entries or ():
            if e.resource == RESOURCE_VCORE:
                vcore[(e.pod_uid, e.container)] = frozenset(e.device_ids)
            elif e.resource == RESOURCE_VMEMORY:
                vmemory[(e.pod_uid, e.container)] = len(e.device_ids)
        return {key: RecordedDevices(ids, vmemory.get(key, 0)) for key, ids in vcore.items()}


class KubeletPodResources:
    LIST = "/v1.PodResourcesLister/List"
    _REQUEST = pr.ListPodResourcesRequest().SerializeToString()

    def __init__(self, socket: str, *, timeout: float, on_list: Callable[[str], None] | None = None) -> None:
        """``on_list(reason)``: told of each List sent (the kubelet rate-limits them; the metrics count)."""
        self.socket = socket
        self.timeout = timeout
        self._on_list = on_list
        self._channel = UnaryChannel(socket)

    def begin_list(self, reason: str) -> asyncio.Future[KubeletRecord]:
        """A List asked for ``reason``, started now: the future gets the record, or fails with
        PodResourcesUnavailable; cancelling it cancels the call. The request leaves in the call's own
        task, which the loop runs next: a caller about to block the loop (an inline append) yields
        once first."""
        if not os.path.exists(self.socket):
            failed: asyncio.Future[KubeletRecord] = asyncio.get_running_loop().create_future()
            failed.set_exception(PodResourcesUnavailable(f"no pod-resources socket at {self.socket}"))
            return failed
        if self._on_list is not None:
            self._on_list(reason)
        return asyncio.ensure_future(self._answer())

    async def _answer(self) -> KubeletRecord:
        try:
            listing = await self._channel.call(self.LIST, self._REQUEST, timeout=self.timeout)
        except CallFailed as exc:
            raise PodResourcesUnavailable(
                f"pod-resources List on {self.socket} failed: {exc.code.name} {exc.message}") from exc
        return parse_record(listing, source=f"from {self.socket}")

    async def list(self, reason: str) -> KubeletRecord:
        return await self.begin_list(reason)

    async def close(self) -> None:
        await self._channel.close()


class ForwardedLists:
    """The Lists the registrar asks as Allocates come in (``KubeletListing``), each handed to its
    Allocate. The request and its List come on two subscriptions, so a List may be handled before its
    request: such an early one is kept. Both kinds are bounded (``KEEP`` each, the oldest dropped): a
    List whose request never comes (the allocator restarted in between), or a request whose List is
    lost, is not kept for ever. A List whose wait was given up (its future cancelled: its Allocate has no
    use for it) is dropped unread when it comes, unless the same request waits for it again: reading one
    costs about 0.5 ms on a node with 30 GPU pods."""

    KEEP = 256

    def __init__(self, on_list: Callable[[str], None] | None = None) -> None:
        """``on_list(reason)``: told of each List that comes (counted as the allocator's own)."""
        self._on_list = on_list
        self._waiting: OrderedDict[str, asyncio.Future[KubeletRecord]] = OrderedDict()
        self._early: OrderedDict[str, KubeletListing] = OrderedDict()
        self._unwanted: OrderedDict[str, None] = OrderedDict()  # request ids whose wait was given up
        self.read = 0  # Lists read (parsed) here: for tests

    def expect(self, request_id: str) -> asyncio.Future[KubeletRecord]:
        """The record of the List asked for ``request_id``; it fails with PodResourcesUnavailable when
        the registrar's List failed. Cancelling it stops the wait."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[KubeletRecord] = loop.create_future()
        self._unwanted.pop(request_id, None)  # waited for again (the request placed again)
        early = self._early.pop(request_id, None)
        if early is not None:
            self._resolve(future, early)
            return future
        self._waiting[request_id] = future
        future.add_done_callback(lambda done: self._drop(request_id, done))
        while len(self._waiting) > self.KEEP:
            self._waiting.popitem(last=False)[1].cancel()
        return future

    async def on_listing(self, listing: KubeletListing) -> None:
        if self._on_list is not None:
            self._on_list("allocate")
        if listing.request_id in self._unwanted:
            del self._unwanted[listing.request_id]
            return
        future = self._waiting.pop(listing.request_id, None)
        if future is None:
            self._early[listing.request_id] = listing
            while len(self._early) > self.KEEP:
                self._early.popitem(last=False)
            return
        # After what is ready to run (a reply on its way out, say): parsing waits its turn.
        asyncio.get_running_loop().call_soon(self._resolve, future, listing)

    def _drop(self, request_id: str, done: asyncio.Future[KubeletRecord]) -> None:
        if self._waiting.get(request_id) is not done:
            return  # answered, or waited for again
        del self._waiting[request_id]
        if done.cancelled():  # given up before its List came: not read when it comes
            self._unwanted[request_id] = None
            while len(self._unwanted) > self.KEEP:
                self._unwanted.popitem(last=False)

    def _resolve(self, future: asyncio.Future[KubeletRecord], listing: KubeletListing) -> None:
        if future.done():
            return
        if listing.error:
            future.set_exception(PodResourcesUnavailable(listing.error))
            return
        self.read += 1
        try:
            future.set_result(parse_record(listing.listing))
        except PodResourcesUnavailable as exc:
            future.set_exception(exc)
