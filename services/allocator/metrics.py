"""The allocator's metrics and status routes, and the observer that times Allocate and the log's appends.

The allocator exports everything about GPUs and allocations (it holds the folded state and the GPU
monitor): per-GPU allocated/free cores and memory and health, allocations per state, the Allocate
latency, the log's append latency and publication lag, the sampled GPU usage, and gpu-manager's four
container metrics with gpu-manager's labels. Every value is read from memory at scrape time.

This module only reads: the health watcher and the usage sampler are built and started by the
composition root, and the timings arrive through `AllocatorMetrics`, the observer handed to the
ledger and the handlers when they are built (so the handlers stay free of metrics code).
"""

from __future__ import annotations

import collections
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.bus.outbox import Relay
from libs.config import Settings
from libs.errors import ServiceError
from libs.http_endpoint import Reply, Route, json_reply
from libs.ledger.state import LedgerState
from libs.metrics import MetricsServer, hop_histogram, serving
from libs.status import agent_version, graph_json, usage_json
from libs.store.log import EventLog
from services.allocator.observer import AllocatorObserver
from services.allocator.usage import UsageSampler

__all__ = ["AllocatorCollector", "AllocatorMetrics", "CommitTimes", "serving_metrics"]

MIB = 1 << 20
ALLOCATE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
APPEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class CommitTimes:
    """When each committed seq was committed, until the relay has published it (for the lag in seconds)."""

    def __init__(self, event_log: EventLog) -> None:
        self._pending: collections.deque[tuple[int, float]] = collections.deque()
        event_log.on_commit(self._committed)

    def _committed(self, last_seq: int) -> None:
        self._pending.append((last_seq, time.monotonic()))

    def lag_seconds(self, published: int) -> float:
        while self._pending and self._pending[0][0] <= published:
            self._pending.popleft()
        return time.monotonic() - self._pending[0][1] if self._pending else 0.0


