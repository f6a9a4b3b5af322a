"""The kubelet's device manager (upstream `cm/devicemanager/manager.go`), profile 1.25-1.36.

Keeps the per-resource device sets fed by ListAndWatch, the endpoints, the allocation table and
the "allocated" sets; chooses device IDs at admission (spec 2.4), calls GetPreferredAllocation,
Allocate and PreStartContainer, garbage-collects allocations of pods that are no longer active
(spec 2.8) and computes capacity/allocatable (spec 2.3, 2.7).

Everything runs on one asyncio loop, so state changes between two awaits are atomic; the places
where upstream drops its mutex around an RPC are exactly the awaits here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from typing import Any

from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as dp

from .calls import CallLog, describe_error
from .checkpoint import Checkpoint, CheckpointError, CheckpointRow, read_checkpoint, write_checkpoint
from .config import SimConfig
from .endpoints import Endpoint, PluginClient, bounded
from .logger import logger
from .notify import Changes
from .poddevices import NO_TOPOLOGY, PodDevices
from .podspec import container_limits, init_containers, is_sidecar, pod_uid

__all__ = ["AllocationError", "ContainerStartError", "DeviceManager", "ResourceInfo"]

_logger = logger("devicemanager")


class AllocationError(Exception):
    """Admission failed; the text is the kubelet's error text."""


class ContainerStartError(Exception):
    """Building a container's device options failed (PreStartContainer and friends)."""


