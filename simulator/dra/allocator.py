"""The scheduler's structured-parameters allocator, for one node: enough for GPU shares.

Given a ResourceClaim, the DeviceClasses, the node's ResourceSlices and the claims already allocated,
find devices for every request or say why not. What it covers:

* requests with ``exactly`` (``ExactCount`` with ``count``, or ``All``), the class's and the request's
  CEL selectors (``simulator.dra.cel``), device taints with ``NoSchedule``/``NoExecute`` unless the
  request tolerates them;
* consumable capacity (KEP-5075): a device with ``allowMultipleAllocations`` can be shared; each
  request consumes, per capacity, what it asks rounded up by the device's ``requestPolicy``
  (``validRange`` min/step/max, or the smallest of ``validValues`` that is enough), or the policy's
  ``default`` (the whole capacity when there is none) for a capacity it does not name; the sum over all
  allocations never exceeds the capacity. Each such result carries a ``shareID`` and its
  ``consumedCapacity``. A device without the flag is used by at most one allocation;
* ``matchAttribute`` constraints: the chosen devices of the named requests (all when none are named)
  share one value of the attribute;
* only the newest generation of each pool counts, as in the scheduler.

The search is a depth-first backtracking over the requests' device slots in slice order, so the first
fitting combination wins (the scheduler's allocator is also first-fit).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from .cel import CelError, device_activation, matches
from .quantity import format_quantity, parse_quantity

__all__ = ["AllocationFailed", "Candidate", "allocate", "consumed_by_claims", "usable_slices"]

Obj = dict[str, Any]
BLOCKING_TAINTS = ("NoSchedule", "NoExecute")


class AllocationFailed(Exception):
    """The claim cannot be allocated on this node (the scheduler's "cannot allocate all claims")."""


@dataclass(frozen=True)
class Candidate:
    driver: str
    pool: str
    device: Obj

    @property
    def name(self) -> str:
        return str(self.device["name"])

    @property
    def key(self) -> tuple[str, str, str]:
        return self.driver, self.pool, self.name

    @property
    def shared(self) -> bool:
        return bool(self.device.get("allowMultipleAllocations"))


@dataclass
class _Usage:
    """What is taken already: exclusive devices, and consumed capacity of shared ones."""

    exclusive: set[tuple[str, str, str]] = field(default_factory=set)
    consumed: dict[tuple[str, str, str], dict[str, int]] = field(default_factory=dict)

    def add(self, key: tuple[str, str, str], amounts: dict[str, int] | None) -> None:
        if amounts is None:
            self.exclusive.add(key)
            return
        mine = self.consumed.setdefault(key, {})
        for name, value in amounts.items():
            mine[name] = mine.get(name, 0) + value

    def remove(self, key: tuple[str, str, str], amounts: dict[str, int] | None) -> None:
        if amounts is None:
            self.exclusive.discard(key)
            return
        for name, value in amounts.items():
            self.consumed[key][name] -= value


def usable_slices(slices: list[Obj], node: str) -> list[Obj]:
    """The node's slices of each pool's newest generation."""
    mine = [s for s in slices if (s.get("spec") or {}).get("nodeName") == node]
    newest: dict[tuple[str, str], int] = {}
    for s in mine:
        pool = s["spec"]["pool"]
        key = (s["spec"]["driver"], pool["name"])
        newest[key] = max(newest.get(key, 0), int(pool.get("generation", 0)))
    return [s for s in mine
            if int(s["spec"]["pool"].get("generation", 0)) == newest[(s["spec"]["driver"], s["spec"]["pool"]["name"])]]


def consumed_by_claims(claims: list[Obj]) -> _Usage:
    usage = _Usage()
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            key = (result["driver"], result["pool"], result["device"])
            consumed = result.get("consumedCapacity")
            if result.get("shareID") or consumed:
                usage.add(key, {k: parse_quantity(v) for k, v in (consumed or {}).items()})
            else:
                usage.add(key, None)
    return usage


def _policy_amount(capacity: Obj, requested: int | None) -> int | None:
    """What a request consumes of one capacity under its policy; None when the policy cannot give it."""
    total = parse_quantity(capacity["value"])
    policy = capacity.get("requestPolicy") or {}
    if requested is None:
        return parse_quantity(policy["default"]) if "default" in policy else total
    if "validValues" in policy:
        values = sorted(parse_quantity(v) for v in policy["validValues"])
        return next((v for v in values if v >= requested), None)
    rng = policy.get("validRange")
    if rng:
        low = parse_quantity(rng.get("min", 0))
        value = max(requested, low)
        if rng.get("step"):
            step = parse_quantity(rng["step"])
            value = low + math.ceil((value - low) / step) * step
        if "max" in rng and value > parse_quantity(rng["max"]):
            return None
        return value
    return requested


def _amounts(candidate: Candidate, requests: dict[str, int]) -> dict[str, int] | None:
    """Per capacity what this request would consume of the device; None when it cannot."""
    capacities = candidate.device.get("capacity") or {}
    if any(name not in capacities for name in requests):
        return None
    out: dict[str, int] = {}
    for name, capacity in capacities.items():
        amount = _policy_amount(capacity, requests.get(name))
        if amount is None:
            return None
        out[name] = amount
    return out


def _fits(candidate: Candidate, amounts: dict[str, int] | None, usage: _Usage) -> bool:
    key = candidate.key
    if key in usage.exclusive:
        return False
    if amounts is None:
        return not usage.consumed.get(key) or not any(usage.consumed[key].values())
    used = usage.consumed.get(key, {})
    capacities = candidate.device.get("capacity") or {}
    return all(used.get(n, 0) + v <= parse_quantity(capacities[n]["value"]) for n, v in amounts.items())


def _tolerated(taint: Obj, tolerations: list[Obj]) -> bool:
    """As for node taints: Exists with no key matches every key, Equal needs key and value, an empty
    effect matches every effect."""
    for tol in tolerations:
        if tol.get("operator", "Equal") == "Exists":
            key_ok = not tol.get("key") or tol.get("key") == taint.get("key")
        else:
            key_ok = tol.get("key") == taint.get("key") and tol.get("value", "") == taint.get("value", "")
        if key_ok and tol.get("effect") in (None, "", taint.get("effect")):
            return True
    return False


@dataclass
class _Request:
    name: str
    selectors: list[str]
    mode: str
    count: int
    capacity: dict[str, int]
    tolerations: list[Obj]


def _requests(claim: Obj, classes: dict[str, Obj]) -> list[_Request]:
    out = []
    for req in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        name = req.get("name") or ""
        exactly = req.get("exactly")
        if exactly is None:
            raise AllocationFailed(f"request {name!r}: only 'exactly' requests are supported by the simulator")
        class_name = exactly.get("deviceClassName", "")
        device_class = classes.get(class_name)
        if device_class is None:
            raise AllocationFailed(f"request {name!r}: device class {class_name!r} does not exist")
        selectors = [s["cel"]["expression"] for s in (device_class.get("spec") or {}).get("selectors") or []]
        selectors += [s["cel"]["expression"] for s in exactly.get("selectors") or []]
        mode = exactly.get("allocationMode", "ExactCount")
        if mode not in ("ExactCount", "All"):
            raise AllocationFailed(f"request {name!r}: unknown allocationMode {mode!r}")
        try:
            asked = (exactly.get("capacity") or {}).get("requests") or {}
            capacity = {k: parse_quantity(v) for k, v in asked.items()}
        except ValueError as err:
            raise AllocationFailed(f"request {name!r}: {err}") from err
        out.append(_Request(name, selectors, mode, int(exactly.get("count", 1)), capacity,
                            list(exactly.get("tolerations") or [])))
    if not out:
        raise AllocationFailed("the claim has no device requests")
    return out


def _attribute(candidate: Candidate, qualified: str) -> Any:
    domain, _, short = qualified.rpartition("/")
    attrs = candidate.device.get("attributes") or {}
    value = attrs.get(qualified) if qualified in attrs else (attrs.get(short) if domain == candidate.driver else None)
    return None if value is None else tuple(sorted(value.items()))


def allocate(claim: Obj, classes: dict[str, Obj], slices: list[Obj], allocated: list[Obj], node: str) -> Obj:
    """The claim's ``status.allocation`` on ``node``, or AllocationFailed with the reason."""
    requests = _requests(claim, classes)
    devices = [Candidate(s["spec"]["driver"], s["spec"]["pool"]["name"], d)
               for s in usable_slices(slices, node) for d in s["spec"].get("devices") or []]
    usage = consumed_by_claims(allocated)
    candidates: dict[str, list[Candidate]] = {}
    for req in requests:
        found = []
        for cand in devices:
            taints = [t for t in cand.device.get("taints") or [] if t.get("effect") in BLOCKING_TAINTS]
            if any(not _tolerated(t, req.tolerations) for t in taints):
                continue
            try:
                if all(matches(expr, device_activation(cand.driver, cand.device)) for expr in req.selectors):
                    found.append(cand)
            except CelError as err:
                raise AllocationFailed(f"request {req.name!r}: {err}") from err
        candidates[req.name] = found
    constraints = [c for c in ((claim.get("spec") or {}).get("devices") or {}).get("constraints") or []
                   if c.get("matchAttribute")]

    slots: list[_Request] = []
    for req in requests:
        if req.mode == "All":
            if not candidates[req.name]:
                raise AllocationFailed(f"request {req.name!r}: no device matches")
            slots += [req] * len(candidates[req.name])
        else:
            slots += [req] * req.count
    chosen: list[tuple[_Request, Candidate, dict[str, int] | None]] = []

    def constraints_hold() -> bool:
        for con in constraints:
            names = set(con.get("requests") or [r.name for r in requests])
            values = {_attribute(c, con["matchAttribute"]) for r, c, _ in chosen if r.name in names}
            if len(values) > 1 or None in values:
                return False
        return True

    def search(i: int) -> bool:
        if i == len(slots):
            return True
        req = slots[i]
        for cand in candidates[req.name]:
            if any(c.key == cand.key and r.name == req.name for r, c, _ in chosen):
                continue  # one request never takes the same device twice
            amounts = _amounts(cand, req.capacity) if cand.shared else None
            if cand.shared and amounts is None:
                continue
            if not cand.shared and req.capacity:
                continue  # capacity asked of a device that cannot be shared
            if not _fits(cand, amounts, usage):
                continue
            usage.add(cand.key, amounts)
            chosen.append((req, cand, amounts))
            if constraints_hold() and search(i + 1):
                return True
            chosen.pop()
            usage.remove(cand.key, amounts)
        return False

    if not search(0):
        names = ", ".join(f"{r.name} ({len(candidates[r.name])} matching)" for r in requests)
        raise AllocationFailed(f"cannot allocate all claims: no fitting devices for {names}")
    results = []
    for req, cand, amounts in chosen:
        result: Obj = {"request": req.name, "driver": cand.driver, "pool": cand.pool, "device": cand.name}
        if amounts is not None:
            result["shareID"] = str(uuid.uuid4())
            result["consumedCapacity"] = {k: format_quantity(v) for k, v in amounts.items()}
        results.append(result)
    return {"devices": {"results": results, "config": []},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}
