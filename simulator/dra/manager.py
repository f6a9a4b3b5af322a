"""The kubelet's DRA manager: prepare a pod's claims before its containers, unprepare after them.

Upstream ``pkg/kubelet/cm/dra``, as far as our driver needs it:

* ``prepare_pod`` runs in the pod worker before any container is created. Each of the pod's
  ``spec.resourceClaims`` is found (directly, or through ``status.resourceClaimStatuses`` for a
  template), must be allocated and reserved for the pod ("is not allowed to use resource claim"
  otherwise), and the claims not prepared yet are sent to their driver's newest registered
  instance in one NodePrepareResources per driver, bounded by the kubelet's 45 s. Every claim asked
  must be answered; a per-claim error, a missing entry, an unregistered driver or a timeout fail the
  attempt with one message (the kubelet tries again on the next pod sync; the simulated kubelet
  with backoff). A claim already prepared (a second pod sharing it) is not prepared again.
* The claim-info cache (claim uid -> namespace, name, the pods using it, each driver's devices with
  their CDI IDs) is written to ``<state dir>/dra_manager_state`` after every change, as the kubelet
  does, and read back at a (simulated) kubelet restart: a claim prepared before the restart is not
  prepared blindly again, and is still unprepared when its pods finish.
* ``container_cdi_ids`` gives the CDI device IDs of the claims (and requests) a container names in
  ``resources.claims``; the kubelet resolves them (``cdi_resolve``) before CreateContainer.
* Once a pod is gone (its containers stopped and the object removed) or terminal, it leaves its
  claims; a claim no pod uses any more is unprepared (NodeUnprepareResources per driver, 45 s),
  tried again on every pass until the driver answers without an error, and only then forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..calls import describe_error
from ..logger import logger
from ..notify import Changes
from ..podspec import pod_key, pod_uid
from .store import DraObjects
from .watcher import PluginWatcher

__all__ = ["CHECKPOINT_FILE", "ClaimInfo", "DraManager", "DraPrepareError"]

CHECKPOINT_FILE = "dra_manager_state"
KUBELET_CALL_TIMEOUT = 45.0  # NodePrepareResources / NodeUnprepareResources deadline
_logger = logger("dra-manager")


class DraPrepareError(Exception):
    """The pod's claims could not be prepared (yet); the message is what the pod's status shows."""


@dataclass
class ClaimInfo:
    uid: str
    namespace: str
    name: str
    pods: set[str] = field(default_factory=set)
    devices: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # driver -> answered devices

    def to_json(self) -> dict[str, Any]:
        return {"uid": self.uid, "namespace": self.namespace, "name": self.name, "pods": sorted(self.pods),
                "devices": self.devices}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ClaimInfo:
        return cls(uid=raw["uid"], namespace=raw["namespace"], name=raw["name"], pods=set(raw["pods"]),
                   devices={k: list(v) for k, v in raw["devices"].items()})


class DraManager:
    def __init__(self, objects: DraObjects, watcher: PluginWatcher, state_dir: Path,
                 pod_done: Callable[[str], bool], *, timeout: float = KUBELET_CALL_TIMEOUT) -> None:
        self.objects = objects
        self.watcher = watcher
        self.state_dir = Path(state_dir)
        self.pod_done = pod_done  # pod uid -> the pod is gone or terminal (its containers stopped)
        self.timeout = timeout
        self.claims: dict[str, ClaimInfo] = {}
        self.unprepare_errors: dict[str, str] = {}  # claim uid -> the last unprepare failure
        self.changes = Changes()
        self.gate: asyncio.Event | None = None  # fault injection: when set, containers wait for it after prepare
        self._lock = asyncio.Lock()  # one prepare or unprepare pass at a time, like the kubelet's manager

    # -- the claim-info checkpoint -----------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        return self.state_dir / CHECKPOINT_FILE

    def load_checkpoint(self) -> None:
        """Replace the cache with the checkpoint's (kubelet start); ValueError when it is corrupt."""
        try:
            raw = self.checkpoint_path.read_bytes()
        except FileNotFoundError:
            self.claims = {}
            return
        try:
            doc = json.loads(raw)
            entries = doc["entries"]
            if zlib.crc32(json.dumps(entries, sort_keys=True).encode()) != doc["checksum"]:
                raise ValueError("checksum mismatch")
            self.claims = {e["uid"]: ClaimInfo.from_json(e) for e in entries}
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"corrupt DRA manager checkpoint {self.checkpoint_path}: {exc}") from None
        _logger.info("DRA claim cache restored", claims=sorted(self.claims))

    async def reload(self) -> None:
        """A kubelet restart: the cache becomes what the checkpoint holds (between two passes)."""
        async with self._lock:
            self.load_checkpoint()

    def _save(self) -> None:
        entries = [c.to_json() for c in sorted(self.claims.values(), key=lambda c: c.uid)]
        body = json.dumps({"version": "v1", "entries": entries,
                           "checksum": zlib.crc32(json.dumps(entries, sort_keys=True).encode())}).encode()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".dra-", dir=self.state_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, self.checkpoint_path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        self.changes.notify()

    # -- prepare -----------------------------------------------------------------------------------

    def _pod_claims(self, pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """(entry name, ResourceClaim) for each of the pod's claims; DraPrepareError when one is not usable."""
        ns, name = pod_key(pod)
        uid = pod_uid(pod)
        statuses = {s.get("name"): s.get("resourceClaimName")
                    for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
        out = []
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            claim_name = entry.get("resourceClaimName") or statuses.get(entry.get("name"))
            if not claim_name:
                raise DraPrepareError(f"waiting for the ResourceClaim of pod claim {entry.get('name')!r}")
            claim = self.objects.claims.get(ns, claim_name)
            if claim is None:
                raise DraPrepareError(f"ResourceClaim {ns}/{claim_name} not found")
            status = claim.get("status") or {}
            if not status.get("allocation"):
                raise DraPrepareError(f"ResourceClaim {ns}/{claim_name} is not allocated")
            if all(r.get("uid") != uid for r in status.get("reservedFor") or []):
                raise DraPrepareError(f"pod {name} ({uid}) is not allowed to use resource claim {claim_name}")
            out.append((entry["name"], claim))
        return out

    async def prepare_pod(self, pod: dict[str, Any]) -> None:
        """Prepare every claim of the pod not prepared yet; DraPrepareError with the reason otherwise."""
        async with self._lock:
            uid = pod_uid(pod)
            claims = self._pod_claims(pod)
            todo: dict[str, list[dict[str, Any]]] = {}  # driver -> claims to prepare
            for _, claim in claims:
                info = self.claims.get(claim["metadata"]["uid"])
                if info is not None:
                    info.pods.add(uid)  # prepared already (another pod's, or before a kubelet restart)
                    continue
                results = claim["status"]["allocation"].get("devices", {}).get("results") or []
                for driver in dict.fromkeys(r.get("driver", "") for r in results):
                    todo.setdefault(driver, []).append(claim)
            prepared: dict[str, dict[str, list[dict[str, Any]]]] = {}
            errors = []
            for driver, batch in todo.items():
                try:
                    answers = await self._call_prepare(driver, batch)
                except DraPrepareError as err:
                    errors.append(str(err))
                    continue
                for claim in batch:
                    prepared.setdefault(claim["metadata"]["uid"], {})[driver] = answers[claim["metadata"]["uid"]]
            for _, claim in claims:
                meta = claim["metadata"]
                if meta["uid"] in self.claims:
                    continue
                drivers_needed = {d for d, batch in todo.items() if claim in batch}
                done = prepared.get(meta["uid"], {})
                if set(done) == drivers_needed:  # no driver of ours at all: nothing to prepare, still tracked
                    self.claims[meta["uid"]] = ClaimInfo(meta["uid"], meta["namespace"], meta["name"], {uid}, done)
            self._save()
            if errors:
                raise DraPrepareError("; ".join(errors))

    async def _call_prepare(self, driver: str, batch: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        client = self.watcher.client(driver)
        if client is None:
            raise DraPrepareError(f"failed to get gRPC client for driver {driver}: plugin name {driver} not found "
                                  "in the list of registered DRA plugins")
        asked = [(c["metadata"]["namespace"], c["metadata"]["uid"], c["metadata"]["name"]) for c in batch]
        try:
            answers = await client.prepare(asked, self.timeout)
        except Exception as err:  # the gRPC error, a deadline, a closed channel
            raise DraPrepareError(f"NodePrepareResources failed: {describe_error(err)}") from None
        out, errors = {}, []
        for ns, claim_uid, name in asked:
            answer = answers.get(claim_uid)
            if answer is None:
                errors.append(f"NodePrepareResources left out claim {ns}/{name} ({claim_uid})")
            elif answer.error:
                errors.append(f"NodePrepareResources failed for claim {ns}/{name}: {answer.error}")
            else:
                out[claim_uid] = answer.devices
        if errors:
            raise DraPrepareError("; ".join(errors))
        return out

    # -- what the containers get -------------------------------------------------------------------

    def container_cdi_ids(self, pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
        """The CDI device IDs of the prepared claims (requests) this container names."""
        ns, _ = pod_key(pod)
        statuses = {s.get("name"): s.get("resourceClaimName")
                    for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
        entries = {e.get("name"): e.get("resourceClaimName") or statuses.get(e.get("name"))
                   for e in (pod.get("spec") or {}).get("resourceClaims") or []}
        by_name = {(c.namespace, c.name): c for c in self.claims.values()}
        ids: list[str] = []
        for ref in ((container.get("resources") or {}).get("claims") or []):
            info = by_name.get((ns, entries.get(ref.get("name")) or ""))
            if info is None:
                continue
            request = ref.get("request")
            for devices in info.devices.values():
                for device in devices:
                    names = device.get("request_names") or []
                    if request and not any(n == request or n.startswith(request + "/") for n in names):
                        continue
                    ids.extend(i for i in device.get("cdi_device_ids") or [] if i not in ids)
        return ids

    # -- unprepare ---------------------------------------------------------------------------------

    async def unprepare_finished(self) -> None:
        """Drop finished pods from their claims; unprepare the claims no pod uses any more."""
        async with self._lock:
            changed = False
            for info in self.claims.values():
                gone = {p for p in info.pods if self.pod_done(p)}
                if gone:
                    info.pods -= gone
                    changed = True
            unused = [c for c in self.claims.values() if not c.pods]
            by_driver: dict[str, list[ClaimInfo]] = {}
            for info in unused:
                for driver in info.devices:
                    by_driver.setdefault(driver, []).append(info)
            failed: set[str] = set()
            for driver, batch in by_driver.items():
                for claim_uid, error in (await self._call_unprepare(driver, batch)).items():
                    failed.add(claim_uid)
                    self.unprepare_errors[claim_uid] = error
            for info in unused:
                if info.uid not in failed:
                    del self.claims[info.uid]
                    self.unprepare_errors.pop(info.uid, None)
                    changed = True
                    _logger.info("claim unprepared", claim=f"{info.namespace}/{info.name}", uid=info.uid)
            if changed:
                self._save()

    async def _call_unprepare(self, driver: str, batch: list[ClaimInfo]) -> dict[str, str]:
        """claim uid -> error for the claims NOT unprepared."""
        client = self.watcher.client(driver)
        if client is None:
            why = f"plugin name {driver} not found in the list of registered DRA plugins"
            return {c.uid: why for c in batch}
        try:
            answers = await client.unprepare([(c.namespace, c.uid, c.name) for c in batch], self.timeout)
        except Exception as err:
            return {c.uid: f"NodeUnprepareResources failed: {describe_error(err)}" for c in batch}
        out = {}
        for info in batch:
            if info.uid not in answers:
                out[info.uid] = "NodeUnprepareResources left out the claim"
            elif answers[info.uid]:
                out[info.uid] = answers[info.uid]
        if out:
            _logger.warning("claims not unprepared; trying again", driver=driver, errors=out)
        return out

    async def run(self, wake: Changes, interval: float = 0.2) -> None:
        """Unprepare on every change of ``wake`` (the pods), at least every ``interval`` seconds."""
        while True:
            with contextlib.suppress(TimeoutError):
                await wake.wait_until(lambda: False, interval, poll=interval)
            if any(not c.pods or any(self.pod_done(p) for p in c.pods) for c in self.claims.values()):
                try:
                    await self.unprepare_finished()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    _logger.exception("unprepare pass failed")
