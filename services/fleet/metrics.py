"""The fleet recorder's metrics: events ingested, lag per node, silent nodes, witness failures."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from libs.config import Settings
from libs.metrics import serving
from services.fleet.ingest import FleetIngest
from services.fleet.sources import SourceWatch
from services.fleet.witness import WitnessDesk

__all__ = ["FleetCollector", "observe"]


class FleetCollector(Collector):
    def __init__(self, ingest: FleetIngest, watch: SourceWatch, desk: WitnessDesk, silent_after: float) -> None:
        self.ingest, self.watch, self.desk, self.silent_after = ingest, watch, desk, silent_after

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        ing = self.ingest
        for name, doc, value in (
            ("gpuledger_fleet_events_ingested", "Events stored by the recorder (each once)", ing.ingested),
            ("gpuledger_fleet_events_duplicate", "Events delivered again and skipped", ing.duplicates),
            ("gpuledger_fleet_events_rejected", "Events refused (forged, unreadable, out of place)", ing.rejected),
            ("gpuledger_fleet_seq_gaps", "Times a node's next event did not continue its seq", ing.gaps),
            ("gpuledger_fleet_source_restarts", "Sources restarted because NATS left them without a consumer",
             self.watch.restarts),
        ):
            fam = CounterMetricFamily(name, doc)
            fam.add_metric([], value)
            yield fam
        pending = GaugeMetricFamily("gpuledger_fleet_recorder_pending", "Fleet stream events not yet recorded")
        pending.add_metric([], ing.pending)
        yield pending
        now = time.time_ns()
        lag = GaugeMetricFamily("gpuledger_fleet_node_lag_events",
                                "Events a node's stream holds that the fleet stream does not yet", labels=["node"])
        age = GaugeMetricFamily("gpuledger_fleet_node_last_event_age_seconds",
                                "Seconds since the recorder stored the node's last event", labels=["node"])
        recorded = GaugeMetricFamily("gpuledger_fleet_node_last_seq", "The node's last recorded seq", labels=["node"])
        silent = 0
        folds = dict(ing.projection.folds)
        sources = dict(self.watch.sources)
        for node in sorted(set(folds) | set(sources)):
            src = sources.get(node)
            lag.add_metric([node], src.lag if src else 0)
            nf = folds.get(node)
            seconds = (now - nf.last_event_at) / 1e9 if nf and nf.last_event_at else float("inf")
            age.add_metric([node], seconds)
            recorded.add_metric([node], nf.last_seq if nf else 0)
            if seconds > self.silent_after and (src is None or src.active_s > self.silent_after or src.lag == 0):
                silent += 1
        yield lag
        yield age
        yield recorded
        fam = GaugeMetricFamily("gpuledger_fleet_silent_nodes",
                                "Nodes with no event for longer than --fleet-silent-after")
        fam.add_metric([], silent)
        yield fam
        failures = CounterMetricFamily("gpuledger_fleet_witness_failures",
                                       "Checkpoints the witness refused, by kind (stale-size, bad-proof, forbidden...)",
                                       labels=["kind"])
        for kind, count in sorted(self.desk.failures.items()):
            failures.add_metric([kind], count)
        yield failures
        cos = CounterMetricFamily("gpuledger_fleet_witness_cosigned", "Checkpoints cosigned")
        cos.add_metric([], self.desk.cosigned)
        yield cos


@asynccontextmanager
async def observe(settings: Settings, ingest: FleetIngest, watch: SourceWatch,
                  desk: WitnessDesk) -> AsyncIterator[CollectorRegistry]:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(FleetCollector(ingest, watch, desk, settings.fleet_silent_after))
    async with serving(settings, "fleet", registry):
        yield registry
