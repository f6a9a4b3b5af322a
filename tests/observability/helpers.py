"""Metrics over HTTP (free ports, a GET, the Prometheus text parser) and the fast health-check settings
of the observability tests."""

from __future__ import annotations

import asyncio
import random
import socket
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Fast enough for tests, slow enough not to depend on the machine's load.
HEALTH = {"health_recovery_seconds": 1.0, "health_recovery_checks": 2, "health_check_interval": 0.2,
          "usage_interval": 0.2}


def free_port_base(count: int = 4) -> int:
    """A base port with ``count`` free ports in a row (the services' offsets)."""
    for _ in range(200):
        base = random.randrange(20000, 60000)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def http_get(url: str, timeout: float = 10) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.headers.get("Content-Type", ""), resp.read().decode()


def scrape(port: int) -> dict[str, list[Any]]:
    """name -> samples, parsed with the Prometheus text parser (histograms keep their _bucket/_count/_sum)."""
    _, text = http_get(f"http://127.0.0.1:{port}/metrics")
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples in {samples.get(name)}"
    return found[0]


def holds_gpu_memory(pod_name: str, at_least: int, container: str | None = None
                     ) -> Callable[[dict[str, list[Any]]], bool]:
    """A check for ``scraped``: the pod's container (any, or ``container``) holds at least ``at_least``
    bytes of GPU memory in all (``container_gpu_memory_total``, in MiB)."""
    def check(samples: dict[str, list[Any]]) -> bool:
        return any(x.labels.get("pod_name") == pod_name and x.labels.get("gpu_memory") == "total"
                   and container in (None, x.labels.get("container_name")) and x.value >= at_least >> 20
                   for x in samples.get("container_gpu_memory_total", []))
    return check


async def scraped(port: int, check: Callable[[dict[str, list[Any]]], bool]) -> dict[str, list[Any]] | None:
    """The port's samples if they pass ``check``, else None: a predicate for tests.polling.eventually."""
    samples = await asyncio.to_thread(scrape, port)
    return samples if check(samples) else None
