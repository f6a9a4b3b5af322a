"""The allocator's request handlers: they change the allocation log only through the `Ledger`.

Every change follows the same order: decide under the ledger's lock (the decision is the callable
handed to `Ledger.record`), append the event (durable when append returns), fold it into the
in-memory state, then answer. A reply therefore never promises anything the log does not hold, and
replaying the log rebuilds exactly the state the replies described.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Generic, NamedTuple, TypeVar

from libs.bus.client import Bus, after_reply
from libs.commands import (
    AllocateReply,
    AllocateRequest,
    InventoryReply,
    InventoryRequest,
    KubeletListing,
    PodsReply,
    PodsRequest,
    PreStartReply,
    PreStartRequest,
    ReleaseReply,
    ReleaseRequest,
    StateReply,
    StateRequest,
)
from libs.config import MEMORY_BLOCK, Settings
from libs.errors import BusError, ServiceError
from libs.events.schema import (
    AllocationCorrected,
    AllocationGranted,
    AllocationRefused,
    AllocationReleased,
    Event,
    GpuShare,
)
from libs.kube.pods import RESOURCE_VCORE, Pod, is_active, vcore_device_ids
from libs.kubelet.admission import AdmissionCheck
from libs.ledger.state import CLAIM_PREFIX, MODE_DEVICE_PLUGIN, MODE_DRA, Allocation, LedgerState
from libs.logger import RepeatedWarning, get_logger
from libs.placement.placement import NoRoom, place
from libs.placement.recorded import ResponseSettings, reproduce
from libs.placement.reuse import place_on_reused, reuse_view
from libs.runtime import discard
from services.allocator.extender import AnnotationWriter, core_limit, is_predicated, mismatch, predicated_minor
from services.allocator.identity import (
    Misattributed,
    can_settle,
    confirmed_grants,
    misattributed,
    plan_corrections,
    settled_grants,
    suspects,
)
from services.allocator.ledger import Ledger
from services.allocator.liveness import GONE_AT_ALLOCATE, gone_holders
from services.allocator.matching import Candidate, candidates
from services.allocator.observer import AllocatorObserver
from services.allocator.podcache import PodCache
from services.allocator.podresources import (
    DeviceHolder,
    ForwardedLists,
    KubeletCheckpoint,
    KubeletPodResources,
    KubeletRecord,
    PodResourcesUnavailable,
    parse_record,
)
from services.allocator.prestart import check_allocation
from services.allocator.replies import RepliesOut

__all__ = ["Allocator"]

WITHDRAWN = "withdrawn at allocate"  # a release's reason: recorded for a pod the kubelet was not admitting
_ROOM_ATTEMPTS = 3  # placements tried while releases keep changing the state, before a refusal
# The registrar's List comes within milliseconds of the request; one not in this long after the
# allocator first needed it is taken as lost, and the allocator asks the kubelet itself (_KubeletView).
_FORWARD_WAIT = 0.5
_NOTIFICATION_WAIT = 0.05  # how long an Allocate waits for its pod's notification before asking
_FETCH_AFTER = 0.005  # a pod's notification is usually in by then: later, fetch the pod rather than wait on
_FETCH_AT_MOST = 3  # pods the kubelet lists and our copy lacks, fetched by name; more: our copy is behind
# A grant is checked against the kubelet's record this long after its reply: the kubelet has recorded
# the devices by then (right after the Allocate returns), and a container start, which asks
# PreStartContainer, comes after the pod's sandbox (~100 ms) at the earliest.
_VERIFY_AFTER = 0.02
_logger = get_logger("allocator")
_T = TypeVar("_T")


def _nobody_holds(device_ids: list[str]) -> str:
    return f"no allocation holds these {len(device_ids)} {RESOURCE_VCORE} devices"


class Allocator:
    def __init__(
        self, settings: Settings, ledger: Ledger, bus: Bus, *, responses: ResponseSettings,
        kubelet: KubeletPodResources | None = None, annotations: AnnotationWriter | None = None,
        pod_cache: PodCache | None = None, observer: AllocatorObserver | None = None,
        checkpoint: KubeletCheckpoint | None = None,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.bus = bus
        self.kubelet = kubelet
        self.checkpoint = checkpoint  # the kubelet's checkpoint file: confirms grants without a List
        self.pod_cache = pod_cache
        self.annotations = annotations or AnnotationWriter(None, ledger.state.pod_allocations)
        self.observer = observer or AllocatorObserver()
        self.corrections = 0
        self._kubelet_unavailable = RepeatedWarning(_logger, "pod-resources unavailable: keeping the Allocate-time "
                                                             "guess of pods")
        self.forwarded = ForwardedLists(on_list=self.observer.kubelet_listed)  # the registrar's Lists
        # What every grant's response is built from: the settings the log's writer records, so the compact
        # row's check at write reproduces it; its template is reused (libs/placement/recorded.py).
        self.responses = responses
        # alloc id -> the kubelet's holder of exactly its device IDs, as a List after its Allocate showed
        # them (same pod and container): its identity is settled, and device IDs do not move while the
        # pod lives, so its PreStart and its release need no List of their own. Added to by every List
        # (``_settle``) and by the kubelet's checkpoint (``_settle_from_checkpoint``); rebuilt by the
        # checks that may correct grants (``verify_identity``).
        self.settled: dict[str, DeviceHolder] = {}
        self._verifying: asyncio.Task[None] | None = None
        self._due: dict[str, float] = {}  # grants to settle -> when (monotonic), see _verify_soon
        self.replies = RepliesOut()  # when the relay may publish (replies.py)

    @property
    def state(self) -> LedgerState:
        """The ledger's folded state, to read (changes go through ``self.ledger.record``)."""
        return self.ledger.state

    async def serve(self) -> None:
        s = self.bus.subjects
        await self.bus.subscribe(s.kubelet_list, KubeletListing, self.forwarded.on_listing)
        await self.bus.serve(s.allocate, AllocateRequest, self._observed_allocate, on_replied=self._replied)
        await self.bus.serve(s.prestart, PreStartRequest, self.prestart)
        await self.bus.serve(s.release, ReleaseRequest, self.release)
        await self.bus.serve(s.inventory, InventoryRequest, self.inventory)
        await self.bus.serve(s.state, StateRequest, self.snapshot)

    async def close(self) -> None:
        """Stop the background check of grants."""
        if self._verifying is not None:
            self._verifying.cancel()
            await asyncio.gather(self._verifying, return_exceptions=True)

    # --- Allocate ---
    async def _observed_allocate(self, req: AllocateRequest) -> AllocateReply:
        """`allocate`, its time from receipt to answer (a refusal's record included) told to the observer."""
        started = time.perf_counter()
        try:
            with self.replies.handling():
                reply = await self.allocate(req)
        except BaseException as exc:
            self.observer.allocate_done(time.perf_counter() - started, exc)
            raise
        took = time.perf_counter() - started
        after_reply(lambda _replied: self.observer.allocate_done(took, None))
        return reply

    def _replied(self, _req: AllocateRequest) -> None:
        self.replies.replied()

    async def allocate(self, req: AllocateRequest) -> AllocateReply:
        try:
            attempts = _ROOM_ATTEMPTS
            while True:
                seq = self.state.seq
                try:
                    return await self._allocate(req)
                except NoRoom:
                    # Room that only dead pods hold is room: free it, then place again. And a refusal
                    # must stand against the latest state: a release recorded meanwhile (ours, or the
                    # watchdog's while this request looked for gone holders) may have made the room
                    # (chaos bench: refused 5 ms after the release that freed the second GPU).
                    await self._release_gone_holders()
                    attempts -= 1
                    if not attempts or self.state.seq == seq:
                        raise
        except ServiceError as exc:
            await self._refuse(req, exc.message)
            raise

    async def _release_gone_holders(self) -> None:
        """Release the allocations of pods gone from the node (liveness.py)."""
        gone = await gone_holders(self.state, self.kubelet, self.pod_cache.pods if self.pod_cache else None)
        if gone:
            await self._move_misattributed_grants(gone[0])  # one kubelet List for all of them
        for uid in gone:
            await self._release_recorded(ReleaseRequest(pod_uid=uid, reason=GONE_AT_ALLOCATE))

    async def _allocate(self, req: AllocateRequest) -> AllocateReply:
        self._check_devices(req.resource, req.device_ids)
        if req.withdraw:
            await self._withdraw_unadmitted(req)
        earlier = next((a for a in self.state.allocations.values() if a.request_id == req.request_id), None)
        if earlier is not None:  # a retried request whose reply was lost
            return _reply(earlier)
        deadline = req.deadline or time.time() + self.settings.allocate_timeout
        started = time.perf_counter()
        # The kubelet's pod-resources List tells which pods it has taken up: it admits one pod at a
        # time, so only a pod it knows and has not given devices to yet can be the one asking. Asked
        # once per request (the kubelet rate-limits that API), as early as can be: by the registrar
        # as the request came in (``check_admission``: it checks what we grant before any List was
        # read, and sends the List on, which we use if we need it here), else by us at once, while we
        # match and append; one loop turn lets the call's task send it before the inline append
        # blocks the loop.
        forwarded = self.forwarded.expect(req.request_id) if req.check_admission and not req.listing else None
        view = _KubeletView(self.kubelet, record=self._brought(req), forwarded=forwarded)
        if req.withdraw:
            view.withdrawn = 1
        if not req.check_admission:
            view.start()
            await asyncio.sleep(0)
        try:
            return await self._lookup_and_grant(req, deadline, started, view)
        finally:
            if (record := view.record) is not None:  # after the reply has gone
                asyncio.get_running_loop().call_soon(self._settle, record)
            elif forwarded is not None and not view.started:
                if self._unsettled(besides=req.request_id):  # the registrar's List settles them when it comes
                    forwarded.add_done_callback(self._settle_with)
                else:  # nothing it could settle: not read at all
                    forwarded.cancel()
            view.cancel()

    @staticmethod
    def _brought(req: AllocateRequest) -> KubeletRecord | None:
        """The kubelet's List that the registrar brought along with ``req`` (after its check failed)."""
        if not req.listing:
            return None
        try:
            return parse_record(req.listing)
        except PodResourcesUnavailable as exc:
            _logger.warning("the registrar's copy of the kubelet's List is unreadable", error=str(exc))
            return None

    def _unsettled(self, *, besides: str) -> bool:
        """Whether a grant a List could settle is not settled yet, the grants of request ``besides``
        left out: a List the registrar asked as that request came in was answered before the kubelet
        could record what the reply grants, so it cannot settle them."""
        settled = self.settled
        return any(a.request_id != besides and a.alloc_id not in settled and can_settle(a)
                   for a in self.state.allocations.values())

    def _settle_with(self, listed: asyncio.Future[KubeletRecord]) -> None:
        if not listed.cancelled() and listed.exception() is None:
            self._settle(listed.result())

    async def _withdraw_unadmitted(self, req: AllocateRequest) -> None:
        """The registrar's List does not show the pod this request's grant ``req.withdraw`` went to being
        admitted: release it before looking on (nothing was answered for it)."""
        granted = self.state.allocations.get(req.withdraw)
        if granted is None or granted.request_id != req.request_id:
            return  # released meanwhile, or not this request's: nothing to take back
        await self._withdraw(granted, f"{granted.namespace}/{granted.pod_name}")

    async def _pick(
        self, pods: list[Pod], cores: int, view: _KubeletView, *, last_resort: bool = False,
    ) -> _Choice | None:
        """The pod and container the request is for: of the candidates, the first that the kubelet
        may be admitting, per its pod-resources; without its answer, the first, as gpu-manager.
        Even a single candidate is checked (issue 13): after an outage our view of the pods can be
        stale (a pod rejected or deleted meanwhile still Pending here, while the pod really asking
        is not in yet), and a grant recorded for such a pod is released with it, possibly before
        any check could move it to the container the kubelet gave the devices to.
        ``last_resort``: the pods are fresh from the API server and none the kubelet lists fits,
        so guess rather than fail (a later check corrects a wrong guess). The answer holds until
        the caller's next await: grant under the lock, re-checked.
        A single candidate, before the kubelet has answered, is taken unconfirmed: the kubelet's
        answer can then only confirm it or send the caller on looking, so the grant is recorded
        while the List runs, and checked against it before the reply (``_grant``)."""
        pods = await self._drop_rejected(pods, view)
        found = candidates(pods, self.state, cores)
        if not found:
            return None
        if len(found) == 1 and (last_resort or not view.answered):
            return _Choice(found[0], confirm=not last_resort)  # last resort: taken whatever the List says
        record = await view.get(self.settings.request_timeout)
        if record is None:
            return _Choice(found[0])
        narrowed = [c for c in found if record.admitting(c.pod)]
        if narrowed:
            return _Choice(narrowed[0])
        return _Choice(found[0]) if last_resort else None

    async def _drop_rejected(self, pods: list[Pod], view: _KubeletView) -> list[Pod]:
        """``pods`` less those part-way through admission (some GPU containers granted, not all)
        that the kubelet is no longer admitting. Matching puts such a pod first, as the kubelet's
        current one; but our view of it may be stale (the watchdog, the broker or this process was
        away; its rejection not through yet): when a later container's Allocate failed the kubelet
        rejected the pod and moved on, and the next pod's request would be matched to the rejected
        pod's next container, then lost with that pod's release (the kubelet has given the devices
        to a container the ledger holds nothing for), or refused as a mismatch. The kubelet's
        pod-resources (the same List the match then uses) lists only active pods it has taken up."""
        held = {(a.pod_uid, a.container) for a in self.state.allocations.values()}
        started = {uid for uid, _ in held}
        partway = [p for p in pods if p.uid in started and any(
            c.vcore > 0 and (p.uid, c.name) not in held for c in (*p.spec.init_containers, *p.spec.containers))]
        if not partway:
            return pods
        record = await view.get(self.settings.request_timeout)
        if record is None:
            return pods  # without the kubelet's answer, trust the view (as before)
        gone = {p.uid for p in partway if not record.admitting(p)}
        if gone:
            _logger.info("pods part-way through admission no longer admitted by the kubelet: not matched",
                      pods=sorted(p.key for p in partway if p.uid in gone))
        return [p for p in pods if p.uid not in gone]

    def _still_free(self, cand: Candidate) -> bool:
        return not any(a.pod_uid == cand.pod.uid and a.container == cand.container.name
                       for a in self.state.allocations.values())

    async def _lookup_and_grant(
        self, req: AllocateRequest, deadline: float, started: float, view: _KubeletView,
    ) -> AllocateReply:
        cores = len(req.device_ids)
        lookups = 0
        if self.pod_cache is not None and (reply := await self._grant_notified(req, deadline, started, view)):
            return reply
        # Not there after the short wait (a lost notification, a pod the cache never saw): ask the
        # watchdog's cache, then at once the API server itself through the watchdog; then the same
        # with growing pauses until the kubelet's deadline.
        delay, fresh = 0.0, False
        while True:
            lookups += 1
            try:
                pods = await self._pending_pods(fresh=fresh)
            except ServiceError as exc:
                unavailable: ServiceError | None = exc  # the watchdog may still be starting: retry in time
            else:
                unavailable = None
                choice = await self._pick(pods, cores, view, last_resort=fresh)
                if choice is not None and (reply := await self._grant(req, choice, view, deadline,
                                                                      lookups=lookups, started=started)):
                    self.observer.pod_found("listed")
                    return reply
            # The pod may not have reached the watchdog's cache yet: ask the API server directly next.
            if time.time() + delay > deadline - 0.5:
                raise unavailable or ServiceError(
                    404, f"candidate pod not found for request of {cores} vcuda-core, allocation failed")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5) if delay else (0.05 if fresh else 0.0)
            fresh = True

    async def _grant_notified(
        self, req: AllocateRequest, deadline: float, started: float, view: _KubeletView,
    ) -> AllocateReply | None:
        """Match against our copy of the watchdog's notifications: no request at all when the pod is
        in. When it is not (the kubelet admits a pod before its watch event has gone through the
        watchdog), the kubelet's List names the pods it has taken up: one our copy lacks is fetched
        at once by name, while the next notifications are awaited too, for at most a short while
        (a fetch under way is awaited to its end); None after that."""
        cache = self.pod_cache
        assert cache is not None
        cores = len(req.device_ids)
        until = time.monotonic() + _NOTIFICATION_WAIT
        lookups = 0
        fetch: asyncio.Task[list[Pod]] | None = None
        try:
            while True:
                lookups += 1
                version = cache.version
                fetched = fetch.result() if fetch is not None and fetch.done() else []
                pending = cache.pending()
                choice = await self._pick(_with_fetched(pending, fetched), cores, view)
                if choice is not None and (reply := await self._grant(req, choice, view, deadline,
                                                                      lookups=lookups, started=started)):
                    notified = any(p.uid == choice.candidate.pod.uid for p in pending)
                    self.observer.pod_found("notification" if notified else "fetched")
                    return reply
                if fetch is None:
                    fetch = asyncio.create_task(self._fetch_unknown(view, cache, started))
                if not await _news(cache, version, fetch, until):
                    return None
        finally:
            if fetch is not None:
                fetch.cancel()

    async def _fetch_unknown(self, view: _KubeletView, cache: PodCache, started: float) -> list[Pod]:
        """The pods the kubelet has taken up, still admitting some container, that ``cache`` lacks
        ``_FETCH_AFTER`` after the request came: each fetched by name from the API server (through
        the watchdog, one GET each, together). A real kubelet adds a pod to its pod manager, which
        its List reads, before admitting it. [] when the kubelet did not answer or too many are
        unknown (our copy is behind: the caller's fallback lists them all)."""
        await asyncio.sleep(max(0.0, started + _FETCH_AFTER - time.perf_counter()))
        record = await view.get(self.settings.request_timeout)
        if record is None:
            return []
        known = {(p.metadata.namespace, p.metadata.name) for p in cache.pods.values()}
        unknown = [key for key, held in record.containers.items() if key not in known and not all(held.values())]
        if not unknown or len(unknown) > _FETCH_AT_MOST:
            return []
        found = await asyncio.gather(*(self._pod_by_name(ns, name) for ns, name in unknown))
        return [p for pods in found for p in pods]

    async def _pod_by_name(self, namespace: str, name: str) -> list[Pod]:
        try:
            pods = await self._pods(PodsRequest(namespace=namespace, name=name, fresh=True))
        except ServiceError as exc:
            _logger.info("could not fetch a pod the kubelet lists", pod=f"{namespace}/{name}", error=exc.message)
            return []
        return [p for p in pods if (p.metadata.namespace, p.metadata.name) == (namespace, name)]

    async def _grant(
        self, req: AllocateRequest, choice: _Choice, view: _KubeletView, deadline: float, *,
        lookups: int, started: float,
    ) -> AllocateReply | None:
        """Grant the chosen container the request, or None when it was granted something meanwhile
        (checked, with the placement, under the ledger's lock), or when the kubelet's List, awaited
        after the append for an unconfirmed choice, says the kubelet is not admitting that pod: the
        grant is then withdrawn (released) before anything was answered, and the caller looks on."""
        cand = choice.candidate
        pod, container = cand.pod, cand.container
        cores = len(req.device_ids)
        memory = container.vmemory * MEMORY_BLOCK
        timing: dict[str, float] = {}

        def decide(_state: LedgerState) -> list[Event]:
            if not self._still_free(cand):
                return []
            timing.update(lookups=lookups, lookup_ms=round((time.perf_counter() - started) * 1000, 2))
            shares = self._choose(req, cand, cores, memory)
            response = reproduce(
                self.responses, shares=shares, cores=cores, memory=memory, pod_uid=pod.uid, container=container.name,
                compat32=container.compat32,
            )
            if time.time() > deadline:
                raise ServiceError(504, "the kubelet's deadline passed before the grant could be recorded")
            event = AllocationGranted(
                alloc_id=uuid.uuid4().hex, request_id=req.request_id,
                pod_uid=pod.uid, namespace=pod.metadata.namespace, pod_name=pod.metadata.name,
                container=container.name, container_index=cand.index, init_container=cand.init,
                cores=cores, memory=memory, device_ids=tuple(req.device_ids), shares=shares,
                core_limit=core_limit(pod), response=response,
            )
            timing["appending"] = time.perf_counter()
            return [event]

        # A grant withdrawn earlier for this request holds its id in the log, where a command id
        # stands for what it recorded (a retry gets those events back): the next try needs its own.
        tries = view.withdrawn
        stored = await self.ledger.record(decide, command_id=f"{req.request_id}.{tries}" if tries else req.request_id)
        if not stored:
            return None
        granted = self.state.allocations[stored[0].event.alloc_id]  # type: ignore[union-attr]
        appended = time.perf_counter()
        check = None
        if choice.confirm:
            if req.check_admission and not view.started:
                check = AdmissionCheck.of(pod)  # the registrar checks it against its List before answering
            elif not await self._confirmed(granted, pod, view):
                return None
        marks = (started, timing.pop("appending"), appended, time.perf_counter())
        # After the reply (even a failed one: the grant is recorded, so it is logged and checked).
        after_reply(functools.partial(self._granted, pod, granted, marks, timing))
        return _reply(granted, check)

    def _granted(self, pod: Pod, granted: Allocation, marks: tuple[float, float, float, float],
                 timing: dict[str, float], replied: float | None) -> None:
        """A grant's bookkeeping, after its reply: its steps to the observer (``marks``: received,
        decided, appended, confirmed), its log line, its annotations, its check against the kubelet."""
        received, decided, appended, done = marks
        if replied is not None:
            self.observer.allocate_hops(decided - received, appended - decided, done - appended, replied - done)
        _logger.info("granted", pod=pod.key, container=granted.container, cores=granted.cores,
                  memory=granted.memory, gpus=[s.index for s in granted.shares], seq=granted.granted_seq,
                  request_id=granted.request_id, append_ms=round((appended - decided) * 1000, 2),
                  confirm_ms=round((done - appended) * 1000, 2), **timing,
                  total_ms=round((done - received) * 1000, 2))
        if not is_predicated(pod):
            # Publish our own choice, as gpu-manager's PREDICATE_MISSING does (one write with the
            # PreStart's when that comes soon: extender.py).
            self.annotations.publish(pod.metadata.namespace, pod.metadata.name, pod.uid, assigned=False,
                                     defer=True)
        self._verify_soon(granted)

    async def _confirmed(self, granted: Allocation, pod: Pod, view: _KubeletView) -> bool:
        """True when the kubelet's List (or its silence) lets an unconfirmed grant stand; else the
        grant is released, nothing having been answered for it."""
        record = await view.get(self.settings.request_timeout)
        if record is None or record.admitting(pod):
            return True
        await self._withdraw(granted, pod.key)
        view.withdrawn += 1
        return False

    async def _withdraw(self, granted: Allocation, pod_key: str) -> None:
        reason = f"{WITHDRAWN}: the kubelet is not admitting pod {pod_key}"

        def decide(state: LedgerState) -> list[Event]:
            if granted.alloc_id not in state.allocations:
                return []
            return [AllocationReleased(alloc_id=granted.alloc_id, pod_uid=granted.pod_uid,
                                       container=granted.container, reason=reason)]

        await self.ledger.record(decide)
        _logger.info("grant withdrawn before its reply", pod=pod_key, container=granted.container,
                     alloc_id=granted.alloc_id, reason=reason)

    def _choose(self, req: AllocateRequest, cand: Candidate, cores: int, memory: int) -> tuple[GpuShare, ...]:
        """Where the container goes: on its init containers' GPUs when it reuses their kubelet
        devices; on the extender's GPU when the pod was predicated (share mode); else placement."""
        links = self.state.inventory.links if self.state.inventory else ()
        share_mode = self.settings.share_mode
        reused, view = reuse_view(self.state, cand.pod.uid, req.device_ids, init=cand.init)
        view = [g for g in view if g.mode != MODE_DRA]  # GPUs the DRA driver serves are not the device plugin's
        on_theirs = place_on_reused(reused, view, links, cores=cores, memory=memory, share_mode=share_mode)
        if on_theirs is not None:
            return on_theirs
        if cores < 100 and not cand.init and is_predicated(cand.pod):
            wanted = predicated_minor(cand.pod, cand.index, view)
            try:
                return place([wanted], links, cores=cores, memory=memory, share_mode=share_mode)
            except ServiceError:
                ours = place(view, links, cores=cores, memory=memory, share_mode=share_mode)
                raise mismatch(cand.pod, cand.container.name, ours, wanted) from None
        return place(view, links, cores=cores, memory=memory, share_mode=share_mode)

    async def _refuse(self, req: AllocateRequest, reason: str) -> None:
        _logger.warning("allocate refused", reason=reason, request_id=req.request_id, devices=len(req.device_ids))
        event = AllocationRefused(request_id=req.request_id, resource=req.resource,
                                  device_count=len(req.device_ids), reason=reason)
        try:
            await self.ledger.record_events([event])
        except Exception as exc:  # the refusal is still answered; only its record is lost
            _logger.error("could not record a refusal", error=str(exc))

    async def _pending_pods(self, *, fresh: bool) -> list[Pod]:
        return await self._pods(PodsRequest(phase="Pending", fresh=fresh))

    async def _pods(self, query: PodsRequest) -> list[Pod]:
        try:
            reply = await self.bus.request(
                self.bus.subjects.pods, query, PodsReply,
                timeout=min(self.settings.request_timeout, self.settings.allocate_timeout / 2),
            )
        except BusError as exc:
            raise ServiceError(503, f"cannot list the node's pods from the watchdog: {exc}") from exc
        return reply.pods

    def _check_devices(self, resource: str, device_ids: list[str]) -> None:
        if resource != RESOURCE_VCORE:
            raise ServiceError(400, f"the allocator places {RESOURCE_VCORE} only, not {resource!r}")
        if not device_ids:
            raise ServiceError(400, "no device IDs in the request")
        if len(set(device_ids)) != len(device_ids):
            raise ServiceError(400, "duplicate device IDs in the request")
        capacity = 100 * len(self.state.gpus_in_mode(MODE_DEVICE_PLUGIN))  # what the registrar advertises
        advertised = _advertised(capacity)
        if not advertised.issuperset(device_ids):
            dev = next(d for d in device_ids if d not in advertised)
            raise ServiceError(400, f"device ID {dev!r} was never advertised by this node")

    # --- PreStartContainer ---
    async def prestart(self, req: PreStartRequest) -> PreStartReply:
        """gpu-manager's PreStartContainer (section 3.9), with the kubelet's pod-resources record in
        place of its private checkpoint: learn who really holds the devices, correct the grant when
        the Allocate-time guess was wrong, check the grant. The registrar has the vmanager serve the
        pod's vcuda.sock meanwhile (services/registrar/prestart.py): the reply's ``seq`` is the log as
        this check saw it, which the vmanager folds before serving the pod the check names."""
        self._check_devices(req.resource, req.device_ids)
        guessed = self.state.find_by_devices(req.device_ids)
        if guessed is None and req.ahead:  # asked before the kubelet's call, the grant is gone already
            raise ServiceError(404, _nobody_holds(req.device_ids))
        alloc = await self._checked(req, guessed)
        self.annotations.publish(alloc.namespace, alloc.pod_name, alloc.pod_uid, assigned=True, defer=True)
        return PreStartReply(alloc_id=alloc.alloc_id, pod_uid=alloc.pod_uid, container=alloc.container,
                             seq=self.state.seq)

    async def _checked(self, req: PreStartRequest, guessed: Allocation | None) -> Allocation:
        """The grant the kubelet's record confirms (corrected if need be), checked against its pod."""
        # The kubelet's record (it may correct the grant) and the granted pod, asked together: the
        # pod is looked up again only when a correction moved the grant to another pod.
        with _Ahead(guessed, self._active_pod) as active_pod:
            settled = None
            if guessed is not None:
                self._settle_from_checkpoint([guessed])
                settled = self.settled.get(guessed.alloc_id)
            holder = settled or await self.verify_identity(req.device_ids, reason="prestart")
            alloc = self.state.find_by_devices(req.device_ids)
            if alloc is None:
                raise ServiceError(404, "PreStartContainer check failed, failed to get pod from deviceplugin "
                                        f"checkpoint: {_nobody_holds(req.device_ids)}")
            pod = await active_pod.for_pod(alloc.pod_uid)
        if pod is None:
            raise ServiceError(404, f"PreStartContainer check failed, failed to get pod {alloc.pod_uid} in watchdog")
        # The memory limit comes from the pod spec (as in gpu-manager); the kubelet's vmemory count
        # normally equals it, but a kubelet that admitted the pod before vmemory was registered
        # holds none, which is worth a warning, not a failed pod.
        problem = check_allocation(alloc, pod, cores=len(req.device_ids), vmemory=None)
        if holder is not None and holder.vmemory * MEMORY_BLOCK != alloc.memory:
            _logger.warning("the kubelet holds a different vmemory count than the pod spec asks for",
                         pod=f"{alloc.namespace}/{alloc.pod_name}", container=alloc.container,
                         kubelet_blocks=holder.vmemory, recorded_bytes=alloc.memory)
        if problem is not None:
            message = f"PreStartContainer check failed, {problem}"
            await self.fail_pod(alloc, message)
            raise ServiceError(409, message)
        return alloc

    async def _active_pod(self, uid: str) -> Pod | None:
        """The pod, while active: from our copy of the watchdog's notifications when it holds it
        active (no request), else the watchdog's cache, else the API server through the watchdog."""
        cached = self.pod_cache.pods.get(uid) if self.pod_cache is not None else None
        if cached is not None and is_active(cached):
            return cached
        for fresh in (False, True):
            pods = [p for p in await self._pods(PodsRequest(uid=uid, fresh=fresh)) if is_active(p)]
            if pods:
                return pods[0]
        return None

    async def fail_pod(self, alloc: Allocation, message: str) -> None:
        """gpu-manager's ALLOCATE_FAIL: free the pod's GPUs and mark it Failed."""
        _logger.warning("prestart check failed", pod=f"{alloc.namespace}/{alloc.pod_name}", error=message)
        await self.release(ReleaseRequest(pod_uid=alloc.pod_uid, reason="prestart-check-failed"))
        await self.annotations.fail_pod(alloc.namespace, alloc.pod_name, message)

    # --- authoritative identity ---
    async def verify_identity(self, device_ids: list[str] | None = None, *, reason: str) -> DeviceHolder | None:
        """Correct every grant the kubelet records under another pod or container; the kubelet's
        holder of ``device_ids`` (None when pod-resources is not available or does not list it)."""
        if self.kubelet is None:
            return None
        try:
            found = (await self.kubelet.list(reason)).holders
        except PodResourcesUnavailable as exc:
            self._kubelet_unavailable(error=str(exc))
            return None
        if suspects(self.state, found):
            await self._correct(found, reason)
        self.settled = settled_grants(self.state, found)
        return found.get(frozenset(device_ids)) if device_ids else None

    def _settle(self, record: KubeletRecord) -> None:
        """Add the grants ``record`` settles. Those settled already stay (device IDs do not move
        while a pod lives; a List sent at an Allocate's receipt can come back after a later one), so
        only the unsettled are looked up: this runs after every Allocate."""
        live = self.state.allocations
        settled = {alloc_id: holder for alloc_id, holder in self.settled.items() if alloc_id in live}
        unsettled = [a for a in live.values() if a.alloc_id not in settled]
        settled.update(settled_grants(self.state, record.holders, among=unsettled))
        self.settled = settled

    def _verify_soon(self, granted: Allocation) -> None:
        """Settle the grant against the kubelet's record ``_VERIFY_AFTER`` from now (one List for the
        grants due then), unless a PreStart or the next Allocate's List did it first: while pods come
        one after another, each Allocate's List settles the grant before it, and the kubelet (100
        Lists a second, 10 at once) is asked about once per pod instead of twice."""
        if self.kubelet is None or not can_settle(granted):
            return  # (a grant no List can settle would otherwise cost one after every grant)
        self._due[granted.alloc_id] = time.monotonic() + _VERIFY_AFTER
        if self._verifying is None or self._verifying.done():
            self._verifying = asyncio.get_running_loop().create_task(self._verify_later())

    async def _verify_later(self) -> None:
        """Settle what the kubelet's record shows as it was granted; correct nothing: a grant it
        shows elsewhere is corrected where it always was (PreStart, release, the periodic check)."""
        assert self.kubelet is not None
        while self._due:
            await asyncio.sleep(max(0.0, min(self._due.values()) - time.monotonic()))
            now = time.monotonic()
            due = [alloc_id for alloc_id, at in self._due.items() if at <= now]
            for alloc_id in due:
                del self._due[alloc_id]
            live = [self.state.allocations[a] for a in due if a in self.state.allocations]
            self._settle_from_checkpoint(live)
            if all(a.alloc_id in self.settled for a in live):
                continue
            try:
                record = await self.kubelet.list("verify")
            except PodResourcesUnavailable:  # PreStart and the periodic check ask again
                continue
            self._settle(record)

    def _settle_from_checkpoint(self, allocs: list[Allocation]) -> None:
        """Settle those of ``allocs`` not settled yet that the kubelet's checkpoint records as granted
        (the file is read when it changed: far cheaper than a List, which the kubelet also rate-limits)."""
        pending = [a for a in allocs if a.alloc_id not in self.settled]
        if pending and self.checkpoint is not None and (recorded := self.checkpoint.recorded()):
            confirmed = confirmed_grants(pending, recorded)
            if confirmed:
                self.settled.update(confirmed)
                self.observer.checkpoint_settled(len(confirmed))

    async def _correct(self, found: dict[frozenset[str], DeviceHolder], reason: str) -> None:
        pods = await self._pods(PodsRequest(fresh=True))
        wrong: list[Misattributed] = []
        events: list[AllocationCorrected] = []

        def decide(state: LedgerState) -> list[AllocationCorrected]:
            wrong[:] = misattributed(state, found, pods)
            if not wrong:
                return []
            try:
                events[:] = plan_corrections(state, wrong, share_mode=self.settings.share_mode,
                                             responses=self.responses, reason=reason)
            except ServiceError as exc:
                raise ServiceError(409, f"PreStartContainer check failed, {exc.message}") from exc
            return events

        if not await self.ledger.record(decide):
            return
        self.corrections += len(events)
        running = {p.uid: p.status.phase == "Running" for p in pods}
        for w, ev in zip(wrong, events, strict=True):
            _logger.warning("grant corrected from the kubelet's pod-resources", alloc_id=ev.alloc_id,
                         guessed=f"{w.alloc.namespace}/{w.alloc.pod_name}/{w.alloc.container}",
                         actual=f"{ev.namespace}/{ev.pod_name}/{ev.container}", memory=ev.memory, reason=reason)
        touched = {w.alloc.pod_uid: (w.alloc.namespace, w.alloc.pod_name) for w in wrong}
        touched.update({w.pod.uid: (w.pod.metadata.namespace, w.pod.metadata.name) for w in wrong})
        for uid, (namespace, name) in sorted(touched.items()):  # a pod left with nothing has its keys withdrawn
            self.annotations.publish(namespace, name, uid, assigned=running.get(uid, False))

    async def reconcile_forever(self, period: float) -> None:
        """The periodic check (gpu-manager's checkAllocationPeriodically, against pod-resources)."""
        while True:
            await asyncio.sleep(period)
            try:
                await self.verify_identity(reason="reconcile")
            except (ServiceError, BusError) as exc:
                _logger.error("identity reconciliation failed", error=str(getattr(exc, "message", exc)))

    # --- release, queries ---
    async def release(self, req: ReleaseRequest) -> ReleaseReply:
        grants = _device_plugin_grants(self.state, req.pod_uid)
        self._settle_from_checkpoint(grants)  # while the kubelet still records the pod (after a restart, say)
        if any(a.alloc_id not in self.settled for a in grants):  # a settled grant is the pod's own
            await self._move_misattributed_grants(req.pod_uid)
        return await self._release_recorded(req)

    async def _move_misattributed_grants(self, pod_uid: str) -> None:
        """A grant recorded under a pod being released may be one the kubelet gave to another container
        (an Allocate-time guess not corrected yet, e.g. matched to a pod rejected meanwhile): released
        with that pod, the container would run on devices the ledger holds for nobody. Move such grants
        to their real holders first (an ordinary correction; one kubelet List covers every pod)."""
        try:
            await self.verify_identity(reason="release")
        except (ServiceError, BusError) as exc:
            _logger.warning("could not check the kubelet's record before a release", pod_uid=pod_uid,
                            error=str(getattr(exc, "message", exc)))

    async def _release_recorded(self, req: ReleaseRequest) -> ReleaseReply:
        held: list[Allocation] = []

        def decide(state: LedgerState) -> list[Event]:
            held[:] = _device_plugin_grants(state, req.pod_uid)
            return [
                AllocationReleased(alloc_id=a.alloc_id, pod_uid=a.pod_uid, container=a.container, reason=req.reason)
                for a in held
            ]

        if not await self.ledger.record(decide):
            return ReleaseReply(released=[])
        _logger.info("released", pod_uid=req.pod_uid, reason=req.reason, alloc_ids=[a.alloc_id for a in held])
        return ReleaseReply(released=[a.alloc_id for a in held])

    async def inventory(self, _req: InventoryRequest) -> InventoryReply:
        if self.state.inventory is None:
            raise ServiceError(503, "no GPU inventory recorded yet")
        return InventoryReply(inventory=self.state.inventory, share_mode=self.settings.share_mode,
                              dra_gpus=[g.index for g in self.state.gpus_in_mode(MODE_DRA)])

    async def snapshot(self, _req: StateRequest) -> StateReply:
        return StateReply(snapshot=self.state.snapshot(), claims=self.state.prepared_claims())


