"""Publishes the node's ResourceSlice for the DRA driver and keeps it current.

The slice is rebuilt from the registrar's catalog (the inventory the allocator recorded) and its
health view whenever either changes (both bump ``catalog.version`` and wake ``catalog.changed``),
and written to the API server: created when missing, replaced with the stored resourceVersion
otherwise (a conflict or an unreachable API server is retried with backoff, capped). Each content
change raises the pool's generation, so the scheduler drops what an older generation said. The
devices are the GPUs the ledger has in DRA mode (``catalog.dra_gpus``, the allocator's answer, followed
on every ``gpu.mode`` event), the very set ListAndWatch leaves out, so the slice and the advertised
device-plugin capacity describe disjoint GPUs: a GPU the ``dra_gpus`` setting names but that was busy
under the device plugin at the allocator's start (it keeps its mode) is not published, and a GPU moved
at run time (``allocator.gpu-mode``) moves between the two. With no DRA GPU the slice is deleted.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.resources.resource_v1 import ResourceSlice

from libs.dra_objects import node_slice, slice_name
from libs.logger import get_logger
from services.registrar.catalog import DeviceCatalog
from services.registrar.health import DeviceHealth

__all__ = ["SlicePublisher"]

_logger = get_logger("registrar")
MAX_BACKOFF = 5.0


class SlicePublisher:
    def __init__(self, client: AsyncClient, catalog: DeviceCatalog, health: DeviceHealth) -> None:
        self.client = client
        self.catalog = catalog
        self.health = health
        self.generation = 0
        self.published: dict[str, Any] | None = None  # the spec last written (None: nothing yet)
        self.writes = 0

    def desired(self) -> dict[str, Any] | None:
        """The slice the catalog calls for now (generation not yet set), or None without DRA GPUs."""
        inventory = self.catalog.inventory
        if inventory is None:
            return None
        gpus = tuple(g for g in inventory.gpus if g.index in self.catalog.dra_gpus)
        if not gpus:
            return None
        unhealthy = {uuid: "unhealthy" for uuid in self.health.unhealthy}
        return node_slice(inventory, gpus, 0, unhealthy=unhealthy,
                          taint_time=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))

    @staticmethod
    def _comparable(obj: dict[str, Any] | None) -> Any:
        """The slice without what changes on every write (generation, taint times)."""
        if obj is None:
            return None
        devices = [{**d, "taints": [{k: v for k, v in t.items() if k != "timeAdded"} for t in d.get("taints", [])]}
                   for d in obj["spec"]["devices"]]
        return {**obj["spec"], "pool": {**obj["spec"]["pool"], "generation": 0}, "devices": devices}

    async def publish_once(self) -> None:
        want = self.desired()
        if self._comparable(want) == self._comparable(self.published) and self.published is not None:
            return
        inventory = self.catalog.inventory
        if inventory is None:
            return
        name = slice_name(inventory.node)
        try:
            current = await self.client.get(ResourceSlice, name)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
            current = None
        if want is None:
            if current is not None:
                await self.client.delete(ResourceSlice, name)
                _logger.info("ResourceSlice deleted: no GPU is in DRA mode", slice=name)
            self.published = None
            return
        if current is not None:
            self.generation = max(self.generation, int(current.spec.pool.generation))
        self.generation += 1
        want["spec"]["pool"]["generation"] = self.generation
        if current is None:
            await self.client.create(ResourceSlice.from_dict(want))
        else:
            want["metadata"]["resourceVersion"] = current.metadata.resourceVersion
            await self.client.replace(ResourceSlice.from_dict(want))
        self.published = want
        self.writes += 1
        _logger.info("ResourceSlice published", slice=name, generation=self.generation,
                     devices=[d["name"] for d in want["spec"]["devices"]],
                     tainted=[d["name"] for d in want["spec"]["devices"] if d.get("taints")])

    async def run(self) -> None:
        delay = 0.2
        seen = -1
        while True:
            async with self.catalog.changed:
                await self.catalog.changed.wait_for(lambda s=seen: self.catalog.version != s)
                seen = self.catalog.version
            while True:
                try:
                    await self.publish_once()
                    delay = 0.2
                    break
                except Exception as exc:  # API errors and the HTTP client's connection errors alike
                    _logger.warning("ResourceSlice publication failed; retrying", error=str(exc), delay=delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, MAX_BACKOFF)
                    if self.catalog.version != seen:
                        break
