"""The metrics ports ``gpuledger up`` is about to serve: checked before any service starts, so that a
port that cannot be bound is an error on the terminal (the services themselves only log it, and in the
demo their logs go to files); the demo moves to free ports instead."""

from __future__ import annotations

import socket

from libs.config import Settings
from libs.errors import ConfigError
from libs.metrics import PORT_OFFSETS, metrics_port

__all__ = ["check_metrics_ports", "free_metrics_base", "unbindable"]

_COUNT = len(PORT_OFFSETS)


def _bind_error(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as the metrics server does (HTTPServer.allow_reuse_address): TIME_WAIT is no conflict
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def unbindable(settings: Settings) -> dict[int, str]:
    """Each metrics port that cannot be bound now, with why (empty when metrics are off)."""
    if not settings.metrics_port:
        return {}
    ports = [metrics_port(settings, s) for s in PORT_OFFSETS]
    return {p: why for p in ports if (why := _bind_error(settings.metrics_host, p))}


def free_metrics_base(host: str, tries: int = 50) -> int:
    """A base port with the three after it free too (the OS picks the first, we check the rest)."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind((host, 0))
            base = int(s.getsockname()[1])
        if base <= 65535 - _COUNT and not any(_bind_error(host, base + i) for i in range(_COUNT)):
            return base
    raise ConfigError(f"found no {_COUNT} free consecutive ports on {host} for the metrics")


def check_metrics_ports(settings: Settings, *, move: bool) -> Settings:
    """``settings`` when its metrics ports can be bound; with ``move`` (the demo), the same on free ports;
    else a ConfigError naming the ports and what to do."""
    taken = unbindable(settings)
    if not taken:
        return settings
    if move:
        return settings.replace(metrics_port=free_metrics_base(settings.metrics_host))
    listed = ", ".join(f"{settings.metrics_host}:{p} ({why})" for p, why in sorted(taken.items()))
    raise ConfigError(f"cannot serve metrics on {listed}: pick another --metrics-port (it uses "
                      f"{_COUNT} ports from it), or --metrics-port 0 to turn the metrics servers off")
