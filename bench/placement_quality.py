"""Placement quality: how many pods of a random trace fit before the first refusal, against a bound.

For each topology and seed, a random trace of pod arrivals (and, in the "churn" traces, departures)
is run through `gpuledger.simulation.Simulation` (the code path of ``gpuledger simulate``: the
kubelet's device-ID count, then a placer over the allocator's LedgerState) twice: with our placer
(`libs.placement.placement.place`, gpu-manager's evaluators + NVLink) and with a naive first-fit
(fractions on the lowest-index GPU that fits, whole GPUs on the lowest-index idle ones). Measured per
trace: arrivals placed before the first refusal, and the utilisation (cores held / node cores) at
that moment. The offline bound is the most arrivals any placement, knowing the whole trace, could
place before its first refusal: an exhaustive search over placements (GPUs with the same contents are
interchangeable, so states are canonicalised and memoised; a state's other placements are not searched
once one reaches what the node's totals allow); its utilisation follows from the trace.
For multi-GPU grants, the link quality: NVLinks per GPU pair, and the share of grants that cross
the CPU sockets (SYS). The same traces in DRA mode (bench/dra_placement.py): each arrival a
ResourceClaim placed by the simulator's structured-parameters allocator, the kube-scheduler's part.

    python -m bench.placement_quality [--traces 100] [--arrivals 40] [--seed 1]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bench.dra_placement import run_dra_trace
from gpuledger.simulation import Simulation
from libs.config import MEMORY_BLOCK
from libs.errors import ServiceError
from libs.events.schema import GpuShare
from libs.gpu.fake import PROFILES_DIR, FakeBackend
from libs.gpu.inventory import Inventory
from libs.kube.pods import Pod
from libs.ledger.state import GpuUsage
from libs.placement.placement import Links, place, topology

TOPOLOGIES = {
    # name: (profile, whole-GPU multiples a multi-GPU pod asks for, with weights)
    "pcie-6gpu": ("pcie-6gpu", {2: 6, 3: 2, 4: 2}),
    "dgx-a100-8gpu": ("dgx-a100-8gpu", {2: 5, 4: 4, 8: 1}),
    "dgx1-v100-8gpu": ("dgx1-v100-8gpu", {2: 5, 4: 4, 8: 1}),
}
SHARE_CORES = (10, 20, 25, 30, 40, 50, 60, 70, 80, 90)
SHARE_P, WHOLE_P = 0.65, 0.2   # the rest (0.15) asks for several whole GPUs
SEARCH_BUDGET = 2_000_000


# --- traces ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    pod: str
    cores: int
    blocks: int


def make_trace(rng: random.Random, inv: Inventory, multiples: dict[int, int], arrivals: int,
               churn: bool) -> list[Request | str]:
    """Arrivals (Request) and departures (the pod name); a pod leaves 1..12 arrivals after it came."""
    per_gpu_blocks = min(g.memory for g in inv.gpus) // MEMORY_BLOCK
    ops: list[Request | str] = []
    leaving: dict[int, list[str]] = {}
    for k in range(arrivals):
        ops.extend(leaving.pop(k, []))
        kind = rng.random()
        if kind < SHARE_P:
            cores = rng.choice(SHARE_CORES)
            blocks = max(1, min(per_gpu_blocks, round(per_gpu_blocks * cores / 100 * rng.uniform(0.5, 1.5))))
        elif kind < SHARE_P + WHOLE_P:
            cores, blocks = 100, 0
        else:
            cores, blocks = 100 * rng.choices(list(multiples), weights=list(multiples.values()))[0], 0
        name = f"p{k}"
        ops.append(Request(name, cores, blocks))
        if churn:
            leaving.setdefault(k + rng.randint(1, 12), []).append(name)
    return ops


def manifest(req: Request) -> Pod:
    limits: dict[str, Any] = {"tencent.com/vcuda-core": req.cores}
    if req.blocks:
        limits["tencent.com/vcuda-memory"] = req.blocks
    return msgspec.convert({"metadata": {"name": req.pod},
                            "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]}}, Pod)


# --- the naive placer ----------------------------------------------------------------------------------

def first_fit(gpus: Sequence[GpuUsage], links: Links, *, cores: int, memory: int,
              share_mode: bool) -> tuple[GpuShare, ...]:
    ordered = sorted(gpus, key=lambda g: g.index)
    if cores < 100:
        for g in ordered:
            if g.cores_free >= cores and g.memory_free >= memory:
                return (GpuShare(index=g.index, uuid=g.uuid, minor=g.minor, cores=cores, memory=memory),)
        raise ServiceError(503, "no free node")
    idle = [g for g in ordered if g.idle][: cores // 100]
    if len(idle) < cores // 100:
        raise ServiceError(503, "no free node")
    return tuple(GpuShare(index=g.index, uuid=g.uuid, minor=g.minor, cores=100, memory=g.memory_total)
                 for g in idle)


# --- one run through the simulation ----------------------------------------------------------------

@dataclass
class Run:
    placed: int = 0
    utilisation: float = 0.0
    nvlinks_per_pair: list[float] = field(default_factory=list)
    cross_socket: list[bool] = field(default_factory=list)


def run_trace(inv: Inventory, ops: list[Request | str], placer: Any) -> Run:
    sim = Simulation(inv, share_mode=True, placer=placer)
    _, nv = topology(inv.links, len(inv.gpus))
    run = Run()
    for op in ops:
        if isinstance(op, str):
            sim.delete(f"default/{op}")
            continue
        (result,) = sim.add(manifest(op))
        if "error" in result:
            break
        run.placed += 1
        gpus = result["gpus"]
        if len(gpus) > 1:
            pairs = list(itertools.combinations(gpus, 2))
            run.nvlinks_per_pair.append(sum(nv[a][b] for a, b in pairs) / len(pairs))
            run.cross_socket.append(any(inv.links[a][b] == "SYS" for a, b in pairs))
    run.utilisation = sim.utilisation()
    return run


# --- the offline bound ---------------------------------------------------------------------------------

class BudgetExceeded(Exception):
    pass


def offline_bound(inv: Inventory, ops: list[Request | str]) -> int:
    """Most arrivals placeable before the first refusal by any placement that knows the trace."""
    n = len(inv.gpus)
    memory = min(g.memory for g in inv.gpus)  # the bundled profiles are homogeneous
    reqs = {op.pod: op for op in ops if isinstance(op, Request)}
    budget = [SEARCH_BUDGET]
    ceiling = arrivals_before_capacity_runs_out(ops, n, memory)

    # A GPU's state: the pods on it (frozenset); the node's state: the sorted tuple of GPU states.
    def load(gpu: frozenset[str]) -> tuple[int, int]:
        cores = sum(reqs[p].cores if reqs[p].cores < 100 else 100 for p in gpu)
        mem = sum(reqs[p].blocks * MEMORY_BLOCK if reqs[p].cores < 100 else memory for p in gpu)
        return cores, mem

    @functools.cache
    def best(i: int, state: tuple[frozenset[str], ...]) -> int:
        budget[0] -= 1
        if budget[0] < 0:
            raise BudgetExceeded
        if ceiling[i] == 0:  # the end of the trace, or an arrival no placement can take
            return 0
        op = ops[i]
        if isinstance(op, str):
            nxt = tuple(sorted((g - {op} for g in state), key=sorted))
            return best(i + 1, nxt)
        options = []
        if op.cores >= 100:
            want = op.cores // 100
            idle = [k for k, g in enumerate(state) if not g]
            if len(idle) >= want:  # idle GPUs are interchangeable: one way to do it
                taken = set(idle[:want])
                options.append(tuple(sorted((g | {op.pod} if k in taken else g for k, g in enumerate(state)),
                                            key=sorted)))
        else:
            fits = []
            seen = set()
            for k, g in enumerate(state):
                if g in seen:
                    continue
                seen.add(g)
                cores, mem = load(g)
                if cores + op.cores <= 100 and mem + op.blocks * MEMORY_BLOCK <= memory:
                    fits.append((-cores, k))
            # The fullest GPU first: it most often leads to a placement that reaches the ceiling.
            options = [tuple(sorted((*state[:k], state[k] | {op.pod}, *state[k + 1:]), key=sorted))
                       for _, k in sorted(fits)]
        most = 0
        for s in options:
            most = max(most, 1 + best(i + 1, s))
            if most == ceiling[i]:  # no placement does better: the other options need no search
                break
        return most

    try:
        return best(0, tuple(frozenset() for _ in range(n)))
    finally:
        best.cache_clear()


def arrivals_before_capacity_runs_out(ops: list[Request | str], gpus: int, memory: int) -> list[int]:
    """For each position i of the trace, how many arrivals from i on come before the first one that
    no placement can take, counted on the node's totals alone (so with ``len(ops) + 1`` entries).

    Which pods are on the node after an arrival does not depend on where they were put (every earlier
    one was placed). The whole-GPU pods need a GPU each to themselves; the shares need at least as many
    GPUs as their cores and their memory fill. Once the two need more GPUs than the node has, that
    arrival is refused by every placement: an exact search can stop as soon as it reaches this count.
    """
    whole = share_cores = share_memory = 0
    live: dict[str, Request] = {}
    stop = len(ops)
    for j, op in enumerate(ops):
        req, sign = (live.pop(op, None), -1) if isinstance(op, str) else (op, 1)
        if req is None:  # a departure of a pod that never came
            continue
        if req.cores >= 100:
            whole += sign * (req.cores // 100)
        else:
            share_cores += sign * req.cores
            share_memory += sign * req.blocks * MEMORY_BLOCK
        if sign > 0:
            live[req.pod] = req
            if whole + max(-(-share_cores // 100), -(-share_memory // memory)) > gpus:
                stop = j
                break
    counts = [0] * (len(ops) + 1)
    for i in range(len(ops) - 1, -1, -1):
        counts[i] = counts[i + 1] + (i < stop and isinstance(ops[i], Request))
    return counts


def utilisation_after(inv: Inventory, ops: list[Request | str], placed: int) -> float:
    """Cores held once `placed` arrivals are in (departures before the next arrival applied)."""
    live: dict[str, int] = {}
    count = 0
    for op in ops:
        if isinstance(op, str):
            live.pop(op, None)
            continue
        if count == placed:
            break
        live[op.pod] = op.cores
        count += 1
    return sum(live.values()) / (100 * len(inv.gpus))


# --- the report --------------------------------------------------------------------------------------

def measure(case: tuple[str, bool], args: argparse.Namespace) -> tuple[list[str], str]:
    """The report's rows for one topology and kind (fill or churn), and a note when traces were left out."""
    name, churn = case
    profile, multiples = TOPOLOGIES[name]
    inv = FakeBackend(PROFILES_DIR / f"{profile}.yaml").inventory()
    lines: list[str] = []
    rng = random.Random(f"{args.seed}/{name}/{churn}")
    traces = [make_trace(rng, inv, multiples, args.arrivals, churn) for _ in range(args.traces)]
    bounds: list[int] = []
    kept: list[list[Request | str]] = []
    skipped = 0
    runs: dict[str, list[Run]] = {"ours": [], "first-fit": [], "DRA (scheduler)": []}
    for k, ops in enumerate(traces):
        try:
            bound = offline_bound(inv, ops)
        except BudgetExceeded:
            skipped += 1
            continue
        bounds.append(bound)
        kept.append(ops)
        runs["ours"].append(run_trace(inv, ops, place))
        runs["first-fit"].append(run_trace(inv, ops, first_fit))
        runs["DRA (scheduler)"].append(run_dra_trace(inv, ops, Run()))
        for label, rs in runs.items():
            placed = rs[-1].placed
            if placed > bound:
                raise AssertionError(f"{name} trace {k}: {label} placed {placed} > bound {bound}")
        if (k + 1) % 50 == 0:
            print(f"  .. {name} {'churn' if churn else 'fill'}: {k + 1}/{len(traces)} traces",
                  file=sys.stderr, flush=True)
    kind = "churn" if churn else "fill"
    mean_bound = statistics.mean(bounds)
    util_bound = statistics.mean(utilisation_after(inv, ops, b) for ops, b in zip(kept, bounds, strict=True))
    for label, rs in runs.items():
        placed = statistics.mean(r.placed for r in rs)
        equal = sum(r.placed == b for r, b in zip(rs, bounds, strict=True)) / len(rs)
        util = statistics.mean(r.utilisation for r in rs)
        nvl = [x for r in rs for x in r.nvlinks_per_pair]
        cross = [x for r in rs for x in r.cross_socket]
        lines.append(f"| {name} | {kind} | {label} | {placed:.2f} | {100 * placed / args.arrivals:.1f}% "
                     f"| {100 * placed / mean_bound:.1f}% "
                     f"| {100 * equal:.0f}% | {100 * util:.1f}% | {statistics.mean(nvl) if nvl else 0:.2f} "
                     f"| {100 * sum(cross) / len(cross) if cross else 0:.1f}% |")
    lines.append(f"| {name} | {kind} | offline bound | {mean_bound:.2f} | {100 * mean_bound / args.arrivals:.1f}% "
                 f"| 100% | 100% | {100 * util_bound:.1f}% | | |")
    note = (f"{name} {kind}: {skipped} of {len(traces)} traces left out (the bound's search went over its "
            f"budget of {SEARCH_BUDGET:,} states)") if skipped else ""
    return lines, note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=100, help="traces per topology and kind")
    ap.add_argument("--arrivals", type=int, default=40, help="arrivals per trace")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    started = time.perf_counter()
    notes: list[str] = []
    print(f"placement quality: {args.traces} traces x {args.arrivals} arrivals per topology and kind, "
          f"seed {args.seed}", flush=True)
    print("| topology | trace | placer | placed before 1st refusal (mean) | of the trace | % of bound "
          "| equals bound | utilisation then | NVLinks/pair (multi-GPU) | multi-GPU with a SYS pair |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    cases = [(name, churn) for name in TOPOLOGIES for churn in (False, True)]
    # Each topology and kind is its own seeded computation: the machine's cores take them side by side.
    with ProcessPoolExecutor(max_workers=min(len(cases), os.cpu_count() or 1)) as pool:
        for lines, note in pool.map(functools.partial(measure, args=args), cases):
            print("\n".join(lines), flush=True)
            if note:
                notes.append(note)
    for note in notes:
        print(f"\n{note}")
    print(f"\n({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