@functools.lru_cache(maxsize=4)
def _advertised(capacity: int) -> frozenset[str]:
    return frozenset(vcore_device_ids(capacity))


def _device_plugin_grants(state: LedgerState, pod_uid: str) -> list[Allocation]:
    """What a pod's release returns: its device-plugin grants. Its DRA claims are not the pod's to
    release (a claim may serve several pods): the kubelet unprepares them, or the watchdog's claim
    reconciliation, each as a ``claim.unprepared``."""
    return [a for a in state.pod_allocations(pod_uid) if not a.alloc_id.startswith(CLAIM_PREFIX)]


def _reply(alloc: Allocation, check: AdmissionCheck | None = None) -> AllocateReply:
    return AllocateReply(alloc_id=alloc.alloc_id, pod_uid=alloc.pod_uid, namespace=alloc.namespace,
                         pod_name=alloc.pod_name, container=alloc.container, response=alloc.response, check=check)


def _with_fetched(pending: list[Pod], fetched: list[Pod]) -> list[Pod]:
    """``pending`` (our copy of the notifications) and the pods fetched for this request that it
    lacks: once a pod's notification is in, its copy is the newer one."""
    if not fetched:
        return pending
    have = {p.uid for p in pending}
    return pending + [p for p in fetched if p.uid not in have and p.status.phase == "Pending"]