class AllocatorCollector(Collector):
    def __init__(self, node: str, state: LedgerState, event_log: EventLog, relay: Relay, commits: CommitTimes,
                 usage: UsageSampler) -> None:
        self.node = node
        self.state = state
        self.event_log = event_log
        self.relay = relay
        self.commits = commits
        self.usage = usage

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._gpus()
        yield from self._allocations()
        yield from self._log()
        yield from self._containers()

    def _gpus(self) -> Iterator[GaugeMetricFamily]:
        labels = ["gpu", "uuid"]
        fams = {
            "cores_allocated": GaugeMetricFamily("gpuledger_gpu_cores_allocated",
                                                 "vcuda-core units allocated on the GPU (100 = the whole GPU)",
                                                 labels=labels),
            "cores_free": GaugeMetricFamily("gpuledger_gpu_cores_free", "vcuda-core units still free on the GPU",
                                            labels=labels),
            "memory_allocated": GaugeMetricFamily("gpuledger_gpu_memory_allocated_bytes",
                                                  "GPU memory allocated to containers", labels=labels),
            "memory_free": GaugeMetricFamily("gpuledger_gpu_memory_free_bytes", "GPU memory still free to allocate",
                                             labels=labels),
            "memory_total": GaugeMetricFamily("gpuledger_gpu_memory_total_bytes", "GPU memory", labels=labels),
            "healthy": GaugeMetricFamily("gpuledger_gpu_healthy",
                                         "1 when the GPU is healthy, 0 when marked unhealthy (no placement)",
                                         labels=labels),
        }
        for g in sorted(self.state.gpus.values(), key=lambda g: g.index):
            values = [str(g.index), g.uuid]
            fams["cores_allocated"].add_metric(values, g.cores_used)
            fams["cores_free"].add_metric(values, g.cores_free)
            fams["memory_allocated"].add_metric(values, g.memory_used)
            fams["memory_free"].add_metric(values, g.memory_free)
            fams["memory_total"].add_metric(values, g.memory_total)
            fams["healthy"].add_metric(values, 1 if g.healthy else 0)
        yield from fams.values()
        util = GaugeMetricFamily("gpuledger_gpu_utilization_percent",
                                 "GPU utilisation in the last background sample", labels=labels)
        used = GaugeMetricFamily("gpuledger_gpu_memory_used_bytes",
                                 "GPU memory in use in the last background sample", labels=labels)
        uuids = {g.index: g.uuid for g in self.state.gpus.values()}
        for s in self.usage.gpus:
            values = [str(s.index), uuids.get(s.index, "")]
            util.add_metric(values, s.utilization)
            used.add_metric(values, s.memory_used)
        age = GaugeMetricFamily("gpuledger_usage_sample_timestamp_seconds",
                                "Unix time of the last background GPU usage sample (0: none yet)")
        age.add_metric([], self.usage.sampled_at)
        yield from (util, used, age)

    def _allocations(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily("gpuledger_allocations",
                                "Allocations by state: active now; released and refused since the log began",
                                labels=["state"])
        fam.add_metric(["active"], len(self.state.allocations))
        fam.add_metric(["released"], self.state.releases)
        fam.add_metric(["refused"], self.state.refusals)
        yield fam

    def _log(self) -> Iterator[GaugeMetricFamily]:
        last, published = self.event_log.last_seq, self.relay.published
        for name, doc, value in (
            ("gpuledger_log_last_seq", "Seq of the last event committed to the log", last),
            ("gpuledger_log_published_seq", "Seq of the last event published to JetStream", published),
            ("gpuledger_log_publication_lag_events", "Committed events not yet published", max(0, last - published)),
            ("gpuledger_log_publication_lag_seconds", "Age of the oldest committed event not yet published",
             self.commits.lag_seconds(published)),
        ):
            fam = GaugeMetricFamily(name, doc)
            fam.add_metric([], value)
            yield fam

    def _containers(self) -> Iterator[GaugeMetricFamily]:
        base = ["pod_name", "namespace", "node", "container_name"]
        req_util = GaugeMetricFamily("container_request_gpu_utilization",
                                     "GPU requested by the container (vcuda-core / 100)", labels=[*base, "req_of_gpu"])
        req_mem = GaugeMetricFamily("container_request_gpu_memory", "GPU memory requested by the container (MiB)",
                                    labels=[*base, "req_of_gpu_memory"])
        for a in sorted(self.state.allocations.values(), key=lambda a: a.granted_seq):
            values = [a.pod_name, a.namespace, self.node, a.container]
            req_util.add_metric([*values, "total"], a.cores / 100)
            req_mem.add_metric([*values, "total"], (a.memory or sum(s.memory for s in a.shares)) / MIB)
        util = GaugeMetricFamily("container_gpu_utilization",
                                 "SM utilisation of the container's processes (percent, summed)", labels=[*base, "gpu"])
        mem = GaugeMetricFamily("container_gpu_memory_total", "GPU memory used by the container's processes (MiB)",
                                labels=[*base, "gpu_memory"])
        for (_uid, container), per_gpu in sorted(self.usage.containers.items()):
            ns, pod = self.usage.names[(_uid, container)]
            values = [pod, ns, self.node, container]
            for index, (sm, used, _pids) in sorted(per_gpu.items()):
                util.add_metric([*values, f"gpu{index}"], sm)
                mem.add_metric([*values, f"gpu{index}"], used / MIB)
            util.add_metric([*values, "total"], sum(v[0] for v in per_gpu.values()))
            mem.add_metric([*values, "total"], sum(v[1] for v in per_gpu.values()) / MIB)
        yield from (util, mem, req_util, req_mem)


def _status_routes(state: LedgerState, usage: UsageSampler, node: str) -> dict[str, Route]:
    async def graph() -> Reply:
        return json_reply(graph_json(state.snapshot(), state.inventory))

    async def usage_route() -> Reply:
        return json_reply(usage_json(state.snapshot(), state.inventory, usage.containers))

    async def version() -> Reply:
        return json_reply({"version": agent_version(), "node": node})  # `status --url` checks it

    return {"/graph": graph, "/usage": usage_route, "/version": version}


def _outcome(exc: BaseException | None) -> str:
    if exc is None:
        return "granted"
    return "refused" if isinstance(exc, ServiceError) else "error"


class AllocatorMetrics(AllocatorObserver):
    """The allocator's registry, with the Allocate and append histograms it observes into."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self._allocate = Histogram("gpuledger_allocate_duration_seconds",
                                   "Allocate requests, from the allocator's receipt to its answer", ["outcome"],
                                   buckets=ALLOCATE_BUCKETS, registry=self.registry)
        self._append = Histogram("gpuledger_log_append_duration_seconds",
                                 "Appending events to the log (durable on return)",
                                 [], buckets=APPEND_BUCKETS, registry=self.registry)
        self._found = Counter("gpuledger_allocate_pod_found",
                              "Granted Allocates, by how their pod was found (notification, fetched, listed)",
                              ["via"], registry=self.registry)
        self._lists = Counter("gpuledger_allocator_kubelet_lists",
                              "pod-resources Lists the allocator asked the kubelet for, by reason", ["reason"],
                              registry=self.registry)
        self._checkpoint_settled = Counter(
            "gpuledger_allocator_checkpoint_settled",
            "Grants confirmed from the kubelet's checkpoint file, each sparing a pod-resources List",
            registry=self.registry)
        # The children each Allocate observes into, looked up once (``labels`` costs a lock and a sort).
        self._allocate_by = {o: self._allocate.labels(outcome=o) for o in ("granted", "refused", "error")}
        self._found_by = {via: self._found.labels(via=via) for via in ("notification", "fetched", "listed")}
        hops = hop_histogram(self.registry)
        self._decide, self._append_fsync, self._confirm, self._reply = (
            hops.labels(hop=h) for h in ("decide", "append_fsync", "confirm", "reply"))

    def allocate_hops(self, decide: float, append: float, confirm: float, reply: float) -> None:
        self._decide.observe(decide)
        self._append_fsync.observe(append)
        self._confirm.observe(confirm)
        self._reply.observe(reply)

    def allocate_done(self, seconds: float, error: BaseException | None) -> None:
        self._allocate_by[_outcome(error)].observe(seconds)

    def append_done(self, seconds: float) -> None:
        self._append.observe(seconds)

    def pod_found(self, via: str) -> None:
        self._found_by[via].inc()

    def kubelet_listed(self, reason: str) -> None:
        self._lists.labels(reason=reason).inc()

    def checkpoint_settled(self, count: int) -> None:
        self._checkpoint_settled.inc(count)


@asynccontextmanager
async def serving_metrics(settings: Settings, metrics: AllocatorMetrics, state: LedgerState, event_log: EventLog,
                          relay: Relay, usage: UsageSampler) -> AsyncIterator[MetricsServer | None]:
    """The metrics server, reading ``state``, the log, the relay and the last usage sample (None when off)."""
    commits = CommitTimes(event_log)
    metrics.registry.register(AllocatorCollector(settings.node_name, state, event_log, relay, commits, usage))
    routes = _status_routes(state, usage, settings.node_name)
    async with serving(settings, "allocator", metrics.registry, routes=routes) as server:
        yield server