class ResourceInfo(dict[str, Any]):
    """What `registered_resources()` reports per resource; attribute access for convenience."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class DeviceManager:
    def __init__(
        self,
        cfg: SimConfig,
        calls: CallLog,
        rng: random.Random,
        active_pods: Callable[[], set[str]],
    ) -> None:
        self._cfg = cfg
        self._calls = calls
        self._rng = rng
        self._active_pods = active_pods
        self.changes = Changes()
        # Resources dropped after the stop grace: the node status reports them as 0 from then on.
        self.removed: set[str] = set()
        self._reset_state()

    def _reset_state(self) -> None:
        self.endpoints: dict[str, Endpoint] = {}
        self.healthy: dict[str, set[str]] = {}
        self.unhealthy: dict[str, set[str]] = {}
        self.all_devices: dict[str, dict[str, dp.Device]] = {}
        self.allocated: dict[str, set[str]] = {}
        self.pod_devices = PodDevices()
        self.devices_to_reuse: dict[str, dict[str, set[str]]] = {}
        self.pending_admission: str | None = None
        self._checkpoint_order: dict[str, tuple[set[str], list[str]]] = {}
        # The simulator re-admits nothing at kubelet restart, so its pod sources are always ready.
        self.sources_ready = True

    # -- helpers -------------------------------------------------------------------------------

    def _shuffled(self, items: Iterable[str]) -> list[str]:
        """Go set iteration order: arbitrary. Sorting first makes it depend on the seed only."""
        out = sorted(items)
        self._rng.shuffle(out)
        return out

    def _first_of_shuffled(self, items: Iterable[str], count: int) -> list[str]:
        """``count`` items in arbitrary order, drawn as the head of ``_shuffled(items)`` would be, without
        shuffling the rest: a pool of 400 vcuda-core IDs shuffled whole for each Allocate cost the
        admission about 0.3 ms."""
        pool = sorted(items)
        return self._rng.sample(pool, min(count, len(pool)))

    def _limits_in_random_order(self, container: dict[str, Any]) -> list[tuple[str, int]]:
        limits = container_limits(container)
        return [(name, limits[name]) for name in self._shuffled(limits)]

    def is_device_plugin_resource(self, resource: str) -> bool:
        """Registered (it has a healthy set, maybe empty) or with allocations on record."""
        return resource in self.healthy or resource in self.allocated

    # -- checkpoint ----------------------------------------------------------------------------

    def _checkpoint(self) -> Checkpoint:
        rows = [
            CheckpointRow(uid, container, resource, alloc.devices_per_numa, alloc.response)
            for uid, container, resource, alloc in self.pod_devices.entries()
        ]
        registered = {resource: self._registered_order(resource, ids) for resource, ids in self.healthy.items()}
        return Checkpoint(rows=rows, registered=registered)

    def _registered_order(self, resource: str, ids: set[str]) -> list[str]:
        """A resource's healthy IDs in the checkpoint's arbitrary order, kept while its set stays the same
        (ListAndWatch replaces the set): sorting and shuffling hundreds of IDs at every write took about a
        third of the emulated kubelet's checkpoint time (a Go kubelet does it in microseconds)."""
        cached = self._checkpoint_order.get(resource)
        if cached is None or cached[0] is not ids:
            cached = self._checkpoint_order[resource] = (ids, self._shuffled(ids))
        return cached[1]

    def write_checkpoint(self) -> None:
        if not self._cfg.write_checkpoint:
            return
        try:
            write_checkpoint(self._cfg.device_plugin_dir, self._checkpoint())
        except OSError as err:
            _logger.error("writing checkpoint failed", error=str(err))

    def _apply_checkpoint(self, cp: Checkpoint) -> None:
        for row in cp.rows:
            self.pod_devices.insert(
                row.pod_uid, row.container, row.resource, row.devices_per_numa, row.response
            )
        self.allocated = self.pod_devices.devices()
        now = time.monotonic()
        for resource in cp.registered:
            # Capacity stays 0 until the plugin registers again; the removal grace starts now.
            self.healthy[resource] = set()
            self.unhealthy[resource] = set()
            self.endpoints[resource] = Endpoint(resource, None, None, self._calls, stopped_at=now)

    def load_checkpoint(self) -> None:
        """Kubelet start: a missing file is fine, a corrupt one means starting empty."""
        try:
            cp = read_checkpoint(self._cfg.device_plugin_dir)
        except CheckpointError as err:
            _logger.warning("ignoring unusable checkpoint", error=str(err))
            return
        if cp is not None:
            self._apply_checkpoint(cp)

    def restart(self) -> None:
        """Forget everything a kubelet process holds in memory and rebuild it from the checkpoint."""
        cp = None if self._cfg.write_checkpoint else self._checkpoint()
        self._reset_state()
        if cp is not None:
            self._apply_checkpoint(cp)
        else:
            self.load_checkpoint()
        self.changes.notify()

    # -- plugin events (called by the registration server) -------------------------------------

    async def plugin_connected(self, resource: str, client: PluginClient,
                               given: dp.DevicePluginOptions | None = None) -> None:
        """Fetch the options inside Register; RegisterRequest.options is ignored on purpose
        (except before 1.25, whose registration passes them as `given`).

        The kubelet sets no deadline on GetDevicePluginOptions; `options_timeout` (default 30 s)
        only keeps a broken plugin from hanging a test forever.
        """
        assert client.stub is not None
        if given is not None:
            self._connected(resource, client, given)
            return
        req = dp.Empty()
        try:
            with self._calls.record("GetDevicePluginOptions", resource, req, client.socket) as rec:
                call = client.stub.GetDevicePluginOptions(req)
                options = await bounded(call, self._cfg.options_timeout, "GetDevicePluginOptions")
                rec.response = {
                    "pre_start_required": options.pre_start_required,
                    "get_preferred_allocation_available": options.get_preferred_allocation_available,
                }
        except Exception as err:
            raise ConnectionError(f"failed to get device plugin options: {describe_error(err)}") from err
        self._connected(resource, client, options)

    def _connected(self, resource: str, client: PluginClient, options: dp.DevicePluginOptions) -> None:
        self.endpoints[resource] = Endpoint(resource, client, options, self._calls)
        self.removed.discard(resource)
        _logger.info("device plugin connected", resource=resource, socket=client.socket)
        self.changes.notify()

    def plugin_disconnected(self, resource: str) -> None:
        ep = self.endpoints.get(resource)
        if ep is None:
            return
        self._mark_resource_unhealthy(resource)
        ep.set_stopped()
        _logger.info("endpoint became unhealthy", resource=resource, socket=ep.socket)
        self.changes.notify()

    def plugin_snapshot(self, resource: str, resp: dp.ListAndWatchResponse) -> None:
        """Each ListAndWatch message replaces the resource's devices entirely."""
        healthy: set[str] = set()
        unhealthy: set[str] = set()
        devices: dict[str, dp.Device] = {}
        for dev in resp.devices:
            devices[dev.ID] = dev
            # Exact string: "healthy" or "" count as unhealthy, as in the kubelet.
            (healthy if dev.health == "Healthy" else unhealthy).add(dev.ID)
        self.healthy[resource] = healthy
        self.unhealthy[resource] = unhealthy
        self.all_devices[resource] = devices
        self.removed.discard(resource)
        self.write_checkpoint()
        self.changes.notify()

    def _mark_resource_unhealthy(self, resource: str) -> None:
        was_healthy = self.healthy.get(resource, set())
        if resource in self.healthy:
            self.healthy[resource] = set()
        self.unhealthy[resource] = self.unhealthy.get(resource, set()) | was_healthy

    # -- node status ---------------------------------------------------------------------------

    def get_capacity(self) -> tuple[dict[str, int], dict[str, int], set[str]]:
        """Capacity, allocatable, and the resources removed now because their grace ran out."""
        grace = self._cfg.endpoint_grace
        capacity: dict[str, int] = {}
        allocatable: dict[str, int] = {}
        deleted: set[str] = set()
        for resource in set(self.healthy) | set(self.unhealthy):
            ep = self.endpoints.get(resource)
            if ep is None or ep.grace_expired(grace):
                self.endpoints.pop(resource, None)
                self.healthy.pop(resource, None)
                self.unhealthy.pop(resource, None)
                deleted.add(resource)
                continue
            if resource in self.healthy:
                allocatable[resource] = len(self.healthy[resource])
            capacity[resource] = allocatable.get(resource, 0) + len(self.unhealthy.get(resource, ()))
        if deleted:
            for resource in deleted:
                self.all_devices.pop(resource, None)
            self.removed |= deleted
            _logger.info("removed resources after endpoint grace", resources=sorted(deleted))
            self.write_checkpoint()
            self.changes.notify()
        return capacity, allocatable, deleted

    def registered_resources(self) -> dict[str, ResourceInfo]:
        capacity, allocatable, _ = self.get_capacity()
        out: dict[str, ResourceInfo] = {}
        for resource, ep in self.endpoints.items():
            opts = ep.options
            out[resource] = ResourceInfo(
                resource=resource,
                socket=ep.socket,
                pre_start_required=bool(opts and opts.pre_start_required),
                get_preferred_allocation_available=bool(opts and opts.get_preferred_allocation_available),
                stopped=ep.is_stopped(),
                capacity=capacity.get(resource, 0),
                allocatable=allocatable.get(resource, 0),
            )
        return out

    # -- garbage collection --------------------------------------------------------------------

    def update_allocated_devices(self) -> None:
        """Drop allocations of pods that are no longer active (upstream UpdateAllocatedDevices)."""
        if not self.sources_ready:
            return
        active = set(self._active_pods())
        if self.pending_admission is not None:
            active.add(self.pending_admission)
        to_remove = self.pod_devices.pods() - active
        if not to_remove:
            return
        _logger.info("reclaiming devices of inactive pods", pods=sorted(to_remove))
        self.pod_devices.delete(to_remove)
        self.allocated = self.pod_devices.devices()
        self.changes.notify()

    # -- allocation ----------------------------------------------------------------------------

    async def allocate(self, pod: dict[str, Any], container: dict[str, Any]) -> None:
        """Allocate devices for one container at admission; raises AllocationError."""
        uid = pod_uid(pod)
        self.pending_admission = uid  # keep GC from reclaiming the pod being admitted
        reuse = self.devices_to_reuse.setdefault(uid, {})
        for other in [u for u in self.devices_to_reuse if u != uid]:
            del self.devices_to_reuse[other]
        name = container["name"]
        for init in init_containers(pod):
            if init.get("name") == name:
                await self._allocate_container_resources(pod, container, reuse)
                if is_sidecar(init):
                    self.pod_devices.remove_container_allocated_resources(uid, name, reuse)
                else:
                    self.pod_devices.add_container_allocated_resources(uid, name, reuse)
                return
        await self._allocate_container_resources(pod, container, reuse)
        self.pod_devices.remove_container_allocated_resources(uid, name, reuse)

    async def _allocate_container_resources(
        self, pod: dict[str, Any], container: dict[str, Any], reuse: dict[str, set[str]]
    ) -> None:
        uid = pod_uid(pod)
        name = container["name"]
        gc_done = False
        needs_checkpoint = False
        try:
            for resource, needed in self._limits_in_random_order(container):
                if not self.is_device_plugin_resource(resource):
                    continue
                if not gc_done:
                    self.update_allocated_devices()
                    gc_done = True
                pool = reuse.get(resource, set())
                chosen = await self._devices_to_allocate(pod, name, resource, needed, pool)
                if not chosen:
                    continue
                needs_checkpoint = True
                ep = self.endpoints.get(resource)
                if ep is None:
                    self.allocated = self.pod_devices.devices()
                    raise AllocationError(f"unknown Device Plugin {resource}")
                ids = self._shuffled(chosen)
                try:
                    resp = await ep.allocate(ids, self._cfg.allocate_timeout)
                except Exception as err:
                    # Roll back: rebuild the allocated sets from what is really on record.
                    self.allocated = self.pod_devices.devices()
                    raise AllocationError(describe_error(err)) from err
                if not resp.container_responses:
                    # Upstream does not roll back here: the IDs stay "allocated" until the next GC.
                    raise AllocationError(
                        "no containers return in allocation response "
                        "&AllocateResponse{ContainerResponses:[]*ContainerAllocateResponse{},}"
                    )
                self.pod_devices.insert(uid, name, resource, self._per_numa(resource, ids),
                                        resp.container_responses[0])
            # Written once per container, and only when it issued an Allocate that succeeded.
            if needs_checkpoint:
                self.write_checkpoint()
        finally:
            self.changes.notify()

    def _per_numa(self, resource: str, ids: list[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        known = self.all_devices.get(resource, {})
        for dev_id in ids:
            for node in _numa_nodes(known.get(dev_id)) or [NO_TOPOLOGY]:
                out.setdefault(node, []).append(dev_id)
        return out

    async def _devices_to_allocate(
        self, pod: dict[str, Any], container: str, resource: str, required: int, reusable: set[str]
    ) -> list[str] | None:
        """Upstream devicesToAllocate: which IDs to send to Allocate, or None for "no RPC"."""
        uid = pod_uid(pod)
        needed = required
        recorded = self.pod_devices.container_devices(uid, container, resource)
        if recorded is not None:
            needed -= len(recorded)
            if needed != 0:
                raise AllocationError(
                    f'pod "{uid}" container "{container}" changed request for resource "{resource}" '
                    f"from {len(recorded)} to {required}"
                )
        healthy = self.healthy.get(resource)
        if healthy is None:
            raise AllocationError(f"cannot allocate unregistered device {resource}")
        if not healthy:
            # Also for a zero-quantity request.
            raise AllocationError(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
        if recorded is not None and not recorded <= healthy:
            raise AllocationError(
                "previously allocated devices are no longer healthy; "
                f"cannot allocate unhealthy devices {resource}"
            )
        if needed == 0:
            return None

        chosen: list[str] = []

        def take_from(candidates: set[str]) -> bool:
            """Add candidates (arbitrary order) until satisfied; True once nothing is needed."""
            nonlocal needed
            in_use = self.allocated.setdefault(resource, set())
            for dev in self._first_of_shuffled(candidates.difference(chosen), needed):
                in_use.add(dev)
                chosen.append(dev)
                needed -= 1
                if needed == 0:
                    return True
            return False

        # The pool is not re-checked against health: a reused device that turned unhealthy is
        # still handed over, as upstream does.
        if take_from(reusable):
            return chosen
        available = healthy - self.allocated.get(resource, set())
        if len(available) < needed:
            raise AllocationError(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {needed}, Available: {len(available)}"
            )
        aligned, unaligned, no_affinity = self._filter_by_affinity(pod, container, resource, available)
        short = AllocationError(
            "unexpectedly allocated less resources than required. "
            f"Requested: {required}, Got: {required - needed}"
        )
        if needed < len(aligned):
            offered = aligned | set(chosen)
            preferred = await self._preferred_allocation(resource, offered, set(chosen), required)
            if take_from(preferred & aligned) or take_from(aligned):
                return chosen
            raise short
        if take_from(aligned):
            return chosen
        preferred = await self._preferred_allocation(resource, available | set(chosen), set(chosen), required)
        if take_from(preferred & available) or take_from(unaligned) or take_from(no_affinity):
            return chosen
        raise short

    def _filter_by_affinity(
        self, pod: dict[str, Any], container: str, resource: str, available: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """Split available devices into (aligned, unaligned, no-topology) by the topology hint."""
        hint = self._cfg.numa_hint(pod, container) if self._cfg.numa_hint else None
        if hint is None:
            return set(), set(), set(available)
        devices = self.all_devices.get(resource, {})
        has_topology = any(d.HasField("topology") and d.topology.nodes for d in devices.values())
        if not has_topology:
            return set(), set(), set(available)
        per_node: dict[int, set[str]] = {}
        for dev_id in available:
            for node in _numa_nodes(devices.get(dev_id)) or [NO_TOPOLOGY]:
                per_node.setdefault(node, set()).add(dev_id)

        def rank(node: int) -> tuple[int, int]:
            group = 0 if node in hint else (2 if node == NO_TOPOLOGY else 1)
            return group, len(per_node[node])

        nodes = list(per_node)
        self._rng.shuffle(nodes)  # ties are broken arbitrarily upstream (sort.Slice)
        nodes.sort(key=rank)
        aligned: set[str] = set()
        unaligned: set[str] = set()
        no_topology: set[str] = set()
        for dev_id in available:
            for node in nodes:  # a device on several nodes goes by the first one in this order
                if dev_id in per_node[node]:
                    if node == NO_TOPOLOGY:
                        no_topology.add(dev_id)
                    elif node in hint:
                        aligned.add(dev_id)
                    else:
                        unaligned.add(dev_id)
                    break
        return aligned, unaligned, no_topology

    async def _preferred_allocation(
        self, resource: str, available: set[str], must_include: set[str], size: int
    ) -> set[str]:
        ep = self.endpoints.get(resource)
        if ep is None:
            raise AllocationError(f"endpoint not found in cache for a registered resource: {resource}")
        if ep.options is None or not ep.options.get_preferred_allocation_available:
            return set()
        try:
            resp = await ep.get_preferred_allocation(
                self._shuffled(available), self._shuffled(must_include), size, self._cfg.allocate_timeout
            )
        except Exception as err:
            raise AllocationError(
                f"device plugin GetPreferredAllocation rpc failed with err: {describe_error(err)}"
            ) from err
        if resp.container_responses:
            return set(resp.container_responses[0].deviceIDs)
        return set()

    # -- container start -----------------------------------------------------------------------

    async def run_container_options(
        self, pod: dict[str, Any], container: dict[str, Any], pod_active: Callable[[str], bool]
    ) -> dict[str, Any]:
        """Upstream GetDeviceRunContainerOptions, called right before each container is created.

        PreStartContainer for every device resource with quantity > 0 whose plugin asks for it;
        Allocate again when an active pod has no record (a lost checkpoint); then the merged
        options. Raises ContainerStartError or AllocationError.
        """
        uid = pod_uid(pod)
        name = container["name"]
        needs_reallocate = False
        for resource, quantity in self._limits_in_random_order(container):
            if not self.is_device_plugin_resource(resource) or quantity == 0:
                continue
            await self._pre_start_if_needed(uid, name, resource)
            if not pod_active(uid):
                continue
            if self.pod_devices.container_devices(uid, name, resource) is None:
                needs_reallocate = True
        if needs_reallocate:
            _logger.info("re-allocating devices at container start", pod=uid, container=name)
            await self.allocate(pod, container)
        return self.pod_devices.run_container_options(uid, name, self._rng)

    async def _pre_start_if_needed(self, uid: str, container: str, resource: str) -> None:
        ep = self.endpoints.get(resource)
        if ep is None:
            raise ContainerStartError(f"endpoint not found in cache for a registered resource: {resource}")
        if ep.options is None or not ep.options.pre_start_required:
            return
        devices = self.pod_devices.container_devices(uid, container, resource)
        if devices is None:
            raise ContainerStartError(
                f"no devices found allocated in local cache for pod {uid}, container {container}, "
                f"resource {resource}"
            )
        try:
            await ep.pre_start_container(self._shuffled(devices), self._cfg.prestart_timeout)
        except Exception as err:
            raise ContainerStartError(
                f"device plugin PreStartContainer rpc failed with err: {describe_error(err)}"
            ) from err

    # -- PodResources views --------------------------------------------------------------------

    def container_devices(self, uid: str, container: str) -> list[tuple[str, str, int]]:
        """(resource, device ID, NUMA node or -1) per device and node, for PodResources."""
        out = []
        for resource, alloc in self.pod_devices.container_allocations(uid, container).items():
            for node, ids in alloc.devices_per_numa.items():
                out.extend((resource, dev_id, node) for dev_id in ids)
        return out

    def allocatable_devices(self) -> list[tuple[str, str, list[int]]]:
        """(resource, device ID, NUMA nodes) for every healthy device."""
        out = []
        for resource, devices in self.all_devices.items():
            healthy = self.healthy.get(resource, set())
            for dev_id, dev in devices.items():
                if dev_id in healthy:
                    out.append((resource, dev_id, _numa_nodes(dev)))
        return out


def _numa_nodes(dev: dp.Device | None) -> list[int]:
    """The NUMA nodes a device reports; empty for an unknown device or one without topology."""
    return [n.ID for n in dev.topology.nodes] if dev is not None and dev.HasField("topology") else []
