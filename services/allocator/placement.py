"""Where a request goes: pure functions over the GPUs' free capacity and their links.

- fewer than 100 cores: one GPU shared with others (share mode); best fit on the cores left, then
  memory, then lowest index, so partly used GPUs fill up before idle ones are broken into;
- 100 cores: one idle GPU, taken from where it breaks the fewest well-connected idle sets;
- n x 100 cores: n idle GPUs, the set with the most NVLinks between its members, then the tightest
  PCIe level, then the lowest indexes.
Ties always fall to the lowest GPU index, never to hash order. (Exact gpu-manager evaluator parity,
its topology tree, is issue #3's job; this module keeps the same contract.)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from libs.errors import ServiceError
from libs.events.schema import GpuShare
from libs.gpu import link_level, nvlink_count
from libs.ledger.state import GpuUsage

__all__ = ["Links", "place"]

Links = Sequence[Sequence[str]]
_MAX_COMBINATIONS = 20_000


def place(
    gpus: Sequence[GpuUsage], links: Links, *, cores: int, memory: int, share_mode: bool
) -> tuple[GpuShare, ...]:
    gpus = [g for g in gpus if g.healthy]  # issue 7: never place on a GPU marked unhealthy
    if cores <= 0:
        raise ServiceError(400, f"a request needs at least 1 vcuda-core unit, got {cores}")
    if cores < 100:
        return (_share(gpus, cores=cores, memory=memory, share_mode=share_mode),)
    if cores % 100:
        raise ServiceError(400, f"cores are greater than 100, must be multiple of 100 (got {cores})")
    wanted = cores // 100
    if wanted > len(gpus):
        raise ServiceError(400, f"{cores} cores asks for {wanted} GPUs; this node has {len(gpus)}")
    idle = [g for g in sorted(gpus, key=lambda g: g.index) if g.idle]
    if len(idle) < wanted:
        raise ServiceError(503, f"no free node: {wanted} whole GPU(s) wanted, {len(idle)} idle")
    chosen = _pick_one(idle, links) if wanted == 1 else _pick_set(idle, links, wanted)
    return tuple(
        GpuShare(index=g.index, uuid=g.uuid, minor=g.minor, cores=100, memory=g.memory_total) for g in chosen
    )


def _share(gpus: Sequence[GpuUsage], *, cores: int, memory: int, share_mode: bool) -> GpuShare:
    if not share_mode:
        raise ServiceError(400, "share mode is not enabled: requests under 100 cores are refused")
    if memory <= 0:
        raise ServiceError(400, "that cores or memory is zero is not permitted in share mode")
    fits = [g for g in gpus if g.cores_free >= cores and g.memory_free >= memory]
    if not fits:
        largest = max((g.memory_total for g in gpus), default=0)
        if memory > largest:
            raise ServiceError(400, f"request memory {memory} is larger than {largest}")
        raise ServiceError(503, f"no free node: no GPU has {cores} cores and {memory} bytes left")
    best = min(fits, key=lambda g: (g.cores_free, g.memory_free, g.index))
    return GpuShare(index=best.index, uuid=best.uuid, minor=best.minor, cores=cores, memory=memory)


def _closeness(links: Links, a: int, b: int) -> tuple[int, int]:
    """Higher is closer: (NVLinks, -PCIe level)."""
    token = links[a][b] if a < len(links) and b < len(links[a]) else "SYS"
    return nvlink_count(token), -link_level(token)


def _pick_one(idle: list[GpuUsage], links: Links) -> list[GpuUsage]:
    # The GPU whose best partner among the other idle GPUs is the weakest: taking it keeps the
    # well-connected idle pairs whole for later multi-GPU requests.
    def best_partner(g: GpuUsage) -> tuple[int, int]:
        others = [_closeness(links, g.index, o.index) for o in idle if o.index != g.index]
        return max(others, default=(-1, -100))

    return [min(idle, key=lambda g: (best_partner(g), g.index))]


def _pick_set(idle: list[GpuUsage], links: Links, n: int) -> list[GpuUsage]:
    def score(group: Sequence[GpuUsage]) -> tuple[int, int, tuple[int, ...]]:
        pairs = [_closeness(links, a.index, b.index) for a, b in itertools.combinations(group, 2)]
        nvlinks = sum(p[0] for p in pairs)
        worst_level = min(p[1] for p in pairs)  # the farthest pair decides the PCIe level
        return -nvlinks, -worst_level, tuple(g.index for g in group)

    total = 1
    for k in range(n):
        total = total * (len(idle) - k) // (k + 1)
    if total <= _MAX_COMBINATIONS:
        return list(min(itertools.combinations(idle, n), key=score))
    # Too many sets to try: grow greedily from each start and keep the best.
    candidates = []
    for start in idle:
        group = [start]
        while len(group) < n:
            rest = [g for g in idle if g not in group]
            group.append(min(rest, key=lambda g: (score([*group, g]), g.index)))
        candidates.append(group)
    return min(candidates, key=score)