async def _news(cache: PodCache, since: int, fetch: asyncio.Task[list[Pod]], until: float) -> bool:
    """Until ``cache`` changes after version ``since`` or ``fetch`` ends, whichever is first, before
    the monotonic time ``until`` (a fetch still under way then is awaited: it has its own timeout).
    False when neither brought anything (the time is up, the fetch was already in)."""
    left = until - time.monotonic()
    if fetch.done():
        return left > 0 and await cache.wait_for_change(since, left)
    changed = asyncio.create_task(cache.wait_for_change(since, max(left, 0.0)))
    try:
        await asyncio.wait({changed, fetch}, return_when=asyncio.FIRST_COMPLETED)
        if not fetch.done() and not changed.result():
            await asyncio.wait({fetch})
    finally:
        changed.cancel()
    return True


class _Ahead(Generic[_T]):
    """A per-pod lookup (``lookup(pod_uid)``) started for the pod of the grant ``guessed`` before a
    check says which pod is the right one: ``for_pod`` answers from it when it is that pod, else
    looks up afresh. Leaving the ``with`` drops it (cancelled; a failure nobody asked for is not
    reported)."""

    def __init__(self, guessed: Allocation | None, lookup: Callable[[str], Awaitable[_T]]) -> None:
        self._lookup = lookup
        self._uid = guessed.pod_uid if guessed is not None else None
        self._task = asyncio.ensure_future(lookup(self._uid)) if self._uid is not None else None

    def __enter__(self) -> _Ahead[_T]:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._task is not None:
            discard(self._task)

    async def for_pod(self, uid: str) -> _T:
        if self._task is not None and uid == self._uid:
            return await self._task
        return await self._lookup(uid)


class _Choice(NamedTuple):
    candidate: Candidate
    confirm: bool = False  # taken before the kubelet's List answered: check it before replying


class _KubeletView:
    """The kubelet's pod-resources List for one Allocate, shared by every step that needs it: ours,
    sent at receipt (or on the first ``get``); or the registrar's (``forwarded``), taken on the first
    ``get``, which asks again here when it failed or has not come ``_FORWARD_WAIT`` after it was first
    needed (this process may reach the kubelet when the registrar does not); or one the registrar
    brought along (``record``). Its answer is None when pod-resources is not available
    (verify_identity warns about it): the guess alone then."""

    def __init__(self, kubelet: KubeletPodResources | None, *, record: KubeletRecord | None = None,
                 forwarded: asyncio.Future[KubeletRecord] | None = None) -> None:
        self._kubelet = kubelet
        self._list: asyncio.Future[KubeletRecord] | None = None
        if record is not None:
            self._list = asyncio.get_running_loop().create_future()
            self._list.set_result(record)
        self._forwarded = forwarded
        self.withdrawn = 0  # the request's grants this List did not confirm, released (``_confirmed``)

    def start(self) -> None:
        if self._list is not None:
            return
        if self._forwarded is not None:
            self._list = self._forwarded
        elif self._kubelet is not None:
            self._list = self._kubelet.begin_list("allocate")

    @property
    def _adopted(self) -> bool:
        """``_list`` is the registrar's List (not one asked here after it failed)."""
        return self._list is not None and self._list is self._forwarded

    @property
    def started(self) -> bool:
        """A List was asked (or taken from the registrar): its answer, not a guess, decides."""
        return self._list is not None

    @property
    def answered(self) -> bool:
        """The List is over (answered, or failed: ``get`` then returns at once; the registrar's, failed,
        is not: ``get`` asks again)."""
        if self._list is None:
            return self._kubelet is None and self._forwarded is None
        if not self._list.done():
            return False
        return not (self._adopted and self._kubelet is not None and self._failed())

    async def get(self, timeout: float) -> KubeletRecord | None:
        """The record, or None when the kubelet did not answer within ``timeout``."""
        deadline = time.monotonic() + timeout
        self.start()
        if self._list is None:
            return None
        if self._adopted and self._kubelet is not None:
            if not self._list.done():
                await asyncio.wait({self._list}, timeout=min(timeout, _FORWARD_WAIT))
            if not self._list.done() or self._failed():
                self.cancel()
                self._list = self._kubelet.begin_list("allocate")
        if not self._list.done():
            await asyncio.wait({self._list}, timeout=max(0.0, deadline - time.monotonic()))
        return self.record

    def _failed(self) -> bool:
        assert self._list is not None and self._list.done()
        return self._list.cancelled() or self._list.exception() is not None

    @property
    def record(self) -> KubeletRecord | None:
        """The kubelet's answer, once it came; None before, or when the List failed."""
        if self._list is None or not self._list.done() or self._list.cancelled() or self._list.exception():
            return None
        return self._list.result()

    def cancel(self) -> None:
        if self._list is not None:
            discard(self._list)
